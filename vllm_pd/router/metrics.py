"""Prometheus metrics of the proxy (its own registry, served on /metrics)."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm_pd.router.instance_pool import InstancePool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector(Collector):
    """Reads instance state at scrape time so gauges can never go stale."""

    def __init__(self, pool: InstancePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        outstanding = GaugeMetricFamily("vllm_pd_proxy_instance_outstanding_requests",
                                        "requests in flight per instance and leg", labels=["instance", "leg"])
        healthy = GaugeMetricFamily("vllm_pd_proxy_instance_healthy", "1 if the health check passes",
                                    labels=["instance", "role"])
        eligible = GaugeMetricFamily("vllm_pd_proxy_instance_eligible",
                                     "1 if the instance takes new requests for the role", labels=["instance", "role"])
        breaker = GaugeMetricFamily("vllm_pd_proxy_instance_breaker_open", "1 if the circuit breaker is not closed",
                                    labels=["instance"])
        for inst in self._pool.all():
            for leg in ("prefill", "decode"):
                outstanding.add_metric([inst.url, leg], inst.outstanding[leg])
                eligible.add_metric([inst.url, leg], 1.0 if inst.eligible(leg) else 0.0)
            healthy.add_metric([inst.url, inst.role], 1.0 if inst.healthy else 0.0)
            breaker.add_metric([inst.url], 0.0 if inst.breaker.state.value == "closed" else 1.0)
        yield from (outstanding, healthy, eligible, breaker)


class ProxyMetrics:
    def __init__(self, pool: InstancePool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vllm_pd_proxy_requests", "client requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("vllm_pd_proxy_request_seconds", "client request duration",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("vllm_pd_proxy_ttft_seconds", "time to the first byte sent to the client",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("vllm_pd_proxy_prefill_seconds", "prefill leg duration",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.leg_errors = Counter("vllm_pd_proxy_leg_errors", "failed legs", ["leg", "kind"], registry=r)
        self.retries = Counter("vllm_pd_proxy_retries", "legs retried on another instance", ["leg"], registry=r)
        self.fallbacks = Counter("vllm_pd_proxy_decode_only", "requests sent to decode without prefill",
                                 ["reason"], registry=r)
        self.kv_releases = Counter("vllm_pd_proxy_kv_releases", "release_remote_kv calls", ["result"], registry=r)
        self.disconnects = Counter("vllm_pd_proxy_client_disconnects", "client disconnects", ["stage"], registry=r)
        self.stream_errors = Counter("vllm_pd_proxy_stream_errors", "streams ended by an error event", registry=r)
        r.register(_PoolCollector(pool))
        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def count_request(self, endpoint: str, status: int, seconds: float) -> None:
        """One finished client request (the labelled children are looked up once per endpoint and status)."""
        children = self._request_children.get((endpoint, status))
        if children is None:
            children = (self.requests.labels(endpoint, str(status)), self.request_seconds.labels(endpoint))
            self._request_children[(endpoint, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of the proxy (its own registry, served on /metrics).

Names follow Prometheus' conventions: seconds, counters ending in ``_total``,
and the vLLM instance a sample is about is the ``backend`` label (its URL):
``instance`` is the label Prometheus gives the scraped target, the proxy itself.
The per-instance leg latencies live in leg_timings.py (lock-free histograms
observed on the event loop); gauges are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm_pd.router.observability.leg_timings import LATENCY_BUCKETS, HistogramSet, LabelledHistogram, LegHistograms
from vllm_pd.router.pool.instance_pool import InstancePool


class _PoolCollector(Collector):
    """Reads instance state at scrape time so gauges can never go stale."""

    def __init__(self, pool: InstancePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        outstanding = GaugeMetricFamily(
            "vllm_pd_proxy_instance_outstanding_requests",
            "requests in flight per instance and leg",
            labels=["backend", "leg"],
        )
        healthy = GaugeMetricFamily(
            "vllm_pd_proxy_instance_healthy", "1 if the health check passes", labels=["backend", "role"]
        )
        eligible = GaugeMetricFamily(
            "vllm_pd_proxy_instance_eligible",
            "1 if the instance takes new requests for the role",
            labels=["backend", "role"],
        )
        breaker = GaugeMetricFamily(
            "vllm_pd_proxy_instance_breaker_open", "1 if the circuit breaker is not closed", labels=["backend"]
        )
        for inst in self._pool.all():
            for leg in ("prefill", "decode"):
                outstanding.add_metric([inst.url, leg], inst.outstanding[leg])
                eligible.add_metric([inst.url, leg], 1.0 if inst.eligible(leg) else 0.0)
            healthy.add_metric([inst.url, inst.role], 1.0 if inst.healthy else 0.0)
            breaker.add_metric([inst.url], 0.0 if inst.breaker.state.value == "closed" else 1.0)
        yield from (outstanding, healthy, eligible, breaker)


class _ProxyStateCollector(Collector):
    """Client requests in flight and queued, and whether the proxy drains, read at scrape time."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m = self._metrics
        yield GaugeMetricFamily("vllm_pd_proxy_requests_in_flight", "client requests being served", value=m.in_flight)
        yield GaugeMetricFamily(
            "vllm_pd_proxy_requests_queued",
            "client requests waiting for a slot (concurrency limit)",
            value=m.queue_length(),
        )
        yield GaugeMetricFamily(
            "vllm_pd_proxy_draining", "1 while the proxy drains before it stops", value=1.0 if m.draining else 0.0
        )


class ProxyMetrics:
    def __init__(self, pool: InstancePool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vllm_pd_proxy_requests", "client requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        # end to end: request received to its last byte sent
        self.request_seconds = LabelledHistogram(
            "vllm_pd_proxy_request_seconds", "client request duration", LATENCY_BUCKETS, label="endpoint"
        )
        r.register(HistogramSet(self.request_seconds))
        self.legs = LegHistograms()
        r.register(self.legs)
        self.leg_errors = Counter("vllm_pd_proxy_leg_errors", "failed legs", ["leg", "kind"], registry=r)
        self.retries = Counter("vllm_pd_proxy_retries", "legs retried on another instance", ["leg"], registry=r)
        self.fallbacks = Counter(
            "vllm_pd_proxy_decode_only", "requests sent to decode without prefill", ["reason"], registry=r
        )
        self.kv_releases = Counter("vllm_pd_proxy_kv_releases", "release_remote_kv calls", ["result"], registry=r)
        self.disconnects = Counter("vllm_pd_proxy_client_disconnects", "client disconnects", ["stage"], registry=r)
        self.store_fetch_hints = Counter(
            "vllm_pd_proxy_store_fetch_hints",
            "prefill legs told which KV store node to fetch the prompt from (kv_aware with --store-master)",
            registry=r,
        )
        self.stream_errors = Counter("vllm_pd_proxy_stream_errors", "streams ended by an error event", registry=r)
        self.bad_stream_events = Counter(
            "vllm_pd_proxy_bad_stream_events",
            "decode streams that sent an SSE event "
            "the proxy does not relay (too long, malformed): the stream ends with an "
            "error event, or is retried elsewhere before its first event",
            ["reason"],
            registry=r,
        )
        r.register(_PoolCollector(pool))
        self.in_flight = 0  # client requests in the PD flow
        self.draining = False
        # requests waiting for a slot: whatever limits concurrency sets this to read its queue
        self.queue_length: Callable[[], int] = lambda: 0
        r.register(_ProxyStateCollector(self))
        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def count_request(self, endpoint: str, status: int, seconds: float) -> None:
        """One finished client request (the labelled children are looked up once per endpoint and status)."""
        children = self._request_children.get((endpoint, status))
        if children is None:
            children = (self.requests.labels(endpoint, str(status)), self.request_seconds.child(endpoint))
            self._request_children[(endpoint, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

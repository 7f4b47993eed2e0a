"""Connector counters: sent from the workers to vLLM's logger and /metrics.

Prometheus names (in vLLM's /metrics, labelled per engine):
``vllm:pd_pushed_blocks_total``, ``vllm:pd_pushed_bytes_total``,
``vllm:pd_loaded_blocks_total{source="push"|"fetch"}``, ``vllm:pd_loaded_bytes_total``,
``vllm:pd_loads_total{result="ok"|"failed"}``, ``vllm:pd_lease_expired_total``,
``vllm:pd_push_transfers_total``, ``vllm:pd_push_tail_seconds_total``, ``vllm:pd_push_span_seconds_total``,
``vllm:pd_store_served_blocks_total{tier="cpu"|"disk"}`` (KV store blocks this node served to peers),
``vllm:pd_connections_refused_total`` (KV connections that did not prove the deployment secret),
``vllm:pd_connections_broken_total`` (authenticated ones closed for a bad seal or frame),
``vllm:pd_shape_refused_total`` (transfers refused for prefill's and decode's KV shapes: recomputed),
and gauges ``vllm:pd_held_transfers`` (prefill KV held for decode),
``vllm:pd_loading_requests``, ``vllm:pd_staged_bytes``, one sample per TP rank
(label ``tp_rank``): with TP > 1 every rank holds its own shard of a transfer's KV,
so a rank that was never released shows on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_pd.connector.worker.transfer_counters import COUNTERS, GAUGES, RANK_GAUGES, TransferCounters

# the help text of each metric in /metrics (and in the docs' generated metrics reference)
HELP = {
    "pushed_blocks": "KV blocks prefill pushed to decode, counted per layer",
    "pushed_bytes": "bytes of KV prefill pushed to decode",
    "loaded_bytes": "bytes of KV decode landed in its blocks (pushed or fetched)",
    "lease_expired": "transfers whose lease ended before decode released them: prefill freed the KV",
    "push_transfers": "push transfers whose layer-wise overlap is summed in push_tail/push_span_seconds",
    "push_tail_seconds": "summed over push transfers: prefill's last layer computed until all its KV landed",
    "push_span_seconds": "summed over push transfers: first push until all KV landed",
    "connections_refused": "KV connections refused: they did not prove the deployment secret",
    "connections_broken": "authenticated KV connections closed for a bad seal or a malformed or oversized frame",
    "shape_refused": "transfers refused because prefill's and decode's KV shapes (TP, block size, KV cache "
    "groups, kernel packing) cannot be re-cut: decode recomputed at once",
    "loaded_blocks": "KV blocks decode landed, counted per layer, by source (push: pushed by prefill; "
    "fetch: read from the peer)",
    "loads": "remote KV loads by result (failed: decode recomputed the prompt)",
    "store_served_blocks": "KV store blocks this node served to other nodes' fetches, by tier",
    "held_transfers": "transfers whose KV prefill holds for decode (until released or the lease ends)",
    "loading_requests": "requests whose KV decode is loading",
    "staged_bytes": "bytes of pushed KV in decode's staging, not yet placed in a request's blocks",
}


@dataclass
class PDConnectorStats(TransferCounters, KVConnectorStats):
    """The counters as vLLM's connector stats (sent to its logger and /metrics)."""

    # ---- KVConnectorStats -----------------------------------------------------------------------
    def aggregate(self, other: KVConnectorStats) -> PDConnectorStats:
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        if RANK_GAUGES in other.data:  # the ranks' latest values; a later interval's win
            self.data[RANK_GAUGES] = {**self.data.get(RANK_GAUGES, {}), **other.data[RANK_GAUGES]}
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counters, and gauges summed over the TP ranks (vLLM's log line)."""
        by_rank = self.data.get(RANK_GAUGES, {}).values()
        return {**{k: self.data.get(k, 0) for k in COUNTERS}, **{k: sum(g[k] for g in by_rank) for k in GAUGES}}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS) and RANK_GAUGES not in self.data


class PDPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        c, g = self._counter_cls, self._gauge_cls
        self._counters: dict[str, Any] = {}
        for name in (
            "pushed_blocks",
            "pushed_bytes",
            "loaded_bytes",
            "lease_expired",
            "push_transfers",
            "push_tail_seconds",
            "push_span_seconds",
            "connections_refused",
            "connections_broken",
            "shape_refused",
        ):
            self._counters[name] = c(name=f"vllm:pd_{name}", documentation=HELP[name], labelnames=labelnames)
        self._loaded_blocks = c(
            name="vllm:pd_loaded_blocks", documentation=HELP["loaded_blocks"], labelnames=[*labelnames, "source"]
        )
        self._loads = c(name="vllm:pd_loads", documentation=HELP["loads"], labelnames=[*labelnames, "result"])
        self._store_served = c(
            name="vllm:pd_store_served_blocks",
            documentation=HELP["store_served_blocks"],
            labelnames=[*labelnames, "tier"],
        )
        self._gauges = {
            name: g(
                name=f"vllm:pd_{name}",
                documentation=f"{HELP[name]}, per TP rank",
                labelnames=[*labelnames, "tp_rank"],
                multiprocess_mode="mostrecent",
            )
            for name in GAUGES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, metric in self._counters.items():
            if v := transfer_stats_data.get(name, 0):
                metric.labels(*labels).inc(v)
        for source in ("push", "fetch"):
            if v := transfer_stats_data.get(f"loaded_blocks_{source}", 0):
                self._loaded_blocks.labels(*labels, source).inc(v)
        for result in ("ok", "failed"):
            if v := transfer_stats_data.get(f"loads_{result}", 0):
                self._loads.labels(*labels, result).inc(v)
        for tier in ("cpu", "disk"):
            if v := transfer_stats_data.get(f"store_served_blocks_{tier}", 0):
                self._store_served.labels(*labels, tier).inc(v)
        for rank, values in transfer_stats_data.get(RANK_GAUGES, {}).items():
            for name, metric in self._gauges.items():
                metric.labels(*labels, rank).set(values[name])

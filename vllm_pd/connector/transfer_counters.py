"""The connector worker's transfer counters, without vLLM (``stats`` reports them to vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_pd.connector.load_job import LoadJob

COUNTERS = (
    "pushed_blocks", "pushed_bytes", "loaded_blocks_push", "loaded_blocks_fetch", "loaded_bytes",
    "loads_ok", "loads_failed", "lease_expired",
    # layer-wise overlap of pushes: time after the last layer computed until all KV landed
    # (tail) vs first push to all landed (span), summed over push transfers
    "push_transfers", "push_tail_seconds", "push_span_seconds",
    "store_served_blocks_cpu", "store_served_blocks_disk",
)
GAUGES = ("held_transfers", "loading_requests", "staged_bytes")


@dataclass
class TransferCounters:
    """The worker's counters for one reporting interval."""

    data: dict[str, Any] = field(default_factory=dict)
    expired: int = 0  # cumulative, turned into a per-interval delta

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self._expired_reported = 0

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def record_push(self, blocks: int, nbytes: int) -> None:
        self.data["pushed_blocks"] += blocks
        self.data["pushed_bytes"] += nbytes

    def record_push_overlap(self, tail_s: float, span_s: float) -> None:
        self.data["push_transfers"] += 1
        self.data["push_tail_seconds"] += tail_s
        self.data["push_span_seconds"] += span_s

    def record_store_served(self, cpu: int, disk: int) -> None:
        self.data["store_served_blocks_cpu"] += cpu
        self.data["store_served_blocks_disk"] += disk

    def record_load(self, job: "LoadJob") -> None:
        self.data["loaded_blocks_push"] += job.blocks_from_push
        self.data["loaded_blocks_fetch"] += job.blocks_fetched
        self.data["loaded_bytes"] += job.bytes_landed
        self.data["loads_ok" if job.ok else "loads_failed"] += 1

    def set_gauges(self, held: int, loading: int, staged_bytes: int) -> None:
        changed = (self.data.get("held_transfers"), self.data.get("loading_requests"),
                   self.data.get("staged_bytes")) != (held, loading, staged_bytes)
        self.data.update(held_transfers=held, loading_requests=loading, staged_bytes=staged_bytes)
        if self.expired != self._expired_reported:
            self.data["lease_expired"] += self.expired - self._expired_reported
            self._expired_reported = self.expired
        self.data["_dirty"] = bool(self.data.get("_dirty")) or changed

    def take(self) -> "TransferCounters | None":
        """The interval's stats (None if nothing happened), then start a new interval."""
        dirty = self.data.pop("_dirty", False)
        if not dirty and not any(self.data.get(k) for k in COUNTERS):
            return None
        out = type(self)(data=dict(self.data))
        gauges = {k: self.data[k] for k in GAUGES if k in self.data}
        self.reset()
        self.data.update(gauges)
        return out

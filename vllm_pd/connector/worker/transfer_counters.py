"""The connector worker's transfer counters, without vLLM (``stats`` reports them to vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_pd.connector.worker.load_job import LoadJob

COUNTERS = (
    "pushed_blocks",
    "pushed_bytes",
    "loaded_blocks_push",
    "loaded_blocks_fetch",
    "loaded_bytes",
    "loads_ok",
    "loads_failed",
    "lease_expired",
    # layer-wise overlap of pushes: time after the last layer computed until all KV landed
    # (tail) vs first push to all landed (span), summed over push transfers
    "push_transfers",
    "push_tail_seconds",
    "push_span_seconds",
    "store_served_blocks_cpu",
    "store_served_blocks_disk",
    # KV connections refused for not proving the deployment secret; authenticated ones closed
    # for breaking the protocol (a bad seal, a malformed or oversized frame)
    "connections_refused",
    "connections_broken",
    # transfers refused for prefill's and decode's KV shapes (kv_geometry.incompatibility): recomputed
    "shape_refused",
)
GAUGES = ("held_transfers", "loading_requests", "staged_bytes")
RANK_GAUGES = "gauges"  # data key: {tp rank (a str: the data crosses msgpack): {gauge: value}}, latest


@dataclass
class TransferCounters:
    """The worker's counters for one reporting interval."""

    data: dict[str, Any] = field(default_factory=dict)
    expired: int = 0  # cumulative, turned into a per-interval delta
    rank: int = 0  # the TP rank whose gauges this worker's stats set

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self._expired_reported = 0
        self._connections_reported = (0, 0)

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

    def record_connections(self, refused_total: int, broken_total: int) -> None:
        """The transport's cumulative counts; the interval gets what is new since the last call."""
        last_refused, last_broken = self._connections_reported
        self.data["connections_refused"] += refused_total - last_refused
        self.data["connections_broken"] += broken_total - last_broken
        self._connections_reported = (refused_total, broken_total)

    def record_shape_refused(self) -> None:
        self.data["shape_refused"] += 1

    def record_load(self, job: LoadJob) -> None:
        self.data["shape_refused"] += int(job.refused)
        self.data["loaded_blocks_push"] += job.blocks_from_push
        self.data["loaded_blocks_fetch"] += job.blocks_fetched
        self.data["loaded_bytes"] += job.bytes_landed
        self.data["loads_ok" if job.ok else "loads_failed"] += 1

    def set_gauges(self, held: int, loading: int, staged_bytes: int) -> None:
        values = dict(zip(GAUGES, (held, loading, staged_bytes)))
        changed = self.data.get(RANK_GAUGES, {}).get(str(self.rank)) != values
        # a new dict each time: a taken interval may still be on its way to the engine
        self.data[RANK_GAUGES] = {str(self.rank): values}
        if self.expired != self._expired_reported:
            self.data["lease_expired"] += self.expired - self._expired_reported
            self._expired_reported = self.expired
        self.data["_dirty"] = bool(self.data.get("_dirty")) or changed

    def take(self) -> TransferCounters | None:
        """The interval's stats (None if nothing happened), then start a new interval."""
        dirty = self.data.pop("_dirty", False)
        if not dirty and not any(self.data.get(k) for k in COUNTERS):
            return None
        out = type(self)(data=dict(self.data))
        gauges = self.data.get(RANK_GAUGES)
        self.reset()
        if gauges is not None:
            self.data[RANK_GAUGES] = gauges
        return out

"""Store settings, read from ``kv_connector_extra_config["store"]`` and validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vllm_pd.connector.config import parse_size
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# keys renamed since a release: old -> new (the old one still works, with a warning naming both)
_RENAMED = {"lease_s": "pin_ttl_s"}  # "lease" is prefill's hold of KV for decode, not the store's pin


def parse_bytes(name: str, value: Any) -> int:
    """``1073741824``, ``"512m"``, ``"4g"`` -> bytes."""
    return parse_size(f"store.{name}", value)


def _renamed_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Old key names under their new ones (a deprecation warning each); both given: an error."""
    for old, new in _RENAMED.items():
        if old not in raw:
            continue
        if new in raw:
            raise ConfigError(
                f"store.{old} and store.{new} are both set: {old} is the old name of {new}; keep only {new}"
            )
        logger.warning("store.%s is deprecated: it was renamed store.%s; please use that", old, new)
        raw[new] = raw.pop(old)
    return raw


def _instance_url(value: Any) -> str:
    """``http(s)://host:port`` without a path or a trailing slash (the proxy compares URLs as strings)."""
    from urllib.parse import urlsplit

    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ConfigError(
            f"store.instance_url: expected the instance's URL as the proxy knows it, "
            f"e.g. http://10.0.0.5:8000, got {value!r}"
        )
    return str(value).rstrip("/")


@dataclass(frozen=True)
class StoreConfig:
    cpu_bytes: int = 1 << 30  # CPU pool size per worker (rank)
    disk_path: str | None = None  # folder of the disk tier's block files; None = no disk tier
    disk_bytes: int = 16 << 30  # capacity of the disk tier (block files under disk_path)
    # pins of blocks being loaded (and a peer's grant to read pinned blocks) expire after this
    pin_ttl_s: float = 60.0
    disk_io_threads: int = 2  # threads that write and read the disk tier's block files
    master: str | None = None  # "tcp://host:port" of `vllm-pd store-master`; None = local only
    # a call to the master must answer within this (it blocks the engine's scheduler), else the node
    # goes on with its local index and retries the master after a growing back-off
    master_timeout_s: float = 0.2
    node_id: str | None = None  # name published to the master (default host:pid)
    # this node's vLLM instance as the proxy knows it (http://host:port), published to the master so
    # the proxy's kv_aware policy can send a prompt where the store holds it; None = not routable
    instance_url: str | None = None
    fetch_timeout_s: float = 2.0  # node-to-node fetch (grant + bytes) must finish in this, else recompute
    # CPU memory beyond cpu_bytes where a holder stages its disk blocks for peers' fetches
    # (with a disk tier and a master only); 0 = peers get blocks in CPU slots only
    disk_serve_bytes: int = 64 << 20
    # pinned host memory per direction (saves, loads) that device (GPU) KV passes through on
    # its way to and from the pool's slots, whose per-layer rows are not contiguous; unused on CPU
    host_bounce_bytes: int = 64 << 20
    # the deployment secret (the connector's, not a key of "store"): the master and the peers'
    # fetches authenticate with it
    secret: DeploymentSecret | None = field(default=None, repr=False, compare=False, metadata={"connector": True})
    tls: TlsSettings | None = field(default=None, compare=False, metadata={"connector": True})  # the connector's

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> StoreConfig:
        raw = _renamed_keys(dict(raw or {}))
        known = {f.name for f in fields(cls) if not f.metadata.get("connector")}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"store: unknown key(s) {unknown}; known: {sorted(known)}")
        for name in ("cpu_bytes", "disk_bytes", "disk_serve_bytes", "host_bounce_bytes"):
            if name in raw:
                raw[name] = parse_bytes(name, raw[name])
        for name in ("pin_ttl_s", "master_timeout_s", "fetch_timeout_s"):
            value = raw.get(name)
            if name in raw and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"store.{name}: expected a number > 0, got {raw[name]!r}")
        if "disk_io_threads" in raw and (not isinstance(raw["disk_io_threads"], int) or raw["disk_io_threads"] <= 0):
            raise ConfigError(f"store.disk_io_threads: expected an integer > 0, got {raw['disk_io_threads']!r}")
        for name in ("disk_path", "master", "node_id"):
            if name in raw and raw[name] is not None and not isinstance(raw[name], str):
                raise ConfigError(f"store.{name}: expected a string, got {raw[name]!r}")
        if raw.get("instance_url") is not None:
            raw["instance_url"] = _instance_url(raw["instance_url"])
        cfg = cls(**raw)
        return cfg

    def num_slots(self, slot_nbytes: int) -> int:
        """CPU pool slots for blocks of ``slot_nbytes`` (all layers of one rank)."""
        n = self.cpu_bytes // slot_nbytes
        if n <= 0:
            raise ConfigError(f"store.cpu_bytes={self.cpu_bytes} holds no block of {slot_nbytes} bytes")
        return n

    def disk_serve_slots(self, slot_nbytes: int) -> int:
        """Spare pool rows for staging disk blocks that peers fetch (0: not served)."""
        if self.disk_path is None or self.master is None:
            return 0
        return self.disk_serve_bytes // slot_nbytes

    def bounce_rows(self, slot_nbytes: int) -> int:
        """Blocks (all layers) one pass through the host bounce moves, for device KV."""
        n = self.host_bounce_bytes // slot_nbytes
        if n <= 0:
            raise ConfigError(
                f"store.host_bounce_bytes={self.host_bounce_bytes} holds no block of {slot_nbytes} "
                "bytes (all layers): KV on a GPU reaches the pool through it"
            )
        return n

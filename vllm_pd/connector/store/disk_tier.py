"""Local disk tier: one file per block key (all layers of this rank), async I/O.

File = 112-byte header + payload. The header names the salt (a directory reused
by another model/layout is ignored), the key and its *parent* key (so the
radix index can be rebuilt from disk alone after a restart), the scope the
block was written for (adapter and cache salt: block_keys.RequestExtraKeys.scope; a
read for another scope fails), the payload length and its blake3 checksum.
Files of the previous format (VPDKVB01, no scope, written when keys ignored
adapters and cache salts) are dropped at start. Writes go to ``*.tmp`` then ``os.replace``: a crash
leaves a stray tmp file, never a half file under a real name (two-phase put on
disk). Reads verify the checksum; a mismatch deletes the file and reports the
key as evicted, so a corrupt block is recomputed, never served.

The capacity bound counts file bytes and holds after every write: the least
recently used files that nobody is reading are deleted first (writes and reads
touch a chain leaf first, so parents outlive children). Evicted keys are
reported so the scheduler side drops them from its index.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vllm_pd.connector.store.cpu_pool import CHECKSUM_BYTES, checksum
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.block_keys import KEY_BYTES, BlockKey
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

MAGIC = b"VPDKVB02"
# magic salt key parent scope len sum
_HEADER = struct.Struct(f"<8s{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}sQ{CHECKSUM_BYTES}s")
HEADER_BYTES = _HEADER.size
_ROOT = b"\x00" * KEY_BYTES  # parent of a chain's first block


@dataclass(frozen=True)
class DiskEntry:
    key: BlockKey
    parent: BlockKey | None
    nbytes: int  # file size
    scope: BlockKey


def rank_dir(root: str | Path, salt_digest: BlockKey, rank: int) -> Path:
    return Path(root) / salt_digest.hex() / f"rank{rank}"


def read_header(path: Path, salt: BlockKey) -> DiskEntry | None:
    """The entry a block file claims to be, or None if its header or size is wrong."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        magic, fsalt, key, parent, scope, nbytes, _ = _HEADER.unpack(head)
    except (OSError, struct.error):
        return None
    if magic != MAGIC or fsalt != salt or size != HEADER_BYTES + nbytes or path.name != key.hex():
        return None
    return DiskEntry(key, None if parent == _ROOT else parent, size, scope)


def scan(root: str | Path, salt_digest: BlockKey, rank: int) -> list[tuple[BlockKey, BlockKey | None, BlockKey]]:
    """Read-only listing of a rank's valid block files, oldest first (the scheduler
    side indexes a restarted disk tier with it before the first step)."""
    found = []
    for path in rank_dir(root, salt_digest, rank).glob("*/*"):
        entry = read_header(path, salt_digest) if path.suffix != ".tmp" else None
        if entry is not None:
            try:
                found.append((path.stat().st_mtime, entry))
            except OSError:
                continue
    found.sort(key=lambda t: t[0])
    return [(e.key, e.parent, e.scope) for _, e in found]


class DiskTier:
    def __init__(
        self, root: str | Path, salt_digest: BlockKey, rank: int, capacity_bytes: int, io_threads: int = 2
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"disk capacity must be > 0, got {capacity_bytes}")
        self.dir = rank_dir(root, salt_digest, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.salt = salt_digest
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockKey, DiskEntry] = OrderedDict()  # LRU first
        self._readers: dict[BlockKey, int] = {}
        self._used = 0
        self._committed: list[tuple[BlockKey, BlockKey | None, BlockKey]] = []
        self._evicted: list[BlockKey] = []
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-disk")
        self._rebuild()

    # -- restart -------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the files already there; drop tmp files and files with a bad header/size."""
        found: list[tuple[float, DiskEntry]] = []
        for path in self.dir.glob("*/*"):
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            entry = read_header(path, self.salt)
            if entry is None:
                logger.warning("dropping corrupt KV block file %s", path)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, entry))
        found.sort(key=lambda t: t[0])
        for _, entry in found:
            self._entries[entry.key] = entry
            self._used += entry.nbytes
            self._committed.append((entry.key, entry.parent, entry.scope))
        self._enforce_capacity(0)
        logger.info("disk tier %s: %d blocks, %d bytes after restart", self.dir, len(self._entries), self._used)

    def _path(self, key: BlockKey) -> Path:
        h = key.hex()
        return self.dir / h[:2] / h

    # -- I/O -----------------------------------------------------------------

    def write(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        payload: memoryview,
        scope: BlockKey,
        payload_sum: bytes | None = None,
    ) -> Future[bool]:
        """Store ``payload`` (kept alive and unchanged by the caller until done), written for ``scope``."""
        return self._pool.submit(self._write, key, parent, payload, scope, payload_sum)

    def _write(
        self, key: BlockKey, parent: BlockKey | None, payload: memoryview, scope: BlockKey, payload_sum: bytes | None
    ) -> bool:
        size = HEADER_BYTES + len(payload)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if not self._enforce_capacity(size):
                return False
            self._used += size  # reserve
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            digest = payload_sum if payload_sum is not None else checksum(payload)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, self.salt, key, parent or _ROOT, scope, len(payload), digest))
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            logger.exception("disk write of %s failed", key.hex())
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._used -= size
            return False
        with self._lock:
            self._entries[key] = DiskEntry(key, parent, size, scope)
            self._committed.append((key, parent, scope))
        return True

    def read_into(self, key: BlockKey, dst: memoryview, scope: BlockKey | None = None) -> Future[bytes | None]:
        """Read and verify ``key`` into ``dst``: resolves to the payload's checksum
        (the commit-time one, now matched by the bytes in ``dst``: callers need not
        hash again), or None (and the file dropped) on any doubt. With ``scope``, a
        block written for another scope is None too (and kept: it is not corrupt)."""
        with self._lock:
            if key not in self._entries:
                f: Future[bytes | None] = Future()
                f.set_result(None)
                return f
            self._readers[key] = self._readers.get(key, 0) + 1
            self._entries.move_to_end(key)
        return self._pool.submit(self._read, key, dst, scope)

    def _read(self, key: BlockKey, dst: memoryview, scope: BlockKey | None) -> bytes | None:
        ok = other_scope = False
        digest = b""
        try:
            with open(self._path(key), "rb") as f:
                magic, salt, fkey, _, fscope, nbytes, digest = _HEADER.unpack(f.read(HEADER_BYTES))
                other_scope = scope is not None and fscope != scope
                if magic == MAGIC and salt == self.salt and fkey == key and nbytes == len(dst) and not other_scope:
                    ok = f.readinto(dst) == nbytes and checksum(dst) == digest
        except (OSError, struct.error):
            ok = False
        with self._lock:
            self._readers[key] -= 1
            if not self._readers[key]:
                del self._readers[key]
            if other_scope:
                logger.error("KV block %s on disk was written for another scope; not served", key.hex())
            elif not ok:
                logger.warning("KV block %s on disk failed verification; dropped", key.hex())
                self._drop(key)
        return digest if ok else None

    # -- capacity --------------------------------------------------------------

    def _enforce_capacity(self, incoming: int) -> bool:
        """Evict LRU unread files until ``incoming`` more bytes fit. Lock held."""
        if incoming > self.capacity_bytes:
            return False
        victims = iter(list(self._entries))
        while self._used + incoming > self.capacity_bytes:
            victim = next((k for k in victims if k not in self._readers), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _drop(self, key: BlockKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._used -= entry.nbytes
        self._path(key).unlink(missing_ok=True)
        self._evicted.append(key)

    # -- reporting -------------------------------------------------------------

    def drain(self) -> tuple[list[tuple[BlockKey, BlockKey | None, BlockKey]], list[BlockKey]]:
        """(committed (key, parent, scope), evicted keys) since the last call."""
        with self._lock:
            committed, self._committed = self._committed, []
            evicted, self._evicted = self._evicted, []
        return committed, evicted

    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(list(self._entries))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

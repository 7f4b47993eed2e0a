"""Single-copy reads of a same-host peer's memory: Linux cross-memory attach.

``process_vm_readv`` copies from another process's address space in one kernel
call, run by the *reader*. The shm transport uses it for layer plans
(layer_plan.py) when the kernel allows it (same user, or CAP_SYS_PTRACE; Yama
ptrace_scope <= 1): the receiver polls the sender's progress word and copies
each layer's blocks straight from the sender's KV cache as soon as the sender's
forward has written them - the one-sided READ of RDMA, on one host. Open MPI's
vader/CMA path is the same idea.

Whether it works is probed at the handshake, never assumed: the peer announces
its pid, boot id and the address of a random token, and the reader must read
that token back. Different hosts or boots, pid namespaces, seccomp or Yama
refusals all fail the probe and the connection keeps the shared-memory rings.

Who may read us: never any process. Under Yama ptrace_scope 1 (Ubuntu's default) only
ancestors and the one pid named with ``PR_SET_PTRACER`` may; :func:`grant_reader` names the
pid of a peer that proved the deployment secret (and the reader announced itself in the
authenticated handshake), one reader at a time - a second concurrent reader's probe fails and
its connection keeps the rings - and :func:`revoke_reader` withdraws it when that connection
ends. Without a secret nothing is granted (the rings are used). Under scope 0, or without
Yama, the kernel itself lets every process of our user read us (classic ptrace rules; also
through /proc/PID/mem): nothing of ours widens or narrows that - enable Yama scope 1 on hosts
that run other users' code under the same uid. Scopes 2 and 3 refuse without CAP_SYS_PTRACE.

A read that races a change of the source (a sender that reused the blocks
before the read) is caught by the blocks' checksums, taken by the sender when a
layer is ready; so cross-memory reads are used only with a checksum.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm_pd.errors import PeerClosed, TransferCorrupted
from vllm_pd.protocol.cross_memory_hello import MemoryProbe
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# process_vm_readv takes at most IOV_MAX (1024) iovecs per side and call.
MAX_IOV = 1024
_PR_SET_PTRACER = 0x59616D61
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


_LIBC: Any = None
_PROBE: ctypes.Array[ctypes.c_char] | None = None  # this process's token, read by peers at the handshake


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def yama_scope() -> int | None:
    """The host's Yama ptrace_scope (None: no Yama, the classic same-user rules)."""
    try:
        with open(YAMA_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def _set_ptracer(pid: int) -> bool:
    """PR_SET_PTRACER: ``pid`` (0: nobody) may read this process under Yama scope 1."""
    global _LIBC
    if _LIBC is None:
        _LIBC = _libc()
    return int(_LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)) == 0


class ReaderGrants:
    """Which peer process may read this one (Yama scope 1 keeps one pid): held while that
    peer's connections last, refused to a second pid meanwhile. Thread-safe."""

    def __init__(
        self, scope: Callable[[], int | None] = yama_scope, set_ptracer: Callable[[int], bool] = _set_ptracer
    ) -> None:
        self._scope, self._set_ptracer = scope, set_ptracer
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._refs = 0

    def grant(self, pid: int, authenticated: bool) -> str | None:
        """Let ``pid`` read us: "open" (the kernel lets it anyway: nothing granted), "granted"
        (``revoke`` it when its connection ends), or None (it cannot: it keeps the rings).
        Only a peer that proved the deployment secret (``authenticated``) is ever granted."""
        scope = self._scope()
        if scope is None or scope == 0:
            return "open"
        if scope != 1 or pid <= 0 or not authenticated:
            return None
        with self._lock:
            if self._pid not in (None, pid):
                return None  # one reader at a time
            if self._pid is None:
                if not self._set_ptracer(pid):
                    return None
                self._pid = pid
            self._refs += 1
            return "granted"

    def revoke(self, pid: int) -> None:
        """One of ``pid``'s connections ended; the last one withdraws its grant."""
        with self._lock:
            if self._pid != pid:
                return
            self._refs -= 1
            if self._refs == 0:
                self._set_ptracer(0)
                self._pid = None

    @property
    def reader(self) -> int | None:
        with self._lock:
            return self._pid


READER_GRANTS = ReaderGrants()  # this process's (the kernel keeps one ptracer per process)


def local_identity() -> dict[str, Any]:
    """Who we are on this host: what a peer needs to grant us reads of its memory."""
    return {"pid": os.getpid(), "boot": _boot_id()}


def same_host(identity: Any) -> bool:
    """Whether a peer's :func:`local_identity` is a process of this host and boot."""
    return isinstance(identity, dict) and _this_boot(identity.get("boot"))


def _this_boot(boot: Any) -> bool:
    ours = _boot_id()
    return bool(ours) and boot == ours


def memory_probe() -> MemoryProbe:
    """What a peer needs to probe (and then read) this process's memory."""
    global _LIBC, _PROBE
    if _PROBE is None:
        if _LIBC is None:
            _LIBC = _libc()
        _PROBE = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
    return MemoryProbe(os.getpid(), _boot_id(), ctypes.addressof(_PROBE), bytes(_PROBE))


def local_info() -> dict[str, Any]:
    """:func:`memory_probe` as it goes in a HELLO."""
    return memory_probe().to_wire()


def address_of(view: memoryview) -> int:
    """Start address of a writable C-contiguous buffer in this process."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class PeerMemory:
    """Reads of one peer process's memory (made by :meth:`probe`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @classmethod
    def probe(cls, info: Any) -> PeerMemory | None:
        """A reader of the peer that announced ``info`` (a :class:`MemoryProbe`, or its wire form:
        :func:`local_info`), or None if its memory cannot be read from here."""
        announced = info if isinstance(info, MemoryProbe) else MemoryProbe.from_wire(info)
        if announced is None:
            return None
        memory_probe()  # loads libc
        pid, address, token = announced.pid, announced.address, announced.token
        if not _this_boot(announced.boot):
            return None  # another host (or boot): its pid means nothing here
        reader = cls(pid)
        got = bytearray(len(token))
        try:
            reader.read_into([memoryview(got)], [address])
        except (PeerClosed, TransferCorrupted, OSError) as e:
            logger.debug("cross-memory reads of pid %d unavailable: %s", pid, e)
            return None
        if bytes(got) != token:
            return None  # another pid namespace: the same number is another process
        return reader

    def read(self, address: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self.read_into([memoryview(buf)], [address])
        return bytes(buf)

    def read_u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def read_into(self, views: Sequence[memoryview], addresses: Sequence[int]) -> None:
        """Copy ``len(views[i])`` bytes at the peer's ``addresses[i]`` into ``views[i]``.
        PeerClosed if the peer is gone, TransferCorrupted on a bad address or short read."""
        for start in range(0, len(views), MAX_IOV):
            chunk = views[start : start + MAX_IOV]
            n = len(chunk)
            local = (_Iovec * n)(*(_Iovec(address_of(v), len(v)) for v in chunk))
            remote = (_Iovec * n)(
                *(_Iovec(a, len(v)) for a, v in zip(addresses[start : start + n], chunk, strict=True))
            )
            want = sum(len(v) for v in chunk)
            got = _LIBC.process_vm_readv(self.pid, local, n, remote, n, 0)
            if got == want:
                continue
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.ESRCH:
                    raise PeerClosed(f"cross-memory read: process {self.pid} is gone")
                raise TransferCorrupted(f"cross-memory read from pid {self.pid}: {os.strerror(err)}")
            raise TransferCorrupted(f"cross-memory read from pid {self.pid}: {got} of {want} bytes")

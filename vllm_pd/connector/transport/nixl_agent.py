"""This process's NIXL agent, as the nixl transport uses it: no progress thread.

NIXL's agents normally run a progress thread that busy-polls a core from the first
connection on (shared/reference/nixl-cpu-baseline.md: both cores of a 2-core box).
Here the agent is made without it and progress is driven by whoever waits: the thread
that posted a transfer polls ``check_xfer_state`` with a growing sleep, and a
:class:`ProgressPump` progresses the agent on behalf of a side whose memory a peer
reads or writes while that side waits for the answer on the control channel - needed
for UCX's connection set-up, and on links where UCX emulates one-sided access with
messages the target must handle (tcp between hosts). Between transfers nothing runs.

UCX transports: where the user's environment sets no ``UCX_TLS``, an agent over host
memory only is made with ``tcp,cma`` - on one host cma (``process_vm_readv``) gives
one-sided, single-copy access; between hosts tcp - which works on CPU machines, where
letting UCX pick its shared-memory transports for everything fails ("Destination is
unreachable"). GPU memory leaves UCX its own choice (cuda_ipc, rc, ...). UCX's keepalive
is turned off (``UCX_KEEPALIVE_INTERVAL=inf``, see below). These variables are set only
while the agent is made, so nothing else in the process sees them, and a ``UCX_*``
setting of the user's is never changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from vllm_pd.errors import ConfigError, PeerClosed, TransferRejected, TransferTimeout, TransportError
from vllm_pd.protocol.nixl_messages import DRAM
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

UCX_TLS_HOST = "tcp,cma"
# UCX's keepalive (on with NIXL's peer error handling) is a round trip the idle side must
# progress: with nobody progressing it, the next transfer's flush waits for it (the first
# one after about a dozen transfers, then one per interval). A dead peer is noticed anyway:
# its control connection closes, and a transfer to it fails.
UCX_KEEPALIVE_OFF = "inf"
# A waiting thread polls its transfer first at this interval, doubling up to the cap: a
# transfer on one host completes inside its post (cma copies synchronously), an RDMA one
# in about its bytes / bandwidth.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
PUMP_MIN_S = 50e-6
PUMP_MAX_S = 1e-3
PROBE_NBYTES = 16


def import_nixl() -> Any:
    """nixl's Python API; ConfigError (naming the install) where it is missing."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ConfigError(f"transport 'nixl' needs the nixl package ({e}): pip install 'vllm-pd[nixl]'") from None
    return _api


@contextlib.contextmanager
def ucx_defaults(host_only: bool) -> Iterator[str]:
    """Our UCX settings, where the user's environment has none, for the agent made inside
    (set only meanwhile); yields the UCX_TLS value in force."""
    ours = {"UCX_KEEPALIVE_INTERVAL": UCX_KEEPALIVE_OFF}
    if host_only:
        ours["UCX_TLS"] = UCX_TLS_HOST
    added = [k for k in ours if k not in os.environ]
    for k in added:
        os.environ[k] = ours[k]
    try:
        yield os.environ.get("UCX_TLS", "all")
    finally:
        for k in added:
            os.environ.pop(k, None)


def ucx_allows_cma(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use cross-memory attach (one-sided on one host)."""
    names = {n.strip().lower() for n in tls.lstrip("^").split(",")}
    listed = bool(names & {"cma", "sm", "shm", "all"})
    return not listed if tls.startswith("^") else listed


def descriptors(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device)."""
    out = np.empty((len(addresses), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addresses, lengths, device
    return out


class LocalAgent:
    """One nixl_agent without a progress thread: registrations, peers, transfers."""

    def __init__(self, name: str, host_only: bool) -> None:
        api = import_nixl()
        from nixl import _bindings

        self._errors = tuple(
            getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")
        )
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        with ucx_defaults(host_only) as tls:
            self._agent = api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise ConfigError("transport 'nixl': NIXL's UCX backend did not start (see NIXL's log above)")
        self.name = name
        self.cma = ucx_allows_cma(tls)
        self._lock = threading.Lock()
        self._registrations: list[Any] = []
        self._peers: dict[str, int] = {}  # loaded remote agents -> sessions using them
        # our token for peers to read at the handshake, and room to read theirs into
        self._probe = ctypes.create_string_buffer(secrets.token_bytes(PROBE_NBYTES) + bytes(PROBE_NBYTES))
        self._probe_lock = threading.Lock()
        self.register(np.array([ctypes.addressof(self._probe)]), np.array([2 * PROBE_NBYTES]), DRAM, 0)

    # -- memory -------------------------------------------------------------------------

    def register(self, addresses: np.ndarray, lengths: np.ndarray, mem: str, device: int) -> Any:
        """Register spans for the life of the agent; returns the handle for ``deregister``."""
        handle = self._call(
            "register", lambda: self._agent.register_memory(descriptors(addresses, lengths, device), mem)
        )
        with self._lock:
            self._registrations.append(handle)
        return handle

    def deregister(self, handle: Any) -> None:
        with self._lock:
            self._registrations.remove(handle)
        self._call("deregister", lambda: self._agent.deregister_memory(handle))

    def register_spans(self, spans: list[tuple[str, int, int, int]]) -> list[Any]:
        """Register each (mem, device, address, nbytes); the handles, for ``deregister``."""
        return [
            self.register(np.array([start]), np.array([nbytes]), mem, device) for mem, device, start, nbytes in spans
        ]

    # -- peers --------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    @property
    def probe(self) -> tuple[int, bytes]:
        """(address, token) a peer reads to check that it reaches our memory."""
        return ctypes.addressof(self._probe), self._probe.raw[:PROBE_NBYTES]

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (counted: ``unload_peer`` once per load)."""
        name = self._call("load peer metadata", lambda: self._agent.add_remote_agent(metadata))
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._peers[name] = self._peers.get(name, 0) + 1
        return name

    def unload_peer(self, name: str) -> None:
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
        try:
            self._agent.remove_remote_agent(name)
        except self._errors as e:
            logger.debug("removing NIXL peer %s: %s", name, e)

    def read_probe(self, peer: str, address: int, deadline: float) -> bytes:
        """The peer's probe token, read with NIXL (this sets up UCX's connection to it)."""
        with self._probe_lock:
            scratch = ctypes.addressof(self._probe) + PROBE_NBYTES
            one = np.array([PROBE_NBYTES])
            self.transfer("READ", np.array([scratch]), one, DRAM, 0, np.array([address]), DRAM, 0, peer, deadline)
            return self._probe.raw[PROBE_NBYTES:]

    # -- transfers ----------------------------------------------------------------------

    def transfer(
        self,
        op: str,
        local: np.ndarray,
        lengths: np.ndarray,
        local_mem: str,
        local_device: int,
        remote: np.ndarray,
        remote_mem: str,
        remote_device: int,
        peer: str,
        deadline: float,
    ) -> None:
        """READ (peer -> local) or WRITE (local -> peer) the paired spans; returns once done.

        Waits by polling with a growing sleep (that poll is the agent's progress). Past
        ``deadline`` the transfer is cancelled and TransferTimeout raised; a peer that is
        gone gives PeerClosed, spans outside registered memory TransferRejected."""
        if not len(local):
            return
        what = f"NIXL {op} with {peer}"
        agent = self._agent

        def post() -> Any:
            return agent.initialize_xfer(
                op,
                agent.get_xfer_descs(descriptors(local, lengths, local_device), local_mem),
                agent.get_xfer_descs(descriptors(remote, lengths, remote_device), remote_mem),
                peer,
            )

        handle = self._call(what, post)
        try:
            state = self._call(what, lambda: agent.transfer(handle))
            delay = POLL_MIN_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"{what}: not done by its deadline")
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
                state = self._call(what, lambda: agent.check_xfer_state(handle))
            if state != "DONE":
                raise TransportError(f"{what} failed ({state})")
        finally:
            try:
                handle.release()  # cancels it if still in flight
            except self._errors as e:
                # still moving and not cancellable: it must not touch memory we hand back
                logger.error("%s: could not release the transfer (%s); waiting for it to end", what, e)
                while self._call(what, lambda: agent.check_xfer_state(handle)) == "PROC":
                    time.sleep(POLL_MAX_S)
                handle.release()

    def progress(self) -> None:
        """One round of the agent's progress (what a progress thread would loop on)."""
        self._call("progress", self._agent.get_new_notifs)

    def close(self) -> None:
        with self._lock:
            peers, regs = list(self._peers), list(self._registrations)
            self._peers.clear()
            self._registrations.clear()
        for name in peers:
            with contextlib.suppress(*self._errors):
                self._agent.remove_remote_agent(name)
        for handle in regs:
            with contextlib.suppress(*self._errors):
                self._agent.deregister_memory(handle)
        del self._agent

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` with NIXL's exceptions turned into ours."""
        try:
            return fn()
        except self._errors as e:
            kind = type(e).__name__
            if kind == "nixlRemoteDisconnectError":
                raise PeerClosed(f"{what}: the peer disconnected") from None
            if kind in ("nixlNotFoundError", "nixlInvalidParamError", "nixlMismatchError"):
                raise TransferRejected(f"{what}: {kind} (memory not registered, or an unknown peer)") from None
            raise TransportError(f"{what}: {kind}: {e}") from None


class ProgressPump:
    """Progresses an agent while someone holds it: a peer's access to our memory may need
    us to handle its messages (UCX's connection set-up; tcp between hosts). Polls with a
    growing sleep while held, sleeps on a condition otherwise (no CPU when idle)."""

    def __init__(self, progress: Callable[[], None]) -> None:
        self._progress = progress
        self._cond = threading.Condition()
        self._holds = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    def hold(self) -> None:
        with self._cond:
            self._holds += 1
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="pd-nixl-progress", daemon=True)
                self._thread.start()
            self._cond.notify()

    def release(self) -> None:
        with self._cond:
            self._holds -= 1

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        delay = PUMP_MIN_S
        while True:
            with self._cond:
                while self._holds <= 0 and not self._stopped:
                    self._cond.wait()
                    delay = PUMP_MIN_S
                if self._stopped:
                    return
            try:
                self._progress()
            except TransportError as e:
                logger.debug("NIXL progress: %s", e)
            time.sleep(delay)
            delay = min(delay * 2, PUMP_MAX_S)

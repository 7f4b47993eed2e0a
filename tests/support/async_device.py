"""An asynchronous stand-in for a GPU: ordering bugs and host syncs of the data path show on CPU.

No GPU runs here (CI has none), and on vLLM's CPU backend every copy is synchronous, so
a missing stream wait would pass unnoticed, and so would a host synchronisation - a GPU's
host thread waiting for the device, which on the forward's thread stalls the forward once
per layer. This device keeps its tensors in host memory but behaves as a GPU does.

**Memory.** The stand-in tells three kinds of memory apart, by storage (a view is of its
base's kind):

* *device* - allocated by the stand-in (``empty``, ``adopt`` for a test's KV cache) or
  made by device work (an op's output);
* *pinned* - host memory from ``host_empty`` (and the host side of ``indices``);
* *pageable* - every other host tensor (``torch.tensor(list)``, the store's pool...).

Device and pinned storages are kept alive until ``finish``, so no address of theirs is
reused by a tensor of another kind.

**Work** (``checked=True``). ``launch(stream, work)`` runs ``work`` at once on the calling
thread, as a GPU's host does, under a ``TorchDispatchMode``: host operations run at once;
an operation on device memory is *deferred* - queued on the stream and run, in order, on
the stream's thread after the launch's delay; its outputs are allocated now (shapes from
the meta device) and filled when it runs. Views run at once (they alias, they read
nothing). An event completes when its stream reaches it; ``wait`` queues a wait on the
stream. Whatever reads KV before waiting on the right event sees stale bytes.

**Host syncs.** Inside launched work, and on the forward's thread within ``forward()``
(where the tests call the connector's hooks, as vLLM does), any operation that would make
a real GPU's host thread wait fails with :class:`HostSyncError` (raised, and kept for
``finish`` in case the data path caught it):

* a device value read on the host: ``.item()`` / ``int()`` / ``bool()``, ``torch.equal``,
  ``.tolist()``, ``.numpy()``, data-dependent shapes (``nonzero``, boolean masks);
* a device operation given pageable host memory - a copy to or from it, or an index
  built with ``torch.tensor(list)``: PyTorch stages it and synchronises the stream;
* a copy between device and pinned memory without ``non_blocking=True``, or a kernel
  given pinned memory instead of a copy;
* an event ``synchronize`` inside launched work or on the forward's thread;
* device memory written or read by the forward's thread outside launched work.

Waits through another thread (a queue the forward waits on, whose thread waits for an
event) are not seen. ``kernel(stream, fn)`` queues ``fn`` whole and unchecked: a test's
fake compute (the forward's KV writes, attention reading them). With ``checked=False``
launched work is queued whole too, unchecked (the GPU harness's processes).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_pd.connector.device.kv_device import DeviceEvent, KVDevice

DEVICE, PINNED, PAGEABLE = "device", "pinned", "pageable"

aten = torch.ops.aten
# device values the host would read (the GPU's host waits for them)
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
# outputs alias their input without the schema saying so (reshape's copy-then-view)
ALIASING = {aten._unsafe_view.default, aten.lift_fresh.default}


class HostSyncError(AssertionError):
    """The data path did something a real GPU would make the host wait for."""


class StandInEvent:
    def __init__(self, host_wait_check: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._check = host_wait_check

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if self._check is not None:
            self._check()
        self._wait()

    def _wait(self) -> None:
        if not self._done.wait(timeout=30):
            raise TimeoutError("stand-in event never completed: its stream is stuck")

    def complete(self) -> None:
        self._done.set()


class StandInStream:
    """Runs its work items one after another on a thread; a launch's items after ``delay_s``."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s
        self._items: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.errors: list[BaseException] = []
        self.ops: Counter[str] = Counter()  # device operations deferred here, by name (checked work)
        self._thread = threading.Thread(target=self._run, name=f"standin-{name}", daemon=True)
        self._thread.start()

    def put(self, item: Callable[[], None], delayed: bool = True) -> None:
        self._items.put(self._delayed(item) if delayed else item)

    def _delayed(self, item: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            time.sleep(self.delay_s)
            item()

        return run

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                item()
            except BaseException as e:
                self.errors.append(e)

    def stop(self) -> None:
        self._items.put(None)
        self._thread.join(timeout=5)


class _Memory:
    """The kind of each storage the stand-in knows (else pageable); keeps them alive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds: dict[int, tuple[str, torch.UntypedStorage]] = {}

    def add(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr():
            with self._lock:
                self._kinds[storage.data_ptr()] = (kind, storage)
        return t

    def kind(self, t: torch.Tensor) -> str:
        if t.device.type == "meta" or t.numel() == 0:
            return PAGEABLE
        entry = self._kinds.get(t.untyped_storage().data_ptr())
        return entry[0] if entry is not None else PAGEABLE

    def clear(self) -> None:
        with self._lock:
            self._kinds.clear()


_current = threading.local()  # .device: the stand-in whose checks run on this thread


class _Checks(TorchDispatchMode):
    def __init__(self, device: AsyncStandInDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.device._dispatch(func, args, kwargs or {})


class AsyncStandInDevice(KVDevice):
    host_accessible = False

    def __init__(
        self,
        compute_delay_s: float = 0.02,
        copy_delay_s: float = 0.005,
        checked: bool = False,
        raise_on_sync: bool = True,
    ) -> None:
        """``raise_on_sync=False``: host syncs are only recorded (``violations``), the work goes on
        (a benchmark counting them)."""
        self.copy_delay_s = copy_delay_s
        self.checked = checked
        self.raise_on_sync = raise_on_sync
        self.compute = StandInStream("compute", compute_delay_s)
        self.streams = [self.compute]
        self.memory = _Memory()
        self.violations: list[HostSyncError] = []
        self.forward_thread: threading.Thread | None = None
        self._local = threading.local()  # .stream: the stream of the work being launched (None: none)
        if checked:
            _check_host_reads_of_tensors()
            _warm_meta_kernels()

    # ---- streams and events -------------------------------------------------------------------
    def compute_stream(self) -> StandInStream:
        return self.compute

    def new_stream(self) -> StandInStream:
        stream = StandInStream(f"copy{len(self.streams)}", self.copy_delay_s)
        self.streams.append(stream)
        return stream

    def record(self, stream: StandInStream) -> DeviceEvent:
        event = StandInEvent(self._check_host_wait if self.checked else None)
        stream.put(event.complete, delayed=False)
        return event

    def wait(self, stream: StandInStream, event: DeviceEvent) -> None:
        wait = event._wait if isinstance(event, StandInEvent) else event.synchronize
        stream.put(wait, delayed=False)

    def launch(self, stream: StandInStream, work: Callable[[], None]) -> None:
        if not self.checked:
            stream.put(work)
            return
        stream.put(_nothing)  # the launch's delay; then its operations, as the work makes them
        with self._checking(stream):
            work()

    def kernel(self, stream: StandInStream, fn: Callable[[], None]) -> None:
        """A test's fake device work: ``fn`` runs whole, unchecked, when the stream reaches it."""
        stream.put(fn)

    # ---- memory ------------------------------------------------------------------------------
    def host_empty(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        return self.memory.add(t, PINNED) if self.checked else t

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype)
        return self.memory.add(t, DEVICE) if self.checked else t

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        if not self.checked:
            return host  # the whole launch runs on the stream: it reads the rows when it runs
        return super().upload(host)

    def indices(self, ids: Sequence[int]) -> torch.Tensor:
        host = torch.tensor(ids, dtype=torch.long)
        if not self.checked:
            return host
        return self.upload(self.memory.add(host, PINNED))  # a GPU's pin_memory: a host copy

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a test's KV cache) is device memory from now on."""
        return self.memory.add(t, DEVICE)

    # ---- the forward's thread ------------------------------------------------------------------
    @contextmanager
    def forward(self) -> Iterator[None]:
        """The calling thread is the forward's while inside (call the connector's hooks here)."""
        self.forward_thread = threading.current_thread()
        try:
            with self._checking(None):
                yield
        finally:
            self.forward_thread = None

    def finish(self) -> None:
        """Wait for all launched work, stop the threads, raise what the work raised or a host sync."""
        for stream in self.streams:
            event = StandInEvent()
            stream.put(event.complete, delayed=False)
            event.synchronize()
            stream.stop()
        errors: list[BaseException] = [*self.violations, *(e for s in self.streams for e in s.errors)]
        self.memory.clear()
        if errors:
            raise errors[0]

    # ---- the checks ------------------------------------------------------------------------------
    @contextmanager
    def _checking(self, stream: StandInStream | None) -> Iterator[None]:
        local = self._local
        if getattr(local, "active", False):  # nested: a launch from the forward's hooks
            outer = local.stream
            local.stream = stream
            try:
                yield
            finally:
                local.stream = outer
            return
        local.active, local.stream, _current.device = True, stream, self
        try:
            with _Checks(self):
                yield
        finally:
            local.active, local.stream, _current.device = False, None, None

    def _fail(self, what: str) -> None:
        error = HostSyncError(what)
        self.violations.append(error)
        if self.raise_on_sync:
            raise error

    def _check_host_wait(self) -> None:
        if getattr(self._local, "stream", None) is not None:
            self._fail("launched work waited for an event on the host")
        if threading.current_thread() is self.forward_thread:
            self._fail("the forward's thread waited for the device (an event's synchronize)")

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        kinds = [self.memory.kind(t) for t in tensors]
        if DEVICE not in kinds:
            return func(*args, **kwargs)  # host work: at once
        if func in HOST_READS:
            self._fail(f"{func} reads device memory on the host: the host waits for the device")
            return func(*args, **kwargs)  # (only counted) the host reads it now
        if func.is_view or func in ALIASING:
            return func(*args, **kwargs)  # aliases device memory: device by its storage
        stream = getattr(self._local, "stream", None)
        if stream is None:
            self._fail(f"{func} touches device memory outside launched work, on the forward's thread")
            return func(*args, **kwargs)
        self._check_operands(func, args, kwargs, tensors, kinds)
        stream.ops[str(func)] += 1
        return self._defer(stream, func, args, kwargs)

    def _check_operands(
        self, func: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor], kinds: list[str]
    ) -> None:
        copy = func is aten.copy_.default
        for t, kind in zip(tensors, kinds):
            if kind == PAGEABLE and (copy or t.dim() > 0):
                self._fail(
                    f"{func} with device memory and pageable host memory {tuple(t.shape)} {t.dtype}: "
                    "a GPU copies it with a host synchronize (pin it: host_empty, indices)"
                )
            if t.dtype == torch.bool and func in (aten.index.Tensor, aten.index_put_.default):
                self._fail(f"{func} with a boolean mask: its shape depends on device data")
            if kind == PINNED:
                if not copy:
                    self._fail(f"{func} given pinned host memory {tuple(t.shape)}: copy it to the device first")
                if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                    self._fail(
                        "a copy between device and pinned host memory without non_blocking=True: the host waits for it"
                    )

    def _defer(self, stream: StandInStream, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Queue ``func`` on ``stream``; what it returns now: the memory it writes, or outputs that
        its run fills."""
        mutated = _mutated(func, args, kwargs)
        if mutated is not None:
            stream.put(lambda: func(*args, **kwargs), delayed=False)
            return mutated
        meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _on_meta, (args, kwargs))
        shapes = func(*meta_args, **meta_kwargs)
        outputs = pytree.tree_map_only(torch.Tensor, lambda m: self.empty_strided_like(m), shapes)

        def run() -> None:
            results = func(*args, **kwargs)
            for out, result in zip(pytree.tree_leaves(outputs), pytree.tree_leaves(results)):
                out.copy_(result)

        stream.put(run, delayed=False)
        return outputs

    def empty_strided_like(self, meta: torch.Tensor) -> torch.Tensor:
        return self.memory.add(torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype), DEVICE)


def _nothing() -> None:
    return None


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _mutated(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """What a mutating op returns (the tensors it writes, per its schema), or None if it writes none."""
    schema = func._schema
    bound = {a.name: args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)}
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if not written:
        return None
    returns = []
    for r in schema.returns:
        alias = next(
            (
                a.name
                for a in schema.arguments
                if a.name in written and r.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set
            ),
            None,
        )
        returns.append(bound[alias] if alias is not None else None)
    return returns[0] if len(returns) == 1 else tuple(returns)


_warm = False


def _warm_meta_kernels() -> None:
    """Load the meta kernels of the data path's ops once (the first call takes seconds, which
    would shift a test's launches against its delays)."""
    global _warm
    if _warm:
        return
    _warm = True
    blocks = torch.empty(4, 8, dtype=torch.uint8, device="meta")
    index = torch.empty(2, dtype=torch.long, device="meta")
    rows = blocks.index_select(0, index)
    blocks.index_copy_(0, index, rows)
    blocks.clone().copy_(blocks)
    with _PassThrough():  # a tensor made under a mode imports torch._dynamo the first time
        torch.tensor([0])


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


_patched = False


def _check_host_reads_of_tensors() -> None:
    """``.tolist()`` and ``.numpy()`` read a tensor without dispatching an op: check them by hand
    (on threads running a stand-in's checks, for its device memory; elsewhere as they were)."""
    global _patched
    if _patched:
        return
    _patched = True
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def checked(self: torch.Tensor, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            device = getattr(_current, "device", None)
            if device is not None and device.memory.kind(self) == DEVICE:
                device._fail(f".{_name}() of device memory: the host waits for the device")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, checked)

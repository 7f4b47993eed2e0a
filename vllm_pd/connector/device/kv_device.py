"""Where the KV cache lives, and how work on it is ordered: streams and events.

The connector's data path is written once against :class:`KVDevice` and runs on
CPU, CUDA and ROCm alike:

* :class:`HostDevice` - vLLM's CPU backend: the host owns the memory, every
  "stream" is the calling thread, so work runs at once and events are complete
  when made. The CPU data path is exactly the synchronous one it always was.
* :class:`CudaDevice` - CUDA and ROCm through ``torch.cuda``: its events block the
  thread that waits on them (``blocking=True``, which the device-agnostic
  ``torch.Event`` accepts but ignores in torch 2.13) instead of spinning a core.
* :class:`TorchDevice` - any other accelerator through torch's device-agnostic
  ``torch.Stream`` / ``torch.Event`` / ``torch.accelerator`` API.

Rules the data path follows (the GPU's, which the CPU satisfies trivially):

* KV memory is touched only by work launched on a stream (``launch``), never by
  the host directly unless ``host_accessible``.
* Work that reads what the forward wrote first makes its stream wait on an event
  recorded on the compute stream after that write (``record`` / ``wait``): a
  stream wait, never a host synchronisation on the forward's thread.
* The host learns that launched work is done only through an event
  (``query`` / ``synchronize``), on a thread that may block - never the forward's.
* Launched work never makes the host wait for the device: host memory it copies
  from or to is pinned (``host_empty``; ``indices`` builds index tensors in pinned
  memory), copies are ``non_blocking``, and nothing reads a device value on the host
  (``.item()``, ``.tolist()``). On a GPU a copy from pageable memory is followed by
  a stream synchronize: the launching thread - the forward's, for a send - would
  wait for everything queued before it.

Tests also run the data path on an asynchronous stand-in device (tests/support/async_device.py)
whose tensor work runs later on other threads, so a missing wait shows as wrong bytes,
and which fails any operation that would make a GPU's host wait.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """A point in a stream's work; complete once everything before it has run."""

    def query(self) -> bool:
        """True once complete (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until complete."""


class CompletedEvent:
    """An event with nothing to wait for (host work, nothing launched)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


COMPLETED = CompletedEvent()


class KVDevice(abc.ABC):
    """The device KV tensors live on, and its streams."""

    #: may the host read and write KV memory directly (CPU), or only through launched copies
    host_accessible: bool = False

    @abc.abstractmethod
    def compute_stream(self) -> Any:
        """The stream the forward is running on now (the caller's current stream)."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A stream of our own, for copies that must not queue behind the forward."""

    @abc.abstractmethod
    def record(self, stream: Any) -> DeviceEvent:
        """An event marking all work launched on ``stream`` so far."""

    @abc.abstractmethod
    def wait(self, stream: Any, event: DeviceEvent) -> None:
        """Work launched on ``stream`` from now on runs after ``event`` (no host sync)."""

    @abc.abstractmethod
    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        """Run ``work``'s tensor operations on ``stream`` (``work`` only launches them)."""

    @abc.abstractmethod
    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer the device copies to and from at full speed (pinned on GPUs)."""

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory, for launched work."""

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (pinned: from ``host_empty``) on the device, copied without blocking on the
        current stream (call inside launched work); ``host`` must stay untouched until that
        stream has passed the copy."""
        out = self.empty(host.shape, host.dtype)
        out.copy_(host, non_blocking=True)
        return out

    @abc.abstractmethod
    def indices(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` as an int64 device tensor, from pinned memory without blocking (inside launched work)."""


class HostDevice(KVDevice):
    """The CPU: one synchronous "stream", events complete at once."""

    host_accessible = True

    def compute_stream(self) -> None:
        return None

    def new_stream(self) -> None:
        return None

    def record(self, stream: Any) -> DeviceEvent:
        return COMPLETED

    def wait(self, stream: Any, event: DeviceEvent) -> None:
        event.synchronize()  # only ever a completed event here, or a stand-in's

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        work()

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host  # the host is the device: nothing to copy

    def indices(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long)


class TorchDevice(KVDevice):
    """An accelerator through torch's device-agnostic stream API."""

    host_accessible = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def compute_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device=self.device)

    def record(self, stream: torch.Stream) -> DeviceEvent:
        event = torch.Event(device=self.device)
        event.record(stream)
        recorded: DeviceEvent = event
        return recorded

    def wait(self, stream: Any, event: DeviceEvent) -> None:
        if isinstance(event, (torch.Event, torch.cuda.Event)):
            event.wait(stream)  # the stream waits, not the host
        else:
            event.synchronize()  # COMPLETED: returns at once

    def launch(self, stream: torch.Stream, work: Callable[[], None]) -> None:
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            work()
        finally:
            torch.accelerator.set_stream(previous)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def indices(self, ids: Sequence[int]) -> torch.Tensor:
        # pinned (torch's caching host allocator keeps the page until the copy has read it)
        return self.upload(torch.tensor(ids, dtype=torch.long, pin_memory=True))


class CudaDevice(TorchDevice):
    """CUDA (and ROCm, which torch names cuda) through ``torch.cuda``: blocking events."""

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def record(self, stream: Any) -> DeviceEvent:
        # blocking: a thread that waits for the copy sleeps in the driver instead of spinning
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        recorded: DeviceEvent = event
        return recorded

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            work()


def kv_device_for(tensors: Sequence[torch.Tensor]) -> KVDevice:
    """The device of a KV cache; ValueError if its layers are on different devices."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"KV cache layers on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu":
        return HostDevice()
    return CudaDevice(device) if device.type == "cuda" else TorchDevice(device)

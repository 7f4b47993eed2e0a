"""An asynchronous stand-in for a GPU, so ordering bugs of the data path show on CPU.

No GPU runs here (CI has none), and on vLLM's CPU backend every copy is synchronous,
so a missing stream wait would pass unnoticed. This device keeps its tensors in
host memory but runs every piece of launched work later, in order, on its stream's
own thread, after a delay; an event completes only when its stream has reached it.
Whatever reads KV before waiting on the right event then sees stale bytes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from vllm_pd.connector.kv_device import DeviceEvent, KVDevice


class StandInEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(timeout=30):
            raise TimeoutError("stand-in event never completed: its stream is stuck")

    def complete(self) -> None:
        self._done.set()


class StandInStream:
    """Runs its work items one after another on a thread, each after ``delay_s``."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s
        self._items: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.errors: list[BaseException] = []
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
            except BaseException as e:  # noqa: BLE001 - surfaced by the test through .errors
                self.errors.append(e)

    def stop(self) -> None:
        self._items.put(None)
        self._thread.join(timeout=5)


class AsyncStandInDevice(KVDevice):
    host_accessible = False

    def __init__(self, compute_delay_s: float = 0.02, copy_delay_s: float = 0.005) -> None:
        self.copy_delay_s = copy_delay_s
        self.compute = StandInStream("compute", compute_delay_s)
        self.streams = [self.compute]

    def compute_stream(self) -> StandInStream:
        return self.compute

    def new_stream(self) -> StandInStream:
        stream = StandInStream(f"copy{len(self.streams)}", self.copy_delay_s)
        self.streams.append(stream)
        return stream

    def record(self, stream: StandInStream) -> DeviceEvent:
        event = StandInEvent()
        stream.put(event.complete, delayed=False)
        return event

    def wait(self, stream: StandInStream, event: DeviceEvent) -> None:
        stream.put(event.synchronize, delayed=False)

    def launch(self, stream: StandInStream, work: Callable[[], None]) -> None:
        stream.put(work)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def finish(self) -> None:
        """Wait for all launched work, stop the threads, raise what the work raised."""
        for stream in self.streams:
            self.record(stream).synchronize()
            stream.stop()
        errors = [e for s in self.streams for e in s.errors]
        if errors:
            raise errors[0]

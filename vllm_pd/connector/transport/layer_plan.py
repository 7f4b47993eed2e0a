"""A step's layer-wise push as one message: the peer reads each layer itself.

Pushing layer by layer costs the sending core a message per layer. On a 1-core
prefill instance that is the core computing the forward, and on these VMs one
small ``sendmsg`` right after a layer's compute costs ~100 us of cold caches and
a wake-up of the peer's core, the framing and bookkeeping around it as much
again: ~2.4 ms of an 8-layer forward of 128 tokens (docs/benchmarks/pd-latency.md, "layer plans").

A plan says once, as the step starts, which blocks of which layers will be pushed
and where they are in the sender's memory; then per layer the sender only
writes the layer's block digests and bumps a counter in its own memory
(:meth:`LayerPlan.ready`: a checksum and two stores, no system call, no thread
switch). The receiver polls that counter with cross-memory reads and, for each
ready layer, copies the blocks from the sender's memory into the sink's
destinations and checks them against the digests, on its own core. One ACK
answers the whole plan.

Only where the peer can read our memory (shm transport, probed at the handshake:
cross_memory.py) and with a checksum; elsewhere ``Transport.push_layers`` returns
None and the caller pushes layer by layer. Ordering: the sender's stores (the
forward's KV writes, then the digests, then the counter) become visible to other
cores in program order on x86-64 (TSO); a reader that saw the counter sees what
came before it. Other architectures fall back to pushes.

The PLAN frame's payload and the progress area's layout: protocol/layer_plan.py.
"""

from __future__ import annotations

import platform
import struct
from collections.abc import Sequence
from concurrent.futures import Future

from vllm_pd.connector.transport.checksum import block_digest
from vllm_pd.connector.transport.cross_memory import address_of
from vllm_pd.protocol.frames import DIGEST_NBYTES, Checksum
from vllm_pd.protocol.layer_plan import digests_offset, encode_plan, progress_nbytes

# x86-64 keeps stores in order for other cores (TSO): the counter never runs ahead of the
# digests and KV it announces. Elsewhere plans are not offered.
ORDERED_STORES = platform.machine() in ("x86_64", "AMD64")


class LayerPlan:
    """Sender side: the layers' blocks (views of our regions) and the progress area."""

    def __init__(self, checksum: Checksum, layers: Sequence[int], views: Sequence[Sequence[memoryview]]) -> None:
        self.checksum = checksum
        self.layers = tuple(layers)
        self._views = [list(v) for v in views]
        self._count = len(self._views[0]) if self._views else 0
        # never resized: the peer reads it at this address until our future settles
        self._progress = bytearray(progress_nbytes(len(self.layers), self._count))
        self._area = memoryview(self._progress)
        self.future: Future[None] | None = None  # ACK of the whole plan (set by the transport)

    def payload(self, timeout: float) -> bytes:
        addresses = [address_of(v) for views in self._views for v in views]
        return encode_plan(address_of(self._area), timeout, self.layers, addresses)

    def ready(self, k: int) -> None:
        """The plan's k-th layer is computed: publish its digests, then the count."""
        off = digests_offset(k, self._count)
        for view in self._views[k]:
            self._area[off : off + DIGEST_NBYTES] = block_digest(self.checksum, view)
            off += DIGEST_NBYTES
        struct.pack_into("<Q", self._progress, 0, k + 1)


class ReadyPacer:
    """Receiver side: when to start polling for a plan's next layer.

    A poll is a system call on the receiver's core, every ~50-100 us for the whole forward;
    on a decode instance that core runs the decode batch. The layers of one forward become
    ready at a steady pace, so once two intervals are known the reader sleeps through the
    first ``EARLY`` of the shorter of them and polls only the rest. Taking the shorter one
    keeps a single slow layer (the sender preempted) from making the reader late for the
    next; an early layer is only found as late as the fine polling would have found it.
    """

    EARLY = 0.75

    def __init__(self) -> None:
        self._last: float | None = None
        self._intervals: list[float] = []

    def seen(self, now: float) -> None:
        """A layer was found ready at ``now``."""
        if self._last is not None:
            self._intervals = [*self._intervals[-1:], now - self._last]
        self._last = now

    def quiet_until(self) -> float | None:
        """No poll is worth making before this time (None: poll from now on)."""
        if self._last is None or len(self._intervals) < 2:
            return None
        return self._last + self.EARLY * min(self._intervals)

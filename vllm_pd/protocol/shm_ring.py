"""The shm transport's ring: what two processes on one host share in /dev/shm, and how.

Each connection has two rings, one per direction, each created by the side that writes it
and announced in the HELLO handshake (``ring``: its name, which starts with
:data:`SEGMENT_PREFIX`; ``slots``; ``slot_nbytes``). A ring is ``slots`` slots of
``slot_nbytes`` followed by a control area of :data:`CONTROL_NBYTES`, zero-filled at creation,
with two u64 counters on their own cache lines: :data:`CONSUMED` (slots the receiver has
emptied; written by the receiver only) and :data:`WANTED` (the ``consumed`` value a waiting
sender wants a CREDIT frame at; written by the sender only). The frames that go with it
(READY, CREDIT, ``FLAG_TRAILER``): frames.py; the transport: transport/shm.py.
"""

from __future__ import annotations

SEGMENT_PREFIX = "vllmpd-"
CONTROL_NBYTES = 4096
# the control area's counters, as u64 indices into it
CONSUMED = 0
WANTED = 8

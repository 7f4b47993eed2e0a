"""Shared pieces of the transport tests: regions, a recording sink, a peer process,
and raw-socket peers that speak the framing (to inject corrupt/truncated streams)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion, Transport
from vllm_pd.connector.transport.checksum import block_digest
from vllm_pd.connector.transport.frame_io import read_frame, send_buffers
from vllm_pd.protocol.frames import Checksum, Frame, Kind

# vLLM CPU KV page: [num_blocks, 2 (k/v), block_size, kv_heads*head_dim]; small
# block_size keeps tests fast, the shape family is the real one.
BLOCK_SHAPE = (2, 16, 128)


def make_regions(
    num_layers: int, num_blocks: int, seed: int | None = 0, block_shape: tuple[int, ...] = BLOCK_SHAPE
) -> list[MemoryRegion]:
    """Regions of random bf16 (or zeros if seed is None). Filled with numpy, not
    torch ops: forked peer processes must not touch torch's OpenMP pool."""
    rng = np.random.default_rng(seed) if seed is not None else None
    out = []
    for i in range(num_layers):
        shape = (num_blocks, *block_shape)
        if rng is None:
            bits = np.zeros(shape, dtype=np.uint16)
        else:  # random bit patterns without the exponent's top bit: no NaN/inf
            bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0xBFFF
        out.append(MemoryRegion(f"layer{i}", torch.from_numpy(bits).view(torch.bfloat16)))
    return out


class RecordingSink:
    """Lands a pushed batch at block ids = positions of its own regions (with ``windows`` set,
    a window's rows at the start of those blocks); records
    every landed() call in order. ``hold`` blocks destinations() until set."""

    def __init__(self, regions: Sequence[MemoryRegion], reject: set[str] | None = None) -> None:
        self.regions = regions
        self.reject = reject or set()
        self.landed_calls: list[tuple[BlockBatch, bool]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.notify_delay = 0.0
        self.notified: list[bytes] = []  # every control message delivered, in order
        self.windows = False  # take rows shorter than a block (pushes of a window of each block)
        self.cond = threading.Condition()

    def destinations(self, batch: BlockBatch):
        self.entered.set()
        self.hold.wait()
        if batch.transfer_id in self.reject:
            return None
        t = self.regions[batch.layer].tensor
        views = [memoryview(t[p].view(-1).view(torch.uint8).numpy()) for p in batch.positions]
        return [v[: batch.block_nbytes] for v in views] if self.windows else views

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        with self.cond:
            self.landed_calls.append((batch, ok))
            self.cond.notify_all()

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        self.notified.append(message)
        if self.notify_delay:
            threading.Event().wait(self.notify_delay)
        if message == b"none":
            return None
        return b"re:" + message + b" from " + peer.encode()

    def wait_landed(self, n: int, timeout: float = 10.0) -> list[tuple[BlockBatch, bool]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.landed_calls) >= n, timeout), self.landed_calls
            return list(self.landed_calls)


def started(name: str, regions: Sequence[MemoryRegion], **options) -> tuple[Transport, RecordingSink, str]:
    t = create_transport(name, **options)
    t.register_regions(regions)
    sink = RecordingSink(regions)
    return t, sink, t.start(sink, "127.0.0.1", 0)


# -- a peer in another process ----------------------------------------------------------


def _peer_main(
    name: str, num_layers: int, num_blocks: int, hold: bool, push_to: str | None, options: dict, conn
) -> None:
    regions = make_regions(num_layers, num_blocks, seed=1)
    t, sink, endpoint = started(name, regions, **options)
    if hold:
        sink.hold.clear()  # pushes never land: the sender fills the pipe and waits
    t.allow_fetch("granted", list(range(num_blocks)))
    if push_to is not None:  # push every block of layer 0 to push_to
        ids = list(range(num_blocks))
        t.push(push_to, BlockBatch("from-peer", 0, tuple(ids), regions[0].block_nbytes), ids, timeout=600)
    conn.send(endpoint)
    threading.Event().wait()  # until killed


def spawn_peer(
    name: str, num_layers: int, num_blocks: int, hold: bool, push_to: str | None = None, **options
) -> tuple[mp.Process, str]:
    # fork, not spawn: re-importing torch in a child takes ~1 min on the loaded CI
    # box. The child builds its own transport and never touches the parent's
    # threads' objects, so forking a threaded parent is safe here. Not for nixl: UCX
    # does not survive a fork once the parent has started it (the child's agent never
    # answers a connection), so nixl peers fork from a fresh forkserver (torch imported
    # there once).
    ctx = mp.get_context("forkserver" if name == "nixl" else "fork")
    if name == "nixl":
        ctx.set_forkserver_preload(["torch", "tests.support.transport_harness"])
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer_main, args=(name, num_layers, num_blocks, hold, push_to, options, child), daemon=True)
    p.start()
    if not parent.poll(60):
        p.kill()
        raise RuntimeError("peer process did not start")
    return p, parent.recv()


# -- raw peers speaking the framing -------------------------------------------------------


def raw_dial(endpoint: str) -> socket.socket:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    send_buffers(s, [Frame(Kind.HELLO, payload=msgspec.json.encode({"endpoint": "raw://test"})).encode()])
    assert read_frame(s).kind is Kind.HELLO
    return s


class RawFetchServer:
    """Answers one FETCH with DATA whose bytes are ``data`` and digests computed
    over ``digest_of`` (different -> a corrupt block), or with a truncated body."""

    def __init__(self, data: list[bytes], digest_of: list[bytes], truncate: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.data, self.digest_of, self.truncate = data, digest_of, truncate
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            assert read_frame(conn).kind is Kind.HELLO
            send_buffers(conn, [Frame(Kind.HELLO, payload=b"{}").encode()])
            req = read_frame(conn)
            frame = Frame(
                Kind.DATA,
                req_id=req.req_id,
                checksum=Checksum.BLAKE3,
                layer=req.layer,
                block_nbytes=req.block_nbytes,
                transfer_id=req.transfer_id,
                ids=req.ids,
                lengths=tuple(len(d) for d in self.data),
            )
            body = b"".join(self.data)
            trailer = b"".join(block_digest(Checksum.BLAKE3, memoryview(d)) for d in self.digest_of)
            if self.truncate:
                send_buffers(conn, [frame.encode(), body[: len(body) // 2]])
            else:
                send_buffers(conn, [frame.encode(), body, trailer])
            threading.Event().wait(0.5)

    def close(self) -> None:
        self.listener.close()


# -- a relay on the path between two transports (records, alters, injects) -------------------


class TcpRelay:
    """Listens on 127.0.0.1 and relays each connection to ``target`` byte for byte, recording
    what the dialler sent (``recorded``: one bytearray per connection). ``alter(data, offset)``
    may return changed bytes of the dialler->listener direction (offset: of ``data`` in that
    connection's stream); ``inject_after`` bytes into that direction, ``inject`` is sent once.
    What an on-path attacker can do, minus reading the secret."""

    def __init__(self, target: str) -> None:
        scheme, _, rest = target.partition("://")
        host, port = rest.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}"
        self.recorded: list[bytearray] = []
        self.recorded_back: list[bytearray] = []  # what the listener sent, per connection
        self.alter = None
        self.inject: bytes | None = None
        self.inject_after = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            record, back = bytearray(), bytearray()
            self.recorded.append(record)
            self.recorded_back.append(back)
            threading.Thread(target=self._pump, args=(client, server, record), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, back, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray, dialler_side: bool = True) -> None:
        offset = 0
        try:
            while data := src.recv(1 << 16):
                if not dialler_side:
                    record += data
                else:
                    if self.alter is not None:
                        data = self.alter(data, offset)
                    record += data
                    offset += len(data)
                    if self.inject is not None and offset >= self.inject_after:
                        data, self.inject = data + self.inject, None
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()

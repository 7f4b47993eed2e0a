"""What a layer-wise push costs the core that computes the forward.

On a 1-core prefill instance the transport's work runs on the core that computes
the next layer, so every microsecond it spends (thread wake-ups, framing, the
ack) lengthens the prompt step and so the TTFT. This measures it without vLLM:

* the sender process (pinned to one core, one torch thread, heap frozen as vLLM's
  EngineCore does) runs a synthetic forward: per layer a few dozen torch ops sized
  so that a layer of ``--tokens`` tokens takes about what one layer of
  pd_latency's model takes on a vLLM CPU server, then (like the connector's
  ``save_kv_layer``) pushes that layer's KV blocks to the receiver;
* the receiver (another process, another core) lands them as decode would.

Printed: the forward's median wall time without pushes, with a push per layer, with
the step's layers pushed as one layer plan (shm: the receiver reads each layer from
the sender's memory once ``ready``; what the connector does where it can), and - the
limit - with a plain socket ``sendall`` of the same bytes per layer to the same
receiver core instead of a push (what moving the bytes costs at least); forwards
of the four kinds interleaved in one run.

Usage: python3 benchmarks/push_cost.py [--transports tcp shm] [--tokens 128 512] [--forwards 40]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion

# pd_latency's model: 8 layers, hidden 512, 4 KV heads x 64, bf16: 1 KiB of KV per token and layer
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 512, 4, 64, 128
BLOCKS = 64


@dataclass(frozen=True)
class Case:
    transport: str
    tokens: int
    forwards: int

    @property
    def blocks(self) -> int:
        return -(-self.tokens // BLOCK_TOKENS)


def kv_regions() -> list[MemoryRegion]:
    """A KV cache of pd_latency's model in vLLM's CPU layout, one region per layer (zeroed)."""
    shape = (BLOCKS, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)  # vLLM CPU layout
    return [MemoryRegion(f"l{i}", torch.zeros(shape, dtype=torch.bfloat16)) for i in range(LAYERS)]


class LandingSink:
    """The receiving end's sink: lands pushed blocks in its regions, as decode's connector does."""

    def __init__(self, regions: list[MemoryRegion]) -> None:
        self._rows = [r.tensor.view(r.num_blocks, -1).view(torch.uint8).numpy() for r in regions]

    def destinations(self, batch: BlockBatch):
        return [memoryview(self._rows[batch.layer][p]) for p in batch.positions]

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        if not ok:
            raise RuntimeError(f"batch {batch.transfer_id} failed its check")

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        return None


class _Layer:
    """About what one decoder layer of the benchmark model costs, in many small ops."""

    def __init__(self, tokens: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
        self.w_qkv = torch.randn(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM, generator=g).bfloat16()
        self.w_o = torch.randn(HIDDEN, HIDDEN, generator=g).bfloat16()
        self.w_up = torch.randn(HIDDEN, 2048, generator=g).bfloat16()
        self.w_down = torch.randn(1024, HIDDEN, generator=g).bfloat16()

    def __call__(self) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(self.x, (HIDDEN,))
        qkv = h @ self.w_qkv
        q = qkv[:, :HIDDEN].reshape(-1, 8, 64).transpose(0, 1)
        k = qkv[:, HIDDEN : HIDDEN + 256].reshape(-1, 4, 64).transpose(0, 1).repeat_interleave(2, 0)
        v = qkv[:, HIDDEN + 256 :].reshape(-1, 4, 64).transpose(0, 1).repeat_interleave(2, 0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.x + a.transpose(0, 1).reshape(-1, HIDDEN) @ self.w_o
        u = torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.w_up
        m = torch.nn.functional.silu(u[:, :1024]) * u[:, 1024:]
        return h + m @ self.w_down


def _freeze_heap() -> None:
    gc.collect()
    gc.freeze()


def _drain(server: socket.socket) -> None:
    """The raw limit's receiving end: read and drop whatever one connection sends."""
    c, _ = server.accept()
    buf = memoryview(bytearray(1 << 20))
    with c:
        while c.recv_into(buf):
            pass


def _receiver(conn, core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    _freeze_heap()
    while (transport := conn.recv()) is not None:
        regions = kv_regions()
        t = create_transport(transport)
        t.register_regions(regions)
        raw = socket.create_server(("127.0.0.1", 0))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        threading.Thread(target=_drain, args=(raw,), daemon=True).start()
        conn.send((t.start(LandingSink(regions), "127.0.0.1", 0), raw.getsockname()[1]))
        conn.recv()
        t.close()
        raw.close()
        conn.send(None)


def _sender(conn, core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    _freeze_heap()
    while (msg := conn.recv()) is not None:
        case, ep, raw_port = msg
        conn.send(_forwards(case, ep, raw_port))


KINDS = ("none", "push", "plan", "raw")


def _forwards(case: Case, ep: str, raw_port: int) -> dict[str, list[float]]:
    """Forward times per kind, interleaved (so machine noise hits all alike)."""
    regions = kv_regions()
    t = create_transport(case.transport)
    t.register_regions(regions)
    t.start(LandingSink(regions), "127.0.0.1", 0)
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    layers = [_Layer(case.tokens) for _ in range(LAYERS)]
    block_nbytes = regions[0].block_nbytes
    rows = [r.tensor.view(r.num_blocks, -1).view(torch.uint8).numpy() for r in regions]
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for n in range(len(KINDS) * (case.forwards + 2)):  # 2 warm-up forwards of each kind
        kind = KINDS[n % len(KINDS)]
        ids = [(n * case.blocks + b) % BLOCKS for b in range(case.blocks)]
        futs = []
        t0 = time.perf_counter()
        plan = None
        if kind == "plan":  # as the connector: one layer plan per step where the transport offers it
            plan = t.push_layers(ep, f"f{n}", range(LAYERS), range(case.blocks), ids, timeout=30, last=True)
            if plan is not None:
                futs.append(plan.future)
            elif n >= 2 * len(KINDS):
                kind = "no plan"
        for i, layer in enumerate(layers):
            layer()
            if plan is not None:
                plan.ready(i)
            elif kind == "push" or kind == "plan":
                batch = BlockBatch(f"f{n}", i, tuple(range(case.blocks)), block_nbytes, last=i == LAYERS - 1)
                futs.append(t.push(ep, batch, ids, timeout=30, answer=i == LAYERS - 1))  # as the connector
            elif kind == "raw":
                raw.sendmsg([memoryview(rows[i][b]) for b in ids])
        if n >= 2 * len(KINDS) and kind in times:
            times[kind].append(time.perf_counter() - t0)
        for f in futs:
            f.result()
        time.sleep(0.02)  # requests arrive apart: each forward starts with idle transport threads
    t.close()
    raw.close()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 512])
    p.add_argument("--forwards", type=int, default=40)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    rx_a, rx_b = ctx.Pipe()
    tx_a, tx_b = ctx.Pipe()
    procs = [
        ctx.Process(target=_receiver, args=(rx_b, 1), daemon=True),
        ctx.Process(target=_sender, args=(tx_b, 0), daemon=True),
    ]
    for pr in procs:
        pr.start()
    try:
        for transport in args.transports:
            for tokens in args.tokens:
                rx_a.send(transport)
                ep, raw_port = rx_a.recv()
                tx_a.send((Case(transport, tokens, args.forwards), ep, raw_port))
                times = tx_a.recv()
                rx_a.send(None)
                rx_a.recv()
                plain, pushed, raw = (statistics.median(times[k]) * 1e3 for k in ("none", "push", "raw"))
                planned = (
                    f"+{statistics.median(times['plan']) * 1e3 - plain:5.2f} ms as one layer plan"
                    if times["plan"]
                    else "no layer plan (transport cannot)"
                )
                print(
                    f"{transport} {tokens:5d} tokens: forward {pushed:6.2f} ms with {LAYERS} pushes vs "
                    f"{plain:6.2f} ms without = +{pushed - plain:5.2f} ms "
                    f"(+{(pushed - plain) / LAYERS * 1e3:4.0f} us per push), {planned}; limit: raw socket "
                    f"sends of the same bytes +{raw - plain:5.2f} ms",
                    flush=True,
                )
    finally:
        rx_a.send(None)
        tx_a.send(None)
        for pr in procs:
            pr.join(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

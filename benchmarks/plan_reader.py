"""What reading a layer plan costs the receiver's core (decode's, which runs the decode batch).

A layer plan's receiver polls the sender's progress word while the sender computes, then
copies each ready layer from the sender's memory and checks its digests
(connector/transport/layer_plan.py). This measures the receiving process's CPU per plan
without vLLM: a sender process (core 0) marks the layers of pd_latency's model ready one
every ``--layer-ms`` (the pace of a forward of that many tokens; ~5 ms for 128 tokens and
~110 ms for 2048 on the session 6 host), and the receiver process (core 1) lands them.

Printed per case, plans interleaved in one run:

* ``paced``   - what the transport does: ReadyPacer sleeps through most of each layer's
  interval once it knows the pace, then polls every ~0.5 ms (every ~50-100 us for the
  plan's last layer, which decode's first token waits for);
* ``unpaced`` - the same without the pacer;
* ``fine``    - polling every ~50-100 us throughout, no pacer (the reader before session 6);
* the limit   - the same plan with every layer ready before it is sent: the copies and
  digest checks alone, no waiting;

and, for the waiting kinds, the time from the sender's last ``ready`` to the plan's answer (what
the pacing must not lengthen: decode's first token waits for the last layer).

Usage: python3 benchmarks/plan_reader.py [--layer-ms 5 110] [--tokens 128 2048] [--plans 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time

import torch
from push_cost import BLOCK_TOKENS, BLOCKS, LAYERS, LandingSink, kv_regions  # benchmarks/ is the script's folder

from vllm_pd.connector.transport import create_transport, serve_session
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.layer_plan import ReadyPacer

KINDS = ("paced", "unpaced", "fine", "limit")
PACER_EARLY, POLL_LAZY_S = ReadyPacer.EARLY, serve_session.PLAN_POLL_LAZY_S  # as shipped


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def _receiver(conn, core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    regions = kv_regions()
    t = create_transport("shm")
    t.register_regions(regions)
    conn.send(t.start(LandingSink(regions), "127.0.0.1", 0))
    while (kind := conn.recv()) is not None:  # one plan: reset the counter, set the pacing
        ReadyPacer.EARLY = 0.0 if kind in ("unpaced", "fine") else PACER_EARLY
        serve_session.PLAN_POLL_LAZY_S = serve_session.PLAN_POLL_S if kind == "fine" else POLL_LAZY_S
        c0 = _cpu_s()
        conn.send(None)
        conn.recv()  # the plan was answered
        conn.send(_cpu_s() - c0)
    t.close()


def _plans(conn, ep: str, tokens: int, layer_s: float, n: int) -> dict[str, tuple[list[float], list[float]]]:
    os.sched_setaffinity(0, {0})
    regions = kv_regions()
    t = create_transport("shm")
    t.register_regions(regions)
    t.start(LandingSink(regions), "127.0.0.1", 0)
    blocks = -(-tokens // BLOCK_TOKENS)
    t.push(ep, BlockBatch("hello", 0, (0,), regions[0].block_nbytes), [0], timeout=30).result(30)  # connect
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in KINDS}
    for i in range(len(KINDS) * (n + 1)):  # one warm-up plan of each kind
        kind = KINDS[i % len(KINDS)]
        ids = [(i * blocks + b) % BLOCKS for b in range(blocks)]
        conn.send(kind)
        conn.recv()
        plan = t.push_layers(ep, f"p{i}", range(LAYERS), range(blocks), ids, timeout=60, last=True)
        if plan is None:
            raise SystemExit("no layer plan: this host does not allow cross-memory reads (see cross_memory.py)")
        if kind == "limit":
            for k in range(LAYERS):
                plan.ready(k)
        else:
            for k in range(LAYERS):
                time.sleep(layer_s)  # the layer's compute
                plan.ready(k)
        last = time.perf_counter()
        plan.future.result(60)
        answered = time.perf_counter() - last
        conn.send(None)
        cpu = conn.recv()
        if i >= len(KINDS):
            out[kind][0].append(cpu)
            out[kind][1].append(answered)
        time.sleep(0.05)
    t.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer-ms", nargs="+", type=float, default=[5.0, 110.0])
    p.add_argument(
        "--tokens", nargs="+", type=int, default=[128, 2048], help="one per --layer-ms: the plan's size for that pace"
    )
    p.add_argument("--plans", type=int, default=12, help="plans per kind and case")
    args = p.parse_args(argv)
    if len(args.tokens) != len(args.layer_ms):
        p.error("give one --tokens value per --layer-ms value")
    ctx = mp.get_context("spawn")
    for tokens, layer_ms in zip(args.tokens, args.layer_ms):
        a, b = ctx.Pipe()
        rx = ctx.Process(target=_receiver, args=(b, 1), daemon=True)
        rx.start()
        try:
            ep = a.recv()
            out = _plans(a, ep, tokens, layer_ms / 1e3, args.plans)
            a.send(None)
        finally:
            rx.join(timeout=10)
        cpu = {k: statistics.median(v[0]) * 1e3 for k, v in out.items()}
        tail = {k: statistics.median(v[1]) * 1e3 for k, v in out.items()}
        print(
            f"{tokens:5d} tokens, a layer every {layer_ms:g} ms: reader CPU per plan paced {cpu['paced']:6.2f} ms "
            f"= {cpu['paced'] / max(cpu['fine'], 1e-9):.2f} x fine {cpu['fine']:6.2f} ms (unpaced "
            f"{cpu['unpaced']:6.2f} ms); limit (copies and checks alone) {cpu['limit']:5.2f} ms; last layer -> "
            f"answer: paced {tail['paced']:.2f} ms, unpaced {tail['unpaced']:.2f} ms, fine {tail['fine']:.2f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a request joining a busy 1P1D decode instance costs the requests already decoding there.

plan_validate's 8x replays decode slower than simulated, and per request the excess grows with how many
other requests joined decode during its stream (docs/benchmarks/planner.md). The profile's
neighbour factor measures decode's steps while the prefill instance runs plain prefills; in 1P1D every
prefill also pushes its KV to decode, whose worker threads - pinned to decode's core - read it (a layer
plan's polling, the copies and checks) and load it into the joining request's blocks.

The pair plan_validate.py uses (two kv_both instances of the built-in small model, one core each, shm).
A lone stream on b (straight to b, --context-token prompt, --out tokens) has its mean step measured over
its second half: alone; while a prefills one-token requests back to back (plain, straight to a: the
profile's neighbour factor); and while back-to-back requests of 2 tokens go through the 1P1D proxy
(prefill on a pushing to b, b loading the KV and decoding one token: the joins). Kinds interleave within
each round, --rounds rounds, --prompt-tokens lengths. Per join: (step beside joins - step beside plain
prefills) x the window's steps / the joins that landed in the window.

  PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/decode_intake.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import aiohttp
from pd_e2e import proxy_process

from vllm_pd.planner.instance_profiler import UniquePrompts, stream_completion
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.small_model import ensure_default_model

SEEDS = itertools.count(5000)


async def lone_step(
    session: aiohttp.ClientSession, url: str, model: str, context: int, out: int
) -> tuple[float, float, float]:
    """(mean step ms over the stream's second half, that window's start and end: time.perf_counter)."""
    s = await stream_completion(session, url, model, UniquePrompts(4000, seed=next(SEEDS)).make(context), out)
    half = out // 2
    return (s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) * 1e3, s.stamps[half], s.stamps[-1]


@contextlib.asynccontextmanager
async def back_to_back(
    session: aiohttp.ClientSession, url: str, model: str, tokens: int, out: int, done: list[float]
) -> AsyncIterator[None]:
    """Requests of ``tokens`` prompt tokens, ``out`` out, one after the other until the block ends; each
    one's end time goes to ``done``."""
    stop = asyncio.Event()
    prompts = UniquePrompts(4000, seed=next(SEEDS))

    async def loop() -> None:
        while not stop.is_set():
            await stream_completion(session, url, model, prompts.make(tokens), out)
            done.append(time.perf_counter())

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.3)  # the neighbour's load is under way before the measured stream starts
    try:
        yield
    finally:
        stop.set()
        await task


async def measure(
    kind: str, urls: dict[str, str], model: str, args: argparse.Namespace, tokens: int
) -> tuple[float, float]:
    """(step ms, joins per window second) for one block of this kind."""
    async with aiohttp.ClientSession() as session:
        if kind == "alone":
            step, _, _ = await lone_step(session, urls["b"], model, args.context_tokens, args.out)
            return step, 0.0
        done: list[float] = []
        url, out = (urls["a"], 1) if kind == "beside plain prefills" else (urls["1P1D"], 2)
        async with back_to_back(session, url, model, tokens, out, done):
            step, t0, t1 = await lone_step(session, urls["b"], model, args.context_tokens, args.out)
        return step, sum(t0 <= t < t1 for t in done) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 640])
    ap.add_argument("--context-tokens", type=int, default=512, help="the measured stream's prompt")
    ap.add_argument("--out", type=int, default=96, help="the measured stream's output tokens")
    args = ap.parse_args()
    model = str(ensure_default_model())
    cluster = LocalCluster(model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector")
    rows: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    with cluster.running(600):
        a, b = cluster.instances()
        proc, pd_url = proxy_process(["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"])
        urls = {"a": a.url, "b": b.url, "1P1D": pd_url}
        try:
            kinds = ("alone", "beside plain prefills", "beside 1P1D joins")
            asyncio.run(measure("beside 1P1D joins", urls, model, args, 128))  # warm-up
            for rnd in range(args.rounds):
                order = [(k, t) for t in args.prompt_tokens for k in kinds]
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                for kind, tokens in order:
                    rows[kind, tokens].append(asyncio.run(measure(kind, urls, model, args, tokens)))
                print(f"round {rnd + 1} done {time.strftime('%H:%M:%S UTC', time.gmtime())}", flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    print(
        f"medians of {args.rounds} rounds; the measured stream: {args.context_tokens}-token prompt, "
        f"{args.out} out, steps over its second half"
    )
    for tokens in args.prompt_tokens:
        alone = statistics.median(s for s, _ in rows["alone", tokens])
        plain = statistics.median(s for s, _ in rows["beside plain prefills", tokens])
        joins = statistics.median(s for s, _ in rows["beside 1P1D joins", tokens])
        rate = statistics.median(r for _, r in rows["beside 1P1D joins", tokens])
        # the share of each step the joins take, over the joins per second: decode's time per join
        per_join = (joins - plain) / joins / rate * 1e3 if rate else float("nan")
        print(
            f"{tokens:5d}-token prompts: step alone {alone:.3f} ms; beside plain prefills {plain:.3f} ms "
            f"(= {plain / alone:.2f} x alone); beside 1P1D joins {joins:.3f} ms (= {joins / alone:.2f} x alone, "
            f"{joins / plain:.2f} x beside plain prefills) at {rate:.1f} joins/s: {per_join:.2f} ms of decode's "
            "steps per join"
        )
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

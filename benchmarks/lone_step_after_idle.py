"""Lone requests' decode step by path and idle time (plan_validate's replays step slower than its probes)

    PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/lone_step_after_idle.py

The pair plan_validate.py uses (two kv_both instances of the built-in small model, one core each, our
connector over shm). Paths to instance b's decode: straight to b; a proxy in front of b alone (as the
profile and the speed probe use it); the same with a request log (as the replays' proxies run); the 1P1D
proxy (prefill on a, decode on b, push). Rounds of 8 lone requests (512-token unique prompts, 16 tokens
out) one after the other, with a pause of 0 or 0.5 s before each: the median steady step (gaps 6-15), first
gap and TPOT. The relay proxy back to back - how profiles and probes run - is the peer the others are read
against.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import time

import aiohttp

from pd_e2e import proxy_process
from vllm_pd.planner.instance_profiler import UniquePrompts, stream_completion
from vllm_pd.router.local_cluster import LocalCluster
from vllm_pd.small_model import ensure_default_model

PAUSES_S = (0.0, 0.5)
SEEDS = itertools.count(3000)


async def lone_requests(url: str, model: str, pause: float, n: int = 8) -> dict[str, float]:
    prompts = UniquePrompts(4000, seed=next(SEEDS))
    steady, first, tpot = [], [], []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            await asyncio.sleep(pause)
            s = await stream_completion(session, url, model, prompts.make(512), 16)
            gaps = [(b - a) * 1e3 for a, b in zip(s.stamps, s.stamps[1:])]
            steady.append(statistics.mean(gaps[5:]))
            first.append(gaps[0])
            tpot.append(statistics.mean(gaps))
    return {"steady_ms": statistics.median(steady), "first_gap_ms": statistics.median(first),
            "tpot_ms": statistics.median(tpot)}


def main() -> int:
    model = str(ensure_default_model())
    cluster = LocalCluster(model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector")
    procs = []
    with cluster.running(600):
        a, b = cluster.instances()
        try:
            paths = {"straight to b": b.url}
            for name, flags in (("relay proxy", ["--decode", b.url]),
                                ("relay proxy + request log", ["--decode", b.url, "--request-log",
                                                               "/tmp/lone-step-requests.jsonl"]),
                                ("1P1D proxy", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"])):
                proc, paths[name] = proxy_process(flags)
                procs.append(proc)
            for url in paths.values():
                asyncio.run(lone_requests(url, model, 0.0, 4))  # warm-up
            for rnd in range(3):
                base = asyncio.run(lone_requests(paths["relay proxy"], model, 0.0))["steady_ms"]
                for name, url in paths.items():
                    for pause in PAUSES_S:
                        r = asyncio.run(lone_requests(url, model, pause))
                        print(f"round {rnd + 1} {name:26s} pause {pause:.1f} s: steady step {r['steady_ms']:.3f} ms "
                              f"(= {r['steady_ms'] / base:.2f} x the relay proxy back to back), first gap "
                              f"{r['first_gap_ms']:.2f} ms, TPOT {r['tpot_ms']:.3f} ms", flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

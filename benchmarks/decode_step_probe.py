"""The decode step of plan_first_try.py's pair, point by point: what the planner's decode model must hold.

    PYTHONPATH=. flock /tmp/vllm-pd-heavy.lock python3 benchmarks/decode_step_probe.py --out /tmp/probe.json  # ~5 min

The same pair as benchmarks/plan_first_try.py (its model, a on core 0 and b on core 1, kv_both over shm,
the 1P1D proxy and a relay in front of b alone). Measured, interleaved ``--rounds`` times:

- decode points: ``batch`` concurrent streams of ``context`` prompt tokens through b's relay, as
  `vllm-pd profile` measures them (the mean gap of each stream's second half, the median over the batch),
  for every batch of ``--batches`` (more than the profile takes: is the step's batch term monotone?);
- a lone stream of ``--lone-context`` tokens through b's relay, through the 1P1D proxy (its KV loaded from
  a) and straight to b: every gap, so a replay's TPOT ((last - first) / (n - 1)) can be set beside the
  profile's steady step (the second half's mean);
- with ``--beside``: a long stream decoding on b (through its relay) while a 1P1D request arrives, prefills
  on a and decodes on b beside it: the long stream's gaps before, during the newcomer's prefill, during
  its first ``tokens / 2`` gaps and after (do the newcomer's first steps slow b's engine, every request on
  it, or only the newcomer's own stream?).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from pd_e2e import proxy_process
from plan_first_try import MODEL

from vllm_pd.planner.completion_stream import UniquePrompts, model_name, served_vocabulary, stream_completion
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.small_model.cache import ensure_model


async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict:
    out: dict = {"points": [], "lone": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = await model_name(session, urls["b"])
        prompts = UniquePrompts(await served_vocabulary(session, urls["b"], model), seed=11)
        half = args.tokens // 2
        for r in range(args.rounds):
            for context in args.contexts:
                for batch in args.batches:
                    streams = await asyncio.gather(
                        *(
                            stream_completion(session, urls["relay_b"], model, prompts.make(context), args.tokens)
                            for _ in range(batch)
                        )
                    )
                    gaps = [(s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) * 1e3 for s in streams]
                    row = {
                        "round": r,
                        "batch": batch,
                        "context": context,
                        "step_ms": round(statistics.median(gaps), 3),
                        "streams_ms": [round(g, 3) for g in gaps],
                    }
                    out["points"].append(row)
                    print(row, flush=True)
            for path in ("relay_b", "1p1d", "b"):
                (s,) = [
                    await stream_completion(session, urls[path], model, prompts.make(args.lone_context), args.tokens)
                ]
                gaps = [round((y - x) * 1e3, 2) for x, y in zip(s.stamps, s.stamps[1:])]
                row = {
                    "round": r,
                    "path": path,
                    "ttft_ms": round(s.ttft * 1e3, 1),
                    "gaps_ms": gaps,
                    "tpot_ms": round(statistics.fmean(gaps), 3),
                    "second_half_ms": round(statistics.fmean(gaps[half:]), 3),
                }
                out["lone"].append(row)
                print({k: v for k, v in row.items() if k != "gaps_ms"}, flush=True)
        for _ in range(args.beside):
            out.setdefault("beside", []).append(await beside(session, urls, model, prompts, args))
            print({k: v for k, v in out["beside"][-1].items() if not k.endswith("stamps")}, flush=True)
    return out


async def beside(
    session: aiohttp.ClientSession, urls: dict[str, str], model: str, prompts: UniquePrompts, args: argparse.Namespace
) -> dict:
    """A long stream on b and a 1P1D newcomer 1.5 s into it: the long stream's mean gap per phase (ms)."""
    long = asyncio.create_task(stream_completion(session, urls["relay_b"], model, prompts.make(64), 4 * args.tokens))
    await asyncio.sleep(1.5)
    t0 = time.perf_counter()
    new = await stream_completion(session, urls["1p1d"], model, prompts.make(args.lone_context), args.tokens)
    old = await long
    first, settled, end = new.stamps[0], new.stamps[args.tokens // 2], new.stamps[-1]

    def mean_gap(lo: float, hi: float) -> float:
        ts = [t for t in old.stamps if lo <= t <= hi]
        return round((ts[-1] - ts[0]) / (len(ts) - 1) * 1e3, 2) if len(ts) > 2 else float("nan")

    return {
        "before": mean_gap(old.stamps[2], t0),
        "newcomer_prefill": mean_gap(t0, first),
        "newcomer_first_half": mean_gap(first, settled),
        "newcomer_second_half": mean_gap(settled, end),
        "after": mean_gap(end, old.stamps[-1]),
        "newcomer_first_half_own": round((settled - first) / (args.tokens // 2) * 1e3, 2),
        "newcomer_second_half_own": round((end - settled) / (len(new.stamps) - 1 - args.tokens // 2) * 1e3, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,2,3,4,6")
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--lone-context", type=int, default=400)
    ap.add_argument("--beside", type=int, default=0, help="rounds of the long stream beside a 1P1D newcomer")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-decode-probe"))
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = str(ensure_model(dataclasses.replace(MODEL)))
    cluster = LocalCluster(
        model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector", log_dir=args.log_dir
    )
    procs = []
    with cluster.running(900):
        a, b = cluster.instances()
        urls = {"b": b.url}
        try:
            for name, flags in (
                ("1p1d", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"]),
                ("relay_b", ["--decode", b.url]),
            ):
                proxy, urls[name] = proxy_process(flags)
                procs.append(proxy)
            t0, load0 = time.monotonic(), os.getloadavg()
            out = asyncio.run(measure(urls, args))
            out.update(
                seconds=round(time.monotonic() - t0),
                loadavg=[load0, os.getloadavg()],
                when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                args=sys.argv[1:],
            )
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

"""KV block store end to end: TTFT on a real vLLM CPU server replaying a multi-turn
chat trace, with the store and without it, one phase after the other.

    python3 benchmarks/store_e2e.py [--conversations 14] [--seed 0] [--svg benchmarks/store_e2e.svg]
    python3 benchmarks/store_e2e.py --nodes [--svg benchmarks/store_e2e_nodes.svg]

The trace is vllm_pd/connector/store/trace.py scaled down (a few shared system
prompts, conversations of 1-6 turns whose prompts grow by the history; one
trace block = 100 tokens, so messages do not fall on vLLM's 128-token blocks).
Each trace block id maps to fixed token ids, so equal prefixes in the trace are
equal token prefixes. Requests are replayed in trace order, one at a time
(closed loop; the other conversations' turns are the think time).

Both phases run the same server (one core, the PD connector as kv_both, vLLM's
own prefix cache off so that only the store reuses KV) - the second one with
``"store": {"cpu_bytes": "1g"}``. Printed: TTFT p50/p99 of each phase and their
ratio, and the fraction of prompt tokens not recomputed (cached_tokens /
prompt_tokens, as vLLM reports them). The SVG bar chart goes to ``--svg``.

``--nodes`` instead runs two store nodes side by side (cores 0 and 1) with the
turns of each conversation alternating between them (a router without
session affinity, the worst case for a local store): once with each node on
its own, once with a store master, so that a turn whose history the other
node computed fetches it from there.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pd_latency import BENCH_MODEL  # noqa: E402
from benchmarks.svg_chart import BarChart  # noqa: E402
from vllm_pd.connector.store.master_command import spawn_master  # noqa: E402
from vllm_pd.connector.store.trace import TraceConfig, generate  # noqa: E402
from vllm_pd.small_model import ensure_model  # noqa: E402
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port  # noqa: E402

UNIT_TOKENS = 100  # tokens per trace block
OUTPUT_TOKENS = 16
MAX_MODEL_LEN = 4096


def trace_prompts(conversations: int, seed: int) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt token ids) in trace order."""
    cfg = TraceConfig(
        conversations=conversations,
        arrival_rate=1.0,
        system_prompts=3,
        system_prompt_blocks=(3, 6),
        single_turn_fraction=0.3,
        mean_turns=4.0,
        max_turns=6,
        user_blocks_median=1.5,
        reply_blocks_median=2.0,
        length_sigma=0.5,
        think_time_median_s=5.0,
        seed=seed,
    )
    prompts = []
    for req in generate(cfg):
        tokens: list[int] = []
        for block in req.prompt:
            rng = random.Random(seed * 1_000_003 + block)
            tokens += [rng.randrange(5, 4000) for _ in range(UNIT_TOKENS)]
        prompts.append((req.conversation, req.turn, tokens[: MAX_MODEL_LEN - OUTPUT_TOKENS - 8]))
    return prompts


def server_spec(model: Path, store: dict[str, Any] | None, core: str = "0") -> VllmServerSpec:
    extra: dict[str, Any] = {"transport": "tcp", "host": "127.0.0.1"}
    if store is not None:
        extra["store"] = store
    ktc = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_both",
        "kv_port": free_port(),
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    return VllmServerSpec(
        model=str(model),
        port=free_port(),
        kv_transfer_config=ktc,
        cpu_cores=core,
        max_model_len=MAX_MODEL_LEN,
        served_model_name="bench",
        kv_cache_bytes="1g",
        extra_args=["--seed", "0", "--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
        pin_processes=True,
    )


def stream(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, int, int]:
    """(TTFT s, prompt tokens, cached tokens) of one streamed completion."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return ttft or float("nan"), int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0)


def run_phase(
    model: Path,
    stores: list[dict[str, Any] | None],
    prompts: list[tuple[int, int, list[int]]],
    log_dir: Path,
    name: str,
) -> dict[str, Any]:
    """One server per entry of ``stores`` (core i); a conversation's turn t goes to server (c + t) % n."""
    servers = [
        VllmServer(server_spec(model, store, str(i)), log_dir / f"{name}-{i}.log").start()
        for i, store in enumerate(stores)
    ]
    try:
        for server in servers:
            server.wait_healthy(timeout=600)
        with httpx.Client() as client:
            warm = random.Random(99)
            for server in servers:
                for _ in range(2):  # first requests pay one-off costs; not counted
                    stream(client, server.url, [warm.randrange(5, 4000) for _ in range(300)])
            rows = [stream(client, servers[(conv + turn) % len(servers)].url, p) for conv, turn, p in prompts]
    finally:
        for server in servers:
            server.stop()
    ttfts = sorted(r[0] for r in rows)
    # turns after the first: with 2 nodes, their history was computed on the other node
    later = sorted(r[0] for r, (_, turn, _) in zip(rows, prompts) if turn > 0)
    prompt_tokens, cached_tokens = sum(r[1] for r in rows), sum(r[2] for r in rows)
    return {
        "requests": len(rows),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "later_turns": len(later),
        "later_turns_ttft_p50_ms": 1000 * statistics.median(later) if later else float("nan"),
        "later_turns_ttft_mean_ms": 1000 * statistics.fmean(later) if later else float("nan"),
        "prompt_tokens": prompt_tokens,
        "not_recomputed": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", action="store_true", help="two nodes, turns alternating: without vs with a master")
    ap.add_argument(
        "--svg",
        type=Path,
        default=None,
        help="default: benchmarks/store_e2e.svg (benchmarks/store_e2e_nodes.svg with --nodes)",
    )
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/store-e2e-bench"))
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    svg = args.svg or ROOT / "benchmarks" / ("store_e2e_nodes.svg" if args.nodes else "store_e2e.svg")
    model = ensure_model(BENCH_MODEL)
    prompts = trace_prompts(args.conversations, args.seed)
    lengths = [len(p) for _, _, p in prompts]
    print(
        f"trace: {len(prompts)} requests from {args.conversations} conversations, prompt tokens "
        f"median {statistics.median(lengths):.0f}, max {max(lengths)}; model {BENCH_MODEL.layers} layers, "
        f"hidden {BENCH_MODEL.hidden}; 1 core per server, {OUTPUT_TOKENS} output tokens",
        flush=True,
    )
    t0 = time.monotonic()
    if args.nodes:
        return compare_nodes(model, prompts, args.log_dir, svg, t0)
    without = run_phase(model, [None], prompts, args.log_dir, "no-store")
    print(f"no store : {json.dumps(without)}", flush=True)
    with_store = run_phase(model, [{"cpu_bytes": "1g"}], prompts, args.log_dir, "store")
    print(f"store    : {json.dumps(with_store)}", flush=True)
    print(
        f"TTFT p50 {with_store['ttft_p50_ms']:.1f} ms vs {without['ttft_p50_ms']:.1f} ms without the store "
        f"= {with_store['ttft_p50_ms'] / without['ttft_p50_ms']:.2f} x; p99 {with_store['ttft_p99_ms']:.1f} vs "
        f"{without['ttft_p99_ms']:.1f} ms = {with_store['ttft_p99_ms'] / without['ttft_p99_ms']:.2f} x; "
        f"prompt tokens not recomputed {100 * with_store['not_recomputed']:.1f} % "
        f"(without: {100 * without['not_recomputed']:.1f} %); {time.monotonic() - t0:.0f} s"
    )
    chart = BarChart(
        title=f"TTFT, multi-turn trace: the store serves {100 * with_store['not_recomputed']:.0f} % of prompt tokens",
        y_label="TTFT (ms)",
        groups=["p50", "p99", "mean"],
        series={
            "without store": [without["ttft_p50_ms"], without["ttft_p99_ms"], without["ttft_mean_ms"]],
            "with store": [with_store["ttft_p50_ms"], with_store["ttft_p99_ms"], with_store["ttft_mean_ms"]],
        },
    )
    print(f"plot: {chart.write(svg)}")
    return 0


def compare_nodes(model: Path, prompts: list[tuple[int, int, list[int]]], log_dir: Path, svg: Path, t0: float) -> int:
    alone = run_phase(model, [{"cpu_bytes": "1g"}] * 2, prompts, log_dir, "nodes-alone")
    print(f"2 nodes, no master : {json.dumps(alone)}", flush=True)
    master, address = spawn_master(free_port())
    try:
        stores = [{"cpu_bytes": "1g", "master": address, "node_id": f"node{i}"} for i in range(2)]
        shared = run_phase(model, stores, prompts, log_dir, "nodes-master")
    finally:
        master.kill()
        master.wait()
    print(f"2 nodes, master    : {json.dumps(shared)}", flush=True)
    print(
        f"turns alternating between 2 nodes: TTFT p50 {shared['ttft_p50_ms']:.1f} ms with the master vs "
        f"{alone['ttft_p50_ms']:.1f} ms without = {shared['ttft_p50_ms'] / alone['ttft_p50_ms']:.2f} x; p99 "
        f"{shared['ttft_p99_ms']:.1f} vs {alone['ttft_p99_ms']:.1f} ms = "
        f"{shared['ttft_p99_ms'] / alone['ttft_p99_ms']:.2f} x; prompt tokens not recomputed "
        f"{100 * shared['not_recomputed']:.1f} % vs {100 * alone['not_recomputed']:.1f} %; "
        f"{time.monotonic() - t0:.0f} s"
    )
    print(
        f"the {shared['later_turns']} later turns (history on the other node): TTFT p50 "
        f"{shared['later_turns_ttft_p50_ms']:.1f} vs {alone['later_turns_ttft_p50_ms']:.1f} ms, mean "
        f"{shared['later_turns_ttft_mean_ms']:.1f} vs {alone['later_turns_ttft_mean_ms']:.1f} ms"
    )
    chart = BarChart(
        title="TTFT, turns alternating between 2 nodes: each node alone vs fetching through the master",
        y_label="TTFT (ms)",
        groups=["p50", "p99", "mean"],
        series={
            f"no master ({100 * alone['not_recomputed']:.0f} % reused)": [
                alone["ttft_p50_ms"],
                alone["ttft_p99_ms"],
                alone["ttft_mean_ms"],
            ],
            f"master ({100 * shared['not_recomputed']:.0f} % reused)": [
                shared["ttft_p50_ms"],
                shared["ttft_p99_ms"],
                shared["ttft_mean_ms"],
            ],
        },
    )
    print(f"plot: {chart.write(svg)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

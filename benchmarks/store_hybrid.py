"""KV store for a hybrid model (sliding-window layers beside full attention, several KV cache
groups): TTFT of a prompt served from the store vs the same prompt computed, in the same run.

    PYTHONPATH=. flock /tmp/vllm-pd-heavy.lock python3 benchmarks/store_hybrid.py [--rounds 8] [--tokens 3000]

One vLLM CPU server (one core; the PD connector as kv_both with ``"store": {"cpu_bytes": "512m"}``,
vLLM's own prefix cache off so that only the store reuses KV) of the benchmark model
(benchmarks/pd_latency.BENCH_MODEL: 8 layers, 8 KiB of KV per token) made hybrid: a 128-token
sliding window on 3 layers of 4 (``--sliding-window 128 --full-attention-every 4``). Each round
sends a new prompt (computed: the peer) and then the same prompt again (every group's KV from the
store: the full-attention group's blocks of the whole prompt, each window group's last block), one
output token each, so the request's latency is its TTFT. Printed: p50 of both, their ratio, and
the prompt tokens vLLM took from the store (``vllm:prompt_tokens_by_source_total``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pd_latency import BENCH_MODEL  # noqa: E402
from vllm_pd.small_model import ensure_model  # noqa: E402
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port  # noqa: E402

HYBRID_MODEL = dataclasses.replace(BENCH_MODEL, sliding_window=128, full_attention_every=4)
SAVED_S = 1.0  # a finished request's blocks are saved asynchronously


def external_tokens(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line
    )


def timed(client: httpx.Client, url: str, prompt: list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--cores", default="0")
    args = ap.parse_args()
    model = ensure_model(HYBRID_MODEL)
    ktc = {
        "kv_connector": "PDConnector",
        "kv_role": "kv_both",
        "kv_port": free_port(),
        "kv_connector_extra_config": {"transport": "tcp", "host": "127.0.0.1", "store": {"cpu_bytes": "512m"}},
    }
    spec = VllmServerSpec(
        model=str(model),
        port=free_port(),
        kv_transfer_config=ktc,
        cpu_cores=args.cores,
        enforce_eager=True,
        max_model_len=4096,
        served_model_name="m",
        extra_args=["--no-enable-prefix-caching", "--seed", "0"],
    )
    rng = random.Random(0)
    computed, served = [], []
    server = VllmServer(spec, Path("/tmp/store-hybrid-bench.log")).start()
    try:
        server.wait_healthy(timeout=600)
        with httpx.Client() as client:
            timed(client, server.url, [rng.randrange(5, 4000) for _ in range(64)])  # warm-up
            before = external_tokens(client, server.url)
            for _ in range(args.rounds):
                prompt = [rng.randrange(5, 4000) for _ in range(args.tokens)]
                computed.append(timed(client, server.url, prompt))
                time.sleep(SAVED_S)
                served.append(timed(client, server.url, prompt))
            from_store = external_tokens(client, server.url) - before
    finally:
        server.stop()
    p50c, p50s = statistics.median(computed) * 1e3, statistics.median(served) * 1e3
    print(
        f"hybrid model ({HYBRID_MODEL.layers} layers, window 128 on 3 of 4), {args.tokens}-token prompts, "
        f"{args.rounds} rounds: TTFT p50 computed {p50c:.0f} ms, from the store {p50s:.0f} ms "
        f"({p50c / p50s:.1f}x); prompt tokens from the store {from_store:.0f} "
        f"({from_store / (args.rounds * args.tokens):.0%} of the repeated prompts')"
    )


if __name__ == "__main__":
    main()

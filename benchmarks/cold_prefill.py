"""How much of 1P1D's short-prompt TTFT gap is the prefill instance going cold between requests,
and how much our push adds to prefill's prompt step.

    python3 benchmarks/cold_prefill.py [--requests 20] [--tokens 128] [--transport shm]

One prefill (core 0) + decode (core 1) pair with our connector, as in pd_latency.py.
On the *same* prefill server, one request of each kind in turn, ``--requests`` times:

* ``plain, after idle``     - a request without kv_transfer_params, max_tokens 1, after
  ``--gap`` seconds idle (how a prefill instance gets its prompts while decode generates);
* ``plain, back to back``   - the same right after it, but for reading /metrics (how the plain 1-core instance of
  pd_latency gets its prompts: its own decode steps keep its core busy until the next one);
* ``push beside``           - 1P1D as the proxy sends it (pd_latency's flow), after the same
  idle gap.

Printed: median TTFT and prompt step (vLLM's "prefill" histogram, read around each request)
per kind, and push beside's prompt step minus the plain-after-idle one of the same turn
(paired, so the host's drift between turns cancels): what the push costs prefill's step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import pd_latency as pd  # benchmarks/ is the script's own folder

from vllm_pd.vllm_server import free_port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="requests per kind (turns)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--gap", type=float, default=0.35, help="idle seconds before each 'after idle' and 'push beside' request"
    )
    ap.add_argument("--transport", choices=("tcp", "shm"), default="shm")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-bench-logs"))
    args = ap.parse_args()
    model = pd.ensure_model(pd.BENCH_MODEL)
    prompts = pd.Prompts(seed=2)
    client = httpx.Client()
    pk, dk = free_port(), free_port()
    p, d = pd.start(
        [
            pd.spec(model, "0", pd.ours_ktc("kv_producer", pk, args.transport)),
            pd.spec(model, "1", pd.ours_ktc("kv_consumer", dk, args.transport)),
        ],
        args.log_dir,
    )
    endpoint = f"{args.transport}://127.0.0.1:{dk}"

    def plain(prompt: list[int]) -> tuple[float, float]:
        body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return pd.stream_ttft(client, p.url, body, time.perf_counter())

    def after_idle(prompt: list[int]) -> tuple[float, float]:
        time.sleep(args.gap)
        return plain(prompt)

    def beside(prompt: list[int]) -> tuple[float, float]:
        time.sleep(args.gap)
        return pd.run_pd_beside(client, p, d, prompt, endpoint, "push", {})

    kinds = {"plain, after idle": after_idle, "plain, back to back": plain, "push beside": beside}
    ttft: dict[str, list[float]] = {k: [] for k in kinds}
    step: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for fn in kinds.values():
            fn(prompts.make(64))  # warm-up
        for _ in range(args.requests):
            for name, fn in kinds.items():
                before = pd.server_times(client, {"prefill": p})
                ttft[name].append(fn(prompts.make(args.tokens))[0] * 1e3)
                step[name].append(pd.mean_ms(before, pd.server_times(client, {"prefill": p}))["prefill"]["prefill"])
    finally:
        pd.stop([p, d])
    print(f"{args.tokens} tokens, {args.transport}, prefill on core 0 (decode on core 1), medians:")
    for name in kinds:
        print(
            f"  {name:<22} TTFT {statistics.median(ttft[name]):6.2f} ms   prefill's prompt step "
            f"{statistics.median(step[name]):6.2f} ms"
        )
    extra = [b - a for a, b in zip(step["plain, after idle"], step["push beside"])]
    q1, _, q3 = statistics.quantiles(extra, n=4)
    print(
        f"  push beside's prompt step - plain after idle's, same turn: median {statistics.median(extra):+.2f} ms "
        f"(quartiles {q1:+.2f} / {q3:+.2f}) over {len(extra)} turns"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

"""Tail of request times through a TP=2 prefill + TP=2 decode pair on two cores (the TP e2e test's load).

The TP=2 e2e test runs four model workers and two engine cores on two cores; vLLM's multiproc executor
spin-waits (sched_yield) in each of them, so the connector's threads get what the spinners leave. A lost
answer there used to cascade: a release that timed out left prefill holding the KV for its lease (600 s
in the test), its engine stepping - and spinning - all that time, and a control frame that timed out in
its sender tore down the link with every transfer on it. This starts the test's pair, sends its six
prompts in pull and push-beside mode for --rounds rounds, one at a time, and prints the request times'
p50 / p90 / max beside the connector's warnings in the servers' logs (release failures, load failures,
recomputes). A request over 300 s is what failed the test (its HTTP timeout).

  PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/tp2_pair_tail.py --rounds 10 --logs /tmp/tp2-logs
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from tests.e2e.test_connector_tp_e2e import KEYS, LEASE_S, tp_spec
from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.small_model.cache import ensure_default_model

# what the connector and vLLM say when a transfer or a release went wrong
TROUBLE = ("release", "KV load", "Recovered from KV load failure", "timed out", "lost")


def run(rounds: int, logs: Path) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    model = ensure_default_model("llama", cache_dir=logs / "cache")
    specs = []
    for role in ("kv_producer", "kv_consumer"):
        kv_port = ec.free_port()
        specs.append((tp_spec(model, ec.connector_config(role, kv_port, lease_s=LEASE_S)), kv_port))
    prefill, decode = pair = ec.start_all(specs, logs)
    times: list[float] = []
    try:
        with httpx.Client() as client:
            for r in range(rounds):
                for mode in ("pull", "push-beside"):
                    for key in KEYS:
                        t0 = time.monotonic()
                        try:
                            ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], mode)
                        except Exception as e:
                            print(f"round {r} {mode} {key}: failed: {e!r:.200}")
                        times.append(time.monotonic() - t0)
                print(f"round {r}: max {max(times[-2 * len(KEYS) :]):.1f} s", flush=True)
    finally:
        ec.stop_all(pair)
    times.sort()
    trouble = [
        ln.strip()[:200]
        for p in logs.glob("vllm-*.log")
        for ln in p.read_text(errors="replace").splitlines()
        if "WARNING" in ln and any(w in ln for w in TROUBLE) and "shutdown" not in ln
    ]
    print(
        f"{len(times)} requests: p50 {statistics.median(times):.1f} s, p90 {times[int(0.9 * len(times))]:.1f} s, "
        f"max {times[-1]:.1f} s (the test's HTTP timeout: 300 s); over 20 s: {sum(t > 20 for t in times)}"
    )
    print(f"connector / vLLM warnings about transfers: {len(trouble)}")
    for line in trouble:
        print("  " + line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/tp2-pair-logs"))
    args = ap.parse_args()
    run(args.rounds, args.logs)


if __name__ == "__main__":
    main()

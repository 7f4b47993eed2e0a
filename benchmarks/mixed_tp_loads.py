"""Failed and slow KV loads of P TP 1 -> D TP 2 pull with the prefill bound to a core a decode rank
is bound to, beside the same pair with the prefill unbound, on real vLLM CPU servers (one run).

    python3 benchmarks/mixed_tp_loads.py [--rounds 8] [--binds 1 nobind] [--load-mode auto]

Each bind is a fresh pair as tests/e2e/test_connector_mixed_tp_e2e.py starts it: a TP 2 ``kv_both``
instance with its ranks on cores 0 and 1, and a TP 1 ``kv_both`` instance with
``VLLM_CPU_OMP_THREADS_BIND`` = the bind ("1": on decode rank 1's core; "nobind": unbound). The six
prompts of the connector e2e go TP 1 -> TP 2 in pull mode, ``--rounds`` times. Per bind: requests,
those over 5 s, those at the 30 s ``transfer_timeout_s`` and decode's failed loads
(``vllm:pd_loads_total{result="failed"}``, each recomputed). The cause of the difference is in
docs/benchmarks/transfer.md ("P1 -> D2: the stall").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's tests/ (the e2e cluster helpers), run from anywhere
    sys.path.insert(0, str(ROOT))

from tests.e2e.test_connector_mixed_tp_e2e import KEYS  # noqa: E402
from tests.e2e.test_connector_tp_e2e import tp_spec  # noqa: E402
from tests.support import e2e_cluster as ec  # noqa: E402
from tests.support.prompt_catalogue import CONNECTOR_CASES  # noqa: E402
from vllm_pd.small_model.cache import ensure_default_model  # noqa: E402

SLOW_S = 5.0
TIMEOUT_S = 29.0  # a load given up at transfer_timeout_s (30 s) makes the request at least this long


@dataclass
class Tally:
    requests: int = 0
    slow: int = 0
    timed_out: int = 0
    failed_loads: int = 0


def run_bind(bind: str, rounds: int, load_mode: str, log_dir: Path) -> Tally:
    model = ensure_default_model("llama", cache_dir=log_dir / "cache")
    extra = {} if load_mode == "auto" else {"load_mode": load_mode}
    ports = ec.free_port(), ec.free_port()
    prefill_spec = ec.server_spec(model, bind, ec.connector_config("kv_both", ports[0], lease_s=60.0, **extra))
    decode_spec = tp_spec(model, ec.connector_config("kv_both", ports[1], lease_s=60.0, **extra))
    specs = [(prefill_spec, ports[0]), (decode_spec, ports[1])]
    prefill, decode = ec.start_all(specs, log_dir)
    tally = Tally()
    try:
        with httpx.Client() as client:
            for r in range(rounds):
                for key in KEYS:
                    failed = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed")
                    t0 = time.monotonic()
                    ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], "pull")
                    took = time.monotonic() - t0
                    failed = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed") - failed
                    tally.requests += 1
                    tally.slow += took > SLOW_S
                    tally.timed_out += took >= TIMEOUT_S
                    tally.failed_loads += int(failed)
                    print(f"  bind {bind} round {r} {key}: {took:.1f} s, failed loads +{failed:.0f}", flush=True)
    finally:
        ec.stop_all([prefill, decode])
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--binds", nargs="+", default=["1", "nobind"])
    ap.add_argument("--load-mode", default="auto", choices=["auto", "async", "layerwise"])
    args = ap.parse_args()
    tallies = {}
    with tempfile.TemporaryDirectory(prefix="mixed-tp-loads-") as tmp:
        for bind in args.binds:
            tallies[bind] = run_bind(bind, args.rounds, args.load_mode, Path(tmp) / bind)
    print(f"\nP TP 1 -> D TP 2 pull, decode load_mode {args.load_mode}, {args.rounds} rounds of {len(KEYS)} prompts")
    print(f"{'TP 1 instance bind':<20} {'requests':>8} {'> 5 s':>6} {'at 30 s':>8} {'failed loads':>13}")
    for bind, t in tallies.items():
        print(f"{bind:<20} {t.requests:>8} {t.slow:>6} {t.timed_out:>8} {t.failed_loads:>13}")


if __name__ == "__main__":
    main()

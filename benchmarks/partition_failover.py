"""Failover when the prefill host is cut off (or paused) under load, across real hosts.

Prefill, decode and the proxy each on their own host (network namespaces on one bridge,
tests/netns_cluster.py; needs root), KV over tcp. Three clients send long prompts back to
back through the proxy, from 1 s before the fault until 10 s after it; the fault lasts
``--outage`` seconds. Reported, over the requests running at the fault or sent during it: how
long each waited from the later of the fault and its start to its answer, and how many failed.

Modes:
  detect  the proxy's health checks every --interval s (timeout --interval s): two missed
          checks mark prefill unreachable and the legs waiting on it move on (decode computes
          the prompt itself); decode's connector gives up on stalled pushes after
          push_wait_s + peer_probe_s.
  blind   health checks so rare that the proxy never notices (what every proxy did before
          partition detection): the legs wait on the cut link until it returns.

Usage (repository root, root user; with vLLM under the e2e lock):
  PYTHONPATH=. python3 benchmarks/partition_failover.py --outage 30 --fault cut pause
  PYTHONPATH=. python3 benchmarks/partition_failover.py --outage 30 --fault cut pause --backend mock
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.netns_cluster import ConnectorTimes, load_through, mock_cluster, multihost_cluster, waits_after  # noqa: E402
from tests.netns_hosts import netns_unavailable  # noqa: E402
from vllm_pd.small_model import ensure_default_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outage", type=float, default=30.0, help="seconds the fault lasts (default 30)")
    ap.add_argument("--fault", nargs="+", choices=("cut", "pause"), default=["cut"])
    ap.add_argument("--modes", nargs="+", choices=("detect", "blind"), default=["blind", "detect"])
    ap.add_argument("--interval", type=float, default=1.0, help="health check interval and timeout (detect)")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "nixl"))
    ap.add_argument("--backend", default="vllm", choices=("vllm", "mock"),
                    help="mock: vllm_pd/router/mock_backend.py (no vLLM, no KV: the proxy's part alone)")
    args = ap.parse_args()
    why = netns_unavailable()
    if why is not None:
        sys.exit(f"network namespaces refused: {why}")
    times = ConnectorTimes(push_wait_s=3.0, peer_probe_s=2.0, lease_s=20.0)
    log_dir = Path(tempfile.mkdtemp(prefix="partition-failover-"))
    print(f"logs: {log_dir}")
    print(f"{'fault':6} {'mode':7} {'requests':>8} {'wait: median':>13} {'max':>7} {'failed':>7}")
    cluster_cm = (mock_cluster(log_dir) if args.backend == "mock"
                  else multihost_cluster(ensure_default_model(), log_dir, args.transport, times))
    with cluster_cm as cluster:
        for fault in args.fault:
            strike, heal = {"cut": (lambda: cluster.net.cut("prefill"), lambda: cluster.net.restore("prefill")),
                            "pause": (cluster.pause_prefill, cluster.resume_prefill)}[fault]
            for mode in args.modes:
                interval = args.interval if mode == "detect" else 3600.0
                cluster.start_proxy(health_interval=interval, health_timeout=min(interval, args.interval),
                                    model_names=["small"])
                sent, struck = load_through(cluster.proxy_url, strike, heal, args.outage, heal_early=False)
                waits = waits_after(sent, struck)
                failed = sum(s.error is not None for s in sent)
                median = statistics.median(waits) if waits else float("nan")
                print(f"{fault:6} {mode:7} {len(waits):>8} {median:>12.1f}s "
                      f"{max(waits, default=float('nan')):>6.1f}s {failed:>4}/{len(sent)}", flush=True)
                # the next round starts with prefill back and its breaker closed again
                cluster.stop_proxy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Failover when a host is lost under load, across real hosts, with the flags users start with.

Prefill, decode and the proxy each on their own host (network namespaces on one bridge,
tests/support/netns_cluster.py; needs root), KV over tcp. Three clients send long prompts back to
back through the proxy, from 1 s before the fault until 10 s after it; the fault lasts
``--outage`` seconds. Reported per fault, over the requests running at the fault or sent during
it: how long each waited from the later of the fault and its start to its end (answer or
refusal), how many were answered and how many refused (a lost decode: nothing can answer).

Faults: prefill-cut (link down), prefill-paused (SIGSTOP), proxy-to-prefill / prefill-to-proxy /
prefill-to-decode / decode-to-prefill (one direction dropped: a blackhole route), decode-cut,
decode-paused.

The proxy runs with its defaults (``--modes default``), or with the health checks so rare that
nothing is detected (``blind``: what a proxy without detection does), or checking every
``--interval`` s (``tuned``: the tuning docs/benchmarks/reliability.md's earlier figures needed). The connector keeps
its defaults (push_wait_s, peer_probe_s); only the lease is 20 s. To compare code versions, run the
same command with PYTHONPATH naming the other tree (the servers and the proxy are started with it).

Usage (repository root, root user; with vLLM under the e2e lock):
  PYTHONPATH=. python3 benchmarks/partition_failover.py --outage 30 --fault prefill-cut prefill-paused
  PYTHONPATH=. python3 benchmarks/partition_failover.py --outage 30 --fault prefill-cut --backend mock
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.netns_cluster import (
    Cluster,
    ConnectorTimes,
    load_through,
    mock_cluster,
    multihost_cluster,
    send,
    waits_after,
)
from tests.support.netns_hosts import netns_unavailable
from vllm_pd.small_model import ensure_default_model

FAULTS = (
    "prefill-cut",
    "prefill-paused",
    "proxy-to-prefill",
    "prefill-to-proxy",
    "prefill-to-decode",
    "decode-to-prefill",
    "decode-cut",
    "decode-paused",
)


def _fault(cluster: Cluster, name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    net = cluster.net
    if name.endswith("-cut"):
        host = name.split("-")[0]
        return (lambda: net.cut(host)), (lambda: net.restore(host))
    if name == "prefill-paused":
        return cluster.pause_prefill, cluster.resume_prefill
    if name == "decode-paused":
        return cluster.pause_decode, cluster.resume_decode
    on, towards = name.split("-to-")
    return (lambda: net.blackhole(on, towards)), (lambda: net.unblackhole(on, towards))


def _proxy_config(mode: str, interval: float) -> dict[str, Any]:
    if mode == "default":
        return {}
    if mode == "blind":  # nothing finds a lost instance: no health checks, no probes of stalled legs
        return {"health_interval": 3600.0, "probe_after": 3600.0}
    return {"health_interval": interval, "health_timeout": interval}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outage", type=float, default=30.0, help="seconds the fault lasts (default 30)")
    ap.add_argument("--fault", nargs="+", choices=FAULTS, default=["prefill-cut"])
    ap.add_argument("--modes", nargs="+", choices=("default", "blind", "tuned"), default=["default"])
    ap.add_argument("--interval", type=float, default=1.0, help="health check interval and timeout (tuned)")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "nixl"))
    ap.add_argument(
        "--backend",
        default="vllm",
        choices=("vllm", "mock"),
        help="mock: tests/support/mock_backend.py (no vLLM, no KV: the proxy's part alone)",
    )
    args = ap.parse_args()
    why = netns_unavailable()
    if why is not None:
        sys.exit(f"network namespaces refused: {why}")
    log_dir = Path(tempfile.mkdtemp(prefix="partition-failover-"))
    print(f"logs: {log_dir}")
    print(f"{'fault':18} {'mode':8} {'requests':>8} {'wait: median':>13} {'max':>7} {'answered':>9} {'refused':>8}")
    cluster_cm = (
        mock_cluster(log_dir)
        if args.backend == "mock"
        else multihost_cluster(ensure_default_model(), log_dir, args.transport, ConnectorTimes(lease_s=20.0))
    )
    with cluster_cm as cluster:
        for fault in args.fault:
            strike, heal = _fault(cluster, fault)
            for mode in args.modes:
                cluster.start_proxy(model_names=["small"], **_proxy_config(mode, args.interval))
                send(cluster.proxy_url, "ids129")  # a proxy in service has had answers: it knows prefill's KV endpoint
                sent, struck = load_through(cluster.proxy_url, strike, heal, args.outage, heal_early=False)
                waits = waits_after(sent, struck)
                ran = [s for s in sent if s.end > struck]
                answered = sum(s.error is None for s in ran)
                median = statistics.median(waits) if waits else float("nan")
                print(
                    f"{fault:18} {mode:8} {len(waits):>8} {median:>12.1f}s "
                    f"{max(waits, default=float('nan')):>6.1f}s {answered:>9} {len(ran) - answered:>8}",
                    flush=True,
                )
                # the next round starts with every host back and healthy to a new proxy
                cluster.stop_proxy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

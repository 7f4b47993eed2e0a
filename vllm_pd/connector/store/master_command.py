"""``vllm-pd store-master``: run the KV store's cluster index."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from vllm_pd.connector.store.master import serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=7700, help="TCP port (default 7700; 0 = any)")
    parser.add_argument("--node-ttl", type=float, default=30.0,
                        help="seconds without a publish after which a node's keys are dropped (default 30)")


def run(args: argparse.Namespace) -> int:
    if args.node_ttl <= 0:
        raise SystemExit("--node-ttl must be > 0")
    try:
        serve(f"tcp://{args.host}:{args.port}", node_ttl_s=args.node_ttl)
    except KeyboardInterrupt:
        pass
    return 0


def spawn_master(port: int, host: str = "127.0.0.1", timeout_s: float = 60.0,
                 netns: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``vllm-pd store-master`` as a child process and wait until it answers
    (tests, benchmarks); returns (process, address). The caller kills it.
    ``netns``: run it inside that network namespace (``ip netns exec``, which execs it: same pid)."""
    from vllm_pd.connector.store.master_client import MasterClient

    address = f"tcp://{host}:{port}"
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "vllm_pd.cli", "store-master", "--host", host,
                             "--port", str(port)])
    probe = MasterClient(address, "probe", "", lambda: [], timeout_s=1.0, retry_after_s=0.0)
    deadline = time.monotonic() + timeout_s
    try:
        while not probe.flush(force=True):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"store master on {address} did not start (exit code {proc.returncode})")
            time.sleep(0.2)
    finally:
        probe.close()
    return proc, address

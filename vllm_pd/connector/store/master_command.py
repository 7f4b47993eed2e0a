"""``vllm-pd store-master``: run the KV store's cluster index."""

from __future__ import annotations

import argparse

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

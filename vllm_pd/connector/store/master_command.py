"""``vllm-pd store-master``: run the KV store's cluster index."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from vllm_pd.connector.deployment_secret import INSECURE_WARNING, SECRET_ENV, check_bind, load_secret
from vllm_pd.connector.store.master import serve
from vllm_pd.errors import ConfigError
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=None, help="address to bind (default: 0.0.0.0 with a deployment secret, else 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=7700, help="TCP port (default 7700; 0 = any)")
    parser.add_argument(
        "--node-ttl",
        type=float,
        default=30.0,
        help="seconds without a publish after which a node's keys are dropped (default 30)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="FILE",
        help=f"the deployment secret (else env {SECRET_ENV}): every node, proxy and tool must "
        "prove it; without one the master listens on loopback only",
    )
    parser.add_argument(
        "--insecure-network",
        action="store_true",
        help="listen beyond loopback without a secret (anyone reaching the port reads and "
        "changes the index); only on a network nothing else can reach",
    )


def run(args: argparse.Namespace) -> int:
    if args.node_ttl <= 0:
        raise SystemExit("--node-ttl must be > 0")
    try:
        secret = load_secret(args.secret_file, "--secret-file")
        host = args.host or ("0.0.0.0" if secret is not None else "127.0.0.1")
        if check_bind(host, secret, args.insecure_network, "--host", "--insecure-network"):
            logger.warning(INSECURE_WARNING, "the store master", host, "--insecure-network", SECRET_ENV)
    except ConfigError as e:
        raise SystemExit(f"vllm-pd store-master: {e}") from None
    try:
        serve(f"tcp://{host}:{args.port}", node_ttl_s=args.node_ttl, secret=secret)
    except KeyboardInterrupt:
        pass
    return 0


def spawn_master(
    port: int,
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    netns: str | None = None,
    secret_file: str | None = None,
    insecure_network: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``vllm-pd store-master`` as a child process and wait until it answers
    (tests, benchmarks); returns (process, address). The caller kills it.
    ``netns``: run it inside that network namespace (``ip netns exec``, which execs it: same pid).
    ``secret_file``: the deployment secret it requires (the readiness call proves it).
    Readiness is a read-only ``Nodes`` call: a node registered to probe would stay in the
    index for ``node_ttl_s`` and show up in its node list."""
    from vllm_pd.connector.store.master_client import MasterLink
    from vllm_pd.protocol.store_index import Nodes

    address = f"tcp://{host}:{port}"
    prefix = ["ip", "netns", "exec", netns] if netns else []
    flags = [
        *(["--secret-file", secret_file] if secret_file else []),
        *(["--insecure-network"] if insecure_network else []),
    ]
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "vllm_pd.cli", "store-master", "--host", host, "--port", str(port), *flags]
    )
    secret = load_secret(secret_file, "secret_file", env={}) if secret_file else None
    link = MasterLink(address, timeout_s=1.0, retry_after_s=0.0, secret=secret)
    deadline = time.monotonic() + timeout_s
    try:
        while link.call(Nodes()) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"store master on {address} did not start (exit code {proc.returncode})")
            time.sleep(0.2)
    finally:
        link.close()
    return proc, address

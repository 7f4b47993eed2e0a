"""The proxy (as ``python -m vllm_pd.router.cli.command_proxy`` runs it) with an event-loop lag probe.

    python3 benchmarks/loop_lag.py OUT_FILE PROXY_ARGS...

A task sleeps 10 ms at a time and records how late each wake-up came: the time any relayed event
waits in the proxy before its callback runs. On exit the samples go to OUT_FILE as JSON
``[[time.monotonic(), lag seconds], ...]`` (proxy.py --loop-lag picks each round's window from them).
Imports the vllm_pd on the path, so it runs another tree's proxy as well (PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from vllm_pd.router.cli import command_proxy
from vllm_pd.router.config import ProxyConfig

TICK = 0.01


async def _probe(samples: list[tuple[float, float]]) -> None:
    while True:
        due = time.monotonic() + TICK
        await asyncio.sleep(TICK)
        now = time.monotonic()
        samples.append((now, now - due))


def main() -> None:
    out = sys.argv.pop(1)
    samples: list[tuple[float, float]] = []
    serve = command_proxy.serve_until_signal

    async def serve_with_probe(cfg: ProxyConfig) -> None:
        probe = asyncio.get_running_loop().create_task(_probe(samples))
        try:
            await serve(cfg)
        finally:
            probe.cancel()
            with open(out, "w") as f:
                json.dump(samples, f)

    command_proxy.serve_until_signal = serve_with_probe  # type: ignore[assignment]
    parser = argparse.ArgumentParser(prog="loop_lag.py OUT")
    command_proxy.add_arguments(parser)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper())
    sys.exit(command_proxy.run(args))


if __name__ == "__main__":
    main()

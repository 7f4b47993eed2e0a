"""The proxy's memory under misbehaving backends: peak RSS per failure case, and what stays after it.

Separate processes: two mock backends (tests/support/mock_backend.py, asked per request through the
body's ``mock_fail`` what to do), the proxy of this checkout and - with ``--compare-tree DIR`` - the
proxy of another source tree (e.g. a `git worktree` of main) beside it, same mocks. Each case sends one
request through a proxy; before it the proxy's peak RSS (VmHWM) is reset (/proc/PID/clear_refs), after
it the peak and the RSS half a second after the answer are read. Cases:

  normal            100 ordinary requests (the baseline)
  prefill-200MB     prefill answers 200 MB of JSON that never ends
  decode-200MB      a non-streamed decode answer of 200 MB
  sse-event-32MB    a stream whose first SSE event never ends (32 MB)
  sse-event-3MB-stall   3 MB of an unfinished event (under the limit), then silence until the idle timeout
                    (2 s here): what the timed-out leg held must go when it ends

    python3 benchmarks/proxy_faults.py                       # this checkout's proxy
    python3 benchmarks/proxy_faults.py --compare-tree /path/to/main-worktree
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy import Layout, _env, _wait, proxy_module, start_mock, stop  # noqa: E402 - benchmarks/ is the script's own folder

from vllm_pd.vllm_server import free_port  # noqa: E402

MIB = 1024 * 1024
BODY = {"model": "mock-model", "prompt": "benchmark prompt " * 32, "max_tokens": 4}
CASES: dict[str, tuple[dict[str, str], bool, int]] = {  # name -> (mock_fail, stream, requests)
    "normal": ({}, False, 100),
    "prefill-200MB": ({"p0": f"huge:{200 * MIB}"}, False, 1),
    "decode-200MB": ({"d0": f"huge:{200 * MIB}"}, False, 1),
    "sse-event-32MB": ({"d0": f"huge:{32 * MIB}"}, True, 1),
    "sse-event-3MB-stall": ({"d0": f"huge-stall:{3 * MIB}"}, True, 1),
}


def start_proxy(layout: Layout, prefill: str, decode: str, tree: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = _env()
    if tree:
        env["PYTHONPATH"] = tree
    p = subprocess.Popen(
        layout.router_prefix()
        + [
            sys.executable,
            "-m",
            proxy_module(tree),
            "--port",
            str(port),
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--decode-idle-timeout",
            "2",
            "--decode-attempts",
            "1",
            "--log-level",
            "ERROR",
        ],
        env=env,
        cwd=tree or None,
    )  # `python -m` puts the working directory first on sys.path
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health")
    return p, url


def _status(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def run_case(url: str, pid: int, mock_fail: dict[str, str], stream: bool, n: int) -> tuple[str, float, int, int]:
    """(statuses, seconds, peak RSS growth, RSS growth after) of ``n`` requests of one case."""
    time.sleep(0.5)
    rss0 = _status(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            r = client.post(url + "/v1/completions", json=dict(BODY, stream=stream, mock_fail=mock_fail))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    elapsed = time.monotonic() - t0
    peak = _status(pid, "VmHWM")
    time.sleep(0.5)
    after = _status(pid, "VmRSS")
    return " ".join(f"{k}x{v}" for k, v in sorted(statuses.items())), elapsed, peak - rss0, after - rss0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-tree", metavar="DIR", help="also the proxy of this source tree")
    ap.add_argument("--router-core", type=int, default=1)
    ap.add_argument("--load-core", type=int, default=0)
    args = ap.parse_args()
    layout = Layout(args.router_core, args.load_core)
    os.sched_setaffinity(0, {args.load_core})
    procs: list[subprocess.Popen] = []
    try:
        pp, purl = start_mock(layout, 0.0, 0.0, "p0")
        dp, durl = start_mock(layout, 0.0, 0.0, "d0")
        procs += [pp, dp]
        proxies = [("this checkout", *start_proxy(layout, purl, durl, None))]
        if args.compare_tree:
            proxies.append((args.compare_tree, *start_proxy(layout, purl, durl, args.compare_tree)))
        procs += [p for _, p, _ in proxies]
        print(f"{'case':22} {'proxy':28} {'answers':>10} {'seconds':>8} {'peak RSS +':>11} {'RSS after +':>12}")
        for case, (mock_fail, stream, n) in CASES.items():
            for name, proc, url in proxies:
                statuses, elapsed, peak, after = run_case(url, proc.pid, mock_fail, stream, n)
                print(
                    f"{case:22} {name[-28:]:28} {statuses:>10} {elapsed:>8.2f} {peak / MIB:>9.1f} MB "
                    f"{after / MIB:>9.1f} MB",
                    flush=True,
                )
    finally:
        stop(procs)


if __name__ == "__main__":
    main()

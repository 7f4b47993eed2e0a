"""SIGTERM to a `vllm-pd proxy` process drains it, against mock backend processes (moved from
tests/unit/router/test_router_drain.py: three processes of their own). The drain itself, in this
process: tests/unit/router/test_router_drain.py; on real vLLM servers: tests/e2e/test_router_e2e.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

from vllm_pd.vllm_server import free_port

BODY = {"model": "mock-model", "prompt": "a prompt to drain " * 8, "stream": True}  # as the unit tests'


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


def test_sigterm_to_the_proxy_process_drains_it(tmp_path) -> None:
    """The signal wiring of `vllm-pd proxy`: SIGTERM drains (the stream in flight completes), the process
    exits 0, and the request log has the request."""
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for name in ("p0", "d0"):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.support.mock_backend",
                        "--port",
                        str(port),
                        "--name",
                        name,
                        "--itl",
                        "0.05",
                    ]
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
            _wait_healthy(urls[-1], procs[-1])
        port, log = free_port(), tmp_path / "requests.jsonl"
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_pd.router.cli.command_proxy",
                "--port",
                str(port),
                "--prefill",
                urls[0],
                "--decode",
                urls[1],
                "--drain-grace",
                "20",
                "--request-log",
                str(log),
            ]
        )
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proxy)
        req = urllib.request.Request(
            url + "/v1/completions",
            json.dumps(dict(BODY, max_tokens=30)).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            first = r.readline()
            proxy.send_signal(signal.SIGTERM)  # 29 tokens, ~1.5 s, still to come
            rest = r.read()
        assert first.startswith(b"data: ") and (first + rest).count(b"data: ") == 31
        assert proxy.wait(20) == 0
        line = json.loads(log.read_text())
        assert line["outcome"] == "ok" and line["events"] == 30 and line["decode_instance"] == urls[1]
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)

"""The proxy on its own host in front of a prefill and a decode on two others (network namespaces,
tests/netns_hosts.py), with mock backends instead of vLLM (vllm_pd/router/mock_backend.py): when
prefill's host is cut off under load, the requests in flight move on to decode-only once the
health checks find it (about 2 x (0.5 + 0.5) s here) instead of waiting for the link - the
prefill leg's own timeout is 300 s and the outage 40 s - and prefill serves again once the link
is back. The real-vLLM version, with KV crossing the links: tests/test_multihost_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests import e2e_cluster as ec
from tests.netns_cluster import load_through, start_proxy, waits_after
from tests.netns_hosts import NetnsHosts, netns_unavailable
from vllm_pd.vllm_server import free_port

_why = netns_unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"network namespaces refused by the kernel: {_why}")

OUTAGE_S = 40.0
BOUND_S = 20.0  # detection ~2 s, plus a wide margin; far below the outage


def _mock(net: NetnsHosts, host: str, name: str, ttft: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(net[host].command([sys.executable, "-m", "vllm_pd.router.mock_backend", "--host",
                                               net[host].address, "--port", str(port), "--name", name,
                                               "--ttft", str(ttft)]))
    url = f"http://{net[host].address}:{port}"
    if not ec.wait_until(lambda: _answers(url), timeout=60, interval=0.2):
        proc.kill()
        raise RuntimeError(f"mock backend {name} did not start")
    return proc, url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetnsHosts, str, Path]]:
    procs: list[subprocess.Popen[bytes]] = []
    with NetnsHosts(["prefill", "decode", "proxy"]) as net:
        try:
            p, prefill_url = _mock(net, "prefill", "p0", ttft=0.3)
            procs.append(p)
            d, decode_url = _mock(net, "decode", "d0", ttft=0.05)
            procs.append(d)
            log_dir = tmp_path_factory.mktemp("netns-proxy")
            proc, url, log = start_proxy(net, log_dir, prefill_url, decode_url, None, health_interval=0.5,
                                         health_timeout=0.5, prefill_timeout=300.0, breaker_cooldown=1.0,
                                         model_names=["small"])  # the catalogue's model name
            procs.append(proc)
            yield net, url, log
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def _prefill_legs(url: str) -> float:
    return ec.metric(httpx.Client(), url, "vllm_pd_proxy_prefill_seconds_count")


def test_requests_in_flight_when_prefills_host_is_cut_move_on_and_prefill_returns(proxy) -> None:
    net, url, log = proxy
    sent, struck = load_through(url, lambda: net.cut("prefill"), lambda: net.restore("prefill"), OUTAGE_S,
                                streams=4, busy_s=5.0)
    assert all(s.error is None for s in sent), [s.error for s in sent if s.error]
    waits = waits_after(sent, struck)
    assert len(waits) >= 4, "too few requests ran while the link was down"
    assert max(waits) < BOUND_S, f"{max(waits):.1f}s after the cut; proxy log: {log.read_text()[-1500:]}"
    assert ec.metric(httpx.Client(), url, "vllm_pd_proxy_leg_errors_total", kind="unreachable") >= 1
    # the link is back: prefill is found healthy and runs prefill legs again
    before = _prefill_legs(url)
    deadline = time.monotonic() + 30
    while _prefill_legs(url) == before and time.monotonic() < deadline:
        assert httpx.post(url + "/v1/completions", json={"model": "mock-model", "prompt": "x " * 200,
                                                          "max_tokens": 2}, timeout=60).status_code == 200
        time.sleep(0.5)
    assert _prefill_legs(url) > before, "prefill never served again after the link came back"

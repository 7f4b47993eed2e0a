"""The proxy on its own host in front of a prefill and a decode on two others (network namespaces,
tests/support/netns_hosts.py), with mock backends instead of vLLM (tests/support/mock_backend.py), the proxy
started with its default flags: when prefill's host is cut off under load, the requests running then
move on to decode-only once the proxy finds it lost - its legs made no progress for a second, it missed
two probes - within 10 s, though the prefill leg's own timeout is 300 s and the outage 40 s; prefill
serves again once the link is back. When decode's host is cut off, the requests running then end
with the proxy's 504 within the same bound. The real-vLLM version, with KV crossing the links:
tests/e2e/test_multihost_e2e.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.netns_cluster import Cluster, load_through, mock_cluster, waits_after
from tests.support.netns_hosts import netns_unavailable

_why = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(_why is not None, reason=f"network namespaces refused by the kernel: {_why}"),
]

OUTAGE_S = 40.0
BOUND_S = 10.0  # detection ~3 s with the default flags; far below the outage


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with mock_cluster(tmp_path_factory.mktemp("netns-proxy")) as c:
        c.start_proxy(model_names=["small"])  # the catalogue's model name; every other setting its default
        yield c


def _prefill_legs(url: str) -> float:
    return ec.metric(httpx.Client(), url, "vllm_pd_proxy_prefill_seconds_count")


def test_requests_in_flight_when_prefills_host_is_cut_move_on_and_prefill_returns(cluster: Cluster) -> None:
    url = cluster.proxy_url
    sent, struck = load_through(
        url, lambda: cluster.net.cut("prefill"), lambda: cluster.net.restore("prefill"), OUTAGE_S, streams=4, busy_s=5.0
    )
    assert all(s.error is None for s in sent), [s.error for s in sent if s.error]
    waits = waits_after(sent, struck)
    assert len(waits) >= 4, "too few requests ran while the link was down"
    assert cluster.proxy_log is not None
    assert max(waits) < BOUND_S, f"{max(waits):.1f}s after the cut; proxy log: {cluster.proxy_log.read_text()[-1500:]}"
    assert ec.metric(httpx.Client(), url, "vllm_pd_proxy_leg_errors_total", kind="unreachable") >= 1
    # the link is back: prefill is found healthy and runs prefill legs again
    before = _prefill_legs(url)
    deadline = time.monotonic() + 30
    while _prefill_legs(url) == before and time.monotonic() < deadline:
        assert (
            httpx.post(
                url + "/v1/completions", json={"model": "small", "prompt": "x " * 200, "max_tokens": 2}, timeout=60
            ).status_code
            == 200
        )
        time.sleep(0.5)
    assert _prefill_legs(url) > before, "prefill never served again after the link came back"


def test_requests_in_flight_when_decodes_host_is_cut_end_within_the_bound(cluster: Cluster) -> None:
    url = cluster.proxy_url
    sent, struck = load_through(
        url, lambda: cluster.net.cut("decode"), lambda: cluster.net.restore("decode"), OUTAGE_S, streams=4, busy_s=5.0
    )
    waits = waits_after(sent, struck)
    assert len(waits) >= 4, "too few requests ran while the link was down"
    assert cluster.proxy_log is not None
    assert max(waits) < BOUND_S, f"{max(waits):.1f}s after the cut; proxy log: {cluster.proxy_log.read_text()[-1500:]}"
    errors = [s.error for s in sent if s.error is not None]
    assert errors and all(e.startswith(("HTTP 503", "HTTP 504")) for e in errors), errors  # no other decode
    assert any(e.startswith("HTTP 504") for e in errors)  # the ones in flight: a gateway timeout
    # the link is back: decode is found healthy and answers again
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            httpx.post(
                url + "/v1/completions", json={"model": "small", "prompt": "x " * 200, "max_tokens": 2}, timeout=60
            ).status_code
            == 200
        ):
            return
        time.sleep(0.5)
    raise AssertionError("decode never served again after the link came back")

"""Prefill, decode and the proxy on three hosts (network namespaces on one bridge; the test
process is a fourth host), KV over tcp across the links (VLLM_PD_TEST_TRANSPORT=nixl: over nixl).

One prefill and one decode server serve every test (tests/support/netns_cluster.py); the proxy runs as
its own process on its own host, started as the README shows it - no flag beyond the instances -
and the connector with its defaults (only prefill's lease is shortened, so "nothing held" is
seen sooner; it bounds how long unclaimed KV is kept, not how fast anything fails over). Outputs
are compared with the session's plain reference instance (``reference_outputs``). The faults are
what this kernel has (no tc netem): a host's link taken down (both directions), a blackhole route
on one host towards another (one direction), a paused process (SIGSTOP). Under a steady load each
fault hits requests in flight; every request running at the fault or sent during it ends within
BOUND_S - answered with the plain instance's output where anything can answer it (decode computes
the prompt itself when prefill is lost), else refused by the proxy with a 5xx (decode lost: there
is no other) - far below the outage. Afterwards the system recovers and neither side holds any KV.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.netns_cluster import (
    Cluster,
    ConnectorTimes,
    Sent,
    load_through,
    multihost_cluster,
    send,
    waits_after,
)
from tests.support.netns_hosts import netns_unavailable
from tests.support.reference_margins import MARGINS, divergence

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

# shm is one host's transport: across hosts the pair uses tcp unless nixl is asked for
TRANSPORT = "nixl" if os.environ.get("VLLM_PD_TEST_TRANSPORT") == "nixl" else "tcp"
TIMES = ConnectorTimes(lease_s=20.0)  # push_wait_s, peer_probe_s: the connector's defaults
BOUND_S = 10.0  # every request in flight at a fault (or sent during it) ends within this after it
OUTAGE_S = 40.0  # the fault lasts at most this long: past the bound, so waiting it out fails
CHECK_KEYS = ("ids300", "ids1000", "text2", "chat2", "ids129")


@pytest.fixture(scope="module")
def cluster(
    reference_outputs: dict[str, list[int]], small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"network namespaces refused by the kernel: {why}")
    with multihost_cluster(small_model_dir, tmp_path_factory.mktemp("multihost-logs"), TRANSPORT, TIMES) as c:
        c.start_proxy()
        yield c


def _assert_bounded(sent: list[Sent], struck: float, cluster: Cluster, refused_ok: bool = False) -> None:
    waits = waits_after(sent, struck)
    assert len(waits) >= 3, "too few requests ran during the fault: the test proved nothing"
    assert cluster.proxy_log is not None
    assert max(waits) < BOUND_S, (
        f"a request running during the fault took {max(waits):.1f}s after it "
        f"(bound {BOUND_S:.0f}s, outage {OUTAGE_S:.0f}s); proxy log: "
        f"{cluster.proxy_log.read_text()[-2000:]}"
    )
    errors = [s.error for s in sent if s.error is not None]
    if refused_ok:  # nothing could answer: the proxy says so, no client waits for a timeout of its own
        assert all(e.startswith(("HTTP 502", "HTTP 503", "HTTP 504")) for e in errors), errors
    else:
        assert not errors, errors


def _assert_exact(sent: list[Sent], reference: dict[str, list[int]]) -> None:
    """Every answer is the plain instance's - up to a near tie of it (tests/support/reference_margins.py: decode
    computing a prompt itself sums in another order; where the plain instance's two best tokens were
    within a nat, either may win on another CPU)."""
    wrong = {
        s.key: why
        for s in sent
        if s.error is None and (why := divergence(s.tokens, reference[s.key], MARGINS.get(s.key))) is not None
    }
    assert not wrong, f"outputs differ from the plain instance's: {wrong}"


def _assert_recovered_and_nothing_held(cluster: Cluster, reference: dict[str, list[int]]) -> None:
    """Prefill serves through the proxy again (its KV reaches decode), and no KV is left held."""
    client = httpx.Client()
    assert ec.wait_until(cluster.proxy_ready, timeout=30)
    loads = ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok")

    def pd_again() -> bool:
        s = send(cluster.proxy_url, "ids1000")
        if s.error is not None and s.error.startswith("HTTP 503"):
            return False  # the proxy has not seen decode healthy again yet
        assert s.error is None and s.tokens == reference["ids1000"], s.error
        return ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok") > loads

    assert ec.wait_until(pd_again, timeout=30, interval=1.0), "prefill never served through the proxy again"
    for server in (cluster.prefill, cluster.decode):

        def released() -> bool:
            # a short plain request makes the engine step: expiries run and the gauges are reported
            ec.post(client, server.url, ec.completion_body("nudge", max_tokens=1))
            return (
                ec.metric(client, server.url, "vllm:pd_held_transfers") == 0
                and ec.metric(client, server.url, "vllm:pd_loading_requests") == 0
                and ec.metric(client, server.url, "vllm:pd_staged_bytes") == 0
            )

        assert ec.wait_until(released, timeout=TIMES.lease_s + 30, interval=1.0), (
            f"{server.url} still holds KV: held={ec.metric(client, server.url, 'vllm:pd_held_transfers')} "
            f"staged={ec.metric(client, server.url, 'vllm:pd_staged_bytes')}"
        )


def test_outputs_across_hosts_equal_the_plain_instance(cluster: Cluster, reference_outputs) -> None:
    client = httpx.Client()
    loads = ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok")
    for key in CHECK_KEYS:
        s = send(cluster.proxy_url, key)
        assert s.error is None, s.error
        assert s.tokens == reference_outputs[key], key
    # the KV really crossed from host to host (decode loaded it rather than computing the prompt)
    assert ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok") - loads >= len(CHECK_KEYS) - 1
    assert ec.metric(client, cluster.decode.url, "vllm:pd_loaded_blocks_total", source="push") > 0


def _unreachable_legs(cluster: Cluster) -> float:
    return ec.metric(httpx.Client(), cluster.proxy_url, "vllm_pd_proxy_leg_errors_total", kind="unreachable")


def _fault(cluster: Cluster, name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    net = cluster.net
    faults: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "prefill-cut": (lambda: net.cut("prefill"), lambda: net.restore("prefill")),
        "prefill-paused": (cluster.pause_prefill, cluster.resume_prefill),
        "proxy-to-prefill-dropped": (
            lambda: net.blackhole("proxy", "prefill"),
            lambda: net.unblackhole("proxy", "prefill"),
        ),
        "prefill-to-proxy-dropped": (
            lambda: net.blackhole("prefill", "proxy"),
            lambda: net.unblackhole("prefill", "proxy"),
        ),
        # the proxy sees both healthy: decode gives up on the transfer itself
        "prefill-to-decode-dropped": (
            lambda: net.blackhole("prefill", "decode"),
            lambda: net.unblackhole("prefill", "decode"),
        ),
        "decode-to-prefill-dropped": (
            lambda: net.blackhole("decode", "prefill"),
            lambda: net.unblackhole("decode", "prefill"),
        ),
        "decode-cut": (lambda: net.cut("decode"), lambda: net.restore("decode")),
        "decode-paused": (cluster.pause_decode, cluster.resume_decode),
    }
    return faults[name]


@pytest.mark.parametrize(
    "fault", ["prefill-cut", "prefill-paused", "proxy-to-prefill-dropped", "prefill-to-proxy-dropped"]
)
def test_prefill_lost_under_load(cluster: Cluster, reference_outputs, fault: str) -> None:
    """Decode computes the prompts prefill was to compute; the proxy sees prefill lost and moves on."""
    cut_off = _unreachable_legs(cluster)
    sent, struck = load_through(cluster.proxy_url, *_fault(cluster, fault), OUTAGE_S)
    _assert_bounded(sent, struck, cluster)
    _assert_exact(sent, reference_outputs)
    if fault != "prefill-to-proxy-dropped":  # (there decode may answer before the proxy needs prefill's answer)
        assert _unreachable_legs(cluster) > cut_off  # legs waiting on the lost host were cut off
    _assert_recovered_and_nothing_held(cluster, reference_outputs)


@pytest.mark.parametrize("fault", ["prefill-to-decode-dropped", "decode-to-prefill-dropped"])
def test_prefill_and_decode_cut_apart_under_load(cluster: Cluster, reference_outputs, fault: str) -> None:
    """A one-way cut between prefill and decode that the proxy cannot see: decode gives up on the
    KV transfer (its pushes or announcement never come; prefill does not answer its probe) within
    the bound and computes the prompt itself."""
    sent, struck = load_through(cluster.proxy_url, *_fault(cluster, fault), OUTAGE_S)
    _assert_bounded(sent, struck, cluster)
    _assert_exact(sent, reference_outputs)
    _assert_recovered_and_nothing_held(cluster, reference_outputs)


@pytest.mark.parametrize("fault", ["decode-cut", "decode-paused"])
def test_decode_lost_under_load(cluster: Cluster, reference_outputs, fault: str) -> None:
    """No other decode: requests in flight end with the proxy's 5xx within the bound (not the outage),
    new ones are refused at once, and decode serves again once back."""
    sent, struck = load_through(cluster.proxy_url, *_fault(cluster, fault), OUTAGE_S)
    _assert_bounded(sent, struck, cluster, refused_ok=True)
    _assert_exact(sent, reference_outputs)
    _assert_recovered_and_nothing_held(cluster, reference_outputs)

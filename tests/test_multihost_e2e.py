"""Prefill, decode and the proxy on three hosts (network namespaces on one bridge; the test
process is a fourth host), KV over tcp across the links (VLLM_PD_TEST_TRANSPORT=nixl: over nixl).

One prefill and one decode server serve every test (tests/netns_cluster.py); the proxy runs as
its own process on its own host. Outputs are compared with the session's plain reference
instance (``reference_outputs``). The faults are what this kernel has (no tc netem): a host's
link taken down, a blackhole route, a paused process (SIGSTOP). Under a steady load each fault
hits requests in flight; every request must complete with the plain instance's output within
the detection time plus a generous margin (the proxy: two failed health checks, 1 s apart, 1 s
each; decode: push_wait_s 3 s + peer_probe_s 2 s), far below the outage - before these bounds a
request in flight waited for the whole outage. Afterwards the system recovers (prefill serves
again) and neither side holds any KV.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests import e2e_cluster as ec
from tests.netns_cluster import Cluster, ConnectorTimes, Sent, load_through, multihost_cluster, send, waits_after
from tests.netns_hosts import netns_unavailable

pytestmark = pytest.mark.e2e

# shm is one host's transport: across hosts the pair uses tcp unless nixl is asked for
TRANSPORT = "nixl" if os.environ.get("VLLM_PD_TEST_TRANSPORT") == "nixl" else "tcp"
TIMES = ConnectorTimes(push_wait_s=3.0, peer_probe_s=2.0, lease_s=20.0)
HEALTH = {"health_interval": 1.0, "health_timeout": 1.0}
# detection: the proxy's two failed checks (~2 x (interval + timeout)), decode's push wait + probe
DETECTION_S = max(2 * (HEALTH["health_interval"] + HEALTH["health_timeout"]), TIMES.push_wait_s + TIMES.peer_probe_s)
BOUND_S = DETECTION_S + 25.0  # a request in flight at the fault completes within this
OUTAGE_S = 60.0  # the fault lasts at most this long: past the bound, so waiting it out fails
CHECK_KEYS = ("ids300", "ids1000", "text2", "chat2", "ids129")


@pytest.fixture(scope="module")
def cluster(reference_outputs: dict[str, list[int]], small_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"network namespaces refused by the kernel: {why}")
    with multihost_cluster(small_model_dir, tmp_path_factory.mktemp("multihost-logs"), TRANSPORT, TIMES) as c:
        c.start_proxy(**HEALTH)
        yield c


def _assert_bounded_and_exact(sent: list[Sent], struck: float, reference: dict[str, list[int]]) -> None:
    assert all(s.error is None for s in sent), [s.error for s in sent if s.error]
    wrong = [s.key for s in sent if s.tokens != reference[s.key]]
    assert not wrong, f"outputs differ from the plain instance's: {wrong}"
    waits = waits_after(sent, struck)
    assert len(waits) >= 3, "too few requests ran during the fault: the test proved nothing"
    assert max(waits) < BOUND_S, (f"a request running during the fault took {max(waits):.1f}s after it; "
                                  f"detection is {DETECTION_S:.0f}s, the outage {OUTAGE_S:.0f}s")


def _assert_recovered_and_nothing_held(cluster: Cluster, reference: dict[str, list[int]]) -> None:
    """Prefill serves through the proxy again (its KV reaches decode), and no KV is left held."""
    client = httpx.Client()
    assert ec.wait_until(cluster.proxy_ready, timeout=30)
    loads = ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok")

    def pd_again() -> bool:
        s = send(cluster.proxy_url, "ids1000")
        assert s.error is None and s.tokens == reference["ids1000"], s.error
        return ec.metric(client, cluster.decode.url, "vllm:pd_loads_total", result="ok") > loads

    assert ec.wait_until(pd_again, timeout=30, interval=1.0), "prefill never served through the proxy again"
    for server in (cluster.prefill, cluster.decode):
        def released() -> bool:
            # a short plain request makes the engine step: expiries run and the gauges are reported
            ec.post(client, server.url, ec.completion_body("nudge", max_tokens=1))
            return (ec.metric(client, server.url, "vllm:pd_held_transfers") == 0
                    and ec.metric(client, server.url, "vllm:pd_loading_requests") == 0
                    and ec.metric(client, server.url, "vllm:pd_staged_bytes") == 0)

        assert ec.wait_until(released, timeout=TIMES.lease_s + 30, interval=1.0), (
            f"{server.url} still holds KV: held={ec.metric(client, server.url, 'vllm:pd_held_transfers')} "
            f"staged={ec.metric(client, server.url, 'vllm:pd_staged_bytes')}")


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


def test_prefill_host_cut_off_under_load(cluster: Cluster, reference_outputs) -> None:
    cut_off = _unreachable_legs(cluster)
    sent, struck = load_through(cluster.proxy_url, lambda: cluster.net.cut("prefill"),
                                lambda: cluster.net.restore("prefill"), OUTAGE_S)
    _assert_bounded_and_exact(sent, struck, reference_outputs)
    assert _unreachable_legs(cluster) > cut_off  # legs waiting on the cut host were cut off
    _assert_recovered_and_nothing_held(cluster, reference_outputs)


def test_prefill_host_paused_under_load(cluster: Cluster, reference_outputs) -> None:
    """SIGSTOP: connections stay open but nothing answers - pushes stall mid-transfer, so decode's
    probe of prefill decides too, not only the proxy."""
    cut_off = _unreachable_legs(cluster)
    sent, struck = load_through(cluster.proxy_url, cluster.pause_prefill, cluster.resume_prefill, OUTAGE_S)
    _assert_bounded_and_exact(sent, struck, reference_outputs)
    assert _unreachable_legs(cluster) > cut_off  # legs waiting on the paused host were cut off
    _assert_recovered_and_nothing_held(cluster, reference_outputs)


def test_proxy_blackholed_from_prefill(cluster: Cluster, reference_outputs) -> None:
    """A one-way partition: what the proxy sends to prefill is dropped; prefill and decode still
    see each other."""
    sent, struck = load_through(cluster.proxy_url, lambda: cluster.net.blackhole("proxy", "prefill"),
                                lambda: cluster.net.unblackhole("proxy", "prefill"), OUTAGE_S)
    _assert_bounded_and_exact(sent, struck, reference_outputs)
    _assert_recovered_and_nothing_held(cluster, reference_outputs)

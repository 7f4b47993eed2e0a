"""The netns test hosts (tests/support/netns_hosts.py): addresses, reachability, faults, teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.netns_hosts import PREFIX, NetnsHosts, _ip, netns_unavailable, remove_leftovers

_why = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(_why is not None, reason=f"network namespaces refused by the kernel: {_why}"),
]

# connect to host:port from where this runs; prints "ok" or the error's name
_DIAL = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "    print('ok')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def _dial(argv_prefix: list[str], address: str, port: int, timeout: float = 1.0) -> str:
    out = subprocess.run(
        [*argv_prefix, sys.executable, "-c", _DIAL, address, str(port), str(timeout)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip() or out.stderr.strip()


def _names_left() -> str:
    return _ip("netns", "list").stdout + _ip("-o", "link").stdout


def test_hosts_reach_each_other_and_faults_cut_them() -> None:
    with NetnsHosts(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        server = subprocess.Popen(
            a.command([sys.executable, "-m", "http.server", "--bind", a.address, "18080"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(50):
                if _dial([], a.address, 18080) == "ok":
                    break
            assert _dial([], a.address, 18080) == "ok"  # root namespace -> a
            assert _dial(b.command([]), a.address, 18080) == "ok"  # b -> a, across the bridge
            # a's loopback is a's own: nothing listens on 127.0.0.1:18080 there
            assert _dial(b.command([]), "127.0.0.1", 18080) == "ConnectionRefusedError"

            net.cut("a")
            assert _dial(b.command([]), a.address, 18080) == "TimeoutError"
            net.restore("a")
            assert _dial(b.command([]), a.address, 18080, timeout=5) == "ok"

            net.blackhole("b", "a")
            assert _dial(b.command([]), a.address, 18080) != "ok"
            assert _dial([], a.address, 18080) == "ok"  # only b's route to a is gone
            net.unblackhole("b", "a")
            assert _dial(b.command([]), a.address, 18080) == "ok"
        finally:
            server.kill()
            server.wait()
        tag = net["a"].netns.split("-")[0]
    assert tag not in _names_left()


def test_leftovers_of_a_dead_owner_are_removed_and_live_ones_kept() -> None:
    dead = f"{PREFIX}4999999-0"  # above the default pid_max: no live process owns it
    _ip("netns", "add", dead)
    try:
        with NetnsHosts(["x"]) as net:  # entering removes the dead owner's namespace
            assert dead not in _ip("netns", "list").stdout
            assert remove_leftovers() == []  # ours belongs to a live process
            assert net["x"].netns in _ip("netns", "list").stdout
    finally:
        _ip("netns", "del", dead, check=False)


def test_teardown_runs_when_the_block_fails() -> None:
    with pytest.raises(RuntimeError):
        with NetnsHosts(["y"]) as net:
            ns = net["y"].netns
            raise RuntimeError("test body failed")
    assert ns not in _ip("netns", "list").stdout


def test_a_vllm_server_spec_runs_inside_its_host() -> None:
    from vllm_pd.vllm_server import VllmServerSpec

    with NetnsHosts(["s"]) as net:
        host = net["s"]
        spec = VllmServerSpec(model="m", port=8000, host=host.address, netns=host.netns)
        cmd = spec.command()
        assert cmd[:4] == ["ip", "netns", "exec", host.netns] and "vllm.entrypoints.openai.api_server" in cmd
        # what runs under that prefix sees the host's own address
        seen = subprocess.run([*cmd[:4], "ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert host.address in seen and net.root_address not in seen
    assert VllmServerSpec(model="m", port=8000).command()[0] == sys.executable

"""The KV store across hosts: the master on one network namespace, two store nodes on two others
(tests/support/netns_store_node.py, no vLLM), all with one deployment secret; a node fetches another
node's blocks through the master across the links, byte for byte. With the master's host cut off
a lookup gives up within the master timeout (the node recomputes), and once the link is back
fetches go through again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.netns_hosts import NetnsHosts, netns_unavailable
from vllm_pd.connector.deployment_secret import new_secret
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.vllm_server import free_port

_why = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(_why is not None, reason=f"network namespaces refused by the kernel: {_why}"),
]

MASTER_TIMEOUT_S = 2.0  # tests/support/store_nodes.Node's master_timeout_s


SECRET = new_secret()


def _node(
    net: NetnsHosts, host: str, role: str, name: str, master: str, seed: int, **kw: object
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.support.netns_store_node", role, name, master, net[host].address, str(seed)]
    return subprocess.Popen(
        net[host].command(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, VLLM_PD_SECRET=SECRET),
        **kw,
    )


def _load(net: NetnsHosts, name: str, master: str) -> dict:
    proc = _node(net, "b", "load", name, master, seed=2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"load node failed (exit {proc.returncode})"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def store_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetnsHosts, str, dict]]:
    secret_file = tmp_path_factory.mktemp("secret") / "secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(SECRET)
    with NetnsHosts(["master", "a", "b"]) as net:
        master, address = spawn_master(
            free_port(), host=net["master"].address, netns=net["master"].netns, secret_file=str(secret_file)
        )
        server = None
        try:
            server = _node(net, "a", "serve", "a", address, seed=1)
            line = server.stdout.readline()  # type: ignore[union-attr]
            assert line, "serving node exited before it was ready"
            yield net, address, json.loads(line)
        finally:
            if server is not None:
                server.stdin.close()  # type: ignore[union-attr]
                server.wait(timeout=30)
            master.kill()
            master.wait()


def test_a_node_fetches_another_nodes_blocks_through_the_master_across_hosts(store_hosts) -> None:
    net, address, served = store_hosts
    assert net["a"].address in served["endpoint"]
    got = _load(net, "b1", address)
    assert got["node"] == "a" and got["hit"] == 12 and got["errors"] == []
    assert got["digest"] == served["digest"]


def test_a_cut_off_master_costs_a_lookup_its_timeout_and_the_store_recovers(store_hosts) -> None:
    net, address, served = store_hosts
    net.cut("master")
    try:
        got = _load(net, "b2", address)
    finally:
        net.restore("master")
    assert got["node"] is None and got["hit"] == 0  # nothing to fetch: this node recomputes
    assert got["seconds"] < MASTER_TIMEOUT_S * 5  # bounded by the master timeout, not stuck
    got = _load(net, "b3", address)
    assert got["node"] == "a" and got["digest"] == served["digest"]

"""KV transports between two hosts (network namespaces on one bridge): a fetch of every layer and
a push back, byte for byte, over tcp and over nixl, authenticated with a deployment secret. Two
namespaces of one machine still share its processes, so UCX may move nixl's bytes by
cross-memory attach (cma, in our default UCX_TLS);
"nixl-tcp" forces UCX_TLS=tcp, so they cross the veth link as between real hosts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support.netns_hosts import NetnsHosts, netns_unavailable
from vllm_pd.connector.deployment_secret import new_secret

_why = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(_why is not None, reason=f"network namespaces refused by the kernel: {_why}"),
]


def _json_line(proc: subprocess.Popen[str]) -> dict:
    """The first JSON line the process prints (NIXL prints its own banner lines too)."""
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"exited before it was ready (exit {proc.wait()})")


@pytest.mark.parametrize("case", ["tcp", "nixl", "nixl-tcp"])
def test_fetch_and_push_across_hosts(case: str) -> None:
    name = case.split("-")[0]
    env = dict(os.environ, VLLM_PD_SECRET=new_secret(), **({"UCX_TLS": "tcp"} if case == "nixl-tcp" else {}))
    if name == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed (pip install 'vllm-pd[nixl]')")
    with NetnsHosts(["a", "b"]) as net:
        module = [sys.executable, "-m", "tests.support.netns_transport_peer"]
        server = subprocess.Popen(
            net["a"].command([*module, "serve", name, net["a"].address]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            endpoint = _json_line(server)["endpoint"]
            assert net["a"].address in endpoint
            client = subprocess.run(
                net["b"].command([*module, "client", name, net["b"].address, endpoint]),
                capture_output=True,
                text=True,
                timeout=180,
                env=env,
            )
            assert client.returncode == 0, client.stderr[-2000:]
            got = json.loads(next(ln for ln in reversed(client.stdout.splitlines()) if ln.startswith("{")))
            assert got["fetched_exact"] and got["pushed"]
        finally:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(timeout=60)

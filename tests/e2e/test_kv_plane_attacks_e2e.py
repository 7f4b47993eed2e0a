"""The issue's attacks on the KV plane, against the session's real vLLM CPU pair (pd_pair, which
runs with a deployment secret), by a process that has our source but not the secret: it cannot
read a held request's KV, release it, push into decode, or replay a member's recorded session,
and any bytes it sends get nothing back. A member with the secret reads as before, and the
attacked request is then served exactly as by a plain instance, from the transferred KV.

The store master's index (Nodes, Holders, Publish) is attacked in tests/e2e/test_store_e2e.py (its
real master and vLLM store nodes run with a secret) and tests/integration/test_store_master_auth.py; the
same-host memory read in tests/unit/connector/test_cross_memory_grants.py (it needs Yama).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from tests.support.transport_harness import TcpRelay
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion, Transport
from vllm_pd.errors import TransportError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.control import ReleaseMessage
from vllm_pd.protocol.transfer_params import RemotePrefill

pytestmark = pytest.mark.e2e

PROMPT = "ids640"
OTHER = DeploymentSecret(b"another-deployment-secret-0123456", "attacker")


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def guarded(pd_pair):
    prefill, decode = pd_pair
    if prefill.secret is None:
        pytest.skip("pd_pair runs without a deployment secret (VLLM_PD_TEST_SECRET=0)")
    return prefill, decode


def _block_nbytes(model_dir: Path, block_size: int) -> int:
    """One layer's KV block of the small model in vLLM's CPU layout (K and V, bf16)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * block_size * cfg["num_key_value_heads"] * head_dim * 2


def _client_transport(nbytes: int, blocks: int, secret: DeploymentSecret | None) -> Transport:
    """Our own transport code, as an attacker (or a member) runs it: zeroed regions to land KV in."""
    t = create_transport(ec.TRANSPORT, **({"secret": secret} if secret is not None else {}))
    t.register_regions([MemoryRegion("l0", torch.zeros(blocks, nbytes, dtype=torch.uint8))])
    t.start(_NoSink(), "127.0.0.1", 0)
    return t


class _NoSink:
    def destinations(self, batch: BlockBatch):
        return None

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        pass

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        return None


def _staged_bytes(client: httpx.Client, decode) -> float:
    """Decode's staged push bytes as of now (the gauge moves with decode's steps: one is made)."""
    ec.post(client, decode.url, ec.completion_body("a step", max_tokens=1))
    return ec.metric(client, decode.url, "vllm:pd_staged_bytes")


def _landed(t: Transport, n: int) -> bytes:
    return b"".join(bytes(v) for v in t._regions.views(0, list(range(n))))  # type: ignore[attr-defined]


def test_without_the_secret_nothing_is_read_released_or_pushed(
    guarded, reference_outputs, small_model_dir, client
) -> None:
    prefill, decode = guarded
    body = CONNECTOR_CASES[PROMPT]
    params = ec.post(client, prefill.url, ec.prefill_leg(body, "pull", decode))["kv_transfer_params"]
    remote = RemotePrefill.parse(params)
    assert remote is not None
    assert ec.wait_until(lambda: ec.metric(client, prefill.url, "vllm:pd_held_transfers") >= 1, timeout=10)
    nbytes, n = _block_nbytes(small_model_dir, remote.block_size), len(remote.block_ids)
    refused_before = ec.metric(client, prefill.url, "vllm:pd_connections_refused_total")
    # earlier tests on this pair may have left pushes no request claimed: they go within the lease
    assert ec.wait_until(lambda: _staged_bytes(client, decode) == 0, timeout=90, interval=2)
    for secret in (None, OTHER):  # no secret, another deployment's secret
        outsider = _client_transport(nbytes, n, secret)
        try:
            with pytest.raises(TransportError):  # read: the outsider got all prompt token ids back
                outsider.fetch(
                    remote.endpoint, remote.transfer_id, 0, list(remote.block_ids), list(range(n)), timeout=10
                ).result(timeout=20)
            assert not _landed(outsider, n).strip(b"\0")
            with pytest.raises(TransportError):  # deny: the outsider released it
                outsider.notify(remote.endpoint, ReleaseMessage(remote.transfer_id).encode(), timeout=10).result(
                    timeout=20
                )
            with pytest.raises(TransportError):  # write: the outsider pushed garbage into decode
                outsider.push(
                    decode.kv_endpoint, BlockBatch(remote.transfer_id, 0, (0,), nbytes), [0], timeout=10
                ).result(timeout=20)
        finally:
            outsider.close()
    assert ec.metric(client, prefill.url, "vllm:pd_held_transfers") >= 1  # still held for decode
    assert _staged_bytes(client, decode) == 0  # nothing pushed landed

    # a member reads it as today (the positive control: the same call, with the secret)
    member = _client_transport(nbytes, n, prefill.secret)
    try:
        member.fetch(remote.endpoint, remote.transfer_id, 0, list(remote.block_ids), list(range(n)), timeout=10).result(
            timeout=20
        )
        assert _landed(member, n).strip(b"\0")
    finally:
        member.close()

    # the real decode loads the KV (no recompute) and answers as the plain instance
    ok_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok")
    out = ec.post(client, decode.url, dict(body, kv_transfer_params=params))
    assert ec.output_tokens(out) == reference_outputs[PROMPT]
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok") == ok_before + 1
    # refused and counted (the counter reaches /metrics with prefill's next step)
    ec.post(client, prefill.url, ec.completion_body("one more step", max_tokens=1))
    assert ec.wait_until(
        lambda: ec.metric(client, prefill.url, "vllm:pd_connections_refused_total") >= refused_before + 2, timeout=30
    )


def test_a_recorded_member_session_replayed_gets_nothing(guarded, client) -> None:
    prefill, _ = guarded
    relay = TcpRelay(prefill.kv_endpoint)
    member = _client_transport(64, 1, prefill.secret)
    try:
        # a member's release of a transfer prefill never held (harmless): recorded on the path
        assert (
            member.notify(relay.endpoint, ReleaseMessage("recorded-release").encode(), timeout=10).result(timeout=20)
            == b"ok"
        )
    finally:
        member.close()
        relay.close()
    recorded = bytes(relay.recorded[0])
    host, port = prefill.kv_endpoint.split("://", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(recorded)
        answer = _until_closed(s)
    # a fresh challenge (the listener's nonce, 40 bytes) is all a replayed session gets back
    assert len(answer) <= 40 and b"ok" not in answer


def test_any_unauthenticated_bytes_get_nothing(guarded) -> None:
    prefill, decode = guarded
    for inst in (prefill, decode):
        host, port = inst.kv_endpoint.split("://", 1)[1].rsplit(":", 1)
        for junk in (b"", os.urandom(40), b"VPD5" + os.urandom(200), b"GET / HTTP/1.1\r\n\r\n", os.urandom(70000)):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                try:
                    s.sendall(junk)
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # closed on us before we finished: nothing came back either
                assert _until_closed(s) == b"", junk[:8]


def _until_closed(s: socket.socket, timeout: float = 15.0) -> bytes:
    s.settimeout(timeout)
    got = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (chunk := s.recv(1 << 16)):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)

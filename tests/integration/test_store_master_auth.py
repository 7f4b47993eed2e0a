"""The store master with a deployment secret, as a real process: outsiders (our own client code
without the secret, raw ZMQ sockets replaying a member's bytes) read nothing and publish
nothing; members work as without a secret. The negative control: a master without a secret
answers the same outsider."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from vllm_pd.connector.store.master_client import MasterClient, MasterLink
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.protocol.auth_handshake import REFUSED, DeploymentSecret, DiallerHandshake, MessageSeal, Service
from vllm_pd.protocol.block_keys import KeySalt, chain_keys
from vllm_pd.protocol.store_index import Holders, Nodes, Publish, Request
from vllm_pd.vllm_server import free_port

SALT = KeySalt("m", "bfloat16", "cpu", 4, 2)
KEYS = chain_keys(list(range(40)), SALT)
SECRET = DeploymentSecret(b"store-master-test-secret-0123456", "test")


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_bytes(SECRET.value)
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture(scope="module")
def guarded_master(secret_file: str) -> Iterator[str]:
    proc, address = spawn_master(free_port(), secret_file=secret_file)
    member = MasterClient(
        address,
        "member",
        "tcp://member:1",
        lambda: [(k, None) for k in KEYS[:5]],
        timeout_s=2.0,
        retry_after_s=0.0,
        salt=SALT,
        secret=SECRET,
    )
    assert member.flush(force=True)  # a node with the secret publishes as today
    member.close()
    yield address
    proc.kill()
    proc.wait()


def test_a_member_reads_the_index(guarded_master: str) -> None:
    link = MasterLink(guarded_master, timeout_s=2.0, retry_after_s=0.0, secret=SECRET)
    try:
        nodes = link.call(Nodes())
        assert nodes is not None and [n.node for n in nodes.nodes] == ["member"]
        held = link.call(Holders(KEYS[:8]))
        assert held is not None and held.held == {"member": 5}
    finally:
        link.close()


@pytest.mark.parametrize(
    "secret", [None, DeploymentSecret(b"another-deployment-secret-98765", "t")], ids=["no-secret", "other-secret"]
)
def test_an_outsider_reads_nothing_and_publishes_nothing(guarded_master: str, secret) -> None:
    outsider = MasterLink(guarded_master, timeout_s=2.0, retry_after_s=0.0, secret=secret)
    try:
        assert outsider.call(Nodes()) is None
        assert outsider.call(Holders(KEYS[:8])) is None
        assert (
            outsider.call(Publish("fake", "tcp://attacker:1", [(k, None) for k in KEYS[:40]], snapshot=True, salt=SALT))
            is None
        )
    finally:
        outsider.close()
    member = MasterLink(guarded_master, timeout_s=2.0, retry_after_s=0.0, secret=SECRET)
    try:
        nodes = member.call(Nodes())
        assert nodes is not None and [n.node for n in nodes.nodes] == ["member"]  # no fake node
        stats = member.stats()
        assert stats is not None and stats["refused"] >= 3
    finally:
        member.close()


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(address)
    return sock


def test_a_recorded_member_session_replayed_is_refused(guarded_master: str) -> None:
    """Record a member's handshake and sealed request byte for byte, replay them on a new socket."""
    recorded: list[bytes] = []
    member = _dealer(guarded_master)
    shake = DiallerHandshake(SECRET, Service.STORE_MASTER)
    for message in (shake.hello(),):
        recorded.append(message)
        member.send(message)
        challenge = member.recv()
    proof = shake.proof(challenge)
    recorded.append(proof)
    member.send(proof)
    keys = shake.finish(member.recv())
    sealed = MessageSeal(keys.send).seal(1, msgspec.msgpack.encode(Request(1, Nodes())))
    recorded.append(sealed)
    member.send(sealed)
    assert member.recv() != REFUSED  # the genuine session is answered
    member.close()

    replay = _dealer(guarded_master)
    try:
        replay.send(recorded[0])
        replay.recv()  # a fresh challenge: the recorded proof answers another one
        replay.send(recorded[1])
        assert replay.recv() == REFUSED
        replay.send(recorded[2])
        assert replay.recv() == REFUSED  # and the sealed request belongs to no session here
    finally:
        replay.close()


def test_negative_control_a_master_without_a_secret_answers_anyone(tmp_path: Path) -> None:
    proc, address = spawn_master(free_port())
    try:
        outsider = MasterLink(address, timeout_s=2.0, retry_after_s=0.0)
        assert (
            outsider.call(Publish("fake", "tcp://attacker:1", [(k, None) for k in KEYS[:4]], snapshot=True, salt=SALT))
            is not None
        )
        nodes = outsider.call(Nodes())
        assert nodes is not None and "fake" in [n.node for n in nodes.nodes]
        outsider.close()
        # and a member with a secret refuses such a master (it cannot prove the secret)
        member = MasterLink(address, timeout_s=2.0, retry_after_s=0.0, secret=SECRET)
        assert member.call(Nodes()) is None
        member.close()
    finally:
        proc.kill()
        proc.wait()

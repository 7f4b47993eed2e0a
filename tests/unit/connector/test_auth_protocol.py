"""The deployment secret (connector/deployment_secret.py) and the handshake (protocol/auth_handshake.py),
without sockets."""

from __future__ import annotations

import os

import pytest

from vllm_pd.connector.deployment_secret import SECRET_ENV, check_bind, is_loopback, load_secret, new_secret
from vllm_pd.errors import AuthFailed, ConfigError
from vllm_pd.protocol.auth_handshake import (
    DeploymentSecret,
    DiallerHandshake,
    ListenerHandshake,
    MessageSeal,
    Service,
    StreamSeal,
)

SECRET = DeploymentSecret(b"s" * 32, "test")


def _shake(
    dialler_secret: DeploymentSecret = SECRET, listener_secret: DeploymentSecret = SECRET, service: Service = Service.KV
):
    d, listener = DiallerHandshake(dialler_secret, service), ListenerHandshake(listener_secret, service)
    challenge = listener.challenge(d.hello())
    ours, lkeys = listener.verify(d.proof(challenge))
    return d.finish(ours), lkeys


def test_both_ends_derive_mirrored_keys_and_fresh_ones_each_time() -> None:
    dkeys, lkeys = _shake()
    assert dkeys.send == lkeys.receive and dkeys.receive == lkeys.send and dkeys.blocks == lkeys.blocks
    assert dkeys.send != dkeys.receive
    again, _ = _shake()
    assert again.send != dkeys.send  # fresh nonces: a new session's keys


def test_a_wrong_secret_fails_on_the_side_that_checks_it() -> None:
    with pytest.raises(AuthFailed, match="dialler's proof"):
        _shake(dialler_secret=DeploymentSecret(b"x" * 32, "t"))
    d = DiallerHandshake(SECRET, Service.KV)
    fake = ListenerHandshake(DeploymentSecret(b"x" * 32, "t"), Service.KV)
    challenge = fake.challenge(d.hello())
    proof = d.proof(challenge)
    with pytest.raises(AuthFailed):  # the fake listener cannot verify, nor prove itself
        fake.verify(proof)


def test_a_recorded_dialler_replayed_to_a_new_listener_fails() -> None:
    d, first = DiallerHandshake(SECRET, Service.KV), ListenerHandshake(SECRET, Service.KV)
    hello = d.hello()
    proof = d.proof(first.challenge(hello))
    first.verify(proof)  # the recorded session was good
    replayed = ListenerHandshake(SECRET, Service.KV)
    replayed.challenge(hello)  # a fresh nonce of its own
    with pytest.raises(AuthFailed):
        replayed.verify(proof)


def test_a_recorded_listener_replayed_to_a_new_dialler_fails() -> None:
    d, listener = DiallerHandshake(SECRET, Service.KV), ListenerHandshake(SECRET, Service.KV)
    challenge = listener.challenge(d.hello())
    ours, _ = listener.verify(d.proof(challenge))
    victim = DiallerHandshake(SECRET, Service.KV)
    victim.hello()
    victim.proof(challenge)
    with pytest.raises(AuthFailed):
        victim.finish(ours)


def test_a_proof_is_bound_to_its_direction_and_service() -> None:
    d, listener = DiallerHandshake(SECRET, Service.KV), ListenerHandshake(SECRET, Service.KV)
    challenge = listener.challenge(d.hello())
    dialler_proof = d.proof(challenge)
    with pytest.raises(AuthFailed):  # the dialler's own proof reflected back is not the listener's
        d.finish(dialler_proof)
    master = ListenerHandshake(SECRET, Service.STORE_MASTER)
    with pytest.raises(AuthFailed, match="STORE_MASTER"):
        master.challenge(DiallerHandshake(SECRET, Service.KV).hello())


def test_garbage_is_refused_with_a_reason() -> None:
    listener = ListenerHandshake(SECRET, Service.KV)
    with pytest.raises(AuthFailed, match="did not authenticate"):
        listener.challenge(b"VPD5" + bytes(36))
    with pytest.raises(AuthFailed, match="bytes"):
        listener.challenge(b"VPDA")


def test_stream_seals_refuse_injected_replayed_and_reordered_messages() -> None:
    key = os.urandom(32)
    send, receive = StreamSeal(key), StreamSeal(key)
    tags = [send.tag(m) for m in (b"one", b"two", b"three")]
    receive.check(tags[0], b"one")
    with pytest.raises(AuthFailed):
        receive.check(tags[2], b"three")  # "two" was dropped: out of order
    replay = StreamSeal(key)
    replay.check(tags[0], b"one")
    with pytest.raises(AuthFailed):
        replay.check(tags[0], b"one")  # the same message again
    with pytest.raises(AuthFailed):
        StreamSeal(key).check(tags[0], b"One")  # altered


def test_message_seals_carry_the_sequence_and_refuse_replays() -> None:
    key = os.urandom(32)
    sender, receiver = MessageSeal(key), MessageSeal(key)
    m1, m2 = sender.seal(1, b"lookup"), sender.seal(2, b"publish")
    assert receiver.open(m1) == (1, b"lookup")
    assert receiver.open(m2) == (2, b"publish")
    with pytest.raises(AuthFailed, match="replayed"):
        receiver.open(m1)
    with pytest.raises(AuthFailed):
        receiver.open(m2[:-1] + bytes([m2[-1] ^ 1]))
    with pytest.raises(AuthFailed):
        MessageSeal(os.urandom(32)).open(sender.seal(3, b"x"))


def test_load_secret_from_env_or_file_and_errors_name_the_key(tmp_path) -> None:
    assert load_secret(None, env={}) is None
    assert load_secret(None, env={SECRET_ENV: "e" * 20}).value == b"e" * 20
    f = tmp_path / "secret"
    f.write_text("f" * 40 + "\n")
    got = load_secret(str(f), env={})
    assert got is not None and got.value == b"f" * 40 and "f" * 40 not in repr(got)
    assert load_secret(str(f), env={SECRET_ENV: "f" * 40}).value == b"f" * 40  # the same: fine
    with pytest.raises(ConfigError, match="secret_file.*different"):
        load_secret(str(f), env={SECRET_ENV: "g" * 40})
    with pytest.raises(ConfigError, match="secret_file: cannot read"):
        load_secret(str(tmp_path / "missing"), env={})
    with pytest.raises(ConfigError, match=f"{SECRET_ENV}: the secret is empty"):
        load_secret(None, env={SECRET_ENV: ""})
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(None, env={SECRET_ENV: "short"})
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="my_key.*at least 16"):
        load_secret(str(short), key="my_key", env={})
    assert len(new_secret()) == 64


def test_binding_beyond_loopback_needs_a_secret_or_insecure_network() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert check_bind("127.0.0.1", None, False, "bind_host") is False
    assert check_bind("0.0.0.0", SECRET, False, "bind_host") is False
    assert check_bind("0.0.0.0", None, True, "bind_host") is True  # the caller warns
    with pytest.raises(ConfigError, match="bind_host.*insecure_network"):
        check_bind("0.0.0.0", None, False, "bind_host")

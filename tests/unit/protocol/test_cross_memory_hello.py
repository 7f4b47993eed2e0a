"""The shm transport's cross-memory HELLOs (protocol/cross_memory_hello.py): the same bytes as the dicts
transport/shm.py sent before them, what a malformed field reads as (no reads: the rings), and a clear error
for bytes that are not JSON."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from vllm_pd.errors import ProtocolError
from vllm_pd.protocol.cross_memory_hello import CrossMemoryAnswer, CrossMemoryOffer, MemoryProbe

PROBE = MemoryProbe(pid=4242, boot="6c1e-é", address=140_000_000_000, token=bytes(range(16)))
OLD_PROBE = {"pid": 4242, "boot": "6c1e-é", "probe": 140_000_000_000, "token": bytes(range(16)).hex()}


@pytest.mark.parametrize("probe", [PROBE, None])
def test_offer_gives_the_bytes_of_the_old_dict(probe: MemoryProbe | None) -> None:
    old = msgspec.json.encode({"cross_memory": OLD_PROBE if probe else None})  # shm.py's round 3 before
    assert CrossMemoryOffer(probe).encode() == old
    assert CrossMemoryOffer.decode(old) == CrossMemoryOffer(probe)


@pytest.mark.parametrize("reads_you", [True, False])
def test_answer_gives_the_bytes_of_the_old_dict(reads_you: bool) -> None:
    old = msgspec.json.encode({"reads_you": reads_you})  # shm.py's round 4 before
    assert CrossMemoryAnswer(reads_you).encode() == old
    assert CrossMemoryAnswer.decode(old) == CrossMemoryAnswer(reads_you)


def test_probe_wire_form_round_trips() -> None:
    assert PROBE.to_wire() == OLD_PROBE
    assert MemoryProbe.from_wire(OLD_PROBE) == PROBE


@pytest.mark.parametrize(
    "info",
    [
        None,
        [],
        "probe",
        {},
        {"pid": "x", "probe": 1, "token": "00"},
        {"pid": 1, "token": "00"},
        {"pid": 1, "probe": 1, "token": "zz"},
        {"pid": 1, "probe": None, "token": "00"},
    ],
)
def test_a_malformed_probe_is_none(info: Any) -> None:
    assert MemoryProbe.from_wire(info) is None
    assert CrossMemoryOffer.decode(msgspec.json.encode({"cross_memory": info})) == CrossMemoryOffer(None)


def test_a_probe_without_a_boot_id_is_of_no_host() -> None:
    assert MemoryProbe.from_wire(dict(OLD_PROBE, boot=5)) == MemoryProbe(4242, "", 140_000_000_000, bytes(range(16)))
    assert MemoryProbe.from_wire({k: v for k, v in OLD_PROBE.items() if k != "boot"}) is not None


@pytest.mark.parametrize("payload", [b"[]", b'"x"', b"{}", b'{"later": 1}', b"null"])
def test_other_json_reads_as_no_reads(payload: bytes) -> None:
    assert CrossMemoryOffer.decode(payload) == CrossMemoryOffer(None)
    assert CrossMemoryAnswer.decode(payload) == CrossMemoryAnswer(False)


def test_only_a_true_answer_reads() -> None:
    assert CrossMemoryAnswer.decode(b'{"reads_you": 1}') == CrossMemoryAnswer(False)
    assert CrossMemoryAnswer.decode(b'{"reads_you": "true"}') == CrossMemoryAnswer(False)


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", b'{"reads_you": true'])
def test_bytes_that_are_not_json_are_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="cross-memory offer: not JSON"):
        CrossMemoryOffer.decode(payload)
    with pytest.raises(ProtocolError, match="cross-memory answer: not JSON"):
        CrossMemoryAnswer.decode(payload)

"""The HELLO frame's payload (protocol/hello_frame.py): the same bytes as the dicts the stream
transports sent before it, the defaults minimal peers rely on, and a clear error for bad input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from vllm_pd.errors import ProtocolError
from vllm_pd.protocol.hello_frame import HelloPayload
from vllm_pd.protocol.nixl_messages import RegionLayout

# what the block channels announce: tcp nothing, shm its ring (and a cross-memory offer), NIXL its agent
CHANNELS: list[dict[str, Any]] = [
    {},
    {"ring": "vpd-ring-1", "slots": 8, "slot_nbytes": 1 << 20, "reader": {"pid": 7, "boot": "é"}},
    {
        "agent": "a",
        "metadata": "bWV0YQ==",
        "probe": 140000000000,
        "token": "00ff",
        "layers": [msgspec.to_builtins(RegionLayout("DRAM", 0, 4096, 256, 3, (0, 128), (64, 32)))],
        "cross_memory": None,
    },
]


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.1:5600", "", "shm://h:1"])
def test_encode_gives_the_bytes_of_the_old_dict(endpoint: str, channel: dict[str, Any]) -> None:
    old = msgspec.json.encode({"endpoint": endpoint, "channel": channel})  # stream.py's _hello before
    assert HelloPayload(endpoint, channel).encode() == old
    back = HelloPayload.decode(old)
    assert back.endpoint == endpoint
    assert back.channel == msgspec.json.decode(msgspec.json.encode(channel))  # tuples come back as lists
    assert back.encode() == old


def test_missing_keys_read_as_defaults_and_unknown_keys_are_ignored() -> None:
    assert HelloPayload.decode(b"{}") == HelloPayload("", {})
    assert HelloPayload.decode(b'{"endpoint":"raw://x"}') == HelloPayload("raw://x", {})
    assert HelloPayload.decode(b'{"channel":{"ring":"r"},"later":1}') == HelloPayload("", {"ring": "r"})


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "not JSON"),
        (b"\x00\x01garbage", "not JSON"),
        (b'{"endpoint": "tcp://h:1"', "not JSON"),
        (b"[]", "not a JSON object"),
        (b'"tcp://h:1"', "not a JSON object"),
        (b'{"endpoint": 5}', "'endpoint' must be a string, got int"),
        (b'{"endpoint": null}', "'endpoint' must be a string, got NoneType"),
        (b'{"endpoint": "tcp://h:1", "channel": []}', "'channel' must be an object, got list"),
        (b'{"endpoint": "tcp://h:1", "channel": "ring"}', "'channel' must be an object, got str"),
    ],
)
def test_bad_input_is_a_protocol_error_naming_what(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        HelloPayload.decode(payload)

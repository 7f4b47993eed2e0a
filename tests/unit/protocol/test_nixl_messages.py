"""The NIXL handshake's region layout (protocol/nixl_messages.py): its wire form, pinned.

``RegionLayout`` moved from transport/nixl_regions.py into the protocol package; the peer reads it
from the dialler's HELLO (a JSON array per region, ``msgspec.to_builtins``), so its bytes must be
what they were: the literal below is what the struct encoded to before the move.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from vllm_pd.protocol.nixl_messages import DRAM, VRAM, RegionLayout

LAYOUT = RegionLayout(DRAM, 0, 4096, 256, 3, (0, 128), (64, 32))
# the HELLO's "layers" entry for LAYOUT, as the transport-side struct encoded it before the move
WIRE = b'["DRAM",0,4096,256,3,[0,128],[64,32]]'


def test_region_layout_wire_form_is_unchanged() -> None:
    assert msgspec.json.encode(msgspec.to_builtins(LAYOUT)) == WIRE
    assert msgspec.json.encode(LAYOUT) == WIRE
    assert msgspec.convert(msgspec.json.decode(WIRE), RegionLayout) == LAYOUT
    assert msgspec.convert([msgspec.to_builtins(LAYOUT)], list[RegionLayout]) == [LAYOUT]


def test_region_layout_refuses_a_field_of_the_wrong_type() -> None:
    bad = msgspec.json.decode(WIRE)
    bad[1] = "zero"  # device
    with pytest.raises(msgspec.ValidationError, match=r"\$\[1\]"):
        msgspec.convert(bad, RegionLayout)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(msgspec.json.decode(WIRE)[:-1], RegionLayout)  # lengths missing


def test_region_layout_places_blocks() -> None:
    assert LAYOUT.block_nbytes == 96
    assert LAYOUT.extent == (4096, 2 * 256 + 160)
    assert LAYOUT.spans(np.array([0, 2])).tolist() == [[4096, 4608], [4224, 4736]]
    assert LAYOUT.wire_offsets().tolist() == [0, 64]
    assert LAYOUT.check_ids([0, 2], "layer 0").tolist() == [0, 2]
    with pytest.raises(ValueError, match="block id 3 out of range for layer 0"):
        LAYOUT.check_ids([1, 3], "layer 0")
    assert RegionLayout(VRAM, 1, 0, 8, 1, (0,), (8,)).mem == "VRAM"

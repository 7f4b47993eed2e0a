"""state_geometry / state_layout: a decode rank's recurrent state block taken from prefill ranks of
another TP size, byte for byte. The model of the state: one full-width Mamba-2 state (conv state
over its ``x | B | C`` channels, SSM state over its heads) of random bytes, sharded per rank by vLLM's
own weight loader for Mamba-2's projections (``mamba_v2_sharded_weight_loader``, which places a
rank's conv channels: x by heads, B and C by groups, the one group of a model with one on every
rank) and packed into a page as vLLM's ``MambaBase.bind_kv_cache`` reads it (conv state, then SSM
state). Decode's block assembled from prefill's blocks by the windows must equal decode's own shard."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_pd.connector.device.kv_geometry import incompatibility, plan_rank, releasers
from vllm_pd.connector.device.state_geometry import StateWindow, state_nbytes, state_windows
from vllm_pd.connector.state_layout import mamba_state_layout
from vllm_pd.protocol.kv_shape import KVGroup, KVShape, StateLayout, decode_shape, encode_shape

HEADS, HEAD_DIM, D_STATE, KERNEL = 8, 4, 3, 4  # Mamba-2 heads, head dim, state size, conv kernel
CONV_DTYPE, SSM_DTYPE = torch.bfloat16, torch.float32  # vLLM's defaults: the model's dtype, float32


@dataclasses.dataclass(frozen=True)
class Model:
    n_groups: int
    dim_first: bool  # the conv state's "DS" layout (vLLM's default on CPU: "SD")

    @property
    def intermediate(self) -> int:
        return HEADS * HEAD_DIM

    def shapes(self, tp: int, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[int, ...], ...]:
        """One rank's state shapes, as vLLM's MambaMixer2 asks for them."""
        monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: self.dim_first)
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp, self.intermediate, self.n_groups, HEADS, HEAD_DIM, D_STATE, KERNEL
        )

    def layout(self, tp: int, monkeypatch: pytest.MonkeyPatch) -> StateLayout:
        layout = mamba_state_layout(
            "MAMBA2", self.shapes(tp, monkeypatch), (CONV_DTYPE, SSM_DTYPE), tp, self.n_groups, self.dim_first
        )
        assert layout is not None
        return layout


def full_state(model: Model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's whole-model state: conv [channels, kernel - 1] (x, B, C channels), SSM [heads, head dim, state]."""
    gen = torch.Generator().manual_seed(seed)
    channels = model.intermediate + 2 * model.n_groups * D_STATE
    conv = torch.randint(-(2**15), 2**15, (channels, KERNEL - 1), generator=gen, dtype=torch.int16).view(CONV_DTYPE)
    ssm = torch.randint(-(2**31), 2**31 - 1, (HEADS, HEAD_DIM, D_STATE), generator=gen, dtype=torch.int32)
    return conv, ssm.view(SSM_DTYPE)


def rank_page(model: Model, conv: torch.Tensor, ssm: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s state page (uint8): its conv channels placed by vLLM's loader, its SSM heads."""
    extra = MambaStateShapeCalculator.extra_groups_for_head_shards(model.n_groups, tp)
    groups_width = (model.n_groups + extra) * D_STATE
    channels_local = (model.intermediate + 2 * groups_width) // tp
    local = torch.zeros(channels_local, KERNEL - 1, dtype=CONV_DTYPE)
    group_settings = (groups_width, extra * D_STATE, model.n_groups == 1)
    loader = mamba_v2_sharded_weight_loader([(model.intermediate, 0, False), group_settings, group_settings], tp, rank)
    loader(local, conv)
    heads_local = HEADS // tp
    local_ssm = ssm[rank * heads_local : (rank + 1) * heads_local]
    local_conv = local if model.dim_first else local.t()  # SD: [kernel - 1, channels]
    return torch.cat(
        [local_conv.contiguous().view(torch.uint8).flatten(), local_ssm.contiguous().view(torch.uint8).flatten()]
    )


def assemble(
    windows: tuple[StateWindow, ...], pages: list[torch.Tensor], nbytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode's block from prefill's pages by ``windows``, and how often each byte was written."""
    out = torch.zeros(nbytes, dtype=torch.uint8)
    written = torch.zeros(nbytes, dtype=torch.int32)
    for w in windows:
        out[w.dst_offset : w.dst_offset + w.nbytes] = pages[w.source][w.src_offset : w.src_offset + w.nbytes]
        written[w.dst_offset : w.dst_offset + w.nbytes] += 1
    return out, written


TPS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)]


def models_for(m: int, n: int) -> list[Model]:
    """The models vLLM shards over both TP sizes: one group (B, C replicated) and as many as the larger TP."""
    return [Model(g, df) for g in sorted({1, max(m, n)}) for df in (False, True)]


@pytest.mark.parametrize("m, n", TPS, ids=[f"P{m}-D{n}" for m, n in TPS])
def test_decode_ranks_state_blocks_are_their_own_shards_byte_for_byte(
    m: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for model in models_for(m, n):
        layout = model.layout(n, monkeypatch)
        assert layout == model.layout(m, monkeypatch)  # whole-model sizes: equal on every TP
        conv, ssm = full_state(model)
        prefill = [rank_page(model, conv, ssm, m, p) for p in range(m)]
        assert all(len(page) == state_nbytes(layout, m) for page in prefill)
        for d in range(n):
            own = rank_page(model, conv, ssm, n, d)
            windows = state_windows(layout, m, n, d)
            got, written = assemble(windows, prefill, state_nbytes(layout, n))
            assert bool((written == 1).all()), f"{model}, rank {d}: a byte written {written.max()} or 0 times"
            assert torch.equal(got, own), f"{model}: decode rank {d} of TP {n} from prefill TP {m}"


def test_vllms_page_is_the_layouts_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for tp, model in ((1, Model(1, False)), (2, Model(1, False)), (2, Model(2, True)), (4, Model(4, False))):
        spec = MambaSpec(block_size=16, shapes=model.shapes(tp, monkeypatch), dtypes=(CONV_DTYPE, SSM_DTYPE))
        assert state_nbytes(model.layout(tp, monkeypatch), tp) == spec.state_content_size_bytes


def test_a_replicated_group_is_read_once_from_one_prefill_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """P2 -> D1, one group: B and C are on both prefill ranks; decode reads each from one, once."""
    model = Model(1, False)
    layout = model.layout(1, monkeypatch)
    windows = state_windows(layout, 2, 1, 0)
    rows, ci = KERNEL - 1, CONV_DTYPE.itemsize
    x_half, groups = HEADS * HEAD_DIM // 2 * ci, 2 * D_STATE * ci  # a rank's x; B and C (one group each)
    ssm_half = HEADS // 2 * HEAD_DIM * D_STATE * SSM_DTYPE.itemsize
    by_source = {p: sum(w.nbytes for w in windows if w.source == p) for p in (0, 1)}
    assert by_source == {0: rows * (x_half + groups) + ssm_half, 1: rows * x_half + ssm_half}
    assert sum(w.nbytes for w in windows) == state_nbytes(layout, 1)


def test_windows_merge_where_they_continue_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model(1, True)
    layout = model.layout(2, monkeypatch)
    # equal TP: one window, the whole block
    assert state_windows(layout, 2, 2, 1) == (StateWindow(1, 0, 0, state_nbytes(layout, 2)),)
    # P1 -> D2, "DS": rank 0 reads its x, then B, C and its SSM heads (which continue each other on
    # both sides); rank 1 its x, B and C, then its SSM heads
    assert [len(state_windows(layout, 1, 2, d)) for d in (0, 1)] == [2, 2]
    # "SD": per conv row its x, then B and C - which continue into the next row's x (the last row's into
    # the SSM heads) on both sides
    assert len(state_windows(Model(1, False).layout(2, monkeypatch), 1, 2, 0)) == (KERNEL - 1) + 1


@pytest.mark.parametrize("m, n", [(1, 2), (2, 1)])
def test_a_wrong_window_fails(m: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: every window moved to another source, or shifted by one unit, breaks decode's block."""
    for model in models_for(m, n):
        layout = model.layout(n, monkeypatch)
        conv, ssm = full_state(model, seed=1)
        prefill = [rank_page(model, conv, ssm, m, p) for p in range(m)]
        own = rank_page(model, conv, ssm, n, 0)
        windows = state_windows(layout, m, n, 0)
        for i, w in enumerate(windows):
            wrong = [
                dataclasses.replace(w, source=(w.source + 1) % m) if m > 1 else None,
                dataclasses.replace(
                    w, src_offset=w.src_offset + (w.nbytes if w.src_offset == 0 else -min(w.src_offset, w.nbytes))
                ),
            ]
            for bad in [b for b in wrong if b is not None]:
                got, _ = assemble((*windows[:i], bad, *windows[i + 1 :]), prefill, len(own))
                if (
                    bad.source != w.source
                    and model.n_groups == 1
                    and m > 1
                    and torch.equal(
                        prefill[bad.source][bad.src_offset : bad.src_offset + bad.nbytes],
                        prefill[w.source][w.src_offset : w.src_offset + w.nbytes],
                    )
                ):
                    continue  # a replicated group: any holder is right (read once, from one)
                assert not torch.equal(got, own), f"{model}: window {i} {bad} still assembled decode's block"


def state_shape(tp: int, layout: StateLayout | None, monkeypatch: pytest.MonkeyPatch, block_size: int = 64) -> KVShape:
    nbytes = state_nbytes(layout, tp) if layout is not None else 100
    groups = (
        KVGroup("full", 16, f"int32:H{2 // min(tp, 2)}.N16.C4" if tp < 2 else "int32:N16.C4"),
        KVGroup("state", block_size, f"int8:C{nbytes}", state=layout),
    )
    return KVShape(tp, 2, groups, (0, 1))


def test_plans_read_every_share_and_release_every_prefill_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Model(2, False).layout(1, monkeypatch)
    p2, d1 = state_shape(2, layout, monkeypatch), state_shape(1, layout, monkeypatch)
    assert incompatibility(p2, d1) is None and incompatibility(d1, p2) is None
    plan = plan_rank(p2, d1, 0)
    assert plan.groups[1].sources == (0, 1) and plan.sources == (0, 1) and not plan.identity
    assert releasers(p2, d1) == {0: (0,), 1: (0,)}
    assert releasers(d1, p2) == {0: (0, 1)}
    # another block size of the state (equal TP) is cut by windows too: one, the whole block
    p1_32 = state_shape(1, layout, monkeypatch, block_size=32)
    [w] = plan_rank(p1_32, d1, 0).groups[1].windows
    assert (w.source, w.src_offset, w.dst_offset, w.nbytes) == (0, 0, 0, state_nbytes(layout, 1))
    # the shape with its state layout survives the handshake's encoding
    assert decode_shape(encode_shape(p2)) == p2


def test_what_cannot_be_cut_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Model(2, False).layout(1, monkeypatch)
    d1 = state_shape(1, layout, monkeypatch)
    unknown = state_shape(2, None, monkeypatch)
    assert "shard layout (prefill's not known" in (incompatibility(unknown, d1) or "")
    other = state_shape(2, Model(1, False).layout(2, monkeypatch), monkeypatch)
    assert "prefill's state is laid out and sharded as" in (incompatibility(other, d1) or "")
    # equal TP and block sizes, but another conv layout ("DS" beside "SD"): never moved whole
    sd, ds = Model(2, False).layout(1, monkeypatch), Model(2, True).layout(1, monkeypatch)
    assert state_nbytes(sd, 1) == state_nbytes(ds, 1)
    p1_sd, d1_ds = state_shape(1, sd, monkeypatch), state_shape(1, ds, monkeypatch)
    assert p1_sd.groups[1].block_format == d1_ds.groups[1].block_format
    assert "conv layout" in (incompatibility(p1_sd, d1_ds) or "")
    # 8 heads over TP 3 do not shard (vLLM would not start such an instance either)
    p3 = KVShape(3, 3, (KVGroup("full", 16, "int32:N16.C4"), KVGroup("state", 64, "int8:C100", state=layout)), (0, 1))
    d1_3 = (
        dataclasses.replace(d1, kv_heads=3)
        if False
        else KVShape(1, 3, (KVGroup("full", 16, "int32:H3.N16.C4"), d1.groups[1]), (0, 1))
    )
    assert "do not shard over prefill TP 3" in (incompatibility(p3, d1_3) or "")
    # a layout that does not size the blocks
    wrong_size = KVShape(2, 2, (p3.groups[0], KVGroup("state", 64, "int8:C100", state=layout)), (0, 1))
    assert "state blocks of" in (incompatibility(wrong_size, d1) or "")


def test_state_kinds_not_cut_get_no_layout() -> None:
    assert mamba_state_layout("GDN_ATTN", ((16, 3), (2, 4, 4)), (CONV_DTYPE, SSM_DTYPE), 1, None, False) is None
    # Mamba-2 at TP 2 without the model's groups: one group replicated or two sharded look alike
    shapes = ((3, 8 * 4 // 2 + 2 * D_STATE), (4, 4, D_STATE))
    assert mamba_state_layout("MAMBA2", shapes, (CONV_DTYPE, SSM_DTYPE), 2, None, False) is None
    assert mamba_state_layout("MAMBA2", shapes, (CONV_DTYPE, SSM_DTYPE), 2, 1, False) is not None
    # groups that do not fit the shapes
    assert mamba_state_layout("MAMBA2", shapes, (CONV_DTYPE, SSM_DTYPE), 2, 4, False) is None


@pytest.mark.parametrize("m, n", [(1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("dim_first", [False, True])
def test_a_mamba1_state_is_cut_byte_for_byte(m: int, n: int, dim_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mamba-1: conv state and SSM state both over the inner channels, each rank a contiguous run of them
    (vLLM's ColumnParallelLinear in_proj / conv1d)."""
    inner, d_state = 16, 3
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)

    def layout(tp: int) -> StateLayout:
        shapes = MambaStateShapeCalculator.mamba1_state_shape(tp, inner, d_state, KERNEL)
        out = mamba_state_layout("MAMBA1", shapes, (CONV_DTYPE, SSM_DTYPE), tp, None, dim_first)
        assert out is not None
        return out

    gen = torch.Generator().manual_seed(2)
    conv = torch.randint(-(2**15), 2**15, (inner, KERNEL - 1), generator=gen, dtype=torch.int16).view(CONV_DTYPE)
    ssm = torch.randint(-(2**31), 2**31 - 1, (inner, d_state), generator=gen, dtype=torch.int32).view(SSM_DTYPE)

    def page(tp: int, rank: int) -> torch.Tensor:
        rows = slice(rank * inner // tp, (rank + 1) * inner // tp)
        c = conv[rows] if dim_first else conv[rows].t()
        return torch.cat(
            [c.contiguous().view(torch.uint8).flatten(), ssm[rows].contiguous().view(torch.uint8).flatten()]
        )

    assert layout(m) == layout(n)
    prefill = [page(m, p) for p in range(m)]
    for d in range(n):
        got, written = assemble(state_windows(layout(n), m, n, d), prefill, state_nbytes(layout(n), n))
        assert bool((written == 1).all()) and torch.equal(got, page(n, d))

"""vLLM 0.32's physical KV cache layouts, as the connector reads them (torch only, no vLLM).

vLLM 0.32 allocates one flat int8 buffer and views each attention layer as a 4-D
``[B, H, N, C]`` tensor in the KV dtype: blocks, head slots, tokens, content (K and V side
by side for attention, ``C = head_size + head_size_v``; MLA's 576-wide latent with
``H = 1``). Its strides follow one :class:`KVLayout` for the whole model - a permutation
of logical ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``) - resolved once in the
engine core from the attention backends' supported sets and the connector's
``get_required_kvcache_layout`` (``resolve_kv_cache_layout``). A backend's kernel block
size may split each block the scheduler hands out (a *manager* block, what this connector
addresses) into ``ratio`` kernel blocks: the view's dim 0 is then ``num_blocks * ratio``
(vLLM's ``group_kernel_blocks`` undoes it).

What the connector takes from this:

* :func:`manager_blocks` - a layer's view with manager blocks as dim 0.
* A block's wire bytes are its bytes in memory order (``MemoryRegion.blocks``), so a block
  of a layer moves as one contiguous range wherever the layout keeps it in one
  (:attr:`KVLayout.layer_block_contiguous`), else as ``H`` ranges.
* :func:`block_format` - what those bytes mean (dtype and the block's dims in memory order):
  both sides of a transfer must agree on it (it travels in the handshake and in prefill's
  answer; a mismatch is refused and decode recomputes).
* :data:`TRANSFER_LAYOUT` - the layout the connector asks vLLM for.
"""

from __future__ import annotations

from enum import Enum

import torch

from vllm_pd.errors import ConfigError

# logical dims of vLLM's 5-D layout [L, B, H, N, C]
_L, _B, _H, _N, _C = 0, 1, 2, 3, 4
# names of the dims of a block in block_format: K = kernel blocks of a split manager block
_VIEW_NAMES = ("H", "N", "C")


class KVLayout(Enum):
    """vLLM 0.32's ``KVCacheLayout``: each value maps logical ``[L, B, H, N, C]`` to memory
    order, outermost first (equal to vLLM's enum: tests/unit/connector/test_kv_layout.py checks)."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @classmethod
    def named(cls, name: str) -> KVLayout:
        """The layout called ``name`` (vLLM's legacy NHD / HND too); ValueError otherwise."""
        name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(name.upper(), name.upper())
        try:
            return cls[name]
        except KeyError:
            raise ConfigError(f"kv_cache_layout: {name!r} is not one of {[m.name for m in cls]}") from None

    @property
    def is_block_outermost(self) -> bool:
        """B outermost: a block holds every layer's page (vLLM never splits such blocks)."""
        return self.value[0] == _B

    @property
    def layer_block_contiguous(self) -> bool:
        """A block of one layer is one contiguous run: H, N and C are the innermost dims."""
        return set(self.value[-3:]) == {_H, _N, _C}

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """Memory order of the per-layer view's dims ``[B, H, N, C]`` (vLLM's property)."""
        return tuple(d - 1 for d in self.value if d != _L)


# What the connector asks vLLM for (PDConnector.get_required_kvcache_layout): head-major
# pages, one contiguous page per block per layer, and a head subset of a block contiguous.
TRANSFER_LAYOUT = KVLayout.LBHNC


def manager_blocks(kv_layer: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """vLLM's view of one layer with manager blocks as dim 0: unchanged ``[num_blocks, H, N, C]``,
    or ``[num_blocks, ratio, H, N, C]`` where kernel blocks split each block (they lie one
    kernel page apart, so a manager block is ``ratio`` consecutive kernel blocks).
    ValueError for a view vLLM 0.32 does not make."""
    shape = tuple(kv_layer.shape)
    if kv_layer.dim() < 1 or num_blocks <= 0 or shape[0] % num_blocks:
        raise ValueError(f"KV cache layer of shape {shape} does not hold {num_blocks} blocks along dim 0")
    ratio = shape[0] // num_blocks
    if ratio == 1:
        return kv_layer
    grouped = kv_layer.unflatten(0, (num_blocks, ratio))
    if grouped.stride(0) != ratio * grouped.stride(1):
        raise ValueError(
            f"KV cache layer of shape {shape}: its {ratio} kernel blocks per block are not "
            f"consecutive (strides {tuple(kv_layer.stride())})"
        )
    return grouped


def block_dim_names(blocks: torch.Tensor) -> tuple[str, ...]:
    """Names of the dims after the block dim of a :func:`manager_blocks` view of vLLM's
    ``[B, H, N, C]`` (``K`` for kernel blocks); ``d1, d2, ...`` for another shape."""
    inner = blocks.dim() - 1
    if inner == len(_VIEW_NAMES):
        return _VIEW_NAMES
    if inner == len(_VIEW_NAMES) + 1:
        return ("K", *_VIEW_NAMES)
    return tuple(f"d{i}" for i in range(1, blocks.dim()))


def block_format(blocks: torch.Tensor) -> str:
    """What a block's wire bytes (its bytes in memory order) mean, e.g. ``bfloat16:H8.N16.C256``:
    the dtype, then the block's dims of more than one element, outermost first. Kernel blocks
    that continue the tokens of the one before (token-major pages) merge into N: a layout's
    bytes that mean the same give the same format, others a different one."""
    dims = [
        (name, int(n), int(s))
        for name, n, s in zip(block_dim_names(blocks), blocks.shape[1:], blocks.stride()[1:], strict=True)
        if n > 1
    ]
    dims.sort(key=lambda d: -d[2])
    merged: list[tuple[str, int, int]] = []
    for name, n, s in dims:
        if merged and merged[-1][0] == "K" and name == "N" and merged[-1][2] == n * s:
            merged[-1] = ("N", merged[-1][1] * n, s)
        else:
            merged.append((name, n, s))
    dtype = str(blocks.dtype).removeprefix("torch.")
    return f"{dtype}:" + ".".join(f"{name}{n}" for name, n, _ in merged)


def memory_order_mismatch(kv_layer: torch.Tensor, layout: KVLayout) -> str | None:
    """Why vLLM's ``[B, H, N, C]`` view of a layer is not laid out as ``layout`` says, or None.
    Only dims of more than one element count (their order is all the strides can show)."""
    if kv_layer.dim() != 4:
        return f"a {kv_layer.dim()}-D view, not vLLM 0.32's [B, H, N, C]"
    wanted = [d for d in layout.layer_view_order if kv_layer.shape[d] > 1]
    seen = sorted(wanted, key=lambda d: -kv_layer.stride(d))
    if seen != wanted:
        names = "BHNC"
        return (
            f"memory order {''.join(names[d] for d in seen)} (strides {tuple(kv_layer.stride())}), "
            f"{layout.name} gives {''.join(names[d] for d in wanted)}"
        )
    return None

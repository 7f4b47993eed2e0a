"""vLLM 0.32's KV cache allocation for its Hopper attention backends, replayed with torch alone.

The GPU machine that runs our checks has CUDA torch but no vLLM, so the harness
(tests/support/gpu_harness.py) and benchmarks/gpu_check.py build KV here, exactly as vLLM 0.32's
GPU model runner does for one model of same-shaped attention layers:

* the layout: one of the backend's accepted layouts (:class:`Backend`); what vLLM resolves
  with our connector is :func:`resolved_layout` (``resolve_kv_cache_layout``);
* the kernel block size: ``prepare_kernel_block_sizes`` / ``select_common_block_size``
  (:func:`kernel_block_size`) - a backend may split each block into kernel blocks;
* one flat int8 buffer and where each layer's blocks lie in it: the ``KVCacheTensor`` of
  ``get_kv_cache_config_from_groups`` (:func:`placement`);
* each layer's ``[B, H, N, C]`` view in the KV dtype: ``create_kv_cache_views``
  (:func:`layer_views`), which is what ``register_kv_caches`` receives.

tests/unit/connector/test_kv_layout.py checks every view against vLLM's own functions, tensor by tensor.
The GPU wheel's Python is the CPU wheel's (vllm 0.32.0 from PyPI, compared file by file:
only version strings and a CPU Triton helper differ); what differs on Hopper is the
platform's answers, written into :data:`BACKENDS` for sm_90 with bf16 KV and head size
128 (FlashAttention's 64-token FA4 pages are for fp8 KV at head 512 or head 256 on
sm_100; FlashInfer's large pages and its LBHNC / BLHNC-only set are sm_100's).

Not modelled (vLLM 0.32 has them, our models do not use them): padded pages
(``page_size_padded``: DeepSeek-V4), packed or quantized content (NVFP4 head slots,
``fp8_ds_mla``'s 656-byte rows), several KV cache groups (hybrid models, sliding windows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_pd.connector.device.kv_layout import TRANSFER_LAYOUT, KVLayout


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block size that is any multiple of ``base`` (vLLM's ``MultipleOf``)."""

    base: int


# vLLM's layout preference where no backend declares one (_DEFAULT_LAYOUT_PREFERENCE)
DEFAULT_LAYOUTS = (KVLayout.LBNHC, KVLayout.LBHNC, KVLayout.BLNHC, KVLayout.BLHNC, KVLayout.BHLNC, KVLayout.LHBNC)


@dataclass(frozen=True)
class Backend:
    """What an attention backend declares, as it answers on Hopper (bf16 KV, head 128 / MLA 576)."""

    name: str
    mla: bool
    kernel_block_sizes: tuple[int | MultipleOf, ...]  # get_supported_kernel_block_sizes
    layouts: tuple[KVLayout, ...]  # the layouts it runs, vLLM's preference first


BACKENDS = {
    b.name: b
    for b in (
        Backend("FLASH_ATTN", False, (MultipleOf(16),), DEFAULT_LAYOUTS),
        # declares no set on Hopper (any layout), but its kernels take a layout only by its NHD / HND
        # name (get_flashinfer_layout_string), which LHBNC has not: the first forward would assert
        Backend("FLASHINFER", False, (16, 32, 64), tuple(m for m in DEFAULT_LAYOUTS if m is not KVLayout.LHBNC)),
        Backend("FLASHMLA", True, (64,), DEFAULT_LAYOUTS),
        Backend("CUTLASS_MLA", True, (128,), DEFAULT_LAYOUTS),  # vLLM runs it on sm_100 only
        Backend("TRITON_MLA", True, (MultipleOf(16),), DEFAULT_LAYOUTS),
        Backend("CPU_ATTN", False, (MultipleOf(32),), (KVLayout.LBHNC,)),  # vLLM's CPU backend
    )
}


@dataclass(frozen=True)
class KVModel:
    """The KV cache shape of a model's attention layers (one TP rank)."""

    name: str
    num_layers: int
    num_kv_heads: int  # H: 1 for MLA
    head_size: int  # MLA: the latent (512) and rope (64) dims
    head_size_v: int  # 0 for MLA (no separate V)
    dtype: torch.dtype
    block_size: int  # tokens per block the scheduler hands out

    @property
    def content_nbytes(self) -> int:
        """C in bytes (AttentionSpec.state_content_size_bytes): K and V side by side per (head, token)."""
        return (self.head_size + self.head_size_v) * self.dtype.itemsize

    def page_nbytes(self, block_size: int | None = None) -> int:
        """One block of one layer."""
        return self.num_kv_heads * (block_size or self.block_size) * self.content_nbytes


PRESETS = {
    m.name: m
    for m in (
        KVModel(
            "llama3-8b",
            num_layers=32,
            num_kv_heads=8,
            head_size=128,
            head_size_v=128,
            dtype=torch.bfloat16,
            block_size=16,
        ),
        KVModel(
            "deepseek-v3",
            num_layers=61,
            num_kv_heads=1,
            head_size=576,
            head_size_v=0,
            dtype=torch.bfloat16,
            block_size=64,
        ),
    )
}


def model(name: str, layers: int = 0, block_size: int = 0, kv_heads: int = 0) -> KVModel:
    """Preset ``name`` (full size), with fewer layers / another block size / heads where given."""
    try:
        m = PRESETS[name]
    except KeyError:
        raise ValueError(f"model: {name!r} is not one of {sorted(PRESETS)}") from None
    return replace(
        m,
        num_layers=layers or m.num_layers,
        block_size=block_size or m.block_size,
        num_kv_heads=kv_heads or m.num_kv_heads,
    )


def resolved_layout(backend: Backend, requested: str = "") -> KVLayout:
    """The layout vLLM resolves for ``backend`` with our connector (``resolve_kv_cache_layout``):
    ``requested`` (VLLM_KV_CACHE_LAYOUT; ValueError if the backend does not run it), else the
    connector's LBHNC where the backend runs it (not for MLA: it asks nothing there), else the
    backend's first choice."""
    if requested:
        layout = KVLayout.named(requested)
        if layout not in backend.layouts:
            raise ValueError(f"kv_layout {layout.name}: {backend.name} runs {[m.name for m in backend.layouts]}")
        return layout
    if not backend.mla and TRANSFER_LAYOUT in backend.layouts:
        return TRANSFER_LAYOUT
    return backend.layouts[0]


@dataclass(frozen=True)
class Placement:
    """vLLM's KVCacheTensor for the model's layers: ``layers[l]``'s block ``b`` starts at
    ``offset + l * layer_stride + b * block_stride`` bytes into a buffer of ``size`` bytes."""

    size: int
    layer_stride: int
    block_stride: int
    offset: int = 0


def _shape_bytes(m: KVModel, num_blocks: int, kernel_block_size: int) -> tuple[int, int, int, int]:
    """compute_layer_kv_cache_shape_bytes: (B, H, N, C in bytes) of one layer in kernel blocks."""
    if m.block_size % kernel_block_size:
        raise ValueError(f"Kernel block size {kernel_block_size} must divide KV cache block size {m.block_size}.")
    return num_blocks * (m.block_size // kernel_block_size), m.num_kv_heads, kernel_block_size, m.content_nbytes


def _strides(shape: tuple[int, ...], layout: KVLayout, fixed: tuple[int | None, ...] = (None,) * 5) -> tuple[int, ...]:
    """compute_layout_strides: byte strides of logical [L, B, H, N, C], fixed ones kept."""
    strides = [0] * 5
    current = 1
    for dim in reversed(layout.value):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def placement(m: KVModel, num_blocks: int, layout: KVLayout) -> Placement:
    """get_kv_cache_config_from_groups for one group of ``m.num_layers`` same-shaped layers."""
    bytes_per_block = m.num_layers * m.page_nbytes()  # pages need no padding (unpadded specs)
    shape = (m.num_layers, *_shape_bytes(m, num_blocks, m.block_size))
    layer_stride, block_stride, *_ = _strides(
        shape, layout, (None, bytes_per_block if layout.is_block_outermost else None, None, None, None)
    )
    return Placement(bytes_per_block * num_blocks, layer_stride, block_stride)


def kernel_block_size(backend: Backend, m: KVModel, layout: KVLayout) -> int:
    """prepare_kernel_block_sizes: the block size itself where pages of other layers lie between
    blocks (block-outermost, several layers) or the backend runs it; else the largest size the
    backend names that divides it. ValueError (vLLM's) where none does."""
    bs = m.block_size
    p = placement(m, 1, layout)
    if p.block_stride > p.layer_stride:
        return bs

    def runs(size: int) -> bool:
        return any(size == s if isinstance(s, int) else size % s.base == 0 for s in backend.kernel_block_sizes)

    if runs(bs):
        return bs
    for size in sorted((s for s in backend.kernel_block_sizes if isinstance(s, int) and bs % s == 0), reverse=True):
        if runs(size):
            return size
    raise ValueError(f"No common block size for {bs} ({backend.name}: {list(backend.kernel_block_sizes)}).")


def layer_views(
    raw: torch.Tensor, m: KVModel, num_blocks: int, layout: KVLayout, where: Placement, kernel_block: int
) -> list[torch.Tensor]:
    """create_kv_cache_views: each layer's ``[B, H, N, C]`` view (kernel blocks as B) in the KV dtype."""
    shape = _shape_bytes(m, num_blocks, kernel_block)
    ratio = shape[0] // num_blocks
    block_stride = where.block_stride
    if ratio > 1:
        dense_page = m.page_nbytes()
        if block_stride != dense_page:
            raise ValueError(
                f"The resolved KV cache layout ({layout.name}) does not store blocks as dense, "
                f"unpadded pages (block stride {block_stride} != page {dense_page}), so a manager "
                f"block cannot be split into {ratio} kernel blocks of {kernel_block} tokens."
            )
        block_stride //= ratio
    logical = (m.num_layers, *shape)
    strides = _strides(logical, layout, (where.layer_stride, block_stride, None, None, None))
    view_5d = torch.as_strided(raw, size=logical, stride=strides, storage_offset=raw.storage_offset() + where.offset)
    return [view_5d[layer].view(m.dtype) for layer in range(m.num_layers)]


@dataclass
class KVCache:
    """One worker's KV cache as vLLM 0.32 allocates it: what ``register_kv_caches`` gets."""

    raw: torch.Tensor  # the flat int8 buffer
    views: dict[str, torch.Tensor]  # layer name -> [num_blocks * ratio, H, N, C]
    layout: KVLayout
    kernel_block_size: int
    num_blocks: int  # manager blocks

    @property
    def ratio(self) -> int:
        """Kernel blocks per block."""
        return next(iter(self.views.values())).shape[0] // self.num_blocks


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def allocate(
    m: KVModel, backend: Backend, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"
) -> KVCache:
    """allocate_kv_cache for ``m`` on ``backend`` in ``layout`` (zeroed, as vLLM's)."""
    if backend.mla != (m.num_kv_heads == 1 and m.head_size_v == 0):
        raise ValueError(
            f"backend {backend.name} is {'' if backend.mla else 'not '}MLA; model {m.name} is "
            f"{'' if m.head_size_v == 0 else 'not '}MLA"
        )
    kernel = kernel_block_size(backend, m, layout)
    where = placement(m, num_blocks, layout)
    raw = torch.zeros(where.size, dtype=torch.int8, device=device)
    views = layer_views(raw, m, num_blocks, layout, where, kernel)
    return KVCache(raw, {layer_name(i): v for i, v in enumerate(views)}, layout, kernel, num_blocks)

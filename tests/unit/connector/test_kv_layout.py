"""vLLM 0.32's KV cache layouts: our torch-only replay (tests/support/vllm_kv_cache.py) against vLLM's own
code, and what the connector reads from them (vllm_pd/connector/device/kv_layout.py).

vLLM's side runs its real functions on the CPU - the spec classes, ``customize_attention_spec``,
``get_kv_cache_config_from_groups``, ``prepare_kernel_block_sizes``, ``allocate_kv_cache`` (which
calls ``create_kv_cache_views``) - with the real backend classes of FLASH_ATTN, FLASHINFER,
FLASHMLA, CUTLASS_MLA, TRITON_MLA and CPU_ATTN. Mocked, because they cannot run here: the
``flashinfer`` package (a CUDA library) that vLLM's FlashInfer backend module imports at its
top, and the GPU allocation of CUTLASS_MLA's module-level workspace (made on the meta device);
the backends' own declarations run unchanged. ``current_platform`` is vLLM's CPU
platform: where a backend asks for the GPU's capability, tests/support/vllm_kv_cache.py's table says
what sm_90 answers (see its docstring).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from tests.support import vllm_kv_cache as replay
from vllm_pd.connector.device.kv_layout import KVLayout, block_format, manager_blocks, memory_order_mismatch
from vllm_pd.connector.transport.base import MemoryRegion

NUM_BLOCKS = 3
BACKEND_MODULES = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
    "CUTLASS_MLA": ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLABackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
}
# the model of each backend, at full size, and the block sizes tried: as the model's default, and
# 128 - which FlashInfer (kernel 64) and FlashMLA (kernel 64) split into two kernel blocks
CASES = [
    (name, model, bs)
    for name, model, sizes in (
        ("FLASH_ATTN", "llama3-8b", (16, 128)),
        ("FLASHINFER", "llama3-8b", (16, 128)),
        ("CPU_ATTN", "llama3-8b", (16, 128)),
        ("FLASHMLA", "deepseek-v3", (64, 128)),
        ("CUTLASS_MLA", "deepseek-v3", (64, 128)),
        ("TRITON_MLA", "deepseek-v3", (64, 128)),
    )
    for bs in sizes
]


class _StubPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import flashinfer[...]`` give mock modules, for the one import of vLLM's backend."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "flashinfer" or name.startswith("flashinfer."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        pass


def _empty_off_gpu(*args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.empty, with CUDA allocations made on the meta device (no GPU here)."""
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "meta"
    return _TORCH_EMPTY(*args, **kwargs)


_TORCH_EMPTY = torch.empty


def backend_class(name: str) -> Any:
    module_name, cls = BACKEND_MODULES[name]
    if name == "CUTLASS_MLA":  # allocates its 128 MB workspace on the GPU at import
        with mock.patch.object(torch, "empty", _empty_off_gpu):
            return getattr(importlib.import_module(module_name), cls)
    if name != "FLASHINFER" or importlib.util.find_spec("flashinfer") is not None:
        return getattr(importlib.import_module(module_name), cls)
    stub = _StubPackages()
    sys.meta_path.insert(0, stub)
    try:
        return getattr(importlib.import_module(module_name), cls)
    finally:
        sys.meta_path.remove(stub)
        for key in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
            del sys.modules[key]  # nothing else may take the stubs for a FlashInfer install


def vllm_spec(backend: Any, m: replay.KVModel) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    if m.head_size_v == 0:  # MLAAttention.get_kv_cache_spec
        spec = MLAAttentionSpec(
            block_size=m.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=m.head_size,
            dtype=m.dtype,
            cache_dtype_str="auto",
        )
    else:  # Attention.get_kv_cache_spec
        spec = FullAttentionSpec(
            block_size=m.block_size,
            num_kv_heads=m.num_kv_heads,
            head_size=m.head_size,
            head_size_v=m.head_size_v,
            dtype=m.dtype,
        )
    return customize_attention_spec(backend, spec)


def vllm_allocate(name: str, m: replay.KVModel, layout: KVLayout) -> dict[str, torch.Tensor]:
    """What vLLM 0.32's GPU model runner allocates (and hands register_kv_caches)."""
    from vllm.config import CacheConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

    backend = backend_class(name)
    spec = vllm_spec(backend, m)
    names = [replay.layer_name(i) for i in range(m.num_layers)]
    cache_config = CacheConfig(block_size=m.block_size)
    cache_config.kv_cache_layout = layout.name
    cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config: Any = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)], 1 << 40)
    kernel_sizes = prepare_kernel_block_sizes(kv_cache_config, [[AttentionGroup(backend, names, spec, 0)]])
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout.name], kernel_sizes)


def test_layouts_and_preference_are_vllms() -> None:
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert [(m.name, m.value) for m in KVLayout] == [(m.name, m.value) for m in KVCacheLayout]
    assert [m.name for m in replay.DEFAULT_LAYOUTS] == [m.name for m in _DEFAULT_LAYOUT_PREFERENCE]
    for ours in KVLayout:
        theirs = KVCacheLayout[ours.name]
        assert ours.layer_view_order == theirs.layer_view_order
        assert ours.is_block_outermost == theirs.is_block_outermost
    assert [m.name for m in KVLayout if m.layer_block_contiguous] == ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("name", list(BACKEND_MODULES))
def test_backend_table_is_what_the_backends_declare(name: str) -> None:
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.utils import get_flashinfer_layout_string, get_supported_kv_cache_layouts

    backend, ours = backend_class(name), replay.BACKENDS[name]
    m = replay.model("deepseek-v3" if ours.mla else "llama3-8b")
    declared = backend.get_supported_kernel_block_sizes(vllm_spec(backend, m))
    assert [replay.MultipleOf(s.base) if isinstance(s, MultipleOf) else s for s in declared] == list(
        ours.kernel_block_sizes
    )
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    if name == "FLASHINFER":  # its kernels name the layout NHD / HND: LHBNC has no such name
        layouts = [n for n in layouts if n != "LHBNC"]
        with pytest.raises(AssertionError):
            from vllm.v1.kv_cache_layout import KVCacheLayout

            get_flashinfer_layout_string(KVCacheLayout.LHBNC)
    assert layouts == [layout.name for layout in ours.layouts]
    assert backend.get_name() == name


@pytest.mark.parametrize(("name", "model_name", "block_size"), CASES)
def test_views_are_vllms_tensor_by_tensor(name: str, model_name: str, block_size: int) -> None:
    """Every layout (also those the backend would not pick), split kernel blocks included: the same
    views (shape, strides, storage offset, dtype), or the same refusal."""
    m = replay.model(model_name, block_size=block_size)
    backend = replay.BACKENDS[name]
    for layout in KVLayout:
        try:
            theirs = vllm_allocate(name, m, layout)
        except ValueError as e:
            with pytest.raises(ValueError):
                replay.allocate(m, backend, layout, NUM_BLOCKS)
            assert "block size" in str(e) or "kernel blocks" in str(e)
            continue
        ours = replay.allocate(m, backend, layout, NUM_BLOCKS)
        assert list(ours.views) == list(theirs)
        base_theirs = next(iter(theirs.values())).untyped_storage().nbytes()
        assert ours.raw.untyped_storage().nbytes() == base_theirs
        for layer, t in theirs.items():
            mine = ours.views[layer]
            assert (tuple(mine.shape), mine.stride(), mine.storage_offset(), mine.dtype) == (
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
                t.dtype,
            ), (layout.name, layer)


def test_the_kernel_block_splits_we_rely_on() -> None:
    """Which cases split a block into kernel blocks, and which vLLM refuses (pinned here so a
    change of vLLM's rules shows; the test above checks them against vLLM's code)."""
    llama, ds = replay.model("llama3-8b", block_size=128), replay.model("deepseek-v3", block_size=128)
    fi, flashmla = replay.BACKENDS["FLASHINFER"], replay.BACKENDS["FLASHMLA"]
    assert replay.allocate(llama, fi, KVLayout.LBHNC, 2).ratio == 2
    assert replay.allocate(llama, fi, KVLayout.BLHNC, 2).ratio == 1  # other layers' pages between blocks
    with pytest.raises(ValueError, match="dense, unpadded pages"):
        replay.allocate(llama, fi, KVLayout.LHBNC, 2)  # a block's heads lie apart
    assert replay.allocate(ds, flashmla, KVLayout.LBNHC, 2).ratio == 2
    assert replay.allocate(ds, flashmla, KVLayout.LHBNC, 2).ratio == 2  # one head: still dense pages
    assert replay.allocate(replay.model("llama3-8b"), replay.BACKENDS["FLASH_ATTN"], KVLayout.LBNHC, 2).ratio == 1
    with pytest.raises(ValueError, match="No common block size"):
        replay.allocate(replay.model("deepseek-v3"), replay.BACKENDS["CUTLASS_MLA"], KVLayout.LBNHC, 2)


# -- what the connector reads ------------------------------------------------------------------


def _regions(cache: replay.KVCache) -> list[MemoryRegion]:
    return [MemoryRegion(name, manager_blocks(t, cache.num_blocks)) for name, t in cache.views.items()]


@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda m: m.name)
def test_a_block_is_its_bytes_in_memory_order_and_one_span_where_the_layout_allows(layout: KVLayout) -> None:
    m = replay.model("llama3-8b", layers=3, block_size=32, kv_heads=4)
    cache = replay.allocate(m, replay.BACKENDS["FLASH_ATTN"], layout, 5)
    other = next(m for m in KVLayout if m.layer_view_order != layout.layer_view_order)
    for t in cache.views.values():
        assert memory_order_mismatch(t, layout) is None  # a layer's view shows where B, H, N, C lie
        assert memory_order_mismatch(t, other)
    raw = cache.raw.view(torch.uint8)
    for r in _regions(cache):
        for b in (0, 3):
            spans = r.block_spans(b)
            assert len(spans) == (1 if layout.layer_block_contiguous else m.num_kv_heads)
            assert sum(n for _, n in spans) == r.block_nbytes == m.page_nbytes()
            # the spans' bytes, in order, are the block's wire bytes (byte_blocks / the stream path)
            got = b"".join(bytes(raw[a - raw.data_ptr() : a - raw.data_ptr() + n].numpy()) for a, n in spans)
            assert got == bytes(r.blocks[b].contiguous().view(torch.uint8).reshape(-1).numpy())
    assert all(r.block_contiguous for r in _regions(cache)) == (layout in (KVLayout.LBHNC, KVLayout.LBNHC))


def test_split_kernel_blocks_group_into_manager_blocks() -> None:
    m = replay.model("deepseek-v3", layers=2, block_size=128)
    cache = replay.allocate(m, replay.BACKENDS["FLASHMLA"], KVLayout.LBNHC, 4)
    t = next(iter(cache.views.values()))
    assert t.shape[0] == 8  # kernel blocks
    blocks = manager_blocks(t, 4)
    assert blocks.shape == (4, 2, 1, 64, 576)
    t.view(torch.uint8)[5].fill_(7)  # kernel block 5 = second half of block 2
    assert blocks.view(torch.uint8)[2, 1].eq(7).all() and not blocks.view(torch.uint8)[3].any()
    assert len(MemoryRegion("l", blocks).block_spans(2)) == 1
    with pytest.raises(ValueError, match="does not hold 3 blocks"):
        manager_blocks(t, 3)


def test_block_format_says_what_the_bytes_mean() -> None:
    def fmt(model_name: str, backend: str, layout: KVLayout, block_size: int = 0) -> str:
        m = replay.model(model_name, layers=1, block_size=block_size)
        cache = replay.allocate(m, replay.BACKENDS[backend], layout, 2)
        return block_format(manager_blocks(next(iter(cache.views.values())), 2))

    assert fmt("llama3-8b", "FLASH_ATTN", KVLayout.LBHNC) == "bfloat16:H8.N16.C256"
    assert fmt("llama3-8b", "FLASH_ATTN", KVLayout.LBNHC) == "bfloat16:N16.H8.C256"
    # the same bytes in the same order, heads apart in memory: the same format (peers may differ)
    assert (
        fmt("llama3-8b", "FLASH_ATTN", KVLayout.LHBNC)
        == fmt("llama3-8b", "FLASH_ATTN", KVLayout.BHLNC)
        == (fmt("llama3-8b", "FLASH_ATTN", KVLayout.BLHNC))
    )
    # kernel blocks: token-major pages read as one block of 128 tokens, head-major ones do not
    assert fmt("llama3-8b", "FLASHINFER", KVLayout.LBNHC, 128) == fmt("llama3-8b", "FLASH_ATTN", KVLayout.LBNHC, 128)
    assert fmt("llama3-8b", "FLASHINFER", KVLayout.LBHNC, 128) == "bfloat16:K2.H8.N64.C256"
    assert fmt("llama3-8b", "FLASH_ATTN", KVLayout.LBHNC, 128) == "bfloat16:H8.N128.C256"
    # MLA has one head: every layout, split or not, is the same bytes
    assert {
        fmt("deepseek-v3", b, layout, 128) for b in ("FLASHMLA", "TRITON_MLA", "CUTLASS_MLA") for layout in KVLayout
    } == {"bfloat16:N128.C576"}


# -- the layout the connector asks for, and what its worker registers ---------------------------


@pytest.mark.parametrize("name", list(BACKEND_MODULES))
def test_vllm_resolves_what_the_harness_builds_with_our_connector(name: str) -> None:
    """vLLM's resolve_kv_cache_layout with PDConnector configured and the backend's own supported set:
    LBHNC for attention backends that run it, the backend's first choice for MLA."""
    from vllm.config import CacheConfig, KVTransferConfig
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    backend, ours = backend_class(name), replay.BACKENDS[name]
    config: Any = SimpleNamespace(
        cache_config=CacheConfig(block_size=16),
        model_config=SimpleNamespace(use_mla=ours.mla),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDConnector", kv_role="kv_both", kv_connector_module_path="vllm_pd.connector.connector"
        ),
    )
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    assert resolve_kv_cache_layout(config, [supported]).name == replay.resolved_layout(ours).name
    assert config.cache_config.kv_cache_layout == replay.resolved_layout(ours).name  # what the workers adopt


def test_where_lbhnc_is_not_run_vllm_takes_the_backends_choice() -> None:
    from vllm.config import CacheConfig, KVTransferConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    config: Any = SimpleNamespace(
        cache_config=CacheConfig(block_size=16),
        model_config=SimpleNamespace(use_mla=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDConnector", kv_role="kv_both", kv_connector_module_path="vllm_pd.connector.connector"
        ),
    )
    assert resolve_kv_cache_layout(config, [["BLHNC", "BLNHC"]]).name == "BLHNC"


def _worker() -> Any:
    from vllm_pd.connector.config import PDConnectorConfig
    from vllm_pd.connector.worker.worker import PDConnectorWorker

    config = PDConnectorConfig.from_extra_config({"transport": "tcp", "host": "127.0.0.1", "bind_host": "127.0.0.1"})
    return PDConnectorWorker(config, block_size=128, tp_rank=0, base_port=0, is_producer=True, is_consumer=False)


def test_the_worker_registers_the_schedulers_blocks_and_reports_their_format(caplog: pytest.LogCaptureFixture) -> None:
    m = replay.model("deepseek-v3", layers=2, block_size=128)
    cache = replay.allocate(m, replay.BACKENDS["FLASHMLA"], KVLayout.LBNHC, 6)
    worker = _worker()
    try:
        with caplog.at_level("WARNING"):
            worker.register_kv_caches(cache.views, 6, kv_layout="LBNHC")
        assert [r.num_blocks for r in worker.regions] == [6, 6]  # not the 12 kernel blocks
        assert worker.regions[0].block_nbytes == m.page_nbytes()
        assert worker.kv_format == "bfloat16:N128.C576"
        assert "not in vLLM's" not in caplog.text
    finally:
        worker.shutdown()
    llama = replay.allocate(replay.model("llama3-8b", layers=2), replay.BACKENDS["FLASH_ATTN"], KVLayout.LBNHC, 4)
    worker = _worker()
    try:
        with caplog.at_level("WARNING"):
            worker.register_kv_caches(llama.views, 4, kv_layout="LBHNC")  # not what the strides say
        assert "is not in vLLM's LBHNC layout" in caplog.text
        assert worker.kv_format == "bfloat16:N16.H8.C256"  # the strides rule
    finally:
        worker.shutdown()

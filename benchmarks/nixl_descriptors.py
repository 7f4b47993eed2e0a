"""NIXL descriptors per layer for one request, in each of vLLM 0.32's KV cache layouts: before and now.

Builds KV exactly as vLLM 0.32 allocates it (tests/support/vllm_kv_cache.py) for a Llama-3-8B-shaped
model (8 KV heads of 128, bf16, 16-token blocks; FLASH_ATTN) and a DeepSeek-V3-shaped one
(MLA, 576 bf16, 64-token blocks; FLASHMLA, and 128-token blocks split into two kernel blocks),
and counts the descriptors a transfer of 8 blocks posts per layer - ids adjacent on both
sides, and scattered - as the nixl transport builds them (nixl_regions.block_pairs):

* before: a block's spans in the logical order of vLLM's ``[B, H, N, C]`` view (what the
  connector did: ``tensor_spans(view[b])``); a split kernel block made ``block_dim()`` raise.
* now: a block's bytes in memory order (``MemoryRegion.blocks``), kernel blocks grouped.

No NIXL agent is needed: the descriptor list is what the agent is handed.
Usage: python3 benchmarks/nixl_descriptors.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import vllm_kv_cache as replay
from vllm_pd.connector.device.kv_layout import KVLayout, manager_blocks
from vllm_pd.connector.transport.base import MemoryRegion, tensor_spans
from vllm_pd.connector.transport.nixl_regions import block_pairs, merge_pairs, region_layout

NUM_BLOCKS = 32
ADJACENT = (np.arange(4, 12), np.arange(20, 28))
SCATTERED = (np.array([0, 3, 6, 9, 13, 17, 22, 30]), np.array([1, 5, 2, 8, 12, 31, 27, 16]))


def before(view: object, ids: tuple[np.ndarray, np.ndarray]) -> tuple[int, int]:
    """(descriptors, bytes each) of the old path: logical-order spans, both sides alike."""
    t = view  # vLLM's [B, H, N, C] view; the old block_dim() found B at dim 0
    spans = [tensor_spans(t[int(b)]) for b in ids[0]]  # type: ignore[index]
    theirs = [tensor_spans(t[int(b)]) for b in ids[1]]  # type: ignore[index]
    per_block = len(spans[0])
    local = np.array([[a for a, _ in s] for s in spans]).T.reshape(-1)  # span-major, as RegionLayout.spans
    remote = np.array([[a for a, _ in s] for s in theirs]).T.reshape(-1) + (1 << 40)  # another process
    lengths = np.array([[n for _, n in s] for s in spans]).T.reshape(-1)
    merged = merge_pairs(local, remote, lengths)[0]
    return len(merged), int(lengths.sum()) // len(merged) if per_block else 0


def now(here: MemoryRegion, there: MemoryRegion, ids: tuple[np.ndarray, np.ndarray]) -> tuple[int, int]:
    local, _, lengths = block_pairs(region_layout(here), ids[0], region_layout(there), ids[1])
    return len(local), int(lengths.sum()) // len(local)


def main() -> None:
    cases = [("llama3-8b", "FLASH_ATTN", 0), ("deepseek-v3", "FLASHMLA", 0), ("deepseek-v3", "FLASHMLA", 128)]
    print("descriptors per layer for 8 blocks (bytes each), ids adjacent / scattered on both sides")
    print(
        "| model, backend, block | layout | kernel blocks | before: adjacent | before: scattered "
        "| now: adjacent | now: scattered |"
    )
    print("|---|---|---|---|---|---|---|")
    for model, backend, block_size in cases:
        m = replay.model(model, layers=2, block_size=block_size)
        for layout in KVLayout:
            try:
                caches = [replay.allocate(m, replay.BACKENDS[backend], layout, NUM_BLOCKS) for _ in range(2)]
            except ValueError:
                print(f"| {model}, {backend}, {m.block_size} | {layout.name} | - | vLLM refuses | | | |")
                continue
            views = [next(iter(c.views.values())) for c in caches]
            regions = [MemoryRegion("l0", manager_blocks(v, NUM_BLOCKS)) for v in views]
            ratio = caches[0].ratio
            old = (
                [f"{n} ({b} B)" for n, b in (before(views[0], ADJACENT), before(views[0], SCATTERED))]
                if ratio == 1
                else ["block_dim() raised"] * 2
            )
            new = [f"{n} ({b} B)" for n, b in (now(*regions, ADJACENT), now(*regions, SCATTERED))]
            print(
                f"| {model}, {backend}, {m.block_size} | {layout.name} | {ratio} | {old[0]} | {old[1]} "
                f"| {new[0]} | {new[1]} |"
            )


if __name__ == "__main__":
    main()

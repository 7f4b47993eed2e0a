"""The store for a model with several attention KV cache groups (vLLM's hybrid KV cache manager):
each group's identity, and the store hit all groups agree on (vLLM-free).

Every group is stored apart, as vLLM's hybrid prefix cache keeps it: its own keys (the salt names
the group: kind, window, block size and layer names, the same on every instance of the model),
its own pool slots (its layers only) and index. A hit of ``h`` blocks needs, in a full-attention
group, every block before ``h``; in a sliding-window group only the blocks of the window that
ends at ``h`` (``cdiv(window - 1, block_size)`` of them, vLLM's
``SlidingWindowManager.find_longest_cache_hit``; vLLM nulls the others when it allocates). The
hit is the longest ``h`` every group holds whole: a group missing a block makes it shorter,
never partial. A recurrent state (Mamba) group is not stored: its state after a prefix is one
block rewritten every step, so a prefix's state exists only at the prompt's end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.protocol.kv_shape import KVGroup

NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): the id of a position a window freed


@dataclass(frozen=True)
class StoreGroup:
    """One KV cache group as the store keys it."""

    kind: str  # "full" or "window" (kv_shape.GroupKind; "state" is never stored)
    block_size: int
    window: int  # sliding window in tokens (kind "window"), else 0
    layers: tuple[str, ...]  # the group's layer names, in vLLM's order

    @classmethod
    def of(cls, group: KVGroup, layers: Sequence[str]) -> StoreGroup:
        return cls(group.kind, group.block_size, group.window if group.kind == "window" else 0, tuple(layers))

    @property
    def identity(self) -> str:
        """Goes into the group's key salt: stable across instances of the same model."""
        return f"group={self.kind}/window={self.window}/block={self.block_size}/layers={','.join(self.layers)}"

    @property
    def window_blocks(self) -> int:
        """Blocks a hit needs at its end in a window group (vLLM: ``cdiv(window - 1, block_size)``)."""
        return -(-(self.window - 1) // self.block_size)

    def needed(self, hit_blocks: int, first_block: int = 0) -> range:
        """The block positions a hit of ``hit_blocks`` loads beyond the ``first_block`` vLLM has."""
        if self.kind == "window":
            return range(max(first_block, hit_blocks - self.window_blocks), hit_blocks)
        return range(first_block, hit_blocks)


def owner(group: int) -> str:
    """Who holds a finished request's blocks while group ``group``'s save copies them (the
    single-group store's name for group 0)."""
    return "store" if group == 0 else f"store{group}"


def group_config(config: StoreConfig, group: StoreGroup, total_layers: int) -> StoreConfig:
    """A group's share of the store's memory and disk, by its layers (so every group gets as many
    slots); no master: the master and the router look up whole prefixes of one group."""

    def share(nbytes: int) -> int:
        return nbytes * len(group.layers) // total_layers

    return dataclasses.replace(
        config,
        cpu_bytes=share(config.cpu_bytes),
        disk_bytes=share(config.disk_bytes),
        host_bounce_bytes=share(config.host_bounce_bytes),
        master=None,
    )


def first_held(block_ids: Sequence[int]) -> int:
    """The first block position vLLM did not null (a window frees the ones behind it)."""
    return next((p for p, b in enumerate(block_ids) if b != NULL_BLOCK), len(block_ids))


def why_not_stored(groups: Sequence[KVGroup]) -> str:
    """Why the store cannot keep these KV cache groups ("" = it can)."""
    kinds = {g.kind for g in groups}
    if "state" in kinds:
        return "a recurrent state group (its state exists only at a prompt's end, not after each prefix block)"
    if not kinds <= {"full", "window"}:
        return f"KV cache groups of kinds {sorted(kinds)}"
    if len({g.block_size for g in groups}) > 1:
        return f"KV cache groups of block sizes {sorted({g.block_size for g in groups})}"
    return ""


def agreed_hit(groups: Sequence[StoreGroup], present: Sequence[Sequence[bool]], first_block: int = 0) -> int:
    """The longest hit, in blocks, that every group holds whole: ``present[g][p]`` says whether
    group ``g`` holds block position ``p`` (all lists as long as the prompt's full blocks). At most
    ``first_block`` (what vLLM already has) when no longer hit is held."""
    n = min((len(p) for p in present), default=0)
    runs = [_runs_ending(p, n) for p in present]
    for h in range(n, first_block, -1):
        if all(run[h] >= len(g.needed(h, first_block)) for g, run in zip(groups, runs)):
            return h
    return min(first_block, n)


def _runs_ending(present: Sequence[bool], n: int) -> list[int]:
    """``runs[h]``: how many positions just before ``h`` are present in a row."""
    runs = [0] * (n + 1)
    for p in range(n):
        runs[p + 1] = runs[p] + 1 if present[p] else 0
    return runs

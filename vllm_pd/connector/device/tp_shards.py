"""vLLM's rule for sharding a model's units (KV heads, Mamba heads and groups) over TP ranks. Pure Python.

With TP ``t`` over ``K`` units, rank ``r`` holds units ``[r*K/t, (r+1)*K/t)`` when ``t <= K``,
else the one unit ``r*K // t`` (replicated on ``t/K`` ranks): attention's KV heads
(``kv_geometry``) and a recurrent state's heads and groups (``state_geometry``) alike.
"""

from __future__ import annotations


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> range:
    """The units (KV heads) TP rank ``rank`` of ``tp_size`` holds (vLLM's sharding, replicated
    units where there are more ranks than units)."""
    if tp_size <= kv_heads:
        per = kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    first = rank * kv_heads // tp_size
    return range(first, first + 1)


def shardable(kv_heads: int, tp_size: int) -> bool:
    """Whether vLLM shards ``kv_heads`` units over ``tp_size`` ranks (one divides the other)."""
    return kv_heads > 0 and tp_size > 0 and (kv_heads % tp_size == 0 or tp_size % kv_heads == 0)


def holders(units: int, tp_size: int, unit: int) -> list[int]:
    """The TP ranks of ``tp_size`` that hold ``unit`` of ``units``."""
    return [r for r in range(tp_size) if unit in rank_heads(units, tp_size, r)]

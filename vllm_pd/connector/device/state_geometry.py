"""How a decode rank takes its recurrent state block (Mamba, linear attention) from prefill ranks of
another TP size: byte windows of their state blocks. Pure Python: no torch, no vLLM.

vLLM shards a Mamba-2 layer's state by parts, each its own way: the SSM state ``[heads, head dim,
state size]`` by heads; the conv state's channels, the concatenation ``x | B | C`` of three
sub-projections, each sub-projection apart - ``x`` by heads, ``B`` and ``C`` by groups (every rank
holds the one group of a model with one: replicated). In vLLM's default conv layout ("SD",
``[kernel - 1, channels]``) each of the ``kernel - 1`` rows holds a rank's ``x | B | C`` shares; in
"DS" (``[channels, kernel - 1]``) the shares are one run each. A :class:`StateLayout`
(``protocol/kv_shape.py``) says this of a model; :func:`state_windows` gives decode rank ``d`` of TP
``n`` the windows of prefill ranks' blocks (TP ``m``) that make its own block, byte for byte: for each
unit (head, group) it holds, the one prefill rank it reads it from - a replicated unit is read once,
from one of its holders (spread over decode ranks), never summed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_pd.connector.device.tp_shards import holders, rank_heads, shardable
from vllm_pd.protocol.kv_shape import StateLayout, StatePart


@dataclass(frozen=True)
class StateWindow:
    """Bytes ``[src_offset, src_offset + nbytes)`` of prefill rank ``source``'s state block land at
    ``dst_offset`` of ours."""

    source: int  # prefill TP rank
    src_offset: int
    dst_offset: int
    nbytes: int


def row_nbytes(part: StatePart, tp_size: int) -> int:
    """One row of ``part`` on a rank of TP ``tp_size`` (every rank holds as many units)."""
    return sum(len(rank_heads(s.shards, tp_size, 0)) * s.unit_nbytes for s in part.segments)


def state_nbytes(layout: StateLayout, tp_size: int) -> int:
    """A rank's state block of TP ``tp_size``, in bytes."""
    return sum(p.rows * row_nbytes(p, tp_size) for p in layout.parts)


def state_incompatibility(
    remote: StateLayout | None, local: StateLayout | None, remote_tp: int, local_tp: int
) -> str | None:
    """Why decode's state of ``local`` layout at TP ``local_tp`` cannot be taken from prefill's, or None."""
    if remote is None or local is None:
        side = "prefill's" if remote is None else "ours"
        return (
            f"recurrent state moves between equal shapes only where a side does not tell its state's shard "
            f"layout ({side} not known: a state kind vllm-pd does not cut, or an older vllm-pd)"
        )
    if remote != local:
        return f"prefill's state is laid out and sharded as {remote}, ours as {local} (another model or conv layout?)"
    for part in local.parts:
        for s in part.segments:
            if not (shardable(s.shards, remote_tp) and shardable(s.shards, local_tp)):
                return (
                    f"{local.kind} state: {s.shards} units of {s.unit_nbytes} bytes do not shard over prefill "
                    f"TP {remote_tp} and decode TP {local_tp}"
                )
    return None


def state_windows(layout: StateLayout, remote_tp: int, local_tp: int, rank: int) -> tuple[StateWindow, ...]:
    """The windows of prefill's state blocks (TP ``remote_tp``) that make decode rank ``rank``'s (TP
    ``local_tp``), in our block's order: they cover our block once, byte for byte. Windows that continue
    each other on both sides merge."""
    windows: list[StateWindow] = []
    src_part = dst_part = 0
    for part in layout.parts:
        src_row, dst_row = row_nbytes(part, remote_tp), row_nbytes(part, local_tp)
        for row in range(part.rows):
            src_seg, dst_seg = src_part + row * src_row, dst_part + row * dst_row
            for seg in part.segments:
                mine = rank_heads(seg.shards, local_tp, rank)
                for i, unit in enumerate(mine):
                    have = holders(seg.shards, remote_tp, unit)
                    source = have[rank % len(have)]
                    src = src_seg + (unit - rank_heads(seg.shards, remote_tp, source).start) * seg.unit_nbytes
                    _append(windows, StateWindow(source, src, dst_seg + i * seg.unit_nbytes, seg.unit_nbytes))
                src_seg += len(rank_heads(seg.shards, remote_tp, 0)) * seg.unit_nbytes
                dst_seg += len(mine) * seg.unit_nbytes
        src_part += part.rows * src_row
        dst_part += part.rows * dst_row
    return tuple(windows)


def _append(windows: list[StateWindow], w: StateWindow) -> None:
    last = windows[-1] if windows else None
    if (
        last is not None
        and last.source == w.source
        and last.src_offset + last.nbytes == w.src_offset
        and last.dst_offset + last.nbytes == w.dst_offset
    ):
        windows[-1] = StateWindow(last.source, last.src_offset, last.dst_offset, last.nbytes + w.nbytes)
    else:
        windows.append(w)

"""A recurrent state group's shard layout (``kv_shape.StateLayout``) from vLLM's description of it:
one rank's state shapes and dtypes (its ``MambaSpec``), the model's B/C groups (its config) and
vLLM's conv state layout ("SD" ``[kernel - 1, channels]``, its default, or "DS" transposed).

Mamba-2 (NemotronH, Granite 4, Bamba, Falcon-H1, Zamba2, Mamba2) and Mamba-1 states are cut across
TP (``state_geometry``); other states (gated delta net, short conv, linear attention) get no layout
and move between equal shapes only. Shapes that do not decompose as vLLM's Mamba layers make them
get none either (never a guessed layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_pd.connector.device.tp_shards import rank_heads, shardable
from vllm_pd.protocol.kv_shape import StateLayout, StatePart, StateSegment
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# where a model's config names its Mamba-2 B/C groups (vLLM's model files read these)
GROUP_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def mamba_state_layout(
    mamba_type: str,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    tp_size: int,
    n_groups: int | None,
    dim_first: bool,
) -> StateLayout | None:
    """The layout of a Mamba layer's state whose rank of TP ``tp_size`` holds ``shapes`` (conv state,
    then SSM state) of ``dtypes``; ``n_groups``: the model's B/C groups (Mamba-2; None: not known);
    ``dim_first``: the conv state is "DS". None where vllm-pd does not cut it."""
    if len(shapes) != 2 or len(dtypes) != 2 or len(shapes[0]) != 2:
        return None
    channels, rows = (shapes[0][0], shapes[0][1]) if dim_first else (shapes[0][1], shapes[0][0])
    ci, si = dtypes[0].itemsize, dtypes[1].itemsize
    # a conv channel's bytes in one row (SD: rows of every channel) or in its one run (DS: all rows)
    channel = ci * (rows if dim_first else 1)
    conv_rows = 1 if dim_first else rows

    def conv(segments: list[tuple[int, int]]) -> StatePart:
        return StatePart(_name(dtypes[0]), conv_rows, tuple(StateSegment(n, w * channel) for n, w in segments))

    if mamba_type == "MAMBA2" and len(shapes[1]) == 3:
        heads_local, head_dim, d_state = shapes[1]
        groups_width = channels - heads_local * head_dim  # B and C: 2 x local groups x d_state
        if groups_width <= 0 or groups_width % (2 * d_state):
            return None
        local_groups = groups_width // (2 * d_state)
        groups = n_groups if n_groups is not None else (local_groups if tp_size == 1 else None)
        if groups is None or not shardable(groups, tp_size) or len(rank_heads(groups, tp_size, 0)) != local_groups:
            return None
        heads = heads_local * tp_size
        return StateLayout(
            "mamba2",
            (
                conv([(heads, head_dim), (groups, d_state), (groups, d_state)]),
                StatePart(_name(dtypes[1]), 1, (StateSegment(heads, head_dim * d_state * si),)),
            ),
        )
    if mamba_type == "MAMBA1" and len(shapes[1]) == 2 and shapes[1][0] == channels:
        inner = channels * tp_size
        return StateLayout(
            "mamba1",
            (conv([(inner, 1)]), StatePart(_name(dtypes[1]), 1, (StateSegment(inner, shapes[1][1] * si),))),
        )
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_layout(spec: Any, vllm_config: Any) -> StateLayout | None:
    """The layout of vLLM's ``MambaSpec`` ``spec`` in an instance of ``vllm_config`` (None: not cut)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    config = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    n_groups = next((int(v) for k in GROUP_KEYS if isinstance(v := getattr(config, k, None), int)), None)
    tp_size = vllm_config.parallel_config.tensor_parallel_size if vllm_config is not None else 1
    if getattr(spec, "tp_replicated", False):
        return None  # every rank holds the whole state: equal shapes only (not cut yet)
    layout = mamba_state_layout(mamba_type, spec.shapes, spec.dtypes, tp_size, n_groups, is_conv_state_dim_first())
    if layout is None:
        logger.info(
            "PD connector: a %s state of shapes %s is moved between equal TP and block sizes only",
            mamba_type,
            spec.shapes,
        )
    return layout

"""Which KV cache group each of a worker's layers belongs to, and which of a request's blocks
each group moves (the worker side of :mod:`kv_geometry`; vLLM-free).

vLLM's hybrid KV cache manager gives every group its own blocks (and block size): full
attention keeps every block of the prompt; a sliding window frees the blocks behind it, so
only those its window keeps at the end of the prompt move (the others are never read again,
and vLLM may reuse them while the prompt is still computing); a recurrent state group holds
one state, rewritten every step, which moves once the prompt is computed. Without a shape
(a worker nobody told, the tests' and the harness's) every layer is one full-attention group.
"""

from __future__ import annotations

from vllm_pd.connector.device.kv_geometry import window_positions
from vllm_pd.connector.step_specs import SendSpec
from vllm_pd.protocol.kv_shape import KVGroup, KVShape


class LayerGroups:
    def __init__(self, shape: KVShape | None, num_layers: int, block_size: int) -> None:
        if shape is not None and len(shape.layer_groups) != num_layers:
            raise ValueError(f"KV shape names the groups of {len(shape.layer_groups)} layers, {num_layers} registered")
        self.shape = shape
        self._layer_groups = shape.layer_groups if shape is not None else (0,) * num_layers
        self._block_size = block_size

    @property
    def num_groups(self) -> int:
        return len(self.shape.groups) if self.shape is not None else 1

    def group(self, layer: int) -> int:
        return self._layer_groups[layer]

    def kv_group(self, group: int) -> KVGroup:
        if self.shape is None:
            return KVGroup("full", self._block_size, "")
        return self.shape.groups[group]

    def block_size(self, group: int) -> int:
        return self.kv_group(group).block_size

    def layers(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self._layer_groups) if g == group]

    def kept_positions(self, group: int, num_tokens: int) -> range:
        """The block positions of a prompt of ``num_tokens`` whose KV moves."""
        g = self.kv_group(group)
        return range(window_positions(g, num_tokens), -(-num_tokens // g.block_size))

    def send_positions(self, spec: SendSpec, group: int) -> range:
        """The positions of ``group`` a step of ``spec`` sends: those it computed (a partial block
        again), of the blocks kept at the end of the prompt; a state only with the prompt's end."""
        g = self.kv_group(group)
        kept = self.kept_positions(group, spec.num_prompt_tokens)
        if g.kind == "state":
            return kept if spec.prefill_done else range(0)
        first = max(kept.start, spec.first_token // g.block_size)
        return range(first, min(kept.stop, -(-spec.end_token // g.block_size)))

    def held_blocks(self, spec: SendSpec) -> list[list[int]]:
        """Per layer, the blocks decode may read of a computed prompt (its kept positions)."""
        by_group = []
        for group in range(self.num_groups):
            ids = spec.group_blocks(group)
            by_group.append([ids[p] for p in self.kept_positions(group, spec.num_prompt_tokens) if p < len(ids)])
        return [by_group[g] for g in self._layer_groups]

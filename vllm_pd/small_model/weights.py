"""Seeded random weights under the tensor names vLLM's Llama / DeepSeek-V2 loaders expect."""

from __future__ import annotations

import math

import torch

from vllm_pd.small_model.spec import ModelSpec

# Embedding / lm_head scales: a large lm_head spreads the logits so greedy decoding has wide
# top-1 margins (random models otherwise have near-ties that flip under bf16 batch-shape noise).
EMBED_STD = 1.0
LM_HEAD_GAIN = 4.0


def _linear(gen: torch.Generator, out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
    # std 1/sqrt(fan_in): each layer changes the residual stream as much as the embedding, so the
    # output depends on the whole context (and on a correctly transferred KV cache), not just the last token
    return torch.randn(out_dim, in_dim, generator=gen) * (gain / math.sqrt(in_dim))


def _attention_llama(spec: ModelSpec, gen: torch.Generator, p: str) -> dict[str, torch.Tensor]:
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return {
        f"{p}.q_proj.weight": _linear(gen, q_out, spec.hidden, gain=2.0),
        f"{p}.k_proj.weight": _linear(gen, kv_out, spec.hidden, gain=2.0),
        f"{p}.v_proj.weight": _linear(gen, kv_out, spec.hidden),
        f"{p}.o_proj.weight": _linear(gen, spec.hidden, q_out),
    }


def _attention_mla(spec: ModelSpec, gen: torch.Generator, p: str) -> dict[str, torch.Tensor]:
    qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    t: dict[str, torch.Tensor] = {}
    if spec.q_lora_rank is None:
        t[f"{p}.q_proj.weight"] = _linear(gen, spec.heads * qk_head, spec.hidden, gain=2.0)
    else:
        t[f"{p}.q_a_proj.weight"] = _linear(gen, spec.q_lora_rank, spec.hidden)
        t[f"{p}.q_a_layernorm.weight"] = torch.ones(spec.q_lora_rank)
        t[f"{p}.q_b_proj.weight"] = _linear(gen, spec.heads * qk_head, spec.q_lora_rank, gain=2.0)
    t[f"{p}.kv_a_proj_with_mqa.weight"] = _linear(gen, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.hidden)
    t[f"{p}.kv_a_layernorm.weight"] = torch.ones(spec.kv_lora_rank)
    t[f"{p}.kv_b_proj.weight"] = _linear(
        gen, spec.heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, gain=2.0)
    t[f"{p}.o_proj.weight"] = _linear(gen, spec.hidden, spec.heads * spec.v_head_dim)
    return t


def make_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """All tensors in bfloat16, a pure function of ``spec`` (including its seed)."""
    gen = torch.Generator().manual_seed(spec.seed)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(spec.vocab, spec.hidden, generator=gen) * EMBED_STD,
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        attn = _attention_llama if spec.arch == "llama" else _attention_mla
        t.update(attn(spec, gen, f"{p}.self_attn"))
        t[f"{p}.mlp.gate_proj.weight"] = _linear(gen, spec.intermediate, spec.hidden)
        t[f"{p}.mlp.up_proj.weight"] = _linear(gen, spec.intermediate, spec.hidden)
        t[f"{p}.mlp.down_proj.weight"] = _linear(gen, spec.hidden, spec.intermediate)
        t[f"{p}.input_layernorm.weight"] = torch.ones(spec.hidden)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(spec.hidden)
    t["model.norm.weight"] = torch.ones(spec.hidden)
    t["lm_head.weight"] = _linear(gen, spec.vocab, spec.hidden, gain=LM_HEAD_GAIN)
    return {name: w.to(torch.bfloat16).contiguous() for name, w in t.items()}

"""Seeded random weights under the tensor names vLLM's Llama / DeepSeek-V2 / NemotronH loaders expect."""

from __future__ import annotations

import math

import torch

from vllm_pd.small_model.spec import MAMBA_HEAD_DIM, MAMBA_STATE, ModelSpec

# Random-weight models have flat logits whose near-ties flip under bf16 batch-shape noise, which
# would make "disaggregated == single instance" greedy comparisons flaky. The Llama model is
# therefore built as a noisy "copy" circuit: layer 0's head 0 attends sharply (large random q/k)
# to one earlier position s* and writes a 64-dim projection of that token's embedding into the
# residual stream, scaled by COPY_GAIN; lm_head row j reads the same projection of the embedding
# of token perm(j). The winner perm^-1(x[s*]) then leads by ~COPY_GAIN x the runner-up, so greedy
# outputs are stable, yet they depend on the keys of the whole context (a wrong KV cache changes them).
# Every other weight is random but small (NOISE_GAIN), so the model still computes everything.
COPY_GAIN = 3.0
QK_GAIN = 4.0
NOISE_GAIN = 0.1
LM_HEAD_SCALE = 0.25
# nemotron_h: the copy layer's query is the last token's residual after a Mamba layer, so the Mamba
# state decides which position it copies from (a wrong state changes the answer); MAMBA_GAIN makes
# the first Mamba layer's output as large as the embedding. Later Mamba layers are noise.
MAMBA_GAIN = 1.0
MAMBA_DT = 0.05  # each head's step: the state forgets over some 20 tokens


def _linear(gen: torch.Generator, out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_dim, in_dim, generator=gen) * (gain / math.sqrt(in_dim))


def _orthonormal_rows(gen: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(dim, rows, generator=gen))
    return q.T.contiguous()  # (rows, dim), orthonormal rows


def _attention_llama(
    spec: ModelSpec, gen: torch.Generator, p: str, proj: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Attention of one layer; ``proj`` (head_dim x hidden) makes it the copy layer."""
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    v = _linear(gen, kv_out, spec.hidden, gain=NOISE_GAIN)
    o = _linear(gen, spec.hidden, q_out, gain=NOISE_GAIN)
    if proj is not None:
        v[: spec.head_dim] = proj  # kv head 0 carries proj(embedding)
        o[:, : spec.head_dim] = COPY_GAIN * proj.T  # only query head 0 writes it back
    return {
        f"{p}.q_proj.weight": _linear(gen, q_out, spec.hidden, gain=QK_GAIN),
        f"{p}.k_proj.weight": _linear(gen, kv_out, spec.hidden, gain=QK_GAIN),
        f"{p}.v_proj.weight": v,
        f"{p}.o_proj.weight": o,
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
        gen, spec.heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, gain=2.0
    )
    t[f"{p}.o_proj.weight"] = _linear(gen, spec.hidden, spec.heads * spec.v_head_dim)
    return t


def _mamba2(spec: ModelSpec, gen: torch.Generator, p: str, gain: float) -> dict[str, torch.Tensor]:
    """A Mamba-2 mixer (vLLM's MambaMixer2 names; one group, expand 1, conv kernel 4)."""
    heads, inner = spec.hidden // MAMBA_HEAD_DIM, spec.hidden
    conv_dim = inner + 2 * MAMBA_STATE
    return {
        f"{p}.in_proj.weight": _linear(gen, 2 * inner + 2 * MAMBA_STATE + heads, spec.hidden),
        f"{p}.conv1d.weight": torch.randn(conv_dim, 1, 4, generator=gen) * 0.5,
        f"{p}.conv1d.bias": torch.zeros(conv_dim),
        f"{p}.dt_bias": torch.full((heads,), math.log(math.expm1(MAMBA_DT))),  # softplus(dt_bias) = MAMBA_DT
        f"{p}.A_log": torch.log(torch.arange(1, heads + 1, dtype=torch.float32)),
        f"{p}.D": torch.ones(heads),
        f"{p}.norm.weight": torch.ones(inner),
        f"{p}.out_proj.weight": _linear(gen, spec.hidden, inner, gain=gain),
    }


def _nemotron_h_layers(spec: ModelSpec, gen: torch.Generator, proj: torch.Tensor) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {}
    first_mamba, first_attention = spec.layer_pattern.find("M"), spec.layer_pattern.find("*")
    for i, kind in enumerate(spec.layer_pattern):
        p = f"backbone.layers.{i}"
        t[f"{p}.norm.weight"] = torch.ones(spec.hidden)
        if kind == "M":
            t.update(_mamba2(spec, gen, f"{p}.mixer", MAMBA_GAIN if i == first_mamba else NOISE_GAIN))
        elif kind == "*":
            t.update(_attention_llama(spec, gen, f"{p}.mixer", proj if i == first_attention else None))
        else:
            t[f"{p}.mixer.up_proj.weight"] = _linear(gen, spec.intermediate, spec.hidden)
            t[f"{p}.mixer.down_proj.weight"] = _linear(gen, spec.hidden, spec.intermediate, gain=NOISE_GAIN)
    t["backbone.norm_f.weight"] = torch.ones(spec.hidden)
    return t


def make_weights(spec: ModelSpec, special_ids: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """All tensors in bfloat16, a pure function of ``spec`` (including its seed).

    ``special_ids`` get zero lm_head rows so greedy decoding never emits them (no early EOS).
    """
    gen = torch.Generator().manual_seed(spec.seed)
    embed = torch.randn(spec.vocab, spec.hidden, generator=gen)
    proj = _orthonormal_rows(gen, spec.head_dim, spec.hidden) if spec.arch != "deepseek_v2" else None
    if spec.arch == "nemotron_h":
        assert proj is not None
        t = {"backbone.embeddings.weight": embed, **_nemotron_h_layers(spec, gen, proj)}
        return _with_lm_head(spec, gen, t, embed, proj, special_ids)
    t = {"model.embed_tokens.weight": embed}
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        if spec.arch == "llama":
            t.update(_attention_llama(spec, gen, f"{p}.self_attn", proj if i == 0 else None))
        else:
            t.update(_attention_mla(spec, gen, f"{p}.self_attn"))
        t[f"{p}.mlp.gate_proj.weight"] = _linear(gen, spec.intermediate, spec.hidden)
        t[f"{p}.mlp.up_proj.weight"] = _linear(gen, spec.intermediate, spec.hidden)
        t[f"{p}.mlp.down_proj.weight"] = _linear(gen, spec.hidden, spec.intermediate, gain=NOISE_GAIN)
        t[f"{p}.input_layernorm.weight"] = torch.ones(spec.hidden)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(spec.hidden)
    t["model.norm.weight"] = torch.ones(spec.hidden)
    return _with_lm_head(spec, gen, t, embed, proj, special_ids)


def _with_lm_head(
    spec: ModelSpec,
    gen: torch.Generator,
    t: dict[str, torch.Tensor],
    embed: torch.Tensor,
    proj: torch.Tensor | None,
    special_ids: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    if proj is not None:
        perm = torch.randperm(spec.vocab, generator=gen)
        t["lm_head.weight"] = LM_HEAD_SCALE * (embed[perm] @ proj.T @ proj)
    else:
        t["lm_head.weight"] = _linear(gen, spec.vocab, spec.hidden, gain=4.0)
    if special_ids:
        t["lm_head.weight"][list(special_ids)] = 0.0
    return {name: w.to(torch.bfloat16).contiguous() for name, w in t.items()}

"""A PEFT-format LoRA adapter for a small Llama model, that vLLM serves with ``--enable-lora``.

``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's own names:
``base_model.model.<module>.lora_A.weight`` (r x in) and ``.lora_B.weight`` (out x r)),
random and seeded. The adapter changes layer 0's query and key projections by
about as much as their own weights (weights.py's copy circuit): the sharp
attention head then attends to another earlier position, so the adapter's
greedy answers differ from the base model's while keeping the base model's
wide margins (stable under batch-shape noise), and its KV cache differs from
the base model's for the same tokens, which is what the isolation tests need
(KV computed with the adapter, served to the base model, changes the answer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from vllm_pd.small_model.spec import LoraSpec, ModelSpec, ModelSpecError
from vllm_pd.small_model.weights import QK_GAIN

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TARGETS = ("q_proj", "k_proj")  # of layer 0's self_attn (vLLM packs them into qkv_proj)


def make_lora_weights(spec: ModelSpec, lora: LoraSpec) -> dict[str, torch.Tensor]:
    """lora_A / lora_B of each target, a pure function of both specs; B @ A has the scale of the base q/k."""
    if spec.arch != "llama":
        raise ModelSpecError(f"--lora: only the llama arch has an adapter, got --arch {spec.arch}")
    gen = torch.Generator().manual_seed(lora.seed)
    out_dims = {"q_proj": spec.heads * spec.head_dim, "k_proj": spec.kv_heads * spec.head_dim}
    t: dict[str, torch.Tensor] = {}
    for target in TARGETS:
        p = f"base_model.model.model.layers.0.self_attn.{target}"
        t[f"{p}.lora_A.weight"] = torch.randn(lora.rank, spec.hidden, generator=gen) / math.sqrt(spec.hidden)
        t[f"{p}.lora_B.weight"] = torch.randn(out_dims[target], lora.rank, generator=gen) * (
            QK_GAIN / math.sqrt(lora.rank)
        )
    return {name: w.to(torch.bfloat16).contiguous() for name, w in t.items()}


def adapter_config(lora: LoraSpec, base_model: str) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.rank,  # scaling alpha / r = 1: B @ A as made
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "layers_to_transform": [0],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_lora(spec: ModelSpec, lora: LoraSpec, adapter_dir: Path, base_model: str = "") -> Path:
    """Create ``adapter_dir`` (must be absent or empty) holding the adapter for ``spec``'s model."""
    from safetensors.torch import save_file

    adapter_dir = Path(adapter_dir)
    if adapter_dir.exists() and any(adapter_dir.iterdir()):
        raise FileExistsError(f"{adapter_dir} exists and is not empty; refusing to overwrite it")
    weights = make_lora_weights(spec, lora)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    (adapter_dir / "adapter_config.json").write_text(
        json.dumps(adapter_config(lora, base_model), indent=2, sort_keys=True) + "\n"
    )
    save_file(weights, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return adapter_dir

"""ModelSpec: the validated shape of a small model and its Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from vllm_pd.errors import ConfigError

ARCHS = ("llama", "deepseek_v2", "nemotron_h")
# nemotron_h: Mamba-2 layers (M) beside attention (*) and MLP (-) layers, this pattern cycled over
# --layers (vLLM keeps the Mamba state in a KV cache group of its own)
NEMOTRON_H_PATTERN = "M*M-"
MAMBA_HEAD_DIM = 32
MAMBA_STATE = 16
# head sizes vLLM's CPU attention backend supports
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# bump when the written files change for the same spec, so cached copies are rebuilt
FORMAT_VERSION = 1


class ModelSpecError(ConfigError):
    """A model argument is out of range or inconsistent; the message names the argument."""


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 4096
    max_positions: int = 4096
    seed: int = 0
    # DeepSeek-V2 (MLA) only
    # CPU MLA rejected 128+32 ("Head dimension 160 is not supported by MLA"); 512+64 is DeepSeek's own
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    q_lora_rank: int | None = None
    # llama only: a sliding window of this many tokens on all layers but every
    # full_attention_every-th (Gemma 3 / Mistral-style ``layer_types``; vLLM's hybrid KV cache
    # manager keeps the two kinds in separate KV cache groups). 0: every layer full attention.
    sliding_window: int = 0
    full_attention_every: int = 4

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ModelSpecError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        positive = [
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "intermediate",
            "vocab",
            "max_positions",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelSpecError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ModelSpecError(f"--q-lora-rank must be > 0 or omitted, got {self.q_lora_rank}")
        if self.seed < 0:
            raise ModelSpecError(f"--seed must be >= 0, got {self.seed}")
        if self.sliding_window < 0:
            raise ModelSpecError(f"--sliding-window must be >= 0, got {self.sliding_window}")
        if self.sliding_window and self.arch != "llama":
            raise ModelSpecError(f"--sliding-window: only the llama arch has sliding-window layers, got {self.arch}")
        if self.sliding_window and not 2 <= self.full_attention_every <= self.layers:
            raise ModelSpecError(
                f"--full-attention-every must be in [2, --layers ({self.layers})] with "
                f"--sliding-window, got {self.full_attention_every}"
            )
        if self.vocab < 512:
            # room for the 256 byte tokens, the special tokens and some merges
            raise ModelSpecError(f"--vocab must be >= 512, got {self.vocab}")
        if self.arch == "nemotron_h" and (self.hidden % MAMBA_HEAD_DIM or "*" not in self.layer_pattern):
            raise ModelSpecError(
                f"--arch nemotron_h needs --hidden a multiple of {MAMBA_HEAD_DIM} (got {self.hidden}) and "
                f"--layers >= 2 for an attention layer (got {self.layers})"
            )
        if self.arch in ("llama", "nemotron_h"):
            if self.heads % self.kv_heads:
                raise ModelSpecError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
            if self.head_dim not in CPU_HEAD_SIZES:
                raise ModelSpecError(
                    f"--head-dim must be one of {CPU_HEAD_SIZES} (vLLM CPU attention), got {self.head_dim}"
                )

    @property
    def layer_types(self) -> list[str]:
        """Each layer's attention (HF ``layer_types``); empty without a sliding window."""
        if not self.sliding_window:
            return []
        return [
            "full_attention" if (i + 1) % self.full_attention_every == 0 else "sliding_attention"
            for i in range(self.layers)
        ]

    @property
    def layer_pattern(self) -> str:
        """nemotron_h's ``hybrid_override_pattern``: M Mamba-2, * attention, - MLP; else empty."""
        if self.arch != "nemotron_h":
            return ""
        return (NEMOTRON_H_PATTERN * self.layers)[: self.layers]

    def key(self) -> str:
        """Short stable hash of every field: names a cached copy of this model."""
        fields = dataclasses.asdict(self)
        if not self.sliding_window:  # the keys of models made before these fields stay
            del fields["sliding_window"], fields["full_attention_every"]
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def hf_config(self, bos_id: int, eos_id: int) -> dict[str, Any]:
        common: dict[str, Any] = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }
        if self.arch == "llama":
            return {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "mlp_bias": False,
                **common,
                **(
                    {"layer_types": self.layer_types, "sliding_window": self.sliding_window}
                    if self.sliding_window
                    else {}
                ),
            }
        if self.arch == "nemotron_h":
            return self._nemotron_h_config(common)
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "num_key_value_heads": self.heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            # every layer dense (first_k_dense_replace = all layers): no MoE kernels needed on CPU;
            # the expert fields must still be ints for transformers' strict config validation
            "first_k_dense_replace": self.layers,
            "n_routed_experts": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": self.intermediate,
            "moe_layer_freq": 1,
            "num_experts_per_tok": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "norm_topk_prob": False,
            "rope_scaling": None,
            **common,
        }

    def _nemotron_h_config(self, common: dict[str, Any]) -> dict[str, Any]:
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            **{k: v for k, v in common.items() if k not in ("rms_norm_eps", "rope_theta", "hidden_act")},
            "hybrid_override_pattern": self.layer_pattern,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "mamba_num_heads": self.hidden // MAMBA_HEAD_DIM,
            "mamba_head_dim": MAMBA_HEAD_DIM,
            "n_groups": 1,
            "ssm_state_size": MAMBA_STATE,
            "conv_kernel": 4,
            "expand": 1,
            "chunk_size": 128,
            "use_conv_bias": True,
            "mamba_proj_bias": False,
            "mamba_hidden_act": "silu",
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "residual_in_fp32": False,
            "rescale_prenorm_residual": True,
            "time_step_limit": [0.0, 1e9],
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "time_step_floor": 0.0001,
            "n_routed_experts": 0,
            "num_experts_per_tok": 0,
        }


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter for a ModelSpec's model (small_model/lora.py)."""

    rank: int = 8
    seed: int = 1

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ModelSpecError(f"--lora-rank must be > 0, got {self.rank}")
        if self.seed < 0:
            raise ModelSpecError(f"--lora-seed must be >= 0, got {self.seed}")

"""``vllm-pd make-model DIR``: write a small random-weight HF model folder vLLM can serve offline."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from vllm_pd.small_model.spec import ARCHS, LoraSpec, ModelSpec, ModelSpecError

_DEFAULTS = ModelSpec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="output folder (must not exist or be empty)")
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        default="llama",
        help="model family: llama (attention), deepseek_v2 (MLA) or nemotron_h (Mamba-2 layers beside "
        "attention and MLP layers, the pattern M*M- cycled over --layers); default llama",
    )
    for f in dataclasses.fields(ModelSpec):
        if f.name == "arch":
            continue
        default = getattr(_DEFAULTS, f.name)
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=int,
            default=default,
            help=f"default {default}" + (" (deepseek_v2 only)" if f.name in _MLA_ONLY else "") + _HELP.get(f.name, ""),
        )
    parser.add_argument(
        "--lora",
        type=Path,
        metavar="ADAPTER_DIR",
        help="also write a PEFT LoRA adapter for the model there (llama only; vLLM serves it with "
        "--enable-lora --lora-modules NAME=ADAPTER_DIR)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=LoraSpec.rank,
        help=f"with --lora: the adapter's rank r (default {LoraSpec.rank})",
    )
    parser.add_argument(
        "--lora-seed",
        type=int,
        default=LoraSpec.seed,
        help=f"with --lora: seed of the adapter's random weights (default {LoraSpec.seed})",
    )


_HELP = {
    "sliding_window": " (llama only: a sliding window of this many tokens on every layer but each "
    "--full-attention-every-th; 0: none)",
    "full_attention_every": " (with --sliding-window: every this-many-th layer is full attention)",
}
_MLA_ONLY = {"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank"}


def run(args: argparse.Namespace) -> int:
    from vllm_pd.small_model.writer import write_model

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSpec)}
    try:
        spec = ModelSpec(**values)
        lora = LoraSpec(args.lora_rank, args.lora_seed) if args.lora is not None else None
        if lora is not None and spec.arch != "llama":
            raise ModelSpecError(f"--lora: only the llama arch has an adapter, got --arch {spec.arch}")
    except ModelSpecError as e:
        raise SystemExit(f"vllm-pd make-model: {e}") from None
    start = time.monotonic()
    try:
        write_model(spec, args.dir)
    except FileExistsError as e:
        raise SystemExit(f"vllm-pd make-model: {e}") from None
    if lora is not None:
        from vllm_pd.small_model.lora import write_lora

        try:
            write_lora(spec, lora, args.lora, base_model=str(args.dir))
        except FileExistsError as e:
            raise SystemExit(f"vllm-pd make-model: {e}") from None
    print(
        f"wrote {spec.arch} model to {args.dir}"
        + (f" and its LoRA adapter to {args.lora}" if lora else "")
        + f" in {time.monotonic() - start:.1f}s"
    )
    return 0

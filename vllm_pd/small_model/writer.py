"""Write a complete Hugging Face model folder for a ModelSpec."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer

from vllm_pd.small_model.spec import ModelSpec
from vllm_pd.small_model.tokenizer import EOS, IM_END, SPECIAL_TOKENS, train_tokenizer, write_tokenizer

logger = logging.getLogger(__name__)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model(spec: ModelSpec, model_dir: Path) -> Path:
    """Create ``model_dir`` (must be absent or empty) holding config, weights and tokenizer."""
    from safetensors.torch import save_file  # torch-heavy: keep out of CLI --help

    from vllm_pd.small_model.weights import make_weights

    model_dir = Path(model_dir)
    if model_dir.exists() and any(model_dir.iterdir()):
        raise FileExistsError(f"{model_dir} exists and is not empty; refusing to overwrite it")
    model_dir.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(spec.vocab)
    if tok.get_vocab_size() > spec.vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than --vocab {spec.vocab}")
    bos_id, eos_id, im_end_id = (_token_id(tok, t) for t in ("<s>", EOS, IM_END))
    write_tokenizer(tok, model_dir, spec.max_positions)

    _write_json(model_dir / "config.json", spec.hf_config(bos_id, eos_id))
    _write_json(
        model_dir / "generation_config.json",
        {
            "bos_token_id": bos_id,
            "eos_token_id": [eos_id, im_end_id],
            "do_sample": False,
        },
    )
    # one metadata key only: safetensors writes metadata from a hash map, so several keys come out
    # in random order and the file bytes would differ between runs
    special_ids = tuple(_token_id(tok, t) for t in SPECIAL_TOKENS)
    save_file(make_weights(spec, special_ids), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote %s model to %s (key %s)", spec.arch, model_dir, spec.key())
    return model_dir


def _token_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:  # the trainer was given every special token: a tokenizers change broke that
        raise RuntimeError(f"the trained tokenizer lacks the special token {token!r}")
    return int(token_id)

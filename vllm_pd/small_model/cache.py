"""The built-in model (and its LoRA adapter), made once per spec into a cache dir shared by tests,
benchmarks and ``vllm-pd up``."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from vllm_pd.small_model.lora import write_lora
from vllm_pd.small_model.spec import LoraSpec, ModelSpec
from vllm_pd.small_model.writer import write_model


def cache_root() -> Path:
    env = os.environ.get("VLLM_PD_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "vllm-pd"
    return base / "models"


def ensure_default_model(arch: str = "llama", cache_dir: Path | None = None) -> Path:
    """Path of the default ``arch`` model, writing it first if absent."""
    return ensure_model(ModelSpec(arch=arch), cache_dir)


def ensure_model(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """Path of the model ``spec`` describes, writing it first if absent.

    Safe under concurrent callers: each writes into its own temp dir and renames it into place;
    a loser of the race discards its copy (the bytes are identical anyway).
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return _ensure(root / f"{spec.arch}-{spec.key()}", "config.json", lambda tmp: write_model(spec, tmp))


def ensure_lora(spec: ModelSpec, lora: LoraSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Path of the LoRA adapter ``lora`` (default LoraSpec()) for ``spec``'s model, writing it first if absent."""
    lora = lora or LoraSpec()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"lora-{spec.key()}-r{lora.rank}-s{lora.seed}"
    return _ensure(final, "adapter_config.json", lambda tmp: write_lora(spec, lora, tmp))


def _ensure(final: Path, marker: str, write: Callable[[Path], object]) -> Path:
    if (final / marker).exists():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

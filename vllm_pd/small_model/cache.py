"""The built-in model, made once per spec into a cache dir shared by tests, benchmarks and ``vllm-pd up``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from vllm_pd.small_model.spec import ModelSpec
from vllm_pd.small_model.writer import write_model


def cache_root() -> Path:
    env = os.environ.get("VLLM_PD_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "vllm-pd"
    return base / "models"


def ensure_default_model(arch: str = "llama", cache_dir: Path | None = None) -> Path:
    """Path of the default ``arch`` model, writing it first if absent.

    Safe under concurrent callers: each writes into its own temp dir and renames it into place;
    a loser of the race discards its copy (the bytes are identical anyway).
    """
    spec = ModelSpec(arch=arch)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"{arch}-{spec.key()}"
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
    try:
        write_model(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

"""Shared fixtures: the built-in small model, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd.small_model import ensure_default_model


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the default llama-style model (in a per-session temp cache, so tests never share state)."""
    return ensure_default_model("llama", cache_dir=tmp_path_factory.mktemp("vllm-pd-cache"))

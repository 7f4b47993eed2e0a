"""Shared by every kind of test: the built-in small model, made once per test session, and the
markers each folder implies (tests/e2e: ``e2e``). What starts vLLM servers is in tests/e2e/conftest.py,
so unit and integration tests never import the e2e cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd.small_model import ensure_default_model

E2E_DIR = Path(__file__).parent / "e2e"


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the default llama-style model (in a per-session temp cache, so tests never share state)."""
    return ensure_default_model("llama", cache_dir=tmp_path_factory.mktemp("vllm-pd-cache"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/e2e starts real vLLM servers: marked ``e2e`` though its file forgot to say so."""
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)

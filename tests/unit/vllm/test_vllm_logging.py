"""Our code inside vLLM's processes logs through vLLM's own handler (vllm_pd.vllm_logging)."""

from __future__ import annotations

from pathlib import Path

import vllm_pd


def test_code_running_inside_vllm_takes_its_loggers_from_vllm_logging() -> None:
    """connector/**, ops/** and the plugin hook run in vLLM's processes: a plain logging.getLogger there
    has no handler (vLLM's "vllm" logger does not propagate), so its lines would never show."""
    root = Path(vllm_pd.__file__).parent
    sources = [*root.glob("connector/**/*.py"), *root.glob("ops/**/*.py"), root / "__init__.py"]
    plain = [str(p.relative_to(root)) for p in sources if "logging.getLogger(" in p.read_text()]
    assert plain == []
    assert any("vllm_logger(__name__)" in p.read_text() for p in sources)

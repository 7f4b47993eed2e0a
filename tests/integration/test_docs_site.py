"""The documentation site builds strictly and offline (moved from tests/unit/docs: ``mkdocs build``
runs as a process of its own, some 10 s on two cores).

``mkdocs build --strict`` (the ``docs`` extra, which install.sh installs) into a temporary folder: a
broken link or anchor, a page left out of the navigation or a warning fails it. The reference's
coverage of the code is checked in tests/unit/docs/test_docs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

import reference_pages  # noqa: E402 - docs/hooks is not a package


def test_site_builds_strictly(tmp_path: Path) -> None:
    """The whole site, generated pages included, with mkdocs' strict mode (any warning fails)."""
    site = tmp_path / "site"
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    for page in reference_pages.PAGES.values():  # the generated pages are in the site
        built = site / page.removesuffix(".md") / "index.html"
        assert built.is_file(), f"{page} was not generated"
    assert (site / "benchmarks" / "img" / "store_e2e.svg").is_file()  # the charts come along
    assert "vllm:pd_loads_total" in (site / "reference" / "metrics" / "index.html").read_text()

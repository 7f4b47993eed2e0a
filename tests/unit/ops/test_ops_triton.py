"""The Triton kernels, run in Triton's interpreter on CPU.

Triton picks interpreter mode when it is imported, and vLLM or other tests may import it
first, so the cases (tests/support/ops_triton_cases.py) run in a fresh interpreter with
TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT),
            str(ROOT / "tests/support/ops_triton_cases.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]

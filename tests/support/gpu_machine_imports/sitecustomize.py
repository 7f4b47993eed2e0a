"""Limits a Python process to the imports a bare GPU machine can satisfy (tests/integration/test_gpu_check.py).

Python runs ``sitecustomize`` at start-up from the first folder on sys.path that has one; the
rehearsal of benchmarks/gpu_check.py puts this folder first on PYTHONPATH, so its step processes
and the harness processes they spawn all start with this finder in front of sys.meta_path. It
raises ModuleNotFoundError for any top-level module that is neither in
``VLLM_PD_IMPORT_ALLOW`` (comma-separated: the GPU machine's packages plus the carried wheels'
modules), nor the standard library, nor found inside ``VLLM_PD_IMPORT_ROOT`` (the repository,
which travels). Each refusal is appended to ``VLLM_PD_IMPORT_BLOCKED_LOG``. Optional imports
that the importer guards (torch tries a few) see the same ImportError as on the machine.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path


class GpuMachineImports:
    """A meta-path finder that only refuses: allowed names fall through to the normal finders."""

    def __init__(self, allowed: set[str], root: Path, log: str | None) -> None:
        self.allowed = allowed | set(sys.stdlib_module_names) | set(sys.builtin_module_names)
        self.root = root
        self.log = log

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        # _sysconfigdata_*: the standard library's per-platform build data, absent from stdlib_module_names
        if "." in name or name in self.allowed or name.startswith("_sysconfigdata_") or self._in_root(name):
            return None
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
        raise ModuleNotFoundError(f"No module named {name!r} (not on the bare GPU machine nor carried)", name=name)

    def _in_root(self, name: str) -> bool:
        spec = PathFinder.find_spec(name)
        origin = spec.origin if spec is not None and spec.origin not in (None, "namespace") else None
        locations = [origin] if origin else list(spec.submodule_search_locations or []) if spec else []
        return any(Path(p).resolve().is_relative_to(self.root) for p in locations)


def install() -> None:
    allowed = {m for m in os.environ.get("VLLM_PD_IMPORT_ALLOW", "").split(",") if m}
    root = Path(os.environ.get("VLLM_PD_IMPORT_ROOT", os.getcwd())).resolve()
    sys.meta_path.insert(0, GpuMachineImports(allowed, root, os.environ.get("VLLM_PD_IMPORT_BLOCKED_LOG")))


install()

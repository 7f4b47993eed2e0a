"""The import graph's shape (issue 27): no import circles in vllm_pd, the router's packages and the connector's
layers in one direction, the protocol package (vllm_pd/protocol/) at the bottom: it imports no other package of
ours, nor torch nor vLLM.

Reads the imports statically with benchmarks/code_shape.py (every import counts: module level, under
``TYPE_CHECKING``, inside functions), so a circle closed by a type-only or a local import fails here too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # wherever tests/ nests it
sys.path.append(str(ROOT / "benchmarks"))  # code_shape is a script there (appended: no shadowing)

from code_shape import PACKAGE, circles, import_graph  # noqa: E402

EVERY = {"module", "type_checking", "local"}
# vllm_pd/router/__init__.py's order: each may import only those before it
ROUTER_ORDER = (
    "http",
    "backend",
    "k8s",
    "request",
    "config",
    "pool",
    "observability",
    "routing",
    "flow",
    "server",
    "cli",
)
# what the router may import of the KV store: its client (and the store master's command, which `vllm-pd up
# --store` starts); the block keys and the master's messages are the protocol package's
STORE_ALLOWED = {
    "vllm_pd.connector.store.master_client",
    "vllm_pd.connector.store.master_command",
}


def _router_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["vllm_pd", "router"] and len(parts) > 2 else None


def test_no_import_circles() -> None:
    assert circles(import_graph(ROOT, PACKAGE), EVERY) == []


def test_router_packages_import_only_those_below() -> None:
    graph = import_graph(ROOT, PACKAGE)
    rank = {name: i for i, name in enumerate(ROUTER_ORDER)}
    upward = []
    for module, targets in graph.items():
        part = _router_part(module)
        if part is None:
            continue
        assert part in rank, f"{module}: a router package not in ROUTER_ORDER (and router/__init__.py's list)"
        for target, kinds in targets.items():
            other = _router_part(target)
            if other is not None and other != part and rank[other] > rank[part]:
                upward.append(f"{module} -> {target} ({', '.join(sorted(kinds))})")
    assert upward == []


def test_router_reaches_the_store_only_through_its_client_and_keys() -> None:
    graph = import_graph(ROOT, PACKAGE)
    reached = {
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _router_part(m)
        for t in targets
        if t.startswith("vllm_pd.connector.store") and t not in STORE_ALLOWED
    }
    assert reached == set()


# ---- the protocol package: the floor everything that talks stands on ----------------------------------
# what vllm_pd/protocol/ may import of vllm_pd besides itself: the exception tree and the logger
PROTOCOL_ALLOWED = ("vllm_pd.protocol", "vllm_pd.errors", "vllm_pd.vllm_logging")
NOT_IN_PROTOCOL = ("torch", "vllm", "triton", "nixl")


def _imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; module level, TYPE_CHECKING, inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_protocol_imports_nothing_above_it() -> None:
    """protocol/ imports no other vllm_pd package (connector and its store, router, planner, ops, ...)."""
    upward = sorted(
        f"{path.relative_to(ROOT)} -> {name}"
        for path in sorted((PACKAGE / "protocol").rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] == "vllm_pd" and not name.startswith(PROTOCOL_ALLOWED)
    )
    assert upward == []


def test_protocol_imports_neither_torch_nor_vllm() -> None:
    """Statically (every import of every module) and when every module is imported in a fresh process."""
    static = sorted(
        f"{path.relative_to(ROOT)} -> {name}"
        for path in sorted((PACKAGE / "protocol").rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] in NOT_IN_PROTOCOL
    )
    assert static == []
    code = (
        "import importlib, pkgutil, sys\n"
        "import vllm_pd.protocol as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('vllm_pd.protocol.' + m.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *NOT_IN_PROTOCOL], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout


# ---- the connector's layers --------------------------------------------------------------------------
# vllm_pd/connector/__init__.py's order: each may import only those before it (a subpackage or a module)
CONNECTOR_ORDER = (
    "transport",
    "deployment_secret",
    "config",
    "device",
    "step_specs",
    "store",
    "worker",
    "metadata",
    "announce_probe",
    "state_layout",
    "scheduler",
    "store_bridge",
    "store_group_bridge",
    "stats",
    "connector",
)
# the worker's data path: the GPU harness runs it without vLLM
VLLM_FREE = ("transport", "device", "worker")


def _connector_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["vllm_pd", "connector"] and len(parts) > 2 else None


def test_connector_layers_import_only_those_below() -> None:
    graph = import_graph(ROOT, PACKAGE)
    rank = {name: i for i, name in enumerate(CONNECTOR_ORDER)}
    upward = []
    for module, targets in graph.items():
        part = _connector_part(module)
        if part is None:
            continue
        assert part in rank, f"{module}: a connector part not in CONNECTOR_ORDER (and connector/__init__.py's list)"
        for target, kinds in targets.items():
            other = _connector_part(target)
            if other is not None and other != part and rank[other] > rank[part]:
                upward.append(f"{module} -> {target} ({', '.join(sorted(kinds))})")
    assert upward == []


def test_connector_order_is_the_packages_own() -> None:
    """The order names every part of vllm_pd/connector/ that exists, and nothing that does not."""
    on_disk = {p.stem for p in (PACKAGE / "connector").glob("*.py") if p.name != "__init__.py"}
    on_disk |= {p.parent.name for p in (PACKAGE / "connector").glob("*/__init__.py")}
    assert set(CONNECTOR_ORDER) == on_disk


def test_worker_data_path_imports_no_vllm() -> None:
    """worker/, device/ and transport/ (every import of every module): the harness runs them without vLLM."""
    found = sorted(
        f"{path.relative_to(ROOT)} -> {name}"
        for part in VLLM_FREE
        for path in sorted((PACKAGE / "connector" / part).rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] == "vllm"
    )
    assert found == []

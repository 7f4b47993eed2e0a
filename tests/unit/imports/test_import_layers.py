"""The import graph's shape (issue 27): no import circles in vllm_pd, the router's packages in one direction.

Reads the imports statically with benchmarks/code_shape.py (every import counts: module level, under
``TYPE_CHECKING``, inside functions), so a circle closed by a type-only or a local import fails here too.
"""

from __future__ import annotations

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
# what the router may import of the KV store: its client and its block keys (and the store master's command,
# which `vllm-pd up --store` starts)
STORE_ALLOWED = {
    "vllm_pd.connector.store.master_client",
    "vllm_pd.connector.store.keys",
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

"""The code's shape as issue 27 measures it: import circles, and the files one request's KV crosses.

    python3 benchmarks/code_shape.py [--transport tcp|shm] [--no-trace] [--json FILE]

Three figures, each beside its peer:

* **Import circles** of ``vllm_pd`` (files that import each other in a loop; every import
  counts, as ``farm-studio look`` counts them: at module level, under ``TYPE_CHECKING``, inside
  functions), and the same over module-level runtime imports only.
* **Files one request's KV crosses, run**: the ``vllm_pd`` files whose functions run in the
  prefill and the decode worker process while the GPU harness (tests/support/gpu_harness.py: the
  connector's worker, sender, loader and transport, without vLLM) sets up a pair, registers its
  KV caches, connects, and moves one push and one pull request on the CPU. Module-level code
  (imports) is not counted. The scheduler side and the facade are not in it (the harness drives
  the worker as vLLM does, without them): they are in the static figure.
* **Files one request's KV crosses, read**: the files under ``vllm_pd/connector/`` (and
  ``vllm_pd/protocol/``, the wire it speaks) that the
  facade vLLM loads (``vllm_pd/connector/connector.py``) reaches through imports not under
  ``TYPE_CHECKING``; the peer is the same count for vLLM's NixlConnector inside its ``nixl/``
  package (``.../kv_connector/v1/nixl/connector.py``).

The refactor's "after" figures are this script run again on the refactored tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's vllm_pd and tests/, run from anywhere without PYTHONPATH
    sys.path.insert(0, str(ROOT))
PACKAGE = ROOT / "vllm_pd"
TRACE_ENV = "VLLM_PD_CODE_SHAPE_TRACE"  # set for the harness's processes: a folder for their file lists


def _install_tracer(out_dir: Path) -> None:
    """In a harness process (this module is its ``__mp_main__``): log every vllm_pd file a function runs in."""
    seen: set[str] = set()
    package = str(PACKAGE) + os.sep
    log = open(out_dir / f"{os.getpid()}.txt", "a", buffering=1)  # open for the process's life

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or code.co_name == "<module>":
            return
        name = code.co_filename
        if name not in seen and name.startswith(package):
            seen.add(name)
            log.write(name + "\n")

    sys.setprofile(hook)
    threading.setprofile(hook)


if __name__ != "__main__" and os.environ.get(TRACE_ENV):
    _install_tracer(Path(os.environ[TRACE_ENV]))


# ---- imports -----------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[tuple[str, str]]:
    """(imported module of ``modules``, kind) per import in ``path``; kind: module | type_checking | local."""
    tree = ast.parse(path.read_text())
    own = module_name(path, root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: list[tuple[str, str]] = []

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "module":
                child_kind = "local"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type_checking")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit_stmt(child, child_kind, recurse=True)

    def visit_stmt(node: ast.AST, kind: str, recurse: bool = True) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name)
                if target:
                    found.append((target, kind))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else resolve(base)
                if target:
                    found.append((target, kind))
        if recurse:
            visit(node, kind)

    visit(tree, "module")
    return [(t, k) for t, k in found if t != own]


def import_graph(root: Path, package_dir: Path) -> dict[str, dict[str, set[str]]]:
    """module -> {imported module: kinds} over the .py files under ``package_dir``."""
    files = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, dict[str, set[str]]] = {m: {} for m in files}
    for name, path in files.items():
        for target, kind in imports_of(path, root, modules):
            graph[name].setdefault(target, set()).add(kind)
    return graph


def circles(graph: dict[str, dict[str, set[str]]], kinds: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module, over edges of ``kinds`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, edge_kinds in graph[v].items():
            if not edge_kinds & kinds:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    # restored after: the test suite imports this module, and a raised limit leaks into later tests
    # (the proxy's "request body nests too deep" 400 depends on the interpreter's default limit)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                strongconnect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def reachable(
    graph: dict[str, dict[str, set[str]]], start: str, prefix: str | tuple[str, ...], kinds: set[str]
) -> set[str]:
    """Modules under ``prefix`` that ``start`` reaches over edges of ``kinds`` (within ``prefix``)."""
    seen, todo = {start}, [start]
    while todo:
        for w, edge_kinds in graph[todo.pop()].items():
            if edge_kinds & kinds and w.startswith(prefix) and w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# ---- the run -----------------------------------------------------------------------------------


def traced_files(transport: str, out_dir: Path) -> dict[str, list[str]]:
    """The harness's worker processes: pid file -> the vllm_pd files their functions ran in."""
    from tests.support.gpu_harness import HarnessSpec, run

    os.environ[TRACE_ENV] = str(out_dir)  # the spawned processes import this module first
    try:
        result = run(HarnessSpec(device="cpu", transport=transport, modes=("push", "pull")))
    finally:
        del os.environ[TRACE_ENV]
    if result.errors or not all(r.exact and r.load_ok for r in result.requests):
        raise SystemExit(f"the harness failed, nothing measured: {result.errors or result.requests}")
    return {p.stem: sorted(set(p.read_text().split())) for p in out_dir.glob("*.txt")}


def by_folder(paths: set[Path]) -> dict[str, int]:
    """Files per folder (relative to the repository)."""
    counts: Counter[str] = Counter(p.relative_to(ROOT).parent.as_posix() + "/" for p in paths)
    return dict(sorted(counts.items()))


def module_file(name: str) -> Path:
    path = ROOT / Path(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"), help="the harness's transport")
    ap.add_argument("--no-trace", action="store_true", help="the static figures only (no harness run)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    figures: dict[str, Any] = {}

    graph = import_graph(ROOT, PACKAGE)
    every = circles(graph, {"module", "type_checking", "local"})
    runtime = circles(graph, {"module"})
    figures["circles"] = {"every import": every, "module-level runtime imports": runtime}
    print(f"import circles of vllm_pd ({len(graph)} modules), every import counted: {len(every)}")
    for c in every:
        kinds = {k for a in c for b in c if b in graph[a] for k in graph[a][b]}
        print(f"  {' <-> '.join(c)}   (imports: {', '.join(sorted(kinds))})")
    print(
        f"  over module-level runtime imports only: {len(runtime)}"
        + "".join(f"\n    {' <-> '.join(c)}" for c in runtime)
    )

    static_kinds = {"module", "local"}
    # the connector and the protocol package it speaks (vllm_pd/protocol/, issue 27; absent before it)
    ours = reachable(graph, "vllm_pd.connector.connector", ("vllm_pd.connector", "vllm_pd.protocol"), static_kinds)
    ours_folders = by_folder({module_file(m) for m in ours})
    import vllm

    vllm_root = Path(vllm.__file__).parent.parent
    nixl_dir = vllm_root / "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
    peer_graph = import_graph(vllm_root, nixl_dir) if nixl_dir.is_dir() else {}
    peer_start = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"
    peer = reachable(peer_graph, peer_start, peer_start.rpartition(".")[0], static_kinds) if peer_graph else set()
    figures["read"] = {
        "ours": sorted(ours),
        "ours by folder": ours_folders,
        "vllm nixl": sorted(peer),
        "vllm nixl files": len(peer_graph),
    }
    print(f"\nfiles under connector/ and protocol/ the facade reaches by its imports: {len(ours)} {ours_folders}")
    print(
        f"  peer: vLLM {vllm.__version__}'s NixlConnector, the same within its nixl/ package: {len(peer)} of "
        f"its {len(peer_graph)} files"
    )

    if not args.no_trace:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            per_process = traced_files(args.transport, Path(tmp))
        both = set().union(*per_process.values()) if per_process else set()
        rel = sorted(str(Path(p).relative_to(ROOT)) for p in both)
        folders = by_folder({Path(p) for p in both})
        figures["run"] = {
            "transport": args.transport,
            "files": rel,
            "by folder": folders,
            "per process": {pid: len(files) for pid, files in per_process.items()},
            # which side each file runs on (prefill's process runs kv_sender, decode's kv_loader)
            "per process files": {
                pid: sorted(str(Path(f).relative_to(ROOT)) for f in files) for pid, files in per_process.items()
            },
        }
        print(
            f"\nfiles whose functions ran in the two worker processes (harness, cpu, {args.transport}, "
            f"set-up + one push + one pull request): {len(both)} {folders}"
        )
        print(f"  per process: {sorted(len(f) for f in per_process.values())}")
        for r in rel:
            print(f"    {r}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

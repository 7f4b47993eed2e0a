"""vLLM's KV connector API as data: what a version's classes declare, and whether ours fits it.

A *surface* is a JSON-able dict describing vLLM classes (each member's kind, abstract flag and
parameters: name, kind, whether it has a default) and vLLM modules (the names each defines), so a
version that cannot be installed here (vLLM 0.33's GPU wheel: CUDA torch, 336 MB) is checked from a
small committed manifest. Two readers make the same format: :func:`surface_from_source` parses
vLLM's source (a wheel or a folder) without importing it, :func:`live_class_surface` inspects the
classes of the vLLM installed here. :func:`check_connector` lists what of a surface a connector class
violates. Nothing of vLLM's source text is kept: names, parameter names and flags only.

Regenerate the committed manifest from a wheel (no install; reads the wheel as a zip)::

    python -m tests.support.vllm_surface /path/vllm-0.33.0-*.whl \
        --out tests/support/data/vllm-0.33.0-connector-surface.json
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METRICS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
# the classes a KV connector implements, returns or is handed: their members and fields
CLASSES = {
    f"{BASE_MODULE}.KVConnectorBase_V1",
    f"{BASE_MODULE}.SupportsHMA",
    f"{BASE_MODULE}.KVConnectorMetadata",
    f"{BASE_MODULE}.KVConnectorWorkerMetadata",
    f"{BASE_MODULE}.KVConnectorHandshakeMetadata",
    f"{BASE_MODULE}.KVConnectorTransferResults",
    f"{METRICS_MODULE}.KVConnectorStats",
    f"{METRICS_MODULE}.KVConnectorPromMetrics",
    "vllm.v1.outputs.KVConnectorOutput",
    "vllm.v1.core.sched.output.SchedulerOutput",
    "vllm.v1.core.sched.output.NewRequestData",
    "vllm.v1.core.sched.output.CachedRequestData",
    "vllm.v1.core.kv_cache_manager.KVCacheBlocks",
    "vllm.v1.core.kv_cache_manager.KVCacheManager",
    "vllm.v1.request.Request",
    "vllm.v1.kv_cache_interface.KVCacheConfig",
    "vllm.config.kv_transfer.KVTransferConfig",
}
# modules whose top-level names are recorded: the connector API's, the connectors composed with
# ours, and those vllm_pd imports from; the contract test flags an import from any other
KV = "vllm.distributed.kv_transfer.kv_connector"
MODULES = (
    f"{KV}.factory",
    f"{KV}.base",
    f"{KV}.utils",
    f"{KV}.v1",
    BASE_MODULE,
    METRICS_MODULE,
    f"{KV}.v1.multi_connector",
    f"{KV}.v1.offloading_connector",
    f"{KV}.v1.simple_cpu_offload_connector",
    f"{KV}.v1.lmcache_connector",
    f"{KV}.v1.nixl",
    "vllm.distributed.kv_transfer.kv_transfer_state",
    "vllm.distributed.parallel_state",
    "vllm.config",
    "vllm.config.kv_transfer",
    "vllm.config.vllm",
    "vllm.forward_context",
    "vllm.platforms",
    "vllm.v1.request",
    "vllm.v1.outputs",
    "vllm.v1.core.sched.output",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.block_pool",
    "vllm.v1.kv_cache_interface",
    "vllm.model_executor.layers.mamba.mamba_utils",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.attention.backends.mla.triton_mla",
    "vllm.v1.attention.backends.mla.cpu_mla",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.v1.metrics.cache_hit_source",
    "vllm._custom_ops",
    "vllm.utils.deep_gemm",
    "vllm.logger",
)
DECORATOR_KINDS = {
    "classmethod": "classmethod",
    "staticmethod": "staticmethod",
    "property": "property",
    "cached_property": "property",
}


# ---- reading source (no import) -----------------------------------------------------------------
def _param(name: str, kind: str, has_default: bool) -> list[Any]:
    return [name, kind, has_default]


def _ast_params(args: ast.arguments) -> list[list[Any]]:
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out = [
        _param(a.arg, "positional_only" if i < len(args.posonlyargs) else "positional_or_keyword", i >= first_default)
        for i, a in enumerate(positional)
    ]
    if args.vararg is not None:
        out.append(_param(args.vararg.arg, "var_positional", False))
    out += [_param(a.arg, "keyword_only", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        out.append(_param(args.kwarg.arg, "var_keyword", False))
    return out


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _ast_class(node: ast.ClassDef) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = _decorator_names(item)
            if "setter" in decorators or "deleter" in decorators:
                continue  # the property's getter is the member
            kind = next((DECORATOR_KINDS[d] for d in decorators if d in DECORATOR_KINDS), "method")
            members[item.name] = {
                "kind": kind,
                "abstract": "abstractmethod" in decorators,
                "params": [] if kind == "property" else _ast_params(item.args),
            }
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = {"kind": "field", "abstract": False, "has_default": item.value is not None}
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                if isinstance(t, ast.Name):
                    members[t.id] = {"kind": "attribute", "abstract": False}
    init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
    for stmt in ast.walk(init) if init is not None else ():  # what instances get: self.x = ...
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                members.setdefault(t.attr, {"kind": "instance_attribute", "abstract": False})
    bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", ast.unparse(b)) for b in node.bases]
    return {"bases": bases, "members": members}


def _module_names(tree: ast.Module) -> dict[str, Any]:
    names: set[str] = set()
    dynamic = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            dynamic |= node.name == "__getattr__"
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
            dynamic |= any(a.name == "*" for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # guarded imports and definitions count too
            body = [
                *node.body,
                *node.orelse,
                *getattr(node, "finalbody", []),
                *(s for h in getattr(node, "handlers", []) for s in h.body),
            ]
            inner = _module_names(ast.Module(body=body, type_ignores=[]))
            names.update(inner["names"])
            dynamic |= inner["dynamic"]
    return {"names": sorted(names), "dynamic": dynamic}


def _module_name(path: str) -> str | None:
    """``vllm/v1/request.py`` -> ``vllm.v1.request`` (a package's ``__init__.py`` -> the package)."""
    if not path.endswith(".py") or not path.startswith("vllm/"):
        return None
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files(source: Path) -> Iterable[tuple[str, Callable[[], str]]]:
    """(path inside the package root, reader) of every .py file of a wheel or a site-packages folder."""
    if source.is_file():
        archive = zipfile.ZipFile(source)
        for name in archive.namelist():
            yield name, (lambda n=name: archive.read(n).decode())
    else:
        for path in source.rglob("vllm/**/*.py"):
            rel = path.relative_to(source).as_posix()
            yield rel, (lambda p=path: p.read_text())


def surface_from_source(source: Path, version: str = "") -> dict[str, Any]:
    """The surface of the vLLM in ``source``: a wheel file, or the folder holding the ``vllm`` package."""
    classes: dict[str, Any] = {}
    modules: dict[str, Any] = {}
    wanted_modules = {c.rsplit(".", 1)[0] for c in CLASSES}
    for path, read in _source_files(source):
        module = _module_name(path)
        if module is None or module not in MODULES and module not in wanted_modules:
            continue
        tree = ast.parse(read())
        modules[module] = _module_names(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and f"{module}.{node.name}" in CLASSES:
                classes[f"{module}.{node.name}"] = _ast_class(node)
    missing = CLASSES - set(classes)
    if missing:
        raise ValueError(f"{source}: classes not found: {sorted(missing)}")
    return {
        "vllm": version,
        "source": source.name,
        "classes": dict(sorted(classes.items())),
        "modules": dict(sorted(modules.items())),
    }


# ---- reading a live class ------------------------------------------------------------------------
_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def live_params(fn: Any) -> list[list[Any]]:
    sig = inspect.signature(fn, follow_wrapped=False)
    return [_param(p.name, _KINDS[p.kind], p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]


def live_member(cls: type, name: str) -> dict[str, Any] | None:
    """A member as ``cls`` itself defines it (not inherited), in the surface format; None if absent."""
    if name not in cls.__dict__:
        return None
    raw = cls.__dict__[name]
    if isinstance(raw, (classmethod, staticmethod)):
        kind, fn = type(raw).__name__, raw.__func__
    elif isinstance(raw, property):
        return {"kind": "property", "abstract": bool(getattr(raw.fget, "__isabstractmethod__", False)), "params": []}
    elif inspect.isfunction(raw):
        kind, fn = "method", raw
    else:
        return {"kind": "attribute", "abstract": False}
    return {"kind": kind, "abstract": bool(getattr(fn, "__isabstractmethod__", False)), "params": live_params(fn)}


def live_class_surface(cls: type) -> dict[str, Any]:
    """The methods, properties and class attributes ``cls`` defines, as :func:`surface_from_source`
    reads them (annotated dataclass fields are left out: the source reader is the one for those)."""
    members = {}
    for name in cls.__dict__:
        if name.startswith("__") and name != "__init__" or name == "_abc_impl":
            continue
        member = live_member(cls, name)
        if member is not None:
            members[name] = member
    return members


# ---- checking a connector -------------------------------------------------------------------------
POSITIONAL = ("positional_only", "positional_or_keyword")


def signature_problems(ours: list[list[Any]], theirs: list[list[Any]]) -> list[str]:
    """Why a call made as ``theirs`` declares it (the base class vLLM calls through) could fail on
    ``ours``: every argument vLLM may pass, by position or by name, must be accepted; what vLLM may
    leave out must have a default here; what we add must have one too. The first parameter
    (self / cls) is skipped."""
    ours, theirs = ours[1:], theirs[1:]
    kinds = {k for _, k, _ in ours}
    problems = []
    matched: set[str] = set()
    pos_ours = [p for p in ours if p[1] in POSITIONAL]
    for i, (name, kind, has_default) in enumerate(p for p in theirs if p[1] in POSITIONAL):
        if i < len(pos_ours):
            o_name, o_kind, o_default = pos_ours[i]
            if kind == "positional_or_keyword" and (o_name != name or o_kind != kind):
                problems.append(f"parameter {i + 1} is {o_name!r} ({o_kind}), vLLM's is {name!r} ({kind})")
            if has_default and not o_default:
                problems.append(f"{o_name!r} needs a default: vLLM may leave {name!r} out")
            matched.add(o_name)
        elif "var_positional" not in kinds:
            problems.append(f"missing positional parameter {name!r}")
    for name, kind, has_default in theirs:
        if kind == "keyword_only":
            mine = next((p for p in ours if p[0] == name and p[1] in ("positional_or_keyword", "keyword_only")), None)
            if mine is None and "var_keyword" not in kinds:
                problems.append(f"missing keyword parameter {name!r}")
            elif mine is not None:
                matched.add(name)
                if has_default and not mine[2]:
                    problems.append(f"{name!r} needs a default: vLLM may leave it out")
        elif kind in ("var_positional", "var_keyword") and kind not in kinds:
            problems.append(f"missing {'*args' if kind == 'var_positional' else '**kwargs'} (vLLM's has it)")
    for name, kind, has_default in ours:
        if name not in matched and kind not in ("var_positional", "var_keyword") and not has_default:
            problems.append(f"extra parameter {name!r} without a default: vLLM never passes it")
    return problems


def defined_on(cls: type, name: str, stop: str) -> type | None:
    """The class of ``cls``'s MRO, below the class named ``stop``, that defines ``name``."""
    for klass in cls.__mro__:
        if klass.__name__ == stop:
            return None
        if name in klass.__dict__:
            return klass
    return None


def check_connector(cls: type, base: dict[str, Any], base_name: str, decisions: dict[str, str]) -> list[str]:
    """What ``cls`` (a KVConnectorBase_V1 subclass) gets wrong about one version's base class surface
    ``base`` (``{"members": ...}``): an abstract member not implemented, an override of another kind
    or signature, a member nobody decided about (``decisions``: member -> "ours" when we override
    it, else why the base's default is right for us)."""
    problems = []
    for name, spec in sorted(base["members"].items()):
        if name.startswith("__") and name != "__init__" or spec["kind"] == "instance_attribute":
            continue  # the base's __init__ sets these on every instance: state, not hooks
        where = defined_on(cls, name, base_name)
        decision = decisions.get(name)
        if decision is None:
            problems.append(
                f"{name}: new in vLLM's {base_name}: decide (implement it, or record why the default is right)"
            )
        elif decision == "ours" and where is None:
            problems.append(f"{name}: decided 'ours' but {cls.__name__} does not define it")
        elif decision != "ours" and where is not None:
            problems.append(f"{name}: {cls.__name__} defines it but the decision says inherit ({decision})")
        if spec.get("abstract") and where is None:
            problems.append(f"{name}: abstract in vLLM, not implemented by {cls.__name__}")
        if where is None or spec["kind"] in ("field", "attribute"):
            continue
        mine = live_member(where, name)
        assert mine is not None
        if mine["kind"] != spec["kind"]:
            problems.append(f"{name}: ours is a {mine['kind']}, vLLM's a {spec['kind']}")
            continue
        if mine["abstract"]:
            problems.append(f"{name}: still abstract in {where.__name__}")
        if spec["kind"] != "property":
            problems += [f"{name}: {p}" for p in signature_problems(mine["params"], spec["params"])]
    return problems


def dump(surface: dict[str, Any]) -> str:
    """JSON with one line per member and per module: diffs between versions read line by line."""

    def block(items: dict[str, Any], indent: str) -> str:
        return ",\n".join(f"{indent}{json.dumps(k)}: {json.dumps(v)}" for k, v in items.items())

    classes = ",\n".join(
        f'  {json.dumps(name)}: {{"bases": {json.dumps(c["bases"])}, "members": {{\n'
        f"{block(c['members'], '   ')}\n  }}}}"
        for name, c in surface["classes"].items()
    )
    return (
        f'{{"vllm": {json.dumps(surface["vllm"])}, "source": {json.dumps(surface["source"])},\n'
        f' "classes": {{\n{classes}\n }},\n "modules": {{\n{block(surface["modules"], "  ")}\n }}\n}}\n'
    )


# ---- the generator ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the KV connector surface of a vLLM wheel or source folder")
    ap.add_argument("source", type=Path, help="a vLLM wheel (.whl), or the folder that holds the vllm package")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--version", default="", help="default: read from the wheel's file name")
    args = ap.parse_args(argv)
    version = args.version or (args.source.name.split("-")[1] if args.source.suffix == ".whl" else "")
    surface = surface_from_source(args.source, version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(surface))
    print(f"{args.out}: {len(surface['classes'])} classes, {len(surface['modules'])} modules of vLLM {version}")


if __name__ == "__main__":
    main()

"""PDConnector against the KV connector API of every vLLM version we support: 0.32 (installed here,
checked live) and 0.33 (its GPU wheel cannot be installed on this CPU machine, so it is checked
against tests/support/data/vllm-0.33.0-connector-surface.json, made from the wheel by tests/support/vllm_surface.py).

Every abstract method implemented, every override callable the way vLLM calls it (by position and by
name), every member of the base class decided on (``DECISIONS``: ours, or why vLLM's default is
right), no field of the data types we read gone, every name vllm_pd imports from vLLM still there.
The negative controls show each check fails on a connector or a vLLM that breaks it."""

from __future__ import annotations

import ast
import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base

from tests.support import vllm_surface as vs
from vllm_pd.connector.connector import PDConnector

MANIFESTS = sorted((Path(__file__).parents[2] / "support" / "data").glob("vllm-*-connector-surface.json"))
BASE = f"{vs.BASE_MODULE}.KVConnectorBase_V1"
PACKAGE = Path(__file__).parents[3] / "vllm_pd"

# Every member of KVConnectorBase_V1 in any supported version: "ours" (PDConnector overrides it; its
# signature is checked) or why vLLM's default is right for PDConnector. A member a new vLLM adds
# fails the test until it is decided here.
DECISIONS: dict[str, str] = {
    "__init__": "ours",
    "_cache_hit_source": "PD loads and store hits are reported as external_unspecified",
    "supports_divergent_local_hybrid_hits": "no hybrid (recurrent) state is restored: False",
    "requires_kv_delivery": "the default (our producer role hands KV off) is what we do",
    "supports_sleep_mode": "ours",
    "role": "a property of the base",
    "get_mem_pool_context": "KV lives in the engine's default pool",
    "bind_connector_metadata": "ours",
    "clear_connector_metadata": "the base clears the bound metadata; workers keep no per-step state on it",
    "_get_connector_metadata": "unused",
    "has_connector_metadata": "unused",
    "register_kv_caches": "ours",
    "unregister_kv_caches": "ours",
    "restore_kv_caches": "ours",
    "set_host_xfer_buffer_ops": "we stage device KV through our own host staging (kv_access.py)",
    "finish_forward": "our sends hold their blocks until the transport reports them done",
    "reset_capture_state": "no state is mutated while CUDA graphs are captured (PIECEWISE graphs)",
    "handle_preemptions": "preempted transfers reach the workers in our own step metadata",
    "start_load_kv": "ours",
    "wait_for_layer_load": "ours",
    "save_kv_layer": "ours",
    "wait_for_save": "ours",
    "get_finished": "ours",
    "get_transfer_results": "ours",
    "get_block_ids_with_load_errors": "ours",
    "shutdown": "ours",
    "get_kv_connector_stats": "ours",
    "get_kv_connector_kv_cache_events": "no KV events",
    "get_handshake_metadata": "ours",
    "build_connector_worker_meta": "ours",
    "bind_kv_cache_manager": "ours",
    "bind_gpu_block_pool": "bind_kv_cache_manager gets the manager (and its pool)",
    "get_loaded_kv_cache_group_ids": "ours",
    "get_num_new_matched_tokens": "ours",
    "get_external_cache_hit_sources": "see _cache_hit_source",
    "update_state_after_alloc": "ours",
    "build_connector_meta": "ours",
    "on_new_request": "ours",
    "update_connector_output": "ours",
    "request_finished": "ours",
    "register_finished_partial_tail": "no partial-tail offload",
    "take_events": "no KV events",
    "has_pending_block_frees": "held blocks are freed by their transfer's end or lease, never on demand",
    "has_pending_push_work": "ours",
    "get_required_kvcache_layout": "ours",
    "requires_piecewise_for_cudagraph": "ours",
    "get_finished_count": "every worker reports its own sends and loads",
    "build_kv_connector_stats": "ours",
    "set_xfer_handshake_metadata": "ours",
    "set_xfer_handshake_metadata_pp_aware": "no pipeline parallelism: the base refuses pp_rank > 0 for us",
    "build_prom_metrics": "ours",
    "reset_cache": "the store outlives a prefix-cache reset (its keys are content hashes of this model)",
}
# fields of vLLM's data types that vllm_pd reads or sets (by class, short name)
READS = {
    "KVConnectorOutput": {"finished_sending", "finished_recving", "kv_connector_worker_meta"},
    "KVConnectorTransferResults": {"finished_sending", "finished_recving", "failed_recving"},
    "KVTransferConfig": {
        "kv_connector_extra_config",
        "kv_role",
        "kv_port",
        "engine_id",
        "kv_load_failure_policy",
        "is_kv_producer",
        "is_kv_consumer",
    },
    "KVCacheBlocks": {"get_block_ids"},
    "KVCacheConfig": {"num_blocks", "kv_cache_groups", "transfer_group_ids"},
    "KVCacheManager": {"get_block_ids"},
    "SchedulerOutput": {"total_num_scheduled_tokens", "preempted_req_ids", "num_scheduled_tokens"},
    "Request": {
        "request_id",
        "kv_transfer_params",
        "num_prompt_tokens",
        "prompt_token_ids",
        "num_computed_tokens",
        "status",
        "all_token_ids",
        # a recurrent state model's prefill leg is cut by one token (scheduler.on_new_request)
        "_all_token_ids",
        "max_tokens",
        "get_skip_reading_prefix_cache",
    },
}


def manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def live_032() -> dict[str, Any]:
    return {"members": vs.live_class_surface(vllm_base.KVConnectorBase_V1)}


def version_cases() -> list[Any]:
    return [pytest.param(lambda: live_032(), id="0.32-live")] + [
        pytest.param(lambda p=p: manifest(p)["classes"][BASE], id=p.name.split("-connector")[0]) for p in MANIFESTS
    ]


def test_the_033_manifest_is_committed() -> None:
    assert any("vllm-0.33" in p.name for p in MANIFESTS), "tests/support/data lacks vLLM 0.33's surface"


@pytest.mark.parametrize("surface", version_cases())
def test_pdconnector_fits_the_base_class(surface: Any) -> None:
    assert vs.check_connector(PDConnector, surface(), "KVConnectorBase_V1", DECISIONS) == []


# our classes that vLLM builds, passes or calls, beside the connector: (ours, vLLM's base, decisions)
def _types() -> list[tuple[type, str, dict[str, str]]]:
    from vllm_pd.connector.metadata import PDConnectorMetadata, PDHandshake, PDWorkerMeta
    from vllm_pd.connector.stats import PDConnectorStats, PDPromMetrics

    hma = vllm_base.SupportsHMA
    declared = issubclass(PDConnector, hma)
    return [
        (
            PDConnector,
            "SupportsHMA",
            {"request_finished_all_groups": "ours" if declared else "PDConnector does not declare SupportsHMA"},
        ),
        (PDWorkerMeta, "KVConnectorWorkerMetadata", {"aggregate": "ours"}),
        (PDHandshake, "KVConnectorHandshakeMetadata", {}),
        (PDConnectorMetadata, "KVConnectorMetadata", {}),
        (
            PDConnectorStats,
            "KVConnectorStats",
            {
                "__init__": "ours",
                "data": "the dataclass field",
                "to_dict": "data as it is",
                "reset": "ours",
                "aggregate": "ours",
                "reduce": "ours",
                "is_empty": "ours",
            },
        ),
        (PDPromMetrics, "KVConnectorPromMetrics", {"__init__": "ours", "observe": "ours"}),
    ]


def type_surfaces() -> list[Any]:
    cases = []
    for ours, base, decisions in _types():
        module = vs.METRICS_MODULE if "Stats" in base or "Prom" in base else vs.BASE_MODULE
        cases += [
            pytest.param(ours, base, decisions, p, id=f"{base}-{p.name.split('-connector')[0]}") for p in MANIFESTS
        ]
        live = getattr(__import__(module, fromlist=[base]), base)
        cases.append(pytest.param(ours, base, decisions, live, id=f"{base}-0.32-live"))
    return cases


@pytest.mark.parametrize("ours,base,decisions,source", type_surfaces())
def test_our_types_fit_vllms(ours: type, base: str, decisions: dict[str, str], source: Any) -> None:
    if isinstance(source, Path):
        module = vs.METRICS_MODULE if "Stats" in base or "Prom" in base else vs.BASE_MODULE
        surface = manifest(source)["classes"][f"{module}.{base}"]
    else:
        surface = {"members": vs.live_class_surface(source)}
        if base == "KVConnectorStats":
            surface["members"]["data"] = {"kind": "field", "abstract": False}
    if base == "SupportsHMA" and not issubclass(ours, vllm_base.SupportsHMA):
        # not declared: nothing of it is required, and nothing of it may be half there (the check below)
        surface = {"members": {k: {**m, "abstract": False} for k, m in surface["members"].items()}}
    assert vs.check_connector(ours, surface, base, decisions) == []


def test_decisions_name_only_members_vllm_has() -> None:
    known = set(live_032()["members"]) | {m for p in MANIFESTS for m in manifest(p)["classes"][BASE]["members"]}
    assert set(DECISIONS) - known == set()


def test_the_source_reader_sees_what_inspect_sees() -> None:
    """The manifest's reader (AST of the source, no import) on the installed 0.32 gives the same
    members, kinds and parameters as inspecting the live class: the 0.33 manifest is read the same way."""
    from_source = {
        k: m for k, m in installed_surface()["classes"][BASE]["members"].items() if m["kind"] != "instance_attribute"
    }  # inspect sees no instance
    live = live_032()["members"]
    assert set(from_source) == set(live)
    for name, member in live.items():
        assert {k: from_source[name][k] for k in member} == member, name


def fields_gone(classes: dict[str, Any]) -> dict[str, list[str]]:
    by_name = {name.rsplit(".", 1)[1]: c for name, c in classes.items()}
    gone = {cls: sorted(fields - set(by_name[cls]["members"])) for cls, fields in READS.items()}
    return {cls: f for cls, f in gone.items() if f}


@functools.cache
def installed_surface() -> dict[str, Any]:
    """The installed vLLM (0.32) read as the manifests are: from its source."""
    return vs.surface_from_source(Path(vllm_base.__file__).parents[5])


def reads_cases() -> list[Any]:
    return [pytest.param(lambda: installed_surface(), id="0.32-installed")] + [
        pytest.param(lambda p=p: manifest(p), id=p.name.split("-connector")[0]) for p in MANIFESTS
    ]


@pytest.mark.parametrize("surface", reads_cases())
def test_no_field_we_read_is_gone(surface: Any) -> None:
    assert fields_gone(surface()["classes"]) == {}


def vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in vllm_pd; (module, "") for ``import vllm.x``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                found |= {(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"}
    return found


def import_problems(modules: dict[str, Any], manifest_path: str) -> list[str]:
    problems = []
    for module, name in sorted(vllm_imports()):
        if module not in modules:
            problems.append(
                f"{module}: not in the manifest; add it to MODULES in tests/support/vllm_surface.py and "
                f"regenerate (python -m tests.support.vllm_surface WHEEL --out {manifest_path})"
            )
        elif name and name not in modules[module]["names"] and not modules[module]["dynamic"]:
            problems.append(f"{module} has no {name}")
    return problems


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_name_vllm_pd_imports_from_vllm_exists(path: Path) -> None:
    assert import_problems(manifest(path)["modules"], f"tests/support/data/{path.name}") == []


# ---- negative controls: each check fails where it should ---------------------------------------
def test_a_missing_abstract_method_fails() -> None:
    surface = copy.deepcopy(manifest(MANIFESTS[-1])["classes"][BASE])
    surface["members"]["prepare_kv_window"] = {
        "kind": "method",
        "abstract": True,
        "params": [["self", "positional_or_keyword", False]],
    }
    problems = vs.check_connector(
        PDConnector, surface, "KVConnectorBase_V1", {**DECISIONS, "prepare_kv_window": "ours"}
    )
    assert any("prepare_kv_window: abstract in vLLM, not implemented" in p for p in problems), problems


def test_an_undecided_new_hook_fails() -> None:
    surface = copy.deepcopy(manifest(MANIFESTS[-1])["classes"][BASE])
    surface["members"]["on_weights_updated"] = {
        "kind": "method",
        "abstract": False,
        "params": [["self", "positional_or_keyword", False]],
    }
    problems = vs.check_connector(PDConnector, surface, "KVConnectorBase_V1", DECISIONS)
    assert problems == [
        "on_weights_updated: new in vLLM's KVConnectorBase_V1: decide (implement it, or record "
        "why the default is right)"
    ]


class _Renamed(PDConnector):
    def get_finished(self, done: set[str]) -> tuple[set[str] | None, set[str] | None]:  # type: ignore[override]
        return None, None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:  # type: ignore[override]
        pass

    @classmethod
    def supports_sleep_mode(cls) -> bool:  # type: ignore[override]
        return True

    def restore_kv_caches(self, strict: bool) -> None:  # type: ignore[override]
        pass


def test_a_mismatched_signature_fails() -> None:
    problems = vs.check_connector(_Renamed, manifest(MANIFESTS[-1])["classes"][BASE], "KVConnectorBase_V1", DECISIONS)
    assert sorted(problems) == [
        "get_finished: parameter 1 is 'done' (positional_or_keyword), vLLM's is 'finished_req_ids' "
        "(positional_or_keyword)",
        "restore_kv_caches: extra parameter 'strict' without a default: vLLM never passes it",
        "save_kv_layer: missing **kwargs (vLLM's has it)",
        "supports_sleep_mode: missing positional parameter 'kv_transfer_config'",
    ]


def test_a_member_of_another_kind_fails() -> None:
    surface = copy.deepcopy(manifest(MANIFESTS[-1])["classes"][BASE])
    surface["members"]["requires_piecewise_for_cudagraph"]["kind"] = "method"
    problems = vs.check_connector(PDConnector, surface, "KVConnectorBase_V1", DECISIONS)
    assert problems == ["requires_piecewise_for_cudagraph: ours is a classmethod, vLLM's a method"]


def test_a_field_gone_from_a_data_type_fails() -> None:
    classes = copy.deepcopy(manifest(MANIFESTS[-1])["classes"])
    del classes["vllm.v1.outputs.KVConnectorOutput"]["members"]["finished_sending"]
    assert fields_gone(classes) == {"KVConnectorOutput": ["finished_sending"]}


def test_a_name_gone_from_a_module_fails(tmp_path: Path) -> None:
    surface = manifest(MANIFESTS[-1])
    surface["modules"]["vllm.v1.request"]["names"].remove("Request")
    del surface["modules"]["vllm.forward_context"]
    problems = import_problems(surface["modules"], "MANIFEST")
    assert (
        problems[0] == "vllm.forward_context: not in the manifest; add it to MODULES in "
        "tests/support/vllm_surface.py and regenerate (python -m tests.support.vllm_surface WHEEL --out MANIFEST)"
    )
    assert problems[1:] == ["vllm.v1.request has no Request"]

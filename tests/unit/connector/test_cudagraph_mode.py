"""CUDA graph mode per configuration: PIECEWISE only where a layer-wise hook may run.

A replayed FULL CUDA graph runs no Python between layers: a layer-wise load's
``wait_for_layer_load`` would be skipped and attention would read KV that has not landed.
The connector asks vLLM for PIECEWISE graphs where its settings allow a layer-wise load
(``load_mode`` auto / layerwise, or a store); a decode that loads whole requests before
its step keeps FULL graphs, and then never loads layer-wise, even when a request asks.

vLLM's own config code decides the mode (``VllmConfig.__post_init__``): it runs here with
the platform mocked to one with CUDA graphs (this machine's CPU platform has none and would
turn graphs off), so the test sees the mode a GPU instance would get.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_pd.connector.config import PDConnectorConfig, needs_layer_hooks
from vllm_pd.connector.connector import PDConnector
from vllm_pd.connector.scheduler import PDConnectorScheduler
from vllm_pd.protocol.transfer_params import RemotePrefill

STORE = {"cpu_bytes": "64m"}
MATRIX = [  # (kv_connector_extra_config, PIECEWISE needed)
    ({"load_mode": "async"}, False),  # decode loads whole requests before its step
    ({"load_mode": "async", "default_mode": "push"}, False),  # prefill's pushes leave after a replay
    ({"load_mode": "auto"}, True),  # layer-wise while alone
    ({}, True),  # the default is auto
    ({"load_mode": "layerwise"}, True),
    ({"load_mode": "async", "store": STORE}, True),  # the store's loads are layer-wise
    ({"load_mode": "layerwise", "store": STORE}, True),
]


@pytest.mark.parametrize(("extra", "piecewise"), MATRIX)
def test_piecewise_only_where_a_layerwise_hook_may_run(extra: dict[str, Any], piecewise: bool) -> None:
    assert PDConnector.requires_piecewise_for_cudagraph(extra) is piecewise
    assert needs_layer_hooks(PDConnectorConfig.from_extra_config(extra)) is piecewise


def test_a_bad_setting_stops_the_config_naming_its_key() -> None:
    with pytest.raises(Exception, match="load_mode"):
        PDConnector.requires_piecewise_for_cudagraph({"load_mode": "sometimes"})


@pytest.fixture
def graphs_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's platform as on a GPU, as far as CUDA graph modes go (mocked: no GPU here)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "support_static_graph_mode", lambda: True)
    monkeypatch.setattr(current_platform, "check_and_update_config", lambda vllm_config: None)


def _vllm_config(extra: dict[str, Any], role: str, mode: str) -> Any:
    from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    ktc = KVTransferConfig(
        kv_connector="PDConnector",
        kv_connector_module_path="vllm_pd.connector.connector",
        kv_role=role,
        kv_connector_extra_config=extra,
    )
    return VllmConfig(kv_transfer_config=ktc, compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer", "kv_both"])
@pytest.mark.parametrize(("extra", "piecewise"), [MATRIX[0], MATRIX[2], MATRIX[5]])
def test_vllm_keeps_full_graphs_only_where_no_layerwise_hook_runs(
    graphs_platform: None, extra: dict[str, Any], piecewise: bool, role: str
) -> None:
    for mode in ("FULL_AND_PIECEWISE", "FULL"):
        vllm_config = _vllm_config(extra, role, mode)
        got = vllm_config.compilation_config.cudagraph_mode.name
        assert got == ("PIECEWISE" if piecewise else mode), (extra, role, mode)
        # and the decode side then loads layer-wise only where vLLM calls the hooks
        sched = PDConnectorScheduler(vllm_config, PDConnectorConfig.from_extra_config(extra), "e")
        assert sched.layerwise_loads is piecewise


def _decode_leg(req_id: str, load_mode: str) -> SimpleNamespace:
    remote = RemotePrefill(
        transfer_id=f"t-{req_id}",
        engine_id="p",
        endpoint="tcp://10.0.0.1:5000",
        host="10.0.0.1",
        port=5000,
        block_ids=(1, 2, 3),
        num_tokens=40,
        block_size=16,
        mode="push",
    )
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(40)),
        num_prompt_tokens=40,
        kv_transfer_params={**remote.to_params(), "load_mode": load_mode},
    )


@pytest.mark.parametrize(("full_graphs", "layerwise"), [(True, False), (False, True)])
def test_under_full_graphs_a_request_asking_for_a_layerwise_load_loads_before_its_step(
    full_graphs: bool, layerwise: bool
) -> None:
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
    )
    sched = PDConnectorScheduler(vllm_config, PDConnectorConfig.from_extra_config({"load_mode": "async"}), "e")
    req = _decode_leg("r1", "layerwise")
    sched.note_request(req.request_id)
    count, is_async = sched.get_num_new_matched_tokens(req, 0)
    # layer-wise leaves the prompt's last token to the step's forward; async loads it all, off the batch
    assert (count, is_async) == ((39, False) if layerwise else (40, True))

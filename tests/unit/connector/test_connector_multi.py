"""PDConnector inside vLLM's MultiConnector, the parts that need no server: how the class-level
answers combine with another connector's (vLLM's OffloadingConnector here), and the stats of both
coming back by name in the API server process (tests/e2e/test_connector_multi_e2e.py runs the instance)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

import vllm_pd
from tests.support.offload_cpu_spec import OFFLOAD
from vllm_pd.connector.connector import PDConnector
from vllm_pd.connector.stats import PDConnectorStats

PD = {
    "kv_connector": "PDConnector",
    "kv_connector_module_path": "vllm_pd.connector.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"transport": "tcp"},
}


def multi(*children: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": list(children)}
    )


def test_piecewise_cuda_graphs_are_asked_for_by_pd_alone() -> None:
    assert MultiConnector.requires_piecewise_for_cudagraph(multi(PD, OFFLOAD).kv_connector_extra_config)
    assert not MultiConnector.requires_piecewise_for_cudagraph(multi(OFFLOAD).kv_connector_extra_config)


def test_hybrid_kv_cache_manager_only_where_every_child_supports_it() -> None:
    assert supports_hma(OffloadingConnector)
    assert KVConnectorFactory.supports_hma_config(multi(OFFLOAD))
    assert KVConnectorFactory.supports_hma_config(multi(PD, OFFLOAD)) == supports_hma(PDConnector)


def test_both_connectors_stats_come_back_by_name_in_the_api_server() -> None:
    """vLLM's logger and /metrics rebuild MultiConnector's stats from dicts by each child's
    registered name (KVConnectorFactory.get_connector_class_by_name): our vllm.general_plugins
    entry point registers "PDConnector" in every process vLLM starts. Negative control: unregistered,
    the API server's stats path raises."""
    pd = PDConnectorStats(rank=0)
    pd.record_push(3, 3000)
    data = {"PDConnector": pd.to_dict(), "OffloadingConnector": {}}
    saved = KVConnectorFactory._registry.pop("PDConnector", None)
    try:
        with pytest.raises(ValueError, match="'PDConnector' is not registered"):
            MultiConnector.build_kv_connector_stats(data=data)
        vllm_pd.register()
        rebuilt = MultiConnector.build_kv_connector_stats(data=data)
    finally:
        if saved is not None:
            KVConnectorFactory._registry["PDConnector"] = saved
    assert rebuilt is not None
    assert rebuilt.reduce()["PDConnector"]["pushed_blocks"] == 3

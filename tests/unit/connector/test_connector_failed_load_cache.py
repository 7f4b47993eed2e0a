"""A failed layer-wise KV load must not leave its blocks in vLLM's prefix cache: the mechanism behind a
wrong answer under a fault (issue 29), reproduced deterministically with vLLM's own scheduler.

A layer-wise load is a sync load: vLLM caches the request's blocks (their hashes) when it schedules the
forward that fills them. When a layer does not land (prefill cut off mid-transfer), the worker reports the
blocks invalid and, under ``kv_load_failure_policy=recompute``, vLLM reschedules the request to recompute
them - but leaves them in the prefix cache, counting on that recompute. When the request is aborted
first (what the proxy does when it finds prefill unreachable: it cancels the decode leg and sends the
prompt decode-only), or another request with the same prompt is scheduled before the recompute, that
request takes the unfilled blocks as computed: its answer is computed on KV that was never written.

The engine is vLLM's real Scheduler and KV cache manager with our connector's scheduler side; the model
runner is stood in for by the outputs a worker reports (a forward cannot run here, and the point is
what the scheduler does with them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_pd.connector.metadata import PDWorkerMeta
from vllm_pd.protocol.transfer_params import AwaitedPrefill

BLOCK = 16
PROMPT = list(range(100, 100 + 5 * BLOCK + 3))  # 5 full blocks and a partial one


def _scheduler(model: Path) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import vllm_pd

    vllm_pd.register()
    model_config = ModelConfig(model=str(model), dtype="bfloat16", seed=0, max_model_len=1024)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDConnector", kv_role="kv_both", kv_load_failure_policy="recompute"
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = 64
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def _request(req_id: str, kv_params: dict | None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": kv_params} if kv_params else None)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(PROMPT),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _output(sched_out: Any, invalid: set[int] = frozenset(), announced: frozenset[str] = frozenset()) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(
            invalid_block_ids=set(invalid), kv_connector_worker_meta=PDWorkerMeta(announced) if announced else None
        ),
    )


def _failed_layerwise_load(sched: Any) -> tuple[Any, set[int]]:
    """Decode leg A, sent beside its prefill leg: announced, loaded layer-wise, a layer never landed."""
    a = _request("A", AwaitedPrefill("t-A", "push").to_params())
    sched.add_request(a)
    out = sched.schedule()
    assert not out.num_scheduled_tokens  # held until prefill announces the push
    sched.update_from_output(out, _output(out, announced=frozenset({"t-A"})))
    out = sched.schedule()
    [load] = out.kv_connector_metadata.loads
    assert load.layerwise and out.num_scheduled_tokens == {"A": 1}  # the rest of the prompt comes from prefill
    # the worker's report: the load failed (KVLoader.block_ids_with_load_errors), vLLM recomputes its blocks
    sched.update_from_output(out, _output(out, invalid=set(load.local_block_ids)))
    assert a.num_computed_tokens == 0  # rescheduled to recompute from the first failed block
    return a, set(load.local_block_ids)


def _prefix_hit(sched: Any, req_id: str) -> int:
    """Tokens of a new request with the same prompt (decode-only) that the prefix cache gives it."""
    sched.add_request(_request(req_id, None))
    out = sched.schedule()
    [new] = [r for r in out.scheduled_new_reqs if r.req_id == req_id]
    return int(new.num_computed_tokens)


@pytest.mark.parametrize("abort_first", [True, False], ids=["failed-leg-aborted", "same-prompt-meanwhile"])
def test_blocks_of_a_failed_layerwise_load_are_no_prefix_hit(small_model_dir: Path, abort_first: bool) -> None:
    from vllm.v1.request import RequestStatus

    sched = _scheduler(small_model_dir)
    a, failed = _failed_layerwise_load(sched)
    if abort_first:
        # the proxy found prefill unreachable: it cancels this leg and sends the prompt decode-only
        sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    hit = _prefix_hit(sched, "A-decode-only")
    assert hit == 0, f"{hit} prompt tokens taken from the blocks of a load that failed: KV never written"
    assert failed  # (the failed blocks were real ones)

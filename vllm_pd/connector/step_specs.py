"""What the scheduler side tells a worker each step, as plain data (no vLLM import).

The worker's data path (sender, loader, transports) reads only these, so it runs
where vLLM does not (the GPU harness); ``metadata.PDConnectorMetadata`` is the
same step as vLLM's connector metadata type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_pd.connector.device.kv_geometry import incompatibility
from vllm_pd.protocol.kv_shape import KVShape
from vllm_pd.protocol.transfer_params import RemotePrefill


class LocalPrompt(msgspec.Struct, frozen=True):
    """What decode knows of a request's prompt, to check remote KV is really for it."""

    prompt_hash: str
    num_tokens: int
    block_size: int
    tp_size: int
    kv_format: str = ""  # what our blocks' bytes mean ("": not known, not checked)
    shape: KVShape | None = None  # our KV shape (None: not known, equal shapes only)

    def mismatch(self, remote: RemotePrefill) -> str | None:
        """Why ``remote``'s KV cannot be used for this prompt, or None if it can."""
        if remote.prompt_hash and remote.prompt_hash != self.prompt_hash:
            return "prompt differs from the one prefill computed"
        if remote.shape is not None and self.shape is not None:
            # another TP, block size or layout is taken where heads and tokens can be re-cut
            return incompatibility(remote.shape, self.shape)
        if remote.block_size != self.block_size:
            return f"block size {remote.block_size} != ours {self.block_size}"
        if self.kv_format and remote.kv_format and remote.kv_format != self.kv_format:
            # same sizes, other meaning (another KV cache layout, kernel block or dtype): wrong KV if used
            return f"KV cache blocks laid out as {remote.kv_format}, ours as {self.kv_format}"
        if remote.tp_size != self.tp_size:
            # rank r of each side holds the r-th shard of the heads: other TP sizes shard differently
            return f"prefill TP {remote.tp_size} != ours {self.tp_size} (PD needs equal tensor-parallel sizes)"
        if remote.prompt_hash and remote.prompt_hash != self.prompt_hash:
            return "prompt differs from the one prefill computed"
        return None


@dataclass(frozen=True)
class SendSpec:
    """Prefill side: a request whose KV a decode instance will take, this step."""

    transfer_id: str  # the proxy's name of the transfer, else the request's id (RemotePrefill.transfer_id)
    block_ids: tuple[int, ...]  # all the request's blocks so far (KV cache group 0's)
    first_token: int  # tokens before it were sent already (a block-aligned token: a partial block goes again)
    end_token: int  # tokens with KV once this step's forward is done
    num_prompt_tokens: int
    push_endpoint: str | None  # push each layer here; None: decode pulls
    # on the step that completes the prompt: RemotePrefill.to_params(), announced at
    # announce_endpoint once the forward is done (a decode leg sent beside the prefill leg waits for it)
    announcement: dict[str, Any] | None = None
    announce_endpoint: str | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # every KV cache group's blocks, where several

    @property
    def prefill_done(self) -> bool:
        return self.end_token >= self.num_prompt_tokens

    def group_blocks(self, group: int) -> tuple[int, ...]:
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids


@dataclass(frozen=True)
class FinishedSend:
    """Prefill side: the scheduler saw the request finish."""

    transfer_id: str
    request_id: str  # vLLM's: the worker reports the transfer finished under it
    held: bool  # blocks kept for decode (normal finish); False: aborted, release at once


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: land a remote prefill's KV into our blocks."""

    request_id: str
    transfer_id: str  # pushed blocks land under it; an awaited prefill is announced under it
    # None: the decode leg came before prefill finished (AwaitedPrefill); prefill announces it
    remote: RemotePrefill | None
    first_position: int  # the request's block index of local_block_ids[0] (KV cache group 0)
    local_block_ids: tuple[int, ...]
    # True: vLLM runs the request's forward now and waits per layer (sync load);
    # False: the request waits off-batch until the whole load is reported
    layerwise: bool = False
    prompt: LocalPrompt | None = None  # awaited prefill: the prompt its announcement must match
    # every KV cache group's (first position, local block ids), where several (a hybrid model)
    group_loads: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # tokens of the prompt whose KV is loaded (0: all prefill computed)
    num_tokens: int = 0

    def group(self, group: int) -> tuple[int, tuple[int, ...]]:
        """(first position, local block ids) of KV cache group ``group``."""
        return self.group_loads[group] if self.group_loads else (self.first_position, self.local_block_ids)

    @property
    def all_local_block_ids(self) -> tuple[int, ...]:
        """Every block this load writes, of every group."""
        if not self.group_loads:
            return self.local_block_ids
        return tuple(b for _, ids in self.group_loads for b in ids)

    def remote_block_ids(self, remote: RemotePrefill, group: int = 0) -> tuple[int, ...]:
        first, ids = self.group(group)
        return remote.group_blocks(group)[first : first + len(ids)]

    def group_positions(self, group: int) -> range:
        first, ids = self.group(group)
        return range(first, first + len(ids))

    @property
    def positions(self) -> range:
        return self.group_positions(0)


@dataclass(frozen=True)
class RemoteRelease:
    """Decode side: tell prefill its held KV is not needed (abort, local hit, unusable);
    each worker tells its share of prefill's ranks (:meth:`RemotePrefill.release_endpoints`)."""

    remote: RemotePrefill
    refused: bool = False  # its KV is of a shape we cannot take (counted)


@dataclass
class WorkerStep:
    sends: list[SendSpec] = field(default_factory=list)
    finished_sends: list[FinishedSend] = field(default_factory=list)
    preempted_transfers: list[str] = field(default_factory=list)  # transfer ids
    loads: list[LoadSpec] = field(default_factory=list)
    remote_releases: list[RemoteRelease] = field(default_factory=list)
    # transfer ids of awaited pushes no request will claim (abort, local prefix hit):
    # released at prefill as soon as it announces them
    abandoned_pushes: list[str] = field(default_factory=list)
    # requests aborted while their load waited for prefill's announcement: end those loads now
    cancelled_loads: list[str] = field(default_factory=list)
    # transfer ids of decode legs waiting (unscheduled) for prefill's announcement: an idle step may wait for them
    awaited_transfers: list[str] = field(default_factory=list)
    # nothing scheduled this step: the worker may wait briefly for transfer events
    idle: bool = False
    # the KV block store's work for this step (store_bridge.StoreStepMeta), None = no store
    store: Any = None

"""What the scheduler side tells a worker each step, as plain data (no vLLM import).

The worker's data path (sender, loader, transports) reads only these, so it runs
where vLLM does not (the GPU harness); ``metadata.PDConnectorMetadata`` is the
same step as vLLM's connector metadata type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_pd.connector.transfer_params import LocalPrompt, RemotePrefill


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

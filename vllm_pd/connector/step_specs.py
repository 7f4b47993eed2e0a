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
    block_ids: tuple[int, ...]  # all the request's blocks so far
    first_block: int  # first position to send this step (earlier ones went already)
    end_token: int  # tokens with KV once this step's forward is done
    num_prompt_tokens: int
    push_endpoint: str | None  # push each layer here; None: decode pulls
    # on the step that completes the prompt: RemotePrefill.to_params(), announced at
    # announce_endpoint once the forward is done (a decode leg sent beside the prefill leg waits for it)
    announcement: dict[str, Any] | None = None
    announce_endpoint: str | None = None

    @property
    def prefill_done(self) -> bool:
        return self.end_token >= self.num_prompt_tokens


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
    first_position: int  # the request's block index of local_block_ids[0]
    local_block_ids: tuple[int, ...]
    # True: vLLM runs the request's forward now and waits per layer (sync load);
    # False: the request waits off-batch until the whole load is reported
    layerwise: bool = False
    prompt: LocalPrompt | None = None  # awaited prefill: the prompt its announcement must match

    def remote_block_ids(self, remote: RemotePrefill) -> tuple[int, ...]:
        return remote.block_ids[self.first_position:self.first_position + len(self.local_block_ids)]

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + len(self.local_block_ids))


@dataclass(frozen=True)
class RemoteRelease:
    """Decode side: tell prefill its held KV is not needed (abort, local hit, unusable);
    each worker tells its share of prefill's ranks (:meth:`RemotePrefill.release_endpoints`)."""

    remote: RemotePrefill


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



"""Scheduler side of the PD connector (runs in vLLM's EngineCore process).

It decides, per request and per step, what the worker side moves:

* prefill (``do_remote_decode``): each step that computes part of the prompt
  becomes a :class:`SendSpec`; when the request finishes its blocks are held
  (``request_finished`` -> True) until the worker reports the transfer released
  by decode, expired (lease) or aborted - then vLLM frees them.
* decode (``do_remote_prefill``): the prompt counts as computed elsewhere; an
  async (or layer-wise) load lands it in our blocks, and prefill is always told
  to release its copy, also when the request is aborted before admission or its
  prompt was already in our own prefix cache. A decode leg sent beside its
  prefill leg (:class:`AwaitedPrefill`) loads asynchronously once prefill announces
  the push; if it will never load, the push is abandoned (released when announced).

A hybrid model (vLLM's hybrid KV cache manager on: several KV cache groups) moves every
group's blocks: a sliding window's only those decode reads. A recurrent state (Mamba, linear
attention) moves the state after the prompt's last token but one: prefill stops one token short
(its request is cut when it arrives, :meth:`PDConnectorScheduler.on_new_request`) and decode
computes the last token from that state, as it does a token after its own prefix-cache hit.
Prefill's KV shape (``kv_geometry.KVShape``, from the workers' handshake) travels with its
answer; decode takes KV of another TP or block size, and refuses only what cannot be re-cut.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_pd.connector.announce_probe import AnnounceProbe
from vllm_pd.connector.config import PROBE_PAUSED_PUSHES_S, PDConnectorConfig
from vllm_pd.connector.device.kv_geometry import incompatibility, window_positions
from vllm_pd.connector.metadata import (
    FinishedSend,
    LoadSpec,
    PDConnectorMetadata,
    PDHandshake,
    RemoteRelease,
    SendSpec,
)
from vllm_pd.connector.step_specs import LocalPrompt
from vllm_pd.protocol.kv_shape import KVGroup, KVShape, decode_shape
from vllm_pd.protocol.transfer_params import (
    AwaitedPrefill,
    RemoteDecodeRequest,
    RemotePrefill,
    TransferParamsError,
    asks_remote_decode,
    asks_remote_prefill,
    mark_remote_prefill_taken,
    parse_decode_leg,
    prompt_hash,
    requested_load_mode,
)
from vllm_pd.vllm_logging import vllm_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = vllm_logger(__name__)

# set in a prefill leg's kv_transfer_params once its prompt is cut (on_new_request): never cut twice
_CUT_KEY = "_vllm_pd_prompt_cut"


@dataclass
class _OutgoingRequest:
    request: Request
    ask: RemoteDecodeRequest  # resolved: its mode is the one used
    next_token: int = 0  # first token not yet handed to the worker (block-aligned)
    seen_by_worker: bool = False
    prompt_hash: str = ""  # hashed once: the announcement and the final params both carry it

    @property
    def transfer_id(self) -> str:
        """The transfer's one name: the proxy's where it named it (the decode leg beside this
        one waits for it), else this request's id."""
        return self.ask.transfer_id or self.request.request_id


def full_cudagraphs(vllm_config: VllmConfig) -> bool:
    """Whether vLLM may replay this instance's forward as a FULL CUDA graph (no Python between layers)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return bool(mode is not None and mode.has_full_cudagraphs())


def kv_cache_groups(kv_cache_config: Any, block_size: int, vllm_config: Any = None) -> tuple[KVGroup, ...]:
    """vLLM's KV cache groups as kv_geometry's (their block formats come from the workers): full
    attention (MLA too), a sliding window, a recurrent state (Mamba, linear attention; its shard
    layout where vllm-pd cuts it across TP, ``state_layout``, which reads ``vllm_config``)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    from vllm_pd.connector.state_layout import state_layout

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return (KVGroup("full", block_size, ""),)
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            groups.append(KVGroup("state", spec.block_size, "", state=state_layout(spec, vllm_config)))
        elif isinstance(spec, SlidingWindowSpec):
            groups.append(KVGroup("window", spec.block_size, "", spec.sliding_window))
        else:
            groups.append(KVGroup("full", spec.block_size, ""))
    return tuple(groups)


class PDConnectorScheduler:
    def __init__(
        self, vllm_config: VllmConfig, config: PDConnectorConfig, engine_id: str, kv_cache_config: Any = None
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.groups = kv_cache_groups(kv_cache_config, self.block_size, vllm_config)
        # A sliding window's first token of the last prompt token's window must be in decode's blocks:
        # vLLM nulls the blocks behind (local + external tokens) - window + 1, so a load covering the
        # whole prompt could leave that block null while the last token is computed again; a load of
        # a model with a window always leaves the last token to decode's forward.
        # A recurrent state cannot be computed again over a token it has taken in: prefill stops one
        # token short (on_new_request) and decode's forward takes the last one in.
        self._has_state = any(g.kind == "state" for g in self.groups)
        self._leave_last = self._has_state or any(g.kind == "window" for g in self.groups)
        # a prompt is handed to the workers in steps of whole blocks of every group
        self._token_step = math.lcm(*(g.block_size for g in self.groups))
        self.shape: KVShape | None = None  # the workers' (handshake): travels with our KV
        # FULL CUDA graphs replay decode steps without our per-layer waits: whole-request loads only
        # (vLLM keeps them only where config.needs_layer_hooks said no layer-wise load would run)
        self.layerwise_loads = not full_cudagraphs(vllm_config)
        self._layerwise_refused = False
        self._push_refused = False
        self._kv_cache_manager: Any = None
        self._endpoints: tuple[str, ...] = ()
        self._host = ""
        self._port = 0
        self.kv_format = ""  # the workers' (handshake): travels with our KV, checked against theirs
        # prefill side
        self._outgoing: dict[str, _OutgoingRequest] = {}  # by request id
        # transfer id -> request id, until vLLM frees the request's blocks (the worker's state of it is gone)
        self._transfer_owners: dict[str, str] = {}
        self._finished_sends: list[FinishedSend] = []
        self._preempted: list[str] = []
        # decode side
        # req -> (remote, locally computed tokens, layer-wise load)
        self._matched: dict[str, tuple[RemotePrefill | AwaitedPrefill, int, bool]] = {}
        self._loads: list[LoadSpec] = []
        self._releases: list[RemoteRelease] = []
        self._abandoned: list[str] = []
        self._awaiting: set[str] = set()  # requests whose load waits for prefill's announcement
        self._cancelled_loads: list[str] = []
        self._live: set[str] = set()  # requests of any role not finished yet
        self._refused: set[str] = set()  # decode legs whose remote KV was refused for its shape
        self._announced: dict[str, float] = {}  # transfer id -> when its announcement reached us
        # unscheduled decode legs waiting for prefill's announcement: request -> (since, transfer id)
        self._awaited_since: dict[str, tuple[float, str]] = {}
        self._announce_probe = AnnounceProbe(config.peer_probe_s)  # is a late announcement's prefill there?

    # ---- set-up ---------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_handshake(self, by_rank: dict[int, PDHandshake]) -> None:
        ranks = sorted(by_rank)
        self._endpoints = tuple(by_rank[r].endpoint for r in ranks)
        self._host = by_rank[ranks[0]].host
        self._port = by_rank[ranks[0]].port
        self.kv_format = "|".join(sorted({by_rank[r].kv_format for r in ranks}))  # one, as ranks shard alike
        shapes = {by_rank[r].kv_shape for r in ranks}
        self.shape = decode_shape(shapes.pop()) if len(shapes) == 1 and b"" not in shapes else None
        logger.info(
            "PD connector KV endpoints: %s; KV blocks %s; %s",
            ", ".join(self._endpoints),
            self.kv_format or "(format not reported)",
            f"TP {self.shape.tp_size}, {self.shape.kv_heads} KV heads, groups "
            + ", ".join(f"{g.kind}/{g.block_size}" for g in self.shape.groups)
            if self.shape is not None
            else "KV shape not reported (equal shapes only)",
        )

    def prefill_tokens(self, num_prompt_tokens: int) -> int:
        """The tokens of a prompt whose KV prefill computes for decode: all, or all but the last
        where the model keeps a recurrent state (see on_new_request)."""
        return num_prompt_tokens - 1 if self._has_state and num_prompt_tokens > 1 else num_prompt_tokens

    def on_new_request(self, request: Request) -> None:
        """A prefill leg of a model with a recurrent state computes its prompt but the last token.

        The state after the whole prompt cannot take the last token in again, and decode computes
        at least one prompt token itself (the one its first output comes from): so prefill's state
        is the one after the last token but one, and decode computes the last. Its one output
        token (of the shorter prompt) is not an answer: the proxy answers from decode's. A request
        that reads no prefix cache (prompt logprobs), which decode computes from scratch, is not
        cut (decode finds prefill's KV is for a longer prompt and computes it). As vLLM's
        NixlConnector does (``_truncate_request_for_prefill``)."""
        params = request.kv_transfer_params
        if not self._has_state or params is None or not asks_remote_decode(params) or params.get(_CUT_KEY):
            return
        prompt = request.prompt_token_ids
        if prompt is None or len(prompt) < 2 or request.get_skip_reading_prefix_cache():
            return
        del prompt[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params[_CUT_KEY] = True

    # ---- decode side: remote prefill -> load --------------------------------------------------
    def note_request(self, request_id: str) -> None:
        """Every request vLLM asks us about (any role): while another one lives, a layer-wise
        load would stall it for as long as the load's forward waits."""
        self._live.add(request_id)

    def note_announced(self, transfer_ids: frozenset[str]) -> None:
        now = time.monotonic()
        for transfer_id in transfer_ids:
            self._announced[transfer_id] = now
        for transfer_id in [t for t, at in self._announced.items() if now - at > self.config.lease_s]:
            del self._announced[transfer_id]  # its decode leg never came (prefill's lease frees the KV)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._decode_leg(request)
        if isinstance(remote, AwaitedPrefill):
            return self._match_awaited(request, remote, num_computed_tokens)
        if remote is None:
            return 0, False
        prompt = request.prompt_token_ids or []
        if not self._remote_usable(request, remote, prompt):
            return 0, False
        layerwise = self._layerwise(request)
        # An async load may cover the whole prompt (vLLM then recomputes the last token);
        # a layer-wise (sync) load must leave that token for this step's forward (and a load with a
        # sliding window, see _leave_last).
        count = min(remote.num_tokens, len(prompt) - (1 if layerwise or self._leave_last else 0)) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = (remote, num_computed_tokens, layerwise)
        return count, not layerwise

    def _decode_leg(self, request: Request) -> RemotePrefill | AwaitedPrefill | None:
        """Where this decode leg's prompt KV comes from; None (logged) if its params are malformed."""
        try:
            return parse_decode_leg(request.kv_transfer_params)
        except TransferParamsError as e:
            logger.warning("request %s: %s; decode recomputes the prompt", request.request_id, e)
            return None

    def _match_awaited(
        self, request: Request, awaited: AwaitedPrefill, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A decode leg sent beside its prefill leg. Unless async loads are asked for, it stays
        unscheduled (None) until prefill announces its KV - the announcement of a push comes as
        prefill's last forward starts - and then takes a layer-wise load if nothing else runs
        here: its forward runs beside prefill's, each layer waiting for the pushed KV, instead
        of a whole engine step after the load."""
        req_id = request.request_id
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        layerwise = False
        if self._load_mode(request) != "async":
            if awaited.transfer_id not in self._announced:
                since, _ = self._awaited_since.setdefault(req_id, (time.monotonic(), awaited.transfer_id))
                waited = time.monotonic() - since
                if waited < self.config.transfer_timeout_s:
                    if not self._prefill_lost(awaited, waited):
                        return None, False
                else:
                    logger.warning(
                        "request %s: prefill never announced %s within %.0fs; decode recomputes the prompt",
                        req_id,
                        awaited.transfer_id,
                        self.config.transfer_timeout_s,
                    )
                del self._awaited_since[req_id]
                return 0, False  # update_state_after_alloc abandons the push
            layerwise = self._layerwise(request)
        # a layer-wise load (and one with a sliding window) leaves the last token to the forward: nothing
        # to load if it is the only one
        count -= 1 if layerwise or self._leave_last else 0
        if count <= 0:
            return 0, False  # update_state_after_alloc abandons the push
        self._matched[req_id] = (awaited, num_computed_tokens, layerwise)
        return count, not layerwise

    def _prefill_lost(self, awaited: AwaitedPrefill, waited: float) -> bool:
        """Whether the prefill of a late announcement stopped answering pings: no announcement will
        come from it (announce_probe.py)."""
        if waited < min(PROBE_PAUSED_PUSHES_S, self.config.push_wait_s) or not awaited.prefill_endpoints:
            return False
        if not self._announce_probe.lost(awaited.prefill_endpoints[0]):
            return False
        logger.warning(
            "transfer %s: prefill %s does not answer; decode computes the prompt",
            awaited.transfer_id,
            awaited.prefill_endpoints[0],
        )
        return True

    def _layerwise(self, request: Request) -> bool:
        if self._has_state:
            return False  # vLLM waits for no layer's load before a recurrent layer's forward
        mode = self._load_mode(request)
        return mode == "layerwise" or (mode == "auto" and self._live <= {request.request_id})

    def _load_mode(self, request: Request) -> str:
        """The instance's load_mode, unless the request's kv_transfer_params ask for another;
        async under FULL CUDA graphs."""
        mode = requested_load_mode(request.kv_transfer_params, self.config.load_mode)
        if mode == "async" or self.layerwise_loads:
            return mode
        if not self._layerwise_refused:
            self._layerwise_refused = True
            logger.warning(
                "request %s asks for a %s KV load, but this instance runs FULL CUDA graphs "
                "(load_mode async): its KV loads before its step instead",
                request.request_id,
                mode,
            )
        return "async"

    def _local_prompt(self, prompt: list[int]) -> LocalPrompt:
        """What prefill's KV must be for: the prompt's tokens that prefill computes."""
        prompt = prompt[: self.prefill_tokens(len(prompt))]
        return LocalPrompt(
            prompt_hash(prompt), len(prompt), self.groups[0].block_size, self.tp_size, self.kv_format, self.shape
        )

    def _remote_usable(self, request: Request, remote: RemotePrefill, prompt: list[int]) -> bool:
        reason = self._local_prompt(prompt).mismatch(remote)
        if reason:
            refused = (
                remote.shape is not None
                and self.shape is not None
                and incompatibility(remote.shape, self.shape) is not None
            )
            logger.warning(
                "request %s: remote KV not usable (%s); decode recomputes the prompt%s",
                request.request_id,
                reason,
                " (refused: shapes)" if refused else "",
            )
            if refused:
                self._refused.add(request.request_id)
        return reason is None

    def _group_loads(
        self, blocks: KVCacheBlocks, num_local: int, num_tokens: int
    ) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per KV cache group, (first position, our blocks) the load of ``num_tokens`` tokens lands
        in, past the ``num_local`` tokens of our own prefix cache: a sliding window's from the first
        block decode reads."""
        out = []
        for group, ids in zip(self.groups, blocks.get_block_ids(), strict=True):
            first = max(num_local // group.block_size, window_positions(group, num_tokens))
            last = -(-num_tokens // group.block_size)
            out.append((first, tuple(ids[first:last])))
        return tuple(out)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if asks_remote_decode(params):
            self._track_outgoing(request)
            return
        if not asks_remote_prefill(params):
            return
        remote = self._decode_leg(request)
        # Only one load per request: the second call (after the load) must not start another.
        mark_remote_prefill_taken(params)
        if isinstance(remote, AwaitedPrefill):
            self._load_awaited(request, remote, blocks, num_external_tokens)
            return
        matched = self._matched.pop(request.request_id, None)
        if remote is None:
            return
        if num_external_tokens == 0 or matched is None:
            # Prompt already in our prefix cache (or unusable): prefill's copy is not needed.
            self._releases.append(RemoteRelease(remote, refused=request.request_id in self._refused))
            self._refused.discard(request.request_id)
            return
        _, num_local, layerwise = matched
        loads = self._group_loads(blocks, num_local, min(remote.num_tokens, request.num_prompt_tokens))
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                transfer_id=remote.transfer_id,
                remote=remote,
                first_position=loads[0][0],
                local_block_ids=loads[0][1],
                layerwise=layerwise,
                group_loads=loads if len(loads) > 1 else (),
            )
        )

    def _load_awaited(
        self, request: Request, awaited: AwaitedPrefill, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.request_id, None)
        self._awaited_since.pop(request.request_id, None)
        self._announced.pop(awaited.transfer_id, None)
        if num_external_tokens == 0 or matched is None:
            self._abandoned.append(awaited.transfer_id)
            return
        _, num_local, layerwise = matched
        loads = self._group_loads(blocks, num_local, self.prefill_tokens(request.num_prompt_tokens))
        if not layerwise:
            self._awaiting.add(request.request_id)
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                transfer_id=awaited.transfer_id,
                remote=None,
                first_position=loads[0][0],
                local_block_ids=loads[0][1],
                layerwise=layerwise,
                prompt=self._local_prompt(request.prompt_token_ids or []),
                group_loads=loads if len(loads) > 1 else (),
            )
        )

    # ---- prefill side ---------------------------------------------------------------------------
    def _track_outgoing(self, request: Request) -> None:
        if request.request_id in self._outgoing:
            return
        try:
            ask = RemoteDecodeRequest.from_params(request.kv_transfer_params)
        except TransferParamsError as e:
            # computed like any request and freed at its end: the proxy's decode leg recomputes
            logger.warning("request %s: %s; its KV is not kept for a remote decode", request.request_id, e)
            return
        if ask is None:
            return
        out = _OutgoingRequest(request, self._resolve(ask))
        if out.transfer_id in self._transfer_owners:
            # a second transfer of that id would take the first one's pushes, grants and release
            logger.warning(
                "request %s: transfer_id %s is already in use here (request %s); its KV is not "
                "kept for a remote decode",
                request.request_id,
                out.transfer_id,
                self._transfer_owners[out.transfer_id],
            )
            return
        self._outgoing[request.request_id] = out
        self._transfer_owners[out.transfer_id] = request.request_id

    def _resolve(self, ask: RemoteDecodeRequest) -> RemoteDecodeRequest:
        """The mode this prefill leg uses: a recurrent state's is written by layers vLLM runs no save
        hook for, so it is pulled once the whole forward is done, never pushed layer by layer."""
        resolved = ask.resolve(self.config.default_mode)
        if self._has_state and resolved.mode == "push":
            if not self._push_refused:
                self._push_refused = True
                logger.info("PD connector: this model keeps a recurrent state: its KV is pulled by decode, not pushed")
            return msgspec.structs.replace(resolved, mode="pull")
        return resolved

    def forget_failed_blocks(self, block_ids: set[int]) -> None:
        """Blocks a sync (layer-wise) load failed to fill leave vLLM's prefix cache now.

        vLLM cached them when it scheduled the forward that was to fill them, and under
        kv_load_failure_policy=recompute it leaves them cached for the failed request's
        recompute. A request with the same prompt scheduled before that recompute - above all
        the decode-only resend of a leg the proxy cancelled, after which no recompute comes -
        would take them as computed and answer from KV that was never written. Uncached, they
        are recomputed by whoever needs them (the failed request keeps its own)."""
        if self._kv_cache_manager is not None:
            self._kv_cache_manager.evict_blocks(set(block_ids))
            logger.info("%d block(s) of a failed KV load removed from the prefix cache", len(block_ids))

    def note_sent(self, request_ids: set[str] | frozenset[str]) -> None:
        """vLLM frees these requests' blocks: the workers are done with their transfers, whose ids
        may name new ones."""
        if request_ids:
            for transfer_id in [t for t, r in self._transfer_owners.items() if r in request_ids]:
                del self._transfer_owners[transfer_id]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(
            finished_sends=self._finished_sends,
            loads=self._loads,
            remote_releases=self._releases,
            abandoned_pushes=self._abandoned,
            cancelled_loads=self._cancelled_loads,
            preempted_transfers=[],
            awaited_transfers=[transfer_id for _, transfer_id in self._awaited_since.values()],
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._finished_sends, self._loads, self._releases, self._abandoned = [], [], [], []
        self._cancelled_loads = []
        for req_id in scheduler_output.preempted_req_ids or ():
            out = self._outgoing.get(req_id)
            if out is not None:
                # Its blocks are freed: sends restart from the first block when it is rescheduled.
                out.next_token = 0
                meta.preempted_transfers.append(out.transfer_id)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            out = self._outgoing.get(req_id)
            if out is None:
                continue
            request = out.request
            end = request.num_computed_tokens + num_tokens
            prompt_len = request.num_prompt_tokens
            if out.next_token >= prompt_len:
                continue  # prompt fully handed over; generated tokens are not transferred
            by_group = tuple(tuple(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))
            announce = out.ask.announce_endpoint is not None and end >= prompt_len
            meta.sends.append(
                SendSpec(
                    transfer_id=out.transfer_id,
                    block_ids=by_group[0],
                    first_token=out.next_token,
                    end_token=min(end, prompt_len),
                    num_prompt_tokens=prompt_len,
                    push_endpoint=out.ask.push_endpoint,
                    announcement=self._remote_prefill(out, by_group).to_params() if announce else None,
                    announce_endpoint=out.ask.announce_endpoint,
                    group_block_ids=by_group if len(by_group) > 1 else (),
                )
            )
            out.seen_by_worker = True
            # A partly filled last block is sent again with the next chunk.
            out.next_token = prompt_len if end >= prompt_len else end - end % self._token_step
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks (one group), or each KV cache group's (the hybrid manager's)."""
        from vllm.v1.request import RequestStatus

        by_group = tuple(tuple(ids) for ids in block_ids) if isinstance(block_ids, tuple) else (tuple(block_ids),)
        req_id = request.request_id
        self._refused.discard(req_id)
        self._matched.pop(req_id, None)
        self._live.discard(req_id)
        self._awaited_since.pop(req_id, None)
        if req_id in self._awaiting:
            self._awaiting.discard(req_id)
            if request.status == RequestStatus.FINISHED_ABORTED:
                # vLLM keeps its blocks until the load reports: do not wait for a prefill that may never come
                self._cancelled_loads.append(req_id)
        params = request.kv_transfer_params
        if asks_remote_prefill(params):
            # Finished (aborted) before any load was set up: prefill still holds the KV.
            remote = self._decode_leg(request)
            mark_remote_prefill_taken(params)
            if isinstance(remote, AwaitedPrefill):
                self._abandoned.append(remote.transfer_id)
            elif remote is not None:
                self._releases.append(RemoteRelease(remote))
            return False, None
        out = self._outgoing.pop(req_id, None)
        if out is None:
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        prefill_done = request.num_computed_tokens >= request.num_prompt_tokens
        held = normal and prefill_done and any(by_group)
        if not out.seen_by_worker:
            del self._transfer_owners[out.transfer_id]  # no worker knows of it
            return False, None
        # The worker may have pushes in flight or reads granted on these blocks: they stay
        # ours until it reports the transfer finished (released, expired or revoked).
        self._finished_sends.append(FinishedSend(out.transfer_id, req_id, held=held))
        if not held:
            return True, None
        return True, self._remote_prefill(out, by_group).to_params()

    def _remote_prefill(self, out: _OutgoingRequest, by_group: tuple[tuple[int, ...], ...]) -> RemotePrefill:
        """Where decode finds this request's prompt KV (``by_group``: each KV cache group's blocks)."""
        request = out.request
        blocks = tuple(
            tuple(ids[: -(-request.num_prompt_tokens // g.block_size)])
            for g, ids in zip(self.groups, by_group, strict=False)
        )
        if not out.prompt_hash:
            out.prompt_hash = prompt_hash(request.prompt_token_ids or [])
        return RemotePrefill(
            transfer_id=out.transfer_id,
            engine_id=self.engine_id,
            endpoint=self._endpoints[0],
            host=self._host,
            port=self._port,
            block_ids=blocks[0],
            num_tokens=request.num_prompt_tokens,
            block_size=self.groups[0].block_size,
            mode=out.ask.mode or self.config.default_mode,  # resolved at admission: never None here
            tp_size=self.tp_size,
            endpoints=self._endpoints,
            prompt_hash=out.prompt_hash,
            kv_format=self.kv_format,
            shape=self.shape,
            group_block_ids=blocks if len(blocks) > 1 and self.shape is not None else (),
        )

    def shutdown(self) -> None:
        self._announce_probe.close()

    def has_pending_work(self) -> bool:
        return bool(self._finished_sends or self._loads or self._releases or self._abandoned or self._cancelled_loads)

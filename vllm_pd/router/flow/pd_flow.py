"""The two-leg prefill -> decode flow, with every failure handled here.

Prefill leg: the request with max_tokens=1, stream=false and
``kv_transfer_params`` asking prefill to keep the KV for a remote decode (in
push mode also where to write it). Decode leg: the original request plus the
``kv_transfer_params`` prefill returned, verbatim; its answer is relayed to
the client event by event.

When decode's KV endpoint is known both legs go out at once: the decode leg
names the transfer (``transfer_id``) prefill will announce to it instead of
carrying prefill's answer, so decode's tokenising, scheduling and block
allocation happen while prefill computes; prefill pushes the KV while it
computes (push) or decode reads it once announced (pull). If no prefill
succeeds, the waiting decode leg is cancelled and the request runs
decode-only (or fails under require_disagg).

Failures: a prefill error retries on another prefill, then falls back to
decode-only (unless require_disagg). A decode error before the first byte to
the client retries on another decode (re-running prefill unless the KV can
follow); when none is left the client gets 504 if the last decode timed out (or
was found unreachable), 503 with ``Retry-After`` if it was busy, else 502. After
bytes went out an OpenAI-style error event ends the stream. A backend answering
429/503 with ``Retry-After`` gets no requests until then (instance_pool.py). A
client disconnect cancels whichever leg is running; prefill KV that no decode
will consume is released through ``release_remote_kv``. What a backend sends is
read only up to the limits of the config (``max_*_bytes``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.errors import RouterError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.transfer_params import AwaitedPrefill, RemoteDecodeRequest, TransferMode
from vllm_pd.router.backend.backend_answer import BackendAnswer
from vllm_pd.router.backend.backend_response import (
    BackendConnectError,
    BackendError,
    BackendResponse,
    BackendUnreachable,
    BodyTooLarge,
)
from vllm_pd.router.backend.http_client import BackendClient
from vllm_pd.router.backend.retry_after import header_value, retry_after_seconds
from vllm_pd.router.config import ProxyConfig
from vllm_pd.router.flow.decode_relay import DecodeFailed, DecodeRelay, FlowState
from vllm_pd.router.http.client_auth import bearer
from vllm_pd.router.http.errors import ProxyError, unavailable, upstream_error
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse
from vllm_pd.router.observability.metrics import ProxyMetrics
from vllm_pd.router.observability.request_log import RequestLog
from vllm_pd.router.observability.tracing import RequestTrace, Tracer
from vllm_pd.router.pool.instance_pool import InFlightLeg, Instance, InstancePool
from vllm_pd.router.pool.partition_watch import InstanceUnreachable, PartitionWatch
from vllm_pd.router.request.request_body import ParsedRequest, decode_body, encode_body, prefill_body
from vllm_pd.router.routing.kv_locations import KvLocations
from vllm_pd.router.routing.policies import Policy, held_tokens

logger = logging.getLogger(__name__)

# not x-data-parallel-rank: the proxy places legs; a client's rank could fail one leg (see test_proxy_client_kv)
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate")

ReleaseFn = Callable[[dict], bool]

_id_prefix = os.urandom(8).hex()
_id_counter = itertools.count()


def _reseed_ids() -> None:
    global _id_prefix
    _id_prefix = os.urandom(8).hex()


os.register_at_fork(after_in_child=_reseed_ids)  # forked workers must not repeat their parent's ids


def new_id() -> str:
    """32 hex digits, unique across proxy processes: a random per-process prefix and a counter
    (uuid4 costs a getrandom call and a UUID object per id, twice per request)."""
    return f"{_id_prefix}{next(_id_counter):016x}"


def default_release_remote_kv(
    params: dict, secret: DeploymentSecret | None = None, tls: TlsSettings | None = None
) -> bool:
    """The connector's release call (every prefill rank), imported on first use: most proxies never need it.
    ``secret``, ``tls``: the deployment's (the proxy's config), which the instances' KV endpoints require."""
    from vllm_pd.connector.worker.release import release_remote_kv

    return release_remote_kv(params, timeout=2.0, secret=secret, tls=tls)


def remote_decode_params(decode: Instance, transfer_id: str | None, mode: TransferMode) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params; transfer_id: the transfer's id, under which prefill
    announces the KV to decode (and pushes it there in push mode). Without one, prefill names the
    transfer itself and its answer goes to decode verbatim."""
    if transfer_id is None:
        return RemoteDecodeRequest().to_params()
    return RemoteDecodeRequest(mode, decode.kv_endpoint, transfer_id).to_params()


class PDFlow:
    def __init__(
        self,
        config: ProxyConfig,
        pool: InstancePool,
        client: BackendClient,
        metrics: ProxyMetrics,
        prefill_policy: Policy,
        decode_policy: Policy,
        release_kv: ReleaseFn = default_release_remote_kv,
        tracer: Tracer | None = None,
        request_log: RequestLog | None = None,
        watch: PartitionWatch | None = None,
        kv_locations: KvLocations | None = None,
    ) -> None:
        self.config = config
        self.kv_locations = kv_locations
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.release_kv = release_kv
        self.watch = watch or PartitionWatch()  # legs on an instance found unreachable move on
        self.relay = DecodeRelay(
            metrics, pool, config.prefill_timeout, config.max_decode_answer_bytes, config.max_sse_event_bytes
        )
        # the proxy's own key for the instances replaces whatever the client authenticated with
        self._backend_auth = bearer(config.backend_api_key) if config.backend_api_key else None
        self._background: set[asyncio.Future] = set()
        self.tracer = tracer or Tracer()
        self.request_log = request_log

    # ------------------------------------------------------------------ entry
    async def handle(self, req: ParsedRequest, http_request: HttpRequest) -> HttpResponse | StreamResponse:
        given = http_request.headers
        request_id = given.get("x-request-id") or new_id()
        headers = {k: given[k] for k in FORWARDED_HEADERS if k in given}
        if self._backend_auth is not None:
            headers["authorization"] = self._backend_auth
        headers["X-Request-Id"] = request_id
        headers["Content-Type"] = "application/json"  # both legs send bytes this proxy encoded
        state = FlowState(request_id)
        trace = state.trace = self.tracer.start(given, headers)
        status = 500
        self.metrics.in_flight += 1
        try:
            resp = await self._run(req, http_request, headers, state)
            status = resp.status
            return resp
        except ProxyError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            state.timings.outcome = "client_disconnected"
            self.metrics.disconnects.labels(state.stage).inc()
            logger.info("client went away; request %s cancelled", request_id)
            raise
        finally:
            self.metrics.in_flight -= 1
            for leg in state.in_flight:
                leg.finish()
            if state.kv_pending and state.kv_params:
                self._release_in_background(state.kv_params)
            self._finish(state, trace, status, req.path)

    def _finish(self, state: FlowState, trace: RequestTrace, status: int, endpoint: str) -> None:
        """The request's timings into the histograms, its span and the request log."""
        t = state.timings
        t.status = status
        t.ended = time.monotonic()
        if status >= 400 and t.outcome == "ok":
            t.outcome = "error"
        self.metrics.legs.observe(t)
        trace.end(t, state.request_id)
        if self.request_log is not None:
            self.request_log.write(t, state.request_id, trace.trace_id, endpoint)

    async def _run(
        self, req: ParsedRequest, http_request: HttpRequest, headers: dict[str, str], state: FlowState
    ) -> HttpResponse | StreamResponse:
        tried: set[str] = set()
        decode = self._pick("decode", req, tried)
        if decode is None:
            raise self._no_decode()
        # (message, kind) of the last failure - not the exception: its traceback holds this frame
        last_error: tuple[str, str] | None = None
        for attempt in range(self.config.decode_attempts):
            if attempt:
                self.metrics.retries.labels("decode").inc()
                state.timings.retries += 1
            try:
                if state.kv_params is None and await self._needs_prefill(req, decode, state):
                    if decode.kv_endpoint is not None:
                        return await self._decode_beside_prefill(req, decode, headers, state, http_request)
                    await self._prefill(req, decode, None, headers, state)
                return await self._decode(req, decode, headers, state, http_request, state.kv_params)
            except DecodeFailed as e:
                last_error = (str(e), e.kind)
                self.metrics.leg_errors.labels("decode", e.kind).inc()
                if e.kind != "busy":
                    decode.breaker.record_failure()
                logger.warning(
                    "decode on %s failed before output (%s); attempt %d/%d",
                    decode.url,
                    last_error[0],
                    attempt + 1,
                    self.config.decode_attempts,
                )
                tried.add(decode.url)
                if state.kv_params is not None and not self._kv_can_follow(state, e):
                    self._drop_kv(state)
                nxt = self._pick("decode", req, tried)
                if nxt is None:
                    break
                decode = nxt
        if state.kv_params is not None:
            self._drop_kv(state)
        if last_error is None:
            raise self._no_decode()
        raise self._decode_error(*last_error)

    def _no_decode(self) -> ProxyError:
        """No decode instance takes the request: 503, with Retry-After when some asked for a pause."""
        wait = self.pool.busy_wait("decode")
        if wait is None:
            return unavailable("no healthy decode instance")
        e = unavailable(
            f"every decode instance asked for no requests for now (Retry-After); retry in {wait:.0f} s", "backend_busy"
        )
        e.headers = {"Retry-After": header_value(wait)}
        return e

    def _decode_error(self, message: str, kind: str) -> ProxyError:
        """What the client gets when no decode could answer: 504 for a backend that did not answer in
        time (or was found unreachable while it waited), 503 for one that asked for a pause, else 502."""
        if kind in ("timeout", "unreachable"):
            return upstream_error(f"decode failed: {message}", 504, "upstream_timeout")
        if kind == "busy":
            e = self._no_decode()
            if e.headers is None:  # busy without a Retry-After: no telling when, so soon
                e.headers = {"Retry-After": "1"}
                e.code = "backend_busy"
                e.message = f"decode failed: {message}"
            return e
        return upstream_error(f"decode failed: {message}")

    def _kv_can_follow(self, state: FlowState, e: DecodeFailed) -> bool:
        # Pull-mode KV still sits untouched on prefill if decode never saw the request;
        # pushed KV went into the failed decode, so prefill must run again.
        return not e.sent and state.kv_params is not None and not state.pushed

    def _drop_kv(self, state: FlowState) -> None:
        if state.kv_params:
            self._release_in_background(state.kv_params)
        state.kv_params = None
        state.kv_pending = False

    def _pick(self, role: str, req: ParsedRequest, exclude: set[str]) -> Instance | None:
        candidates = self.pool.eligible(role, exclude)
        if not candidates:
            return None
        policy = self.prefill_policy if role == "prefill" else self.decode_policy
        choose_for = getattr(policy, "choose_for", None)  # policies that read the whole request (kv_aware)
        if choose_for is not None:
            return choose_for(candidates, role, req)
        return policy.choose(candidates, role, req.prompt_key, req.prompt_tokens)

    # ---------------------------------------------------------------- prefill
    async def _needs_prefill(self, req: ParsedRequest, decode: Instance, state: FlowState) -> bool:
        """Whether this request gets a prefill leg (False: decode computes the prompt)."""
        if not req.disaggregable:
            self.metrics.fallbacks.labels("multi_sequence").inc()
            state.timings.fallback = "multi_sequence"
            return False
        if req.prompt_tokens <= self.config.short_prompt_tokens:
            self.metrics.fallbacks.labels("short_prompt").inc()
            state.timings.fallback = "short_prompt"
            return False
        if self.kv_locations is not None and self.kv_locations.holds_prompt(decode.url, req.blocks):
            self.metrics.fallbacks.labels("decode_holds_prompt").inc()  # its prefix cache has every full block
            return False
        if req.store is not None and req.store.holds_prompt(decode.url):
            # its own KV store has every full block: a request without a prefill leg loads them from there
            # (connector.py: the store is asked for every request that awaits no remote prefill)
            self.metrics.fallbacks.labels("decode_store_holds_prompt").inc()
            return False
        if not self.pool.eligible("prefill", {decode.url}):  # a "both" instance never prefills for itself
            if self.config.require_disagg:
                raise unavailable("no prefill instance available and --require-disagg is set", "prefill_unavailable")
            self.metrics.fallbacks.labels("no_prefill_instance").inc()
            state.timings.fallback = "no_prefill_instance"
            return False
        return True

    async def _decode_beside_prefill(
        self, req: ParsedRequest, decode: Instance, headers: dict[str, str], state: FlowState, http_request: HttpRequest
    ) -> HttpResponse | StreamResponse:
        """Both legs at once; decode waits for prefill to announce the KV of transfer_id."""
        transfer_id = new_id()
        # auto = push: an idle decode then runs its first forward beside prefill's, taking each layer
        # as it lands - the fastest on every prompt length measured (docs/benchmarks/pd-latency.md)
        mode: TransferMode = "pull" if self.config.kv_mode == "pull" else "push"
        state.pushed = mode == "push"
        # the prefill instance is chosen first: decode is told where its KV endpoint is (learned from its
        # earlier answers), to probe it should the announcement be late (connector/announce_probe.py)
        first = self._pick("prefill", req, {decode.url})
        awaited = AwaitedPrefill(transfer_id, mode, first.kv_peers if first is not None else ())
        prefill = asyncio.ensure_future(self._prefill(req, decode, transfer_id, headers, state, mode, first))
        state.prefill_leg = prefill
        decode_leg = asyncio.ensure_future(self._decode(req, decode, headers, state, http_request, awaited.to_params()))
        try:
            await asyncio.wait({prefill, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode_leg.done() and state.stage != "stream":
                # result() raises the client's 4xx, or 503 under require_disagg
                if not prefill.result() or state.kv_params is None:
                    # nothing will be announced: decode would wait for nothing, so it computes the prompt
                    decode_leg.cancel()
                    await asyncio.gather(decode_leg, return_exceptions=True)
                    state.pushed = False
                    return await self._decode(req, decode, headers, state, http_request, None)
            return await decode_leg
        finally:
            if not decode_leg.done():
                decode_leg.cancel()
                await asyncio.gather(decode_leg, return_exceptions=True)
            if not prefill.done():
                if decode_leg.cancelled() or decode_leg.exception() is not None:
                    prefill.cancel()  # decode failed or the client left: the KV has no taker
                else:  # decode answered already; let prefill's answer (usage, release) come in
                    self._background.add(prefill)
                    prefill.add_done_callback(self._background.discard)

    async def _prefill(
        self,
        req: ParsedRequest,
        decode: Instance,
        transfer_id: str | None,
        headers: dict[str, str],
        state: FlowState,
        mode: TransferMode = "pull",
        first: Instance | None = None,
    ) -> bool:
        """Run the prefill leg with retries (on ``first``, when chosen already, then others), leaving
        ``state.kv_params`` set. False: none succeeded, decode computes the prompt (raises instead
        under require_disagg)."""
        tried: set[str] = {decode.url}
        for attempt in range(self.config.prefill_attempts):
            prefill = first if attempt == 0 and first is not None else self._pick("prefill", req, tried)
            if prefill is None:
                break
            if attempt:
                self.metrics.retries.labels("prefill").inc()
                state.timings.retries += 1
            tried.add(prefill.url)
            if await self._prefill_once(req, prefill, decode, transfer_id, headers, state, mode):
                return True
        if self.config.require_disagg:
            raise unavailable(
                "no prefill instance could run the prompt and --require-disagg is set", "prefill_unavailable"
            )
        self.metrics.fallbacks.labels("prefill_unavailable").inc()
        state.timings.fallback = "prefill_unavailable"
        logger.warning("request %s: no prefill succeeded; decode computes the prompt", state.request_id)
        return False

    def _prefill_work(self, req: ParsedRequest, prefill: Instance) -> int:
        """Prompt tokens the prefill leg computes: blocks the instance holds cost (nearly) nothing, so a
        queue of multi-turn requests on their holder is not mistaken for a long one (kv_aware)."""
        if self.kv_locations is None or req.blocks is None:
            return req.prompt_tokens
        return max(1, req.prompt_tokens - held_tokens(self.kv_locations, prefill.url, req))

    def _prefill_params(
        self, req: ParsedRequest, prefill: Instance, decode: Instance, transfer_id: str | None, mode: TransferMode
    ) -> dict[str, Any]:
        """The prefill leg's kv_transfer_params, with a store_fetch hint when another node's KV store
        holds more of the prompt than the prefill instance has (its store then fetches from there
        without asking the store master on the engine's scheduler thread)."""
        params = remote_decode_params(decode, transfer_id, mode)
        if req.store is not None and self.kv_locations is not None:
            hint = req.store.fetch_hint(prefill.url, held_tokens(self.kv_locations, prefill.url, req))
            if hint is not None:
                params.update(hint.to_params())
                self.metrics.store_fetch_hints.inc()
        return params

    async def _prefill_once(
        self,
        req: ParsedRequest,
        prefill: Instance,
        decode: Instance,
        transfer_id: str | None,
        headers: dict[str, str],
        state: FlowState,
        mode: TransferMode,
    ) -> bool:
        body = prefill_body(req.body, self._prefill_params(req, prefill, decode, transfer_id, mode))
        leg = InFlightLeg(prefill, "prefill", self._prefill_work(req, prefill))
        state.in_flight.append(leg)
        span = state.trace.leg("prefill", prefill.url)  # type: ignore[union-attr]
        failed: str | None = "cancelled"
        t0 = time.monotonic()
        try:
            status, raw, retry_after = await self.watch.guard(
                prefill.url, self._post_prefill(prefill, req, body, span.headers(headers))
            )
            if status in (429, 503):
                wait = retry_after_seconds(retry_after)
                if wait is not None:
                    prefill.mark_busy(wait)  # other prefills serve meanwhile
                raise _LegError(
                    f"HTTP {status}: {raw[:200]!r}", "busy" if wait is not None or status == 429 else "status"
                )
            if status >= 500 or status == 408:
                raise _LegError(f"HTTP {status}: {raw[:200]!r}", "status")
            if status >= 400:
                # the client's own mistake: decode would say the same, so say it now
                prefill.breaker.record_success()
                raise _passthrough_error(status, raw)
            answer = BackendAnswer(raw)
            failed = None
        except ProxyError:
            failed = "client_error"
            raise
        except (BackendError, TimeoutError, _LegError, ValueError, InstanceUnreachable) as e:
            kind = failed = _prefill_failure(e)
            self.metrics.leg_errors.labels("prefill", kind).inc()
            if kind != "busy":
                prefill.breaker.record_failure()
            logger.warning("prefill on %s failed: %s", prefill.url, repr(e))  # not e: see decode_relay
            return False
        finally:
            leg.finish()
            span.end(failed)
        now = time.monotonic()
        elapsed = now - t0
        prefill.ttft.add(elapsed)
        prefill.breaker.record_success()
        self.metrics.legs.prefill.child(prefill.url).observe(elapsed)
        t = state.timings
        t.prefill_instance, t.prefill_seconds, t.prefill_done = prefill.url, elapsed, now
        params = answer.kv_params
        if params is None:
            # an instance without a connector: decode will have to compute the prompt
            logger.warning("prefill %s returned no kv_transfer_params; decode recomputes", prefill.url)
            self.metrics.fallbacks.labels("no_kv_params").inc()
            state.timings.fallback = "no_kv_params"
            return True
        state.kv_params = params
        prefill.learn_kv_peers(params)
        # beside a running decode leg the KV is decode's already (it releases it); else it waits for one
        state.kv_pending = transfer_id is None
        state.pushed = transfer_id is not None and mode == "push"
        if answer.cached_tokens is not None:
            state.prefill_cached_tokens = answer.cached_tokens
        return True

    async def _post_prefill(
        self, prefill: Instance, req: ParsedRequest, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        """(status, body, Retry-After) of the prefill leg; an answer longer than max_prefill_answer_bytes
        raises BodyTooLarge (the leg fails over), an error answer is cut to max_error_body_bytes."""
        r = await self.client.request(
            "POST",
            prefill.url,
            req.path,
            encode_body(body),
            headers.items(),
            timeout=self.config.prefill_timeout,
            connect_timeout=self.config.connect_timeout,
        )
        try:
            if r.status >= 400:
                return r.status, await _read_error_body(r, self.config.max_error_body_bytes), r.retry_after
            return r.status, await r.read(self.config.max_prefill_answer_bytes, "max_prefill_answer_bytes"), None
        finally:
            r.close()

    # ----------------------------------------------------------------- decode
    async def _decode(
        self,
        req: ParsedRequest,
        decode: Instance,
        headers: dict[str, str],
        state: FlowState,
        http_request: HttpRequest,
        kv_params: dict | None,
    ) -> HttpResponse | StreamResponse:
        body = decode_body(req, kv_params)
        leg = InFlightLeg(decode, "decode", req.prompt_tokens + req.max_tokens)
        state.in_flight.append(leg)
        state.stage = "decode"
        span = state.trace.leg("decode", decode.url)  # type: ignore[union-attr]
        failed: str | None = "cancelled"
        t0 = time.monotonic()
        state.timings.decode_instance, state.timings.decode_sent = decode.url, t0
        try:
            # from here decode owns the KV: closing this request aborts it and decode releases prefill's KV
            state.kv_pending = False
            resp = await self.watch.guard(
                decode.url,
                self.client.request(
                    "POST",
                    decode.url,
                    req.path,
                    body,
                    span.headers(headers).items(),
                    head_timeout=self.config.decode_timeout,
                    read_timeout=self.config.decode_idle_timeout,
                    connect_timeout=self.config.connect_timeout,
                ),
            )
        except InstanceUnreachable as e:
            leg.finish()
            span.end("unreachable")
            raise DecodeFailed(f"unreachable: {e}", sent=True, kind="unreachable") from None
        except BackendConnectError as e:
            state.kv_pending = state.kv_params is not None
            leg.finish()
            span.end("connect")
            raise DecodeFailed(str(e), sent=False, kind="connect") from None
        except (BackendError, TimeoutError) as e:
            leg.finish()
            kind = "timeout" if isinstance(e, TimeoutError) else "connection"
            span.end(kind)
            raise DecodeFailed(repr(e), sent=True, kind=kind) from None
        except asyncio.CancelledError:
            span.end("cancelled")
            raise
        try:
            if resp.status in (429, 503):
                wait = retry_after_seconds(resp.retry_after)
                if wait is not None:
                    decode.mark_busy(wait)  # other decodes serve meanwhile
                if wait is not None or resp.status == 429:
                    text = await _read_some(resp)
                    raise DecodeFailed(f"HTTP {resp.status}: {text!r}", sent=True, kind="busy")
            if resp.status >= 500:
                text = await _read_some(resp)
                raise DecodeFailed(f"HTTP {resp.status}: {text!r}", sent=True, kind="status")
            if resp.status >= 400:
                # rejected before reaching the engine: the KV prefill holds was never taken
                decode.breaker.record_success()
                state.kv_pending = state.kv_params is not None
                raise _passthrough_error(resp.status, await _read_error_body(resp, self.config.max_error_body_bytes))
            with self.watch.following(decode.url, resp):  # found unreachable: the read fails, the leg ends
                if req.stream:
                    out: HttpResponse | StreamResponse = await self.relay.stream(resp, decode, state, http_request, t0)
                else:
                    out = await self.relay.json(resp, decode, state, t0)
            failed = None if state.timings.outcome == "ok" else state.timings.outcome
            return out
        except DecodeFailed as e:
            failed = e.kind
            raise
        except ProxyError:
            failed = "client_error"
            raise
        finally:
            resp.close()  # aborts decode in vLLM if we got here early (client gone, error)
            leg.finish()
            span.end(failed)

    # ---------------------------------------------------------------- release
    def _release_in_background(self, params: dict) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self._release_sync, params)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)

    def _release_sync(self, params: dict) -> None:
        try:
            ok = self.release_kv(params)
        except Exception as e:  # the release path must never take the proxy down
            logger.warning("release_remote_kv failed: %s", repr(e))
            ok = False
        self.metrics.kv_releases.labels("ok" if ok else "failed").inc()

    def cancel_background_legs(self) -> None:
        """Cancel prefill legs still running after their decode answered (shutdown); releases keep going."""
        for fut in list(self._background):
            if isinstance(fut, asyncio.Task):
                fut.cancel()

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


class _LegError(RouterError):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _passthrough_error(status: int, raw: bytes) -> ProxyError:
    """A backend 4xx, relayed with the backend's own message."""
    message, etype, param, code = raw.decode(errors="replace")[:2000], "invalid_request_error", None, None
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            message = str(err.get("message", message))
            etype = str(err.get("type", etype))
            param, code = err.get("param"), err.get("code")
    except (ValueError, AttributeError):
        pass
    return ProxyError(status, message, etype, param, code)


async def _read_some(resp: BackendResponse) -> bytes:
    try:
        return (await asyncio.wait_for(resp.readany(), 2.0))[:500]
    except (BackendError, TimeoutError):
        return b""


async def _read_error_body(resp: BackendResponse, limit: int) -> bytes:
    """An error answer's body, its first ``limit`` bytes at most (all that is kept of a failed leg);
    what did not arrive within 2 s is not waited for."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(2.0):
            while size < limit:
                chunk = await resp.readany()
                if not chunk:
                    break
                parts.append(chunk[: limit - size])
                size += len(parts[-1])
    except (BackendError, TimeoutError):
        pass
    return b"".join(parts)


def _prefill_failure(e: Exception) -> str:
    """The kind of a failed prefill leg (the metric's label and the leg span's outcome)."""
    if isinstance(e, _LegError):
        return e.kind
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, (InstanceUnreachable, BackendUnreachable)):
        return "unreachable"
    if isinstance(e, BodyTooLarge):
        return "too_large"
    if isinstance(e, BackendConnectError):
        return "connect"
    if isinstance(e, BackendError):
        return "connection"
    return "bad_answer"  # not JSON

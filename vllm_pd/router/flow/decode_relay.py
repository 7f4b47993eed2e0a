"""Relaying decode's answer to the client: whole JSON, or SSE event by event.

After its first event a stream is relayed from decode's socket callback
(:class:`_StreamPump`, ``BackendResponse.relay_to``): each read's events are
checked and sent to the client at once, with no task switch per read - at a
thousand streams that switch was most of the relay's Python time.

Until decode's first event nothing is sent to the client, so a failure there is
a :class:`DecodeFailed` the flow can retry; after it, an OpenAI-style error
event ends the stream - also for an event that is not relayable (sse_relay.py:
too long, or malformed). A non-streamed answer longer than
``max_decode_answer_bytes`` ends the request with 502. TTFT and TPOT are
recorded on the way (the supervisor and the policies read them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_pd.errors import RouterError
from vllm_pd.router.backend.backend_answer import BackendAnswer
from vllm_pd.router.backend.backend_response import BackendError, BackendResponse, BackendUnreachable, BodyTooLarge
from vllm_pd.router.backend.sse_relay import DEFAULT_MAX_EVENT_BYTES, BadBackendStream, SseSplitter, rewrite_usage
from vllm_pd.router.http.errors import upstream_error
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse
from vllm_pd.router.observability.leg_timings import FastHistogram, LegTimings
from vllm_pd.router.observability.metrics import ProxyMetrics
from vllm_pd.router.observability.tracing import RequestTrace
from vllm_pd.router.pool.instance_pool import InFlightLeg, Instance, InstancePool

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TPOT_WINDOW = 16  # stream events per live TPOT sample
_DONE = b"data: [DONE]\n\n"


class DecodeFailed(RouterError):
    """Decode failed before any byte reached the client; ``sent`` = decode saw the request."""

    def __init__(self, message: str, sent: bool, kind: str) -> None:
        super().__init__(message)
        self.sent = sent
        self.kind = kind


@dataclass
class FlowState:
    """What one client request has in flight (for cleanup on cancel)."""

    request_id: str
    kv_params: dict | None = None
    kv_pending: bool = False  # prefill holds KV that no decode has been asked to take
    prefill_cached_tokens: int | None = None
    pushed: bool = False  # prefill was told to push the KV into one decode instance
    prefill_leg: asyncio.Task[bool] | None = None  # running beside the decode leg
    timings: LegTimings = field(default_factory=lambda: LegTimings(time.monotonic()))
    trace: RequestTrace | None = None
    stage: str = "prefill"  # prefill | decode | stream (bytes reached the client): where a disconnect hit
    in_flight: list[InFlightLeg] = field(default_factory=list)

    def first_token(self) -> None:
        """Decode answered with its first token: its leg counts as decoding (the supervisor's model)."""
        for leg in self.in_flight:
            leg.first_token()


def read_failure(e: BaseException) -> str:
    """The kind of a failed read of decode's answer: timeout (also an instance found unreachable
    meanwhile: it did not answer in time) or read (the connection broke)."""
    return "timeout" if isinstance(e, TimeoutError) else "unreachable" if isinstance(e, BackendUnreachable) else "read"


class DecodeRelay:
    def __init__(
        self,
        metrics: ProxyMetrics,
        pool: InstancePool,
        prefill_timeout: float,
        max_answer_bytes: int = 64 * 1024 * 1024,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.metrics = metrics
        self.pool = pool
        self.prefill_timeout = prefill_timeout
        self.max_answer_bytes = max_answer_bytes
        self.max_event_bytes = max_event_bytes

    async def json(self, resp: BackendResponse, decode: Instance, state: FlowState, t0: float) -> HttpResponse:
        try:
            raw = await resp.read(self.max_answer_bytes, "max_decode_answer_bytes")
        except BodyTooLarge as e:  # the same request would be as long anywhere: no retry
            raise upstream_error(f"decode's answer is too long: {e}", 502, "answer_too_large") from None
        except (BackendError, TimeoutError) as e:
            raise DecodeFailed(repr(e), sent=True, kind=read_failure(e)) from None
        decode.breaker.record_success()
        now = time.monotonic()
        elapsed = now - t0
        state.timings.first_token = state.timings.last_event = now
        state.first_token()
        if state.prefill_leg is not None and not state.prefill_leg.done():
            # decode answered before prefill's answer (with its usage) came back
            await asyncio.wait({state.prefill_leg}, timeout=self.prefill_timeout)
        if state.prefill_cached_tokens is not None:
            raw = rewrite_usage(raw, state.prefill_cached_tokens) or raw
        try:
            tokens = BackendAnswer(raw).completion_tokens
            state.timings.events = tokens
            if tokens > 0:
                state.timings.json_tpot = elapsed / tokens
            if tokens > 1:
                decode.tpot.add(elapsed / tokens)
                self.pool.observe(self.pool.recent_tpot, state.timings.started, elapsed / tokens)
        except ValueError:
            pass
        return HttpResponse(raw, resp.status, headers={"X-Request-Id": state.request_id})

    async def stream(
        self, resp: BackendResponse, decode: Instance, state: FlowState, http_request: HttpRequest, t0: float
    ) -> StreamResponse:
        events = SseSplitter(state.prefill_cached_tokens, self.max_event_bytes)
        try:
            return await self._stream(resp, events, decode, state, http_request)
        finally:
            events.drop_partial()  # an unfinished event goes with the leg

    async def _stream(
        self, resp: BackendResponse, events: SseSplitter, decode: Instance, state: FlowState, http_request: HttpRequest
    ) -> StreamResponse:
        # hold the client's response until decode produced its first event, so a
        # failure before that can still be retried elsewhere
        first = b""
        try:
            while not first:
                chunk = await resp.readany()
                if not chunk:
                    raise DecodeFailed("stream ended before any event", sent=True, kind="empty")
                first = events.feed(chunk)
        except (BackendError, TimeoutError) as e:
            raise DecodeFailed(repr(e), sent=True, kind=read_failure(e)) from None
        except BadBackendStream as e:
            self.metrics.bad_stream_events.labels(e.code).inc()
            logger.warning("decode stream from %s not relayed: %s (%r)", decode.url, str(e), e.sample)
            raise DecodeFailed(str(e), sent=True, kind="bad_stream") from None
        decode.breaker.record_success()
        t_first = time.monotonic()
        timings = state.timings
        timings.first_token = timings.last_event = t_first
        state.first_token()
        self.pool.observe(self.pool.recent_ttft, timings.started, t_first - timings.started)
        out = StreamResponse(200, headers={**SSE_HEADERS, "X-Request-Id": state.request_id})
        pump = _StreamPump(
            events,
            out,
            state,
            self.metrics.legs.inter_token.child(decode.url),
            lambda sent, tpot: self._record_tpot(decode, sent, tpot),
            first.count(b"data:"),
            t_first,
        )
        timings.events = pump.n_events
        try:
            await out.prepare(http_request)
            state.stage = "stream"
            await out.write(first)
            resp.relay_to(pump.feed)
            while True:
                try:
                    if await resp.relayed():
                        data = events.flush()  # what the backend left without a closing blank line
                        if data:
                            await out.write(data)
                        break
                except (BackendError, TimeoutError, BadBackendStream) as e:
                    await self._stream_broke(out, events, decode, resp, e, timings)
                    return out
                if isinstance(pump.error, ConnectionResetError):
                    raise ConnectionResetError("client disconnected")
                if pump.error is not None:
                    await self._stream_broke(out, events, decode, resp, pump.error, timings)
                    return out
                await out.drain()  # the pump held decode's stream: the client reads slower than decode writes
                resp.resume_relay()
            await out.write_eof()
        except ConnectionResetError:  # writing to the client failed: it went away
            timings.outcome = "client_disconnected"
            self.metrics.disconnects.labels(state.stage).inc()
            logger.info("client disconnected mid-stream; request %s aborted", state.request_id)
            return out
        finally:
            resp.relay_to(None)
        pump.record_tail()
        return out

    def _record_tpot(self, decode: Instance, sent: float, tpot: float) -> None:
        decode.tpot.add(tpot)
        self.pool.observe(self.pool.recent_tpot, sent, tpot)

    async def _stream_broke(
        self,
        out: StreamResponse,
        events: SseSplitter,
        decode: Instance,
        resp: BackendResponse,
        e: BaseException,
        timings: LegTimings,
    ) -> None:
        """Bytes already reached the client: end the stream with an error event."""
        timings.outcome = "stream_error"
        resp.relay_to(None)
        await self._end_with_error(out, events, decode, e)

    async def _end_with_error(
        self, out: StreamResponse, events: SseSplitter, decode: Instance, e: BaseException
    ) -> None:
        self.metrics.stream_errors.inc()
        code = "stream_interrupted"
        if isinstance(e, BadBackendStream):
            code = e.code
            self.metrics.bad_stream_events.labels(code).inc()
        decode.breaker.record_failure()
        # the exception itself is no log argument: a record kept by a handler would keep its traceback's frames
        logger.warning("decode stream from %s broke after output started: %s", decode.url, repr(e))
        err = upstream_error(f"decode stream interrupted: {e}", code=code)
        events.drop_partial()  # the client only ever got whole events; the error is the next one
        await out.write(err.sse_event())
        await out.write_eof()


class _StreamPump:
    """Decode's stream after its first event, relayed from its socket's callback (BackendResponse.relay_to):
    each read's whole events checked (sse_relay.py), counted, timed and sent to the client at once, with
    no task switch per read. It never raises: a bad event or a client gone is its ``error``, and its
    False holds decode's stream for the relay's task to handle - as is a client that reads slower than
    decode writes (``error`` None)."""

    __slots__ = ("events", "out", "state", "inter_token", "record_tpot", "n_events", "sample_t", "sample_n", "error")

    def __init__(
        self,
        events: SseSplitter,
        out: StreamResponse,
        state: FlowState,
        inter_token: FastHistogram,
        record_tpot: Callable[[float, float], None],
        n_events: int,
        t_first: float,
    ) -> None:
        self.events = events
        self.out = out
        self.state = state
        self.inter_token = inter_token
        self.record_tpot = record_tpot  # (request sent, seconds per token)
        self.n_events = n_events
        # TPOT is sampled while the stream runs (every TPOT_WINDOW events), not only at its end:
        # long outputs would otherwise tell the supervisor about decode pressure far too late
        self.sample_t, self.sample_n = t_first, n_events
        self.error: BadBackendStream | ConnectionResetError | None = None

    def feed(self, chunk: bytes) -> bool:
        """Relay what ``chunk`` completes; False: stop (``error``, or the client's buffer is full)."""
        if self.error is not None:
            return False
        state = self.state
        try:
            self.events.cached_tokens = state.prefill_cached_tokens  # prefill may answer after decode began
            data = self.events.feed(chunk)
            if not data:
                return True
            self._count(data, state.timings)
            return self.out.send(data)
        except (BadBackendStream, ConnectionResetError) as e:
            self.error = e.with_traceback(None)  # kept: its traceback would hold this frame, and so this pump
            return False

    def _count(self, data: bytes, timings: LegTimings) -> None:
        k = data.count(b"data:")
        self.n_events += k
        tokens = k - 1 if data.endswith(_DONE) else k  # [DONE] is no token
        if tokens > 0:
            now = time.monotonic()
            self.inter_token.observe_n((now - timings.last_event) / tokens, tokens)  # type: ignore[operator]
            timings.last_event = now
            timings.events += tokens
            if self.n_events - self.sample_n >= TPOT_WINDOW:
                self.record_tpot(timings.started, (now - self.sample_t) / (self.n_events - self.sample_n))
                self.sample_t, self.sample_n = now, self.n_events

    def record_tail(self) -> None:
        """The stream ended: the TPOT of the tail since the last sample, minus the [DONE] event."""
        if self.n_events - self.sample_n > 2:
            self.record_tpot(
                self.state.timings.started, (time.monotonic() - self.sample_t) / (self.n_events - self.sample_n - 1)
            )

"""W3C trace context for a request's two legs (tracer_choice.py picks the tracer).

Both legs of a request carry a ``traceparent`` (https://www.w3.org/TR/trace-context/)
so that vLLM's own spans of prefill and decode (vLLM reads the header when it
traces) land in one trace. Without an exporter the proxy forwards the client's
valid ``traceparent`` unchanged, or starts a trace of its own when the client
sent none (or a malformed one). With an OTLP endpoint (``--otlp-endpoint`` or
the standard ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``) the proxy exports a
span for the request and one per leg, and each leg's ``traceparent`` names its
leg span (otel_tracing.py; the OpenTelemetry SDK is imported only then).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm_pd.router.observability.leg_timings import LegTimings

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
SAMPLED = "01"


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid ``traceparent``, else None."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags = m.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id, flags


def format_traceparent(trace_id: str, span_id: str, flags: str = SAMPLED) -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


class LegSpan(Protocol):
    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The headers this leg sends (its own ``traceparent`` when exporting)."""

    def end(self, error: str | None = None) -> None:
        """The leg is over; ``error`` names how it failed."""


class RequestTrace(Protocol):
    trace_id: str

    def leg(self, leg: str, instance: str) -> LegSpan:
        """A span for one leg (prefill or decode) sent to ``instance``."""

    def end(self, timings: LegTimings, request_id: str) -> None:
        """The request is over; its timings describe it."""


class _NoSpan:
    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def end(self, error: str | None = None) -> None:
        pass


_NO_SPAN = _NoSpan()


class PropagatedTrace:
    """A request's trace context without an exporter: both legs send the same ``traceparent``."""

    __slots__ = ("trace_id",)

    def __init__(self, trace_id: str) -> None:
        self.trace_id = trace_id

    def leg(self, leg: str, instance: str) -> LegSpan:
        return _NO_SPAN

    def end(self, timings: LegTimings, request_id: str) -> None:
        pass


class Tracer:
    """Propagation only: nothing is exported."""

    exporting = False

    def start(self, given: dict[str, str], headers: dict[str, str]) -> RequestTrace:
        """Begin a request's trace from the client's headers ``given``; sets ``headers``' traceparent."""
        given_tp = given.get("traceparent")
        ctx = parse_traceparent(given_tp) if given_tp is not None else None
        if ctx is None:
            # trace and parent span id in one draw (the odds of an all-zero id are 2^-64)
            ids = f"{random.getrandbits(192):048x}"
            headers["traceparent"] = format_traceparent(ids[:32], ids[32:])
            if given_tp is not None:
                headers.pop("tracestate", None)  # it belonged to the trace we did not continue
            return PropagatedTrace(ids[:32])
        return PropagatedTrace(ctx[0])  # the client's header is forwarded as it came

    async def shutdown(self) -> None:
        pass

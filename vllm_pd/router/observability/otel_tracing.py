"""Spans of the request and its legs, exported over OTLP with the OpenTelemetry SDK.

Imported only when OTLP is configured (tracer_choice.make_tracer): the SDK and its
exporters cost ~0.2 s to import. The provider is the proxy's own, not the
global one, and its batch processor exports from its own thread. The protocol
follows ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``,
``grpc`` by default as in vLLM, so one collector address serves both.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_pd.router.config import ConfigError
from vllm_pd.router.observability.tracing import Tracer

if TYPE_CHECKING:
    from vllm_pd.router.observability.leg_timings import LegTimings

PROTOCOLS = ("grpc", "http/protobuf")
_propagator = TraceContextTextMapPropagator()


def otlp_exporter(endpoint: str | None) -> SpanExporter:
    """The OTLP span exporter; without ``endpoint`` it reads the standard OTEL_* variables itself."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not one of {PROTOCOLS}")
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


class OtelLegSpan:
    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        _propagator.inject(out, context=trace.set_span_in_context(self._span))
        return out

    def end(self, error: str | None = None) -> None:
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class OtelRequestTrace:
    __slots__ = ("_tracer", "_span", "trace_id")

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span
        self.trace_id = f"{span.get_span_context().trace_id:032x}"

    def leg(self, leg: str, instance: str) -> OtelLegSpan:
        span = self._tracer.start_span(
            f"{leg} leg",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"vllm_pd.leg": leg, "vllm_pd.instance": instance},
        )
        return OtelLegSpan(span)

    def end(self, timings: LegTimings, request_id: str) -> None:
        span = self._span
        attrs: dict[str, Any] = {
            "vllm_pd.request_id": request_id,
            "http.response.status_code": timings.status,
            "vllm_pd.outcome": timings.outcome,
            "vllm_pd.retries": timings.retries,
        }
        for key, value in (
            ("vllm_pd.prefill_instance", timings.prefill_instance),
            ("vllm_pd.decode_instance", timings.decode_instance),
            ("vllm_pd.prefill_seconds", timings.prefill_seconds),
            ("vllm_pd.decode_first_token_seconds", timings.decode_first_token_seconds),
            ("vllm_pd.prefill_to_decode_gap_seconds", timings.handoff_gap_seconds),
            ("vllm_pd.fallback", timings.fallback),
        ):
            if value is not None:
                attrs[key] = value
        span.set_attributes(attrs)
        if timings.status >= 500 or timings.outcome == "stream_error":
            span.set_status(Status(StatusCode.ERROR, timings.outcome))
        span.end()


class OtelTracer(Tracer):
    exporting = True

    def __init__(self, endpoint: str | None, service_name: str) -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(otlp_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("vllm_pd.router")

    def start(self, given: dict[str, str], headers: dict[str, str]) -> OtelRequestTrace:
        parent = _propagator.extract(given)  # an invalid or missing traceparent starts a new trace
        span = self._tracer.start_span("vllm-pd proxy request", context=parent, kind=SpanKind.SERVER)
        headers.pop("tracestate", None)
        _propagator.inject(headers, context=trace.set_span_in_context(span))
        return OtelRequestTrace(self._tracer, span)

    async def shutdown(self) -> None:
        # flushes the batch; the exporter blocks, so not on the event loop
        await asyncio.get_running_loop().run_in_executor(None, self._provider.shutdown)

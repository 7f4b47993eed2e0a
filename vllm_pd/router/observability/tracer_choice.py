"""The proxy's tracer: exporting spans over OTLP when that is configured and OpenTelemetry is installed.

Apart from tracing.py so that the propagation-only tracer never imports the exporting one
(otel_tracing.py builds on it); the OpenTelemetry SDK is imported only when OTLP is configured.
"""

from __future__ import annotations

import logging
import os

from vllm_pd.router.observability.tracing import Tracer

logger = logging.getLogger(__name__)


def otlp_configured(endpoint: str | None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def make_tracer(endpoint: str | None) -> Tracer:
    """An exporting tracer when OTLP is configured and OpenTelemetry is installed, else propagation only."""
    if not otlp_configured(endpoint):
        return Tracer()
    try:
        from vllm_pd.router.observability.otel_tracing import OtelTracer
    except ImportError as e:
        logger.warning(
            "OTLP tracing asked for but OpenTelemetry is not installed (pip install "
            "'vllm-pd[otel]'): %s; trace context is still propagated",
            e,
        )
        return Tracer()
    return OtelTracer(endpoint, os.environ.get("OTEL_SERVICE_NAME") or "vllm-pd-proxy")

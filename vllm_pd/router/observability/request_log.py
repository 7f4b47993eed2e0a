"""Optional JSON request log: one line per client request, its id, instances, leg times and outcome.

``--request-log PATH`` (``-`` for standard error). Lines go through the
``vllm_pd.router.requests`` logger with a handler of their own that writes the
bare JSON, so the proxy's other log lines never mix into the file.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec

from vllm_pd.router.observability.leg_timings import LegTimings

LOGGER_NAME = "vllm_pd.router.requests"


class RequestLine(msgspec.Struct, omit_defaults=True):
    """One request as logged; seconds, None fields left out."""

    ts: float  # wall clock at the end of the request
    request_id: str
    trace_id: str
    endpoint: str
    status: int
    outcome: str
    e2e_s: float
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_s: float | None = None
    decode_first_token_s: float | None = None
    prefill_to_decode_gap_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    events: int = 0
    retries: int = 0
    fallback: str | None = None


def request_line(t: LegTimings, request_id: str, trace_id: str, endpoint: str) -> RequestLine:
    ttft = None if t.first_token is None else t.first_token - t.started
    return RequestLine(
        time.time(),
        request_id,
        trace_id,
        endpoint,
        t.status,
        t.outcome,
        t.e2e_seconds or 0.0,
        t.prefill_instance,
        t.decode_instance,
        t.prefill_seconds,
        t.decode_first_token_seconds,
        t.handoff_gap_seconds,
        ttft,
        t.time_per_output_token,
        t.events,
        t.retries,
        t.fallback,
    )


class RequestLog:
    """Writes :class:`RequestLine` s as JSON lines to a file or standard error."""

    def __init__(self, path: str) -> None:
        self._encoder = msgspec.json.Encoder()
        self._logger = logging.getLogger(LOGGER_NAME)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False  # the proxy's own log format must not wrap the JSON
        handler: logging.Handler = (
            logging.StreamHandler(sys.stderr) if path == "-" else logging.FileHandler(path, encoding="utf-8")
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler = handler
        self._logger.addHandler(handler)

    def write(self, t: LegTimings, request_id: str, trace_id: str, endpoint: str) -> None:
        line = request_line(t, request_id, trace_id, endpoint)
        self._logger.info(self._encoder.encode(line).decode())

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()

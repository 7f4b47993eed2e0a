"""Per-request leg timings and the per-instance latency histograms built from them.

A request's :class:`LegTimings` is filled in by the flow as its legs run
(monotonic timestamps, instance URLs, retries, the outcome); when the request
ends, :meth:`LegHistograms.observe` turns it into histogram samples, and the
request log and the trace read the same record.

The histograms are :class:`FastHistogram`: bucket counts in a list, found by
``bisect`` over precomputed bounds, no lock. They are observed from the event
loop thread only (the proxy is one loop), so prometheus_client's locked
histogram (a lock and a labels() lookup per observation) would buy nothing;
:class:`LegHistograms` exposes them to the registry at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# seconds: legs and end-to-end times (prefill of long prompts can take minutes on CPU)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# seconds: per output token (vLLM's own inter-token buckets start at 10 ms; a fast GPU decodes faster)
TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class FastHistogram:
    """One histogram series: ``counts[i]`` = observations in bucket i (not cumulative), the last is +Inf."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # Prometheus buckets are "<= le"
        self.total += value

    def observe_n(self, value: float, n: int) -> None:
        """``n`` observations of the same value (the events of one network read)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.total += value * n

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip((*map(float, self.bounds), float("inf")), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class LabelledHistogram:
    """A histogram family with one label (``backend``: the instance URL); children are made on first use."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...], label: str = "backend") -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.label = label
        self.children: dict[str, FastHistogram] = {}

    def child(self, value: str) -> FastHistogram:
        h = self.children.get(value)
        if h is None:
            h = self.children[value] = FastHistogram(self.bounds)
        return h

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, h in list(self.children.items()):
            fam.add_metric([value], h.cumulative(), h.total)
        return fam


class HistogramSet(Collector):
    """Exposes :class:`LabelledHistogram` s to a prometheus_client registry, read at scrape time."""

    def __init__(self, *histograms: LabelledHistogram) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for h in self.histograms:
            yield h.family()

    def describe(self) -> Iterator[HistogramMetricFamily]:
        # names without samples: registering must not depend on which children exist yet
        for h in self.histograms:
            yield HistogramMetricFamily(h.name, h.documentation, labels=[h.label])


@dataclass(slots=True)
class LegTimings:
    """What one client request's legs did; times are ``time.monotonic()`` seconds."""

    started: float
    prefill_instance: str | None = None
    prefill_seconds: float | None = None  # the successful prefill leg, request sent -> answer read
    prefill_done: float | None = None
    decode_instance: str | None = None
    decode_sent: float | None = None
    first_token: float | None = None  # decode's first event (streams) or its whole answer (JSON)
    last_event: float | None = None
    events: int = 0  # SSE events relayed (a JSON answer: its completion tokens)
    json_tpot: float | None = None  # a JSON answer's decode time over its tokens (no events to time)
    retries: int = 0
    fallback: str | None = None  # why decode computed the prompt itself, if it did
    outcome: str = "ok"  # ok | error | client_disconnected | stream_error
    status: int = 0
    ended: float | None = None

    @property
    def decode_first_token_seconds(self) -> float | None:
        if self.first_token is None or self.decode_sent is None:
            return None
        return self.first_token - self.decode_sent

    @property
    def handoff_gap_seconds(self) -> float | None:
        """Prefill's answer -> decode's first token; 0 when decode's token came first (legs at once, push)."""
        if self.first_token is None or self.prefill_done is None:
            return None
        return max(0.0, self.first_token - self.prefill_done)

    @property
    def time_per_output_token(self) -> float | None:
        if self.json_tpot is not None:
            return self.json_tpot
        if self.first_token is None or self.last_event is None or self.events < 2:
            return None
        return (self.last_event - self.first_token) / (self.events - 1)

    @property
    def e2e_seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class LegHistograms(HistogramSet):
    """The per-backend latency histograms of the legs."""

    def __init__(self) -> None:
        p = "vllm_pd_proxy_"
        self.prefill = LabelledHistogram(
            p + "prefill_seconds", "prefill leg: request sent to answer read, by prefill backend", LATENCY_BUCKETS
        )
        self.decode_first_token = LabelledHistogram(
            p + "decode_first_token_seconds",
            "decode leg: request sent to its first token, by decode backend",
            LATENCY_BUCKETS,
        )
        self.handoff_gap = LabelledHistogram(
            p + "prefill_to_decode_gap_seconds",
            "prefill's answer to decode's first token (0 when decode's token came first), by decode backend",
            LATENCY_BUCKETS,
        )
        self.ttft = LabelledHistogram(
            p + "ttft_seconds",
            "client's time to first token: request received to the first byte sent back, by decode backend",
            LATENCY_BUCKETS,
        )
        self.inter_token = LabelledHistogram(
            p + "inter_token_latency_seconds", "time between decode's stream events, by decode backend", TOKEN_BUCKETS
        )
        self.time_per_output_token = LabelledHistogram(
            p + "time_per_output_token_seconds",
            "per request: decode's first to last token over the tokens between, by decode backend",
            TOKEN_BUCKETS,
        )
        super().__init__(
            self.prefill,
            self.decode_first_token,
            self.handoff_gap,
            self.ttft,
            self.inter_token,
            self.time_per_output_token,
        )

    def observe(self, t: LegTimings) -> None:
        """The histograms one finished request feeds (prefill and ITL were observed as they happened;
        the end-to-end time is the proxy's request histogram, by endpoint)."""
        first, decode = t.first_token, t.decode_instance
        if first is None or t.decode_sent is None or decode is None:
            return
        self.decode_first_token.child(decode).observe(first - t.decode_sent)
        self.ttft.child(decode).observe(first - t.started)
        if t.prefill_done is not None:
            self.handoff_gap.child(decode).observe(max(0.0, first - t.prefill_done))
        tpot = t.time_per_output_token
        if tpot is not None:
            self.time_per_output_token.child(decode).observe(tpot)

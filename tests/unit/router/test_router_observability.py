"""The proxy's observability against mock backends: per-leg metrics, the JSON request log, trace context.

The backends are mock_backend.py (fixed TTFT and inter-token latency), so the
leg times the proxy reports can be checked against what the mocks were told
to take. The OTLP test exports to a local receiver over HTTP and decodes the
protobuf it gets, so the spans are the ones a collector would see.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.router_harness import Harness, harness, run, wait_for
from vllm_pd.router.observability.leg_timings import FastHistogram
from vllm_pd.router.observability.tracer_choice import make_tracer
from vllm_pd.router.observability.tracing import format_traceparent, parse_traceparent

STREAM = {"model": "mock-model", "prompt": "an observed prompt " * 8, "max_tokens": 6, "stream": True}


async def _metrics(h: Harness) -> dict[str, list[Any]]:
    async with h.session.get(h.url + "/metrics") as r:
        text = await r.text()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _one(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    hits = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


async def _stream(h: Harness, body: dict, headers: dict[str, str] | None = None) -> tuple[str, bytes]:
    async with h.session.post(h.url + "/v1/completions", json=body, headers=headers or {}) as r:
        assert r.status == 200
        return r.headers["X-Request-Id"], await r.read()


def test_fast_histogram_buckets_are_le() -> None:
    h = FastHistogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    h.observe_n(0.2, 3)
    assert h.cumulative() == [("0.1", 2), ("1.0", 7), ("+Inf", 8)]
    assert h.total == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 7.0 + 0.6)


def test_leg_histograms_per_instance_match_the_mocks_latencies() -> None:
    async def go() -> None:
        # prefill answers after 0.15 s; decode's first token after 0.1 s, then one every 0.05 s
        async with harness(backend_kw={"ttft": 0.1, "itl": 0.05}) as h:
            h.prefills[0].ttft = 0.15
            await _stream(h, STREAM)
            m = await _metrics(h)
            p_url, d_url = h.backend_urls["p0"], h.backend_urls["d0"]
            assert _one(m, "vllm_pd_proxy_prefill_seconds_count", backend=p_url) == 1
            prefill_s = _one(m, "vllm_pd_proxy_prefill_seconds_sum", backend=p_url)
            assert 0.15 <= prefill_s < 0.5
            assert _one(m, "vllm_pd_proxy_prefill_seconds_bucket", backend=p_url, le="0.1") == 0
            assert _one(m, "vllm_pd_proxy_prefill_seconds_bucket", backend=p_url, le="0.25") == 1
            first = _one(m, "vllm_pd_proxy_decode_first_token_seconds_sum", backend=d_url)
            assert 0.1 <= first < 0.4
            # the legs ran one after the other (no KV endpoint): the gap is decode's own TTFT
            gap = _one(m, "vllm_pd_proxy_prefill_to_decode_gap_seconds_sum", backend=d_url)
            assert 0.1 <= gap < 0.4
            ttft = _one(m, "vllm_pd_proxy_ttft_seconds_sum", backend=d_url)
            assert ttft >= prefill_s + 0.1
            # 6 token events, 5 gaps of 0.05 s between them ([DONE] is no token)
            assert _one(m, "vllm_pd_proxy_inter_token_latency_seconds_count", backend=d_url) == 5
            itl = _one(m, "vllm_pd_proxy_inter_token_latency_seconds_sum", backend=d_url) / 5
            assert 0.045 <= itl < 0.2
            tpot = _one(m, "vllm_pd_proxy_time_per_output_token_seconds_sum", backend=d_url)
            assert tpot == pytest.approx(itl, rel=1e-6)
            e2e = _one(m, "vllm_pd_proxy_request_seconds_sum", endpoint="/v1/completions")
            assert e2e >= ttft + 5 * 0.05
            assert _one(m, "vllm_pd_proxy_requests_in_flight") == 0
            assert _one(m, "vllm_pd_proxy_draining") == 0

    run(go)


def test_in_flight_gauge_counts_running_requests() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.05}) as h:
            tasks = [asyncio.ensure_future(_stream(h, dict(STREAM, max_tokens=20))) for _ in range(3)]
            await wait_for(lambda: h.proxy.metrics.in_flight == 3)
            assert _one(await _metrics(h), "vllm_pd_proxy_requests_in_flight") == 3
            await asyncio.gather(*tasks)
            assert _one(await _metrics(h), "vllm_pd_proxy_requests_in_flight") == 0

    run(go)


def test_retry_and_fallback_reach_metrics_and_request_log(tmp_path) -> None:
    log = tmp_path / "requests.jsonl"

    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin", request_log=str(log)) as h:
            h.prefills[0].fail_next("500")
            h.prefills[1].fail_next("500")
            rid, _ = await _stream(h, STREAM)  # both prefills fail: decode computes the prompt
            rid2, _ = await _stream(h, STREAM, {"traceparent": format_traceparent("ab" * 16, "cd" * 8)})
            async with h.session.post(h.url + "/v1/completions", json=dict(STREAM, max_tokens=-1)) as r:
                assert r.status == 400
            m = await _metrics(h)
            assert _one(m, "vllm_pd_proxy_retries_total", leg="prefill") == 1
            assert _one(m, "vllm_pd_proxy_decode_only_total", reason="prefill_unavailable") == 1
        lines = [json.loads(ln) for ln in log.read_text().splitlines()]
        first = next(ln for ln in lines if ln["request_id"] == rid)
        assert first["outcome"] == "ok" and first["status"] == 200 and first["retries"] == 1
        assert first["fallback"] == "prefill_unavailable" and "prefill_instance" not in first
        assert first["decode_instance"] == h.backend_urls["d0"] and first["events"] == 6
        second = next(ln for ln in lines if ln["request_id"] == rid2)
        assert second["trace_id"] == "ab" * 16  # the client's trace continued
        assert second["prefill_instance"] in (h.backend_urls["p0"], h.backend_urls["p1"])
        assert 0 < second["prefill_s"] <= second["ttft_s"] <= second["e2e_s"]

    run(go)


def test_both_legs_carry_one_trace_context() -> None:
    async def go() -> None:
        async with harness() as h:
            await _stream(h, STREAM)  # no traceparent from the client: the proxy starts a trace
            client_tp = format_traceparent("12" * 16, "34" * 8)
            await _stream(h, STREAM, {"traceparent": client_tp, "tracestate": "k=v"})
            await _stream(h, STREAM, {"traceparent": "00-zz-bad"})
        p_seen, d_seen = h.prefills[0].seen, h.decodes[0].seen
        started = [parse_traceparent(s.headers.get("traceparent")) for s in (p_seen[0], d_seen[0])]
        assert started[0] is not None and started[0] == started[1]
        assert p_seen[1].headers["traceparent"] == d_seen[1].headers["traceparent"] == client_tp
        assert p_seen[1].headers["tracestate"] == "k=v"
        replaced = parse_traceparent(d_seen[2].headers["traceparent"])
        assert replaced is not None and replaced[0] not in ("12" * 16, started[0][0])

    run(go)


def test_traceparent_parsing() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    for bad in (
        "",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        good.upper(),
        good + "-x",
    ):
        assert parse_traceparent(bad) is None, bad


class _OtlpReceiver:
    """An OTLP/HTTP collector stand-in: decodes every ExportTraceServiceRequest it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans: list[Any] = []
        self.spans = spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def otlp(monkeypatch: pytest.MonkeyPatch) -> Iterator[_OtlpReceiver]:
    pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry (vllm-pd[otel]) not installed")
    receiver = _OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    yield receiver
    receiver.server.shutdown()


def test_spans_of_request_and_legs_exported_over_otlp(otlp: _OtlpReceiver) -> None:
    client_trace = "5a" * 16

    async def go() -> None:
        async with harness(otlp_endpoint=otlp.url) as h:
            await _stream(h, STREAM, {"traceparent": format_traceparent(client_trace, "6b" * 8)})
        # the proxy's stop flushed the batch; each leg named its own span to its instance
        by_name = {s.name: s for s in otlp.spans}
        assert set(by_name) == {"vllm-pd proxy request", "prefill leg", "decode leg"}
        request, prefill, decode = (by_name[n] for n in ("vllm-pd proxy request", "prefill leg", "decode leg"))
        assert {s.trace_id.hex() for s in otlp.spans} == {client_trace}
        assert request.parent_span_id.hex() == "6b" * 8
        assert prefill.parent_span_id == decode.parent_span_id == request.span_id
        sent = {
            parse_traceparent(h.prefills[0].seen[0].headers["traceparent"])[1],  # type: ignore[index]
            parse_traceparent(h.decodes[0].seen[0].headers["traceparent"])[1],
        }  # type: ignore[index]
        assert sent == {prefill.span_id.hex(), decode.span_id.hex()}
        attrs = {a.key: a.value for a in request.attributes}
        assert attrs["vllm_pd.decode_instance"].string_value == h.backend_urls["d0"]
        assert attrs["http.response.status_code"].int_value == 200
        assert (
            request.start_time_unix_nano
            <= prefill.start_time_unix_nano
            <= decode.end_time_unix_nano
            <= request.end_time_unix_nano
        )

    run(go)


def test_tracing_off_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert make_tracer(None).exporting is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert make_tracer(None).exporting is False

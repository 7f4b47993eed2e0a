"""``vllm-pd profile`` against fake OpenAI servers: the served vocabulary, streams that are not measurements,
the profiler's own failures, and a PD pair whose two instances differ (no vLLM).

The fakes stand in for vLLM where these cases are cheap to make: :class:`FakeServer` refuses a prompt id at or
past its vocabulary as vLLM 0.32 does - an error event *inside* a 200 stream - and can slip a non-token event
into a stream or end it short; a pair of them with a third as the "PD proxy" (its TTFT the prefill
instance's plus a hand-over) stands in for a prefill/decode pair. (Moved from tests/unit/planner/: they serve
HTTP and the profiles sleep the fakes' real delays.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.support.served_apps import serve_apps
from vllm_pd import cli
from vllm_pd.planner.completion_stream import Stream, stream_completion
from vllm_pd.planner.instance_profiler import InstanceProfiler
from vllm_pd.planner.latency_profile import load_profile
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.workload import TraceRequest

PLAN = [
    "--prefill-tokens",
    "16,64",
    "--decode-batches",
    "1",
    "--decode-contexts",
    "32",
    "--repeats",
    "2",
    "--decode-repeats",
    "1",
    "--wake-repeats",
    "0",
]


class FakeServer:
    """Streams ``max_tokens`` tokens, the first ``ttft`` s after the request; ``vocab``: ids at or past it get
    vLLM's error event in a 200 stream; ``extra_event``: written before the first token; ``short_by``: that
    many tokens fewer than asked."""

    def __init__(
        self,
        vocab: int = 1 << 30,
        ttft: float = 0.01,
        itl: float = 0.005,
        extra_event: bytes = b"",
        short_by: int = 0,
        merged: bool = False,
    ) -> None:
        self.vocab, self.ttft, self.itl = vocab, ttft, itl
        self.extra_event, self.short_by = extra_event, short_by
        self.merged = merged  # as vLLM behind: the first two tokens in one event, with their ids (asked for)
        self.prompts: list[list[int]] = []

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "fake-model"}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        self.prompts.append(prompt)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            err = {
                "error": {
                    "message": f"Token id {max(bad)} is out of vocabulary",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        await asyncio.sleep(self.ttft)
        if self.extra_event:
            await resp.write(b"data: " + self.extra_event + b"\n\n")
        n = max(0, body["max_tokens"] - self.short_by)
        if self.merged and n >= 2:
            assert body["return_token_ids"]
            await resp.write(b'data: {"choices": [{"index": 0, "text": " t t", "token_ids": [7, 8]}]}\n\n')
            n -= 2
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl)
            await resp.write(b'data: {"choices": [{"index": 0, "text": " t", "finish_reason": null}]}\n\n')
        if self.merged:  # vLLM's last event can carry the finish reason alone
            await resp.write(
                b'data: {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}\n\n'
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_profile_draws_its_prompts_from_the_served_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    server = FakeServer(vocab=1000)
    for (url,) in serve_apps(server.app()):
        assert cli.main(["profile", url, "--out", str(tmp_path / "p.json"), *PLAN]) == 0
    assert "vocabulary of 1000 token ids" in capsys.readouterr().out
    measured = [p for p in server.prompts if len(p) > 1]  # the probe's are one token each
    assert measured and max(max(p) for p in measured) < 1000
    assert max(max(p) for p in measured) > 900  # drawn over the whole vocabulary, not a corner of it


def test_prompts_past_the_vocabulary_fail_the_profile_naming_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The issue's case, forced: ids drawn below 4,000 from a 1,000-token vocabulary. The error event in the
    200 stream is the measurement's failure, named - never a token, a sample or a traceback."""
    for (url,) in serve_apps(FakeServer(vocab=1000).app()):
        rc = cli.main(["profile", url, "--out", str(tmp_path / "p.json"), "--vocab-size", "4000", *PLAN])
    err = capsys.readouterr().err
    assert rc == 1 and "the stream carried an error: Token id" in err and "out of vocabulary" in err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "server, message",
    [
        (FakeServer(extra_event=b'{"choices": [], "usage": {"prompt_tokens": 16}}'), "an event that is not a token"),
        (
            FakeServer(extra_event=b'{"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}'),
            "the stream ended in an error",
        ),
        (FakeServer(extra_event=b"not json"), "a line that is not JSON"),
        (FakeServer(short_by=1), "tokens, not the"),
    ],
)
def test_a_stream_that_is_not_a_measurement_fails_the_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture, server: FakeServer, message: str
) -> None:
    for (url,) in serve_apps(server.app()):
        rc = cli.main(["profile", url, "--out", str(tmp_path / "p.json"), "--vocab-size", "500", *PLAN])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_tokens_merged_into_one_event_count_by_their_ids() -> None:
    """Seen on a busy machine: vLLM sent 23 events for 24 tokens, and the profile failed as a short stream."""

    async def one(url: str) -> Stream:
        async with aiohttp.ClientSession() as session:
            return await stream_completion(session, url, "fake-model", [5, 6, 7], 4)

    for (url,) in serve_apps(FakeServer(merged=True).app()):
        s = asyncio.run(one(url))
    assert len(s.stamps) == 4 and s.stamps[0] == s.stamps[1] < s.stamps[2] < s.stamps[3]


def test_a_failure_of_the_profiler_itself_ends_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of ours (the issue's IndexError) stands in by a patched measurement that raises one."""

    async def broken(self: InstanceProfiler, tp: int) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(InstanceProfiler, "run_all", broken)
    rc = cli.main(["profile", "http://127.0.0.1:1", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip() == (
        "vllm-pd profile: failed: IndexError: list index out of range (--log-level DEBUG shows where)"
    )


def test_profile_measures_both_instances_of_a_pair_and_the_plan_uses_each_for_its_role(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The prefill instance answers in 20 ms, the decode instance in 60 ms; through the pair the first token
    comes 25 ms after the prefill instance's. The profile keeps both, says how far they differ, and takes the
    hand-over against the prefill instance's own TTFT (against the decode instance's, as before, it would be
    45 - 60 ms: fitted 0)."""
    prefill, decode, pair = FakeServer(ttft=0.02), FakeServer(ttft=0.06), FakeServer(ttft=0.045)
    out = tmp_path / "p.json"
    for p_url, d_url, pd_url in serve_apps(prefill.app(), decode.app(), pair.app()):
        rc = cli.main(
            [
                "profile",
                d_url,
                "--pd-url",
                pd_url,
                "--prefill-url",
                p_url,
                "--out",
                str(out),
                *PLAN,
                "--kv-repeats",
                "3",
            ]
        )
    assert rc == 0
    text = capsys.readouterr().out
    profile = load_profile(out)
    first, main = profile.instances
    assert (first.url, first.role, main.url, main.role) == (p_url, "prefill", d_url, "decode")
    assert profile.for_tp(1) is main and profile.for_role(1, "prefill") == [first]
    # generous bounds: a loaded 2-core box delays the client, never speeds the fakes up
    assert 18 <= first.prefill_ms(64) <= 45 and 55 <= main.prefill_ms(64) <= 90
    assert 15 <= main.kv_ms(40) <= 45 and main.kv == first.kv  # the pair's term, in both
    assert len(main.speed_checks) == len(first.speed_checks) == 3
    assert f"{first.prefill_ms(512) / main.prefill_ms(512):.2f} x" in text and "drifted" in text
    # 1P1D: a lone request's TTFT is the prefill instance's prefill and the hand-over
    (req,) = simulate(profile, Deployment(1, 1), [TraceRequest(0.0, 64, 4)])
    assert req.ttft * 1e3 == pytest.approx(first.prefill_ms(64) + main.kv_ms(64), rel=1e-6)
    # colocated x2: the instances measured, in turn
    a, b = simulate(profile, Deployment(0, 2), [TraceRequest(0.0, 64, 2), TraceRequest(5.0, 64, 2)])
    assert (a.ttft * 1e3, b.ttft * 1e3) == (pytest.approx(first.prefill_ms(64)), pytest.approx(main.prefill_ms(64)))


def test_merge_pools_a_pair_per_role(tmp_path: Path) -> None:
    prefill, decode, pair = FakeServer(ttft=0.02), FakeServer(ttft=0.04), FakeServer(ttft=0.03)
    out = tmp_path / "p.json"
    for p_url, d_url, pd_url in serve_apps(prefill.app(), decode.app(), pair.app()):
        flags = [d_url, "--pd-url", pd_url, "--prefill-url", p_url, "--out", str(out), *PLAN, "--merge"]
        assert cli.main(["profile", *flags]) == 0
        once = load_profile(out)
        assert cli.main(["profile", *flags]) == 0
    twice = load_profile(out)
    assert [i.role for i in twice.instances] == ["prefill", "decode"]
    for a, b in zip(once.instances, twice.instances):
        assert len(b.prefill_samples) == 2 * len(a.prefill_samples) and b.url == a.url

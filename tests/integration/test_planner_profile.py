"""``vllm-pd profile`` against mock servers on sockets: the delays it measures back (moved from
tests/unit/planner/test_planner_cli.py: they serve HTTP and sleep the mock's real delays, about 90 s of
the unit suite).

The mock (tests.support.mock_backend) streams with a fixed TTFT and inter-token latency whatever
the prompt, standing in for vLLM: the profiler must measure those delays back. Its delays never depend
on another server, so the neighbour measurement has its own fake: two aiohttp apps on one "host"
(:class:`FakeHost`), the instance answering slower while the neighbour is at work.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.mock_backend import MockBackend, start_backend
from tests.support.served_apps import serve_apps
from vllm_pd import cli
from vllm_pd.planner.latency_profile import fit_instance, load_profile


@pytest.fixture
def mock_url() -> Iterator[str]:
    yield from _serve_mock(0.05, 0.02)


@pytest.fixture
def slow_mock_url() -> Iterator[str]:
    yield from _serve_mock(0.1, 0.04)


def _serve_mock(ttft: float, itl: float) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def serve() -> None:
        box["server"], box["url"] = await start_backend(MockBackend(ttft=ttft, itl=itl, record=False))
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop)
    assert started.wait(10)
    yield box["url"]
    asyncio.run_coroutine_threadsafe(box["server"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_profile_measures_the_mock_delays(mock_url: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = cli.main(
        [
            "profile",
            mock_url,
            "--out",
            str(out),
            "--prefill-tokens",
            "16,64",
            "--decode-batches",
            "1,2",
            "--decode-contexts",
            "32,64",
            "--repeats",
            "1",
            "--decode-repeats",
            "2",
            "--kv-fixed-ms",
            "7",
            "--wake-idle-ms",
            "20,50",
            "--wake-repeats",
            "2",
        ]
    )
    assert rc == 0
    prof = load_profile(out)
    inst = prof.for_tp(1)
    assert prof.model == "mock-model" and prof.source == mock_url
    # generous bounds: a loaded 2-core box delays the client, never speeds the mock up
    assert 45 <= inst.prefill_ms(64) <= 200
    assert 18 <= inst.decode_ms(2, 128) <= 80
    assert inst.kv_ms(0) == pytest.approx(7)
    assert len(inst.prefill_samples) == 6 and len(inst.decode_samples) == 8
    # the decode points' scatter is the spread, over the second half of each stream (ignore_eos: 12 gaps)
    assert len(inst.decode_spread) == 8 and inst.decode_spread_window_ms > 0
    # each lone stream's first gap less its steady step (the mock's gaps are alike: ~0)
    assert len(inst.first_step_samples) == 4 and 0 <= inst.first_step_ms < 15
    # lone prefills back to back and after 20 / 50 ms idle, in pairs (the mock does not sleep: ~0)
    assert [idle for idle, _, _ in inst.wake_samples] == [20.0, 50.0, 20.0, 50.0]
    assert [idle for idle, _ in inst.wake_after_idle] == [20.0, 50.0]
    assert all(0 <= ms < 15 for _, ms in inst.wake_after_idle)
    # a second TP size joins the same file
    rc = cli.main(
        [
            "profile",
            mock_url,
            "--out",
            str(out),
            "--append",
            "--tp",
            "2",
            "--prefill-tokens",
            "16,64",
            "--decode-batches",
            "1,2",
            "--decode-contexts",
            "32",
            "--repeats",
            "1",
            "--wake-repeats",
            "0",
        ]
    )
    assert rc == 0 and load_profile(out).tps() == [1, 2] and load_profile(out).for_tp(2).wake_after_idle == []


def test_profile_merge_pools_the_samples_of_two_runs(mock_url: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    flags = [
        "--out",
        str(out),
        "--prefill-tokens",
        "16,64",
        "--decode-batches",
        "1,2",
        "--decode-contexts",
        "32",
        "--repeats",
        "1",
        "--decode-repeats",
        "1",
        "--wake-idle-ms",
        "20,50,80",
        "--wake-repeats",
        "1",
        "--merge",
    ]
    assert cli.main(["profile", mock_url, *flags]) == 0  # nothing to merge into yet: a fresh file
    first = load_profile(out).for_tp(1)
    assert cli.main(["profile", mock_url, *flags]) == 0
    merged = load_profile(out).for_tp(1)
    assert len(merged.prefill_samples) == 2 * len(first.prefill_samples) == 12
    assert merged.decode_samples[: len(first.decode_samples)] == first.decode_samples
    assert len(merged.decode_samples) == 2 * len(first.decode_samples)
    assert merged == fit_instance(
        1,
        merged.prefill_samples,
        merged.decode_samples,
        merged.kv_samples,
        merged.max_num_batched_tokens,
        merged.max_num_seqs,
        merged.decode_spread_window_ms,
        first_step=merged.first_step_samples,
        wake=merged.wake_samples,
        url=mock_url,
        speed_checks=merged.speed_checks,
    )
    # each run checked the instance's speed at its start, midway and at its end: both runs' checks are kept
    assert len(merged.speed_checks) == 2 * len(first.speed_checks) == 6
    assert len(merged.wake_samples) == 2 * len(first.wake_samples) == 6
    # another instance kind is refused, naming it; the file is left as it was
    assert cli.main(["profile", mock_url, *flags, "--max-num-batched-tokens", "4096"]) == 1
    assert load_profile(out).for_tp(1) == merged


def test_profile_measures_through_the_relay(mock_url: str, slow_mock_url: str, tmp_path: Path) -> None:
    # the "relay" mock is twice as slow as the instance: what the profile holds must be the relay's
    out = tmp_path / "p.json"
    rc = cli.main(
        [
            "profile",
            mock_url,
            "--relay-url",
            slow_mock_url,
            "--out",
            str(out),
            "--prefill-tokens",
            "16,64",
            "--decode-batches",
            "1",
            "--decode-contexts",
            "32",
            "--repeats",
            "1",
            "--decode-repeats",
            "1",
            "--wake-idle-ms",
            "20",
            "--wake-repeats",
            "1",
        ]
    )
    assert rc == 0
    inst = load_profile(out).for_tp(1)
    assert 95 <= inst.prefill_ms(64) <= 250 and 38 <= inst.decode_ms(1, 32) <= 120


def test_profile_measures_the_hand_over_through_a_pd_proxy(mock_url: str, slow_mock_url: str, tmp_path: Path) -> None:
    # the "PD proxy" mock answers its first token 50 ms after the instance's: the hand-over is the pair's TTFT
    # less the prefill instance's (here the instance itself: no other given), each back to back
    out = tmp_path / "p.json"
    rc = cli.main(
        [
            "profile",
            mock_url,
            "--pd-url",
            slow_mock_url,
            "--out",
            str(out),
            "--prefill-tokens",
            "16,64",
            "--decode-batches",
            "1",
            "--decode-contexts",
            "32",
            "--repeats",
            "1",
            "--decode-repeats",
            "1",
            "--wake-idle-ms",
            "20",
            "--wake-repeats",
            "2",
            "--kv-repeats",
            "3",
        ]
    )
    assert rc == 0
    inst = load_profile(out).for_tp(1)
    assert [t for t, _ in inst.kv_samples] == [16, 16, 16, 64, 64, 64]
    # 50 ms, told from 0 (the instance against itself) and 100 (the pair's TTFT not less the instance's);
    # a sample is the difference of two, each late by what a busy host's scheduler adds: judged by the median
    assert 20 <= statistics.median(ms for _, ms in inst.kv_samples) <= 85 and 20 <= inst.kv_ms(40) <= 85
    # the wake-up through the pair as well as straight: the "pair" answers 50 ms later either way
    assert [idle for idle, _, _ in inst.pd_wake_samples] == [20.0, 20.0]
    pair_ttft = statistics.median(hot for _, hot, _ in inst.pd_wake_samples)
    direct_ttft = statistics.median(hot for _, hot, _ in inst.wake_samples)
    assert 20 <= pair_ttft - direct_ttft <= 85


class FakeHost:
    """An instance and its neighbour: the instance's tokens come ``beside_prefill`` x slower while the
    neighbour runs a one-token request (a prefill), its first token ``beside_decode`` x later while the
    neighbour streams a longer one (decoding); ``fail`` makes the neighbour answer HTTP 500."""

    def __init__(self, beside_prefill: float, beside_decode: float, fail: bool = False, join_s: float = 0.0) -> None:
        self.ttft, self.itl, self.prefill_s = 0.04, 0.01, 0.03
        self.beside_prefill, self.beside_decode, self.fail = beside_prefill, beside_decode, fail
        self.join_s = join_s  # what each PD request joining the instance adds to its next token gap
        self.joins_due = 0.0
        self.prefilling = self.decoding = 0
        self.peak_decoding = 0
        self.prompts: list[tuple[int, ...]] = []  # every prompt either server saw

    def apps(self) -> tuple[web.Application, web.Application]:
        return self._app(self._instance), self._app(self._neighbour)

    def pd_app(self) -> web.Application:
        """A PD proxy over the pair: prefill on the neighbour, then the request decodes on the instance."""
        return self._app(self._pd)

    @staticmethod
    def _app(completions) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "fake-model"}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        return app

    @staticmethod
    async def _token(resp: web.StreamResponse) -> None:
        await resp.write(b'data: {"choices": [{"index": 0, "text": " t"}]}\n\n')

    async def _instance(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"]
        self.prompts.append(tuple(body["prompt"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft * (self.beside_decode if self.decoding else 1.0))
        for i in range(body["max_tokens"]):
            if i:
                due, self.joins_due = self.joins_due, 0.0
                await asyncio.sleep(self.itl * (self.beside_prefill if self.prefilling else 1.0) + due)
            await self._token(resp)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _pd(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(tuple(body["prompt"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.prefilling += 1
        try:
            await asyncio.sleep(self.prefill_s)
        finally:
            self.prefilling -= 1
        self.joins_due += self.join_s
        for i in range(body["max_tokens"]):
            if i:  # the running streams (the profiler's lone stream) pay for the joins, not the joiners
                due, self.joins_due = (self.joins_due, 0.0) if body["max_tokens"] > 2 else (0.0, self.joins_due)
                await asyncio.sleep(self.itl + due)
            await self._token(resp)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _neighbour(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(tuple(body["prompt"]))
        if self.fail:
            return web.json_response({"error": "injected"}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prefill = body["max_tokens"] == 1
        if prefill:
            self.prefilling += 1
        else:
            self.decoding += 1
            self.peak_decoding = max(self.peak_decoding, self.decoding)
        try:
            await asyncio.sleep(self.prefill_s if prefill else self.ttft)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.itl)
                await self._token(resp)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the profiler cancelled the stream
        finally:
            if prefill:
                self.prefilling -= 1
            else:
                self.decoding -= 1
        return resp


SMALL_PLAN = [
    "--prefill-tokens",
    "16",
    "--decode-batches",
    "1",
    "--decode-contexts",
    "32",
    "--repeats",
    "1",
    "--decode-repeats",
    "1",
    "--wake-repeats",
    "0",
]


def test_profile_measures_how_a_neighbour_slows_the_instance(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    host = FakeHost(beside_prefill=1.3, beside_decode=1.5)
    out = tmp_path / "p.json"
    for instance_url, neighbour_url in serve_apps(*host.apps()):
        rc = cli.main(["profile", instance_url, "--neighbour-url", neighbour_url, "--out", str(out), *SMALL_PLAN])
    assert rc == 0
    inst = load_profile(out).for_tp(1)
    # the injected factors, give or take the timer and event-loop noise of a busy 2-core box
    assert inst.beside_prefill == pytest.approx(1.3, abs=0.12) and inst.beside_decode == pytest.approx(1.5, abs=0.12)
    kinds = [k for k, _, _ in inst.neighbour_samples]
    assert kinds == ["decode"] * 4 + ["prefill"] * 4 and host.peak_decoding == 4
    assert host.prefilling == host.decoding == 0  # the loop stopped, the streams were cancelled
    assert len(set(host.prompts)) == len(host.prompts)  # no prefix cache hit on either instance
    assert (
        f"beside a neighbour: decode step x{inst.beside_prefill:.2f} while it prefills, "
        f"prefill x{inst.beside_decode:.2f} while it decodes"
    ) in capsys.readouterr().out


def test_profile_measures_what_a_join_costs_the_running_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each PD request joining the instance delays its running stream by 5 ms: the profile's join cost."""
    host = FakeHost(beside_prefill=1.0, beside_decode=1.0, join_s=0.005)
    out = tmp_path / "p.json"
    for instance_url, neighbour_url, pd_url in serve_apps(*host.apps(), host.pd_app()):
        rc = cli.main(
            [
                "profile",
                instance_url,
                "--neighbour-url",
                neighbour_url,
                "--pd-url",
                pd_url,
                "--out",
                str(out),
                *SMALL_PLAN,
                "--join-tokens",
                "16,64",
                "--join-repeats",
                "3",
            ]
        )
    assert rc == 0
    inst = load_profile(out).for_tp(1)
    assert [t for t, *_ in inst.join_samples] == [16, 64] * 3
    assert all(rate > 5 for *_, rate in inst.join_samples)  # ~25 joins/s: one per 30 ms prefill
    # 5 ms per join, give or take a window of a few joins and the event loop of a busy 2-core box
    assert 2.5 <= inst.join_ms(40) <= 9
    assert "a decode leg joining costs the running steps" in capsys.readouterr().out
    # without a PD proxy (or a neighbour) nothing is measured and a join costs nothing
    for instance_url, neighbour_url in serve_apps(*FakeHost(1.0, 1.0).apps()):
        assert (
            cli.main(["profile", instance_url, "--neighbour-url", neighbour_url, "--out", str(out), *SMALL_PLAN]) == 0
        )
    assert load_profile(out).for_tp(1).join_samples == [] and load_profile(out).for_tp(1).join_ms(500) == 0


def test_profile_without_a_neighbour_keeps_the_factors_neutral(
    mock_url: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rc = cli.main(["profile", mock_url, "--out", str(tmp_path / "p.json"), *SMALL_PLAN])
    inst = load_profile(tmp_path / "p.json").for_tp(1)
    assert rc == 0 and (inst.beside_prefill, inst.beside_decode, inst.neighbour_samples) == (1.0, 1.0, [])
    assert "neighbour" not in capsys.readouterr().out


def test_profile_with_a_failing_neighbour_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for instance_url, neighbour_url in serve_apps(*FakeHost(1.0, 1.0, fail=True).apps()):
        rc = cli.main(
            ["profile", instance_url, "--neighbour-url", neighbour_url, "--out", str(tmp_path / "p.json"), *SMALL_PLAN]
        )
    assert rc == 1 and f"{neighbour_url}/v1/completions: HTTP 500" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()

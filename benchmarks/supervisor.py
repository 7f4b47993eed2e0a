"""Supervisor vs a fixed prefill/decode split when the traffic mix shifts (simulated GPUs).

Four simulated instances behind the real proxy. Each has one "GPU": a prefill
takes prompt_tokens x PREFILL_S_PER_TOKEN of exclusive compute (it pauses the
instance's decode batch, as a prefill does on a real engine), a decode step
takes STEP_S for up to BATCH streams (more streams -> more steps per token).
Traffic: phase A long prompts / short outputs, then phase B short prompts /
long outputs, then phase C = A again (the way back from an all-decode split),
open-loop Poisson arrivals. Goodput = requests/s that meet both
TTFT <= TTFT_SLO and TPOT <= TPOT_SLO.

Cases, in one run: a fixed 2P2D split; four ``both`` instances under the
supervisor on what clients saw (TTFT/TPOT, queue depth); the same with
``supervisor_profile`` - a latency profile fitted to the simulator's own costs
(:func:`sim_profile`), so the supervisor's cost model knows these engines as the
planner's profile knows a real one. Each case reports the split over time and
how often an instance changed role.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/supervisor.py
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, fit_instance, save_profile
from vllm_pd.router.config import InstanceConfig, ProxyConfig
from vllm_pd.router.server.app import ProxyServer, serve
from vllm_pd.vllm_server import free_port

PREFILL_S_PER_TOKEN = 0.0002
STEP_S = 0.02
BATCH = 8
TTFT_SLO = 1.5
TPOT_SLO = 0.05


def sim_profile() -> InstanceProfile:
    """The simulated engine as the planner's profile describes an instance: fitted to samples of its own costs.

    Prefill is exactly linear; the decode step (STEP_S per BATCH streams, a staircase) gets the best line
    a + b*n, as a real profile fits a real engine; the hand-over is the proxy's second HTTP hop (~1 ms).
    A prompt is one prefill here (no chunking), so the chunk is larger than any prompt."""
    prefill = [(t, 1, t * PREFILL_S_PER_TOKEN * 1e3) for t in (100, 500, 1000, 2000, 3000, 4000)]
    decode = [(n, 0, STEP_S * 1e3 * math.ceil(n / BATCH)) for n in range(1, 4 * BATCH + 1)]
    return fit_instance(1, prefill, decode, [(t, 1.0) for t in (100, 1000, 3000)], max_num_batched_tokens=8192)


@dataclass
class _Stream:
    left: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class SimInstance:
    """One simulated engine: a prefill FIFO that preempts a batched decode loop."""

    def __init__(self) -> None:
        self.prefills: asyncio.Queue = asyncio.Queue()
        self.streams: list[_Stream] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        while True:
            if not self.prefills.empty():
                tokens, done = self.prefills.get_nowait()
                await asyncio.sleep(tokens * PREFILL_S_PER_TOKEN)
                done.set_result(None)
            elif self.streams:
                steps = -(-len(self.streams) // BATCH)
                await asyncio.sleep(STEP_S * steps)
                for s in list(self.streams):
                    s.left -= 1
                    s.queue.put_nowait(s.left)
                    if s.left <= 0:
                        self.streams.remove(s)
            else:
                self.wake.clear()
                await self.wake.wait()

    async def prefill(self, tokens: int) -> None:
        done = asyncio.get_running_loop().create_future()
        self.prefills.put_nowait((tokens, done))
        self.wake.set()
        await done

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "sim"}]}))
        return app

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt_tokens = len(body["prompt"])
        kvp = body.get("kv_transfer_params") or {}
        if kvp.get("do_remote_decode"):
            await self.prefill(prompt_tokens)
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}})
        if not kvp.get("do_remote_prefill"):
            await self.prefill(prompt_tokens)  # decode-only: this instance computes the prompt
        stream = _Stream(body["max_tokens"])
        self.streams.append(stream)
        self.wake.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while True:
            left = await stream.queue.get()
            await resp.write(b'data: {"choices":[{"text":" t"}]}\n\n')
            if left <= 0:
                break
        await resp.write(b"data: [DONE]\n\n")
        return resp


@dataclass
class Phase:
    name: str
    rate: float
    prompt: int
    output: int
    seconds: float


async def one_request(session: aiohttp.ClientSession, url: str, ph: Phase, out: list[tuple[str, float, float]]) -> None:
    body = {"model": "sim", "prompt": [1] * ph.prompt, "max_tokens": ph.output, "stream": True}
    t0 = time.monotonic()
    first = last = None
    n = 0
    try:
        # bounded so an overloaded case ends: a request still unanswered after 30 s misses its SLO anyway
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    n += 1
                    last = time.monotonic()
                    first = first or last
    except (TimeoutError, aiohttp.ClientError):
        pass
    if first is None or last is None or n < ph.output:
        out.append((ph.name, float("inf"), float("inf")))
    else:
        out.append((ph.name, first - t0, (last - first) / max(1, n - 1)))


def _split(proxy: ProxyServer) -> str:
    roles = Counter(i.active_role or i.role for i in proxy.pool.all())
    unassigned = f"{roles['both']}B" if roles.get("both") else ""  # both instances the supervisor has not placed
    return f"{roles.get('prefill', 0)}P{roles.get('decode', 0)}D{unassigned}"


async def _watch_split(proxy: ProxyServer, t0: float, timeline: list[tuple[float, str]]) -> None:
    """Every 0.25 s: the split, kept where it changed (the role moves as the clients' traffic saw them)."""
    while True:
        split = _split(proxy)
        if not timeline or timeline[-1][1] != split:
            timeline.append((time.monotonic() - t0, split))
        await asyncio.sleep(0.25)


def _timeline(timeline: list[tuple[float, str]], limit: int = 14) -> str:
    shown = [f"{t:.0f}s {split}" for t, split in timeline[:limit]]
    more = f" ... (+{len(timeline) - limit} changes)" if len(timeline) > limit else ""
    return " > ".join(shown) + more


async def run_case(
    name: str, roles: list[str], supervisor: bool, phases: list[Phase], seed: int, profile: str | None = None
) -> None:
    sims, runners, instances = [], [], []
    for role in roles:
        sim = SimInstance()
        sim.task = asyncio.create_task(sim.run())
        runner = web.AppRunner(sim.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        sims.append(sim)
        runners.append(runner)
        instances.append(InstanceConfig(f"http://127.0.0.1:{port}", role))
    cfg = ProxyConfig(
        port=free_port(),
        instances=instances,
        prefill_policy="least_outstanding",
        decode_policy="least_outstanding",
        supervisor=supervisor,
        supervisor_interval=1.0,
        supervisor_ttft_slo=TTFT_SLO,
        supervisor_tpot_slo=TPOT_SLO,
        supervisor_profile=profile,
    )
    proxy = ProxyServer(cfg)
    prunner = await serve(proxy)
    url = f"http://127.0.0.1:{cfg.port}"
    rng = random.Random(seed)
    results: list[tuple[str, float, float]] = []
    splits: dict[str, str] = {}
    timeline: list[tuple[float, str]] = []
    watch = asyncio.create_task(_watch_split(proxy, time.monotonic(), timeline))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for ph in phases:
            end = time.monotonic() + ph.seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one_request(session, url, ph, results)))
                await asyncio.sleep(rng.expovariate(ph.rate))
            splits[ph.name] = _split(proxy)
        await asyncio.gather(*tasks)
    watch.cancel()
    moves = proxy.supervisor.moves if proxy.supervisor is not None else 0
    await prunner.cleanup()
    for r in runners:
        await r.cleanup()
    for s in sims:
        assert s.task is not None
        s.task.cancel()
    print(f"  {name}: {moves} role moves; split over time: {_timeline(timeline)}")
    total_good = 0
    total_time = 0.0
    for ph in phases:
        rs = [r for r in results if r[0] == ph.name]
        good = sum(1 for _, ttft, tpot in rs if ttft <= TTFT_SLO and tpot <= TPOT_SLO)
        ttfts = sorted(r[1] for r in rs)
        tpots = sorted(r[2] for r in rs)
        total_good += good
        total_time += ph.seconds
        print(
            f"    {ph.name:28s} split at end {splits[ph.name]}  "
            f"goodput {good / ph.seconds:5.2f} req/s ({good}/{len(rs)} in SLO)  "
            f"TTFT p50 {ttfts[len(ttfts) // 2]:6.2f} s  TPOT p50 {tpots[len(tpots) // 2] * 1e3:6.1f} ms"
        )
    print(f"    overall goodput {total_good / total_time:.2f} req/s")


CASES = ("fixed", "supervisor", "profile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES), help=f"which of {','.join(CASES)} to run (comma list)")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    phases = [
        Phase("A long prompts (3000/16)", 4.0, 3000, 16, args.seconds),
        Phase("B long outputs (200/200)", 5.0, 200, 200, args.seconds),
        Phase("C long prompts again", 4.0, 3000, 16, args.seconds),
    ]
    profile = sim_profile()
    print(
        f"sim: prefill {PREFILL_S_PER_TOKEN * 1e3:.1f} ms/token, decode step {STEP_S * 1e3:.0f} ms for up to "
        f"{BATCH} streams; SLO TTFT <= {TTFT_SLO} s, TPOT <= {TPOT_SLO * 1e3:.0f} ms; 4 instances"
    )
    print(
        f"profile of the sim: prefill_ms = {profile.prefill.b:.3f}*t, decode_ms = {profile.decode.a:.1f} + "
        f"{profile.decode.b:.2f}*batch, kv_ms = {profile.kv.a:.1f}"
    )
    for ph in phases:
        print(f"  phase {ph.name}: {ph.rate} req/s for {ph.seconds:.0f} s")
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "sim_profile.json")
        save_profile(LatencyProfile("sim", [profile], source="benchmarks/supervisor.py sim_profile()"), path)
        if "fixed" in cases:
            asyncio.run(run_case("fixed 2P2D", ["prefill", "prefill", "decode", "decode"], False, phases, args.seed))
        if "supervisor" in cases:
            asyncio.run(run_case("supervisor, 4 x both", ["both"] * 4, True, phases, args.seed))
        if "profile" in cases:
            asyncio.run(run_case("supervisor + profile, 4 x both", ["both"] * 4, True, phases, args.seed, path))


if __name__ == "__main__":
    main()

"""Supervisor vs a fixed prefill/decode split when the traffic mix shifts (simulated GPUs).

Four simulated instances behind the real proxy. Each has one "GPU": a prefill
takes prompt_tokens x PREFILL_S_PER_TOKEN of exclusive compute (it pauses the
instance's decode batch, as a prefill does on a real engine), a decode step
takes STEP_S for up to BATCH streams (more streams -> more steps per token).
Traffic: phase A long prompts / short outputs, then phase B short prompts /
long outputs, open-loop Poisson arrivals. Goodput = requests/s that meet both
TTFT <= TTFT_SLO and TPOT <= TPOT_SLO.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/supervisor.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_pd.router.app import ProxyServer, serve  # noqa: E402
from vllm_pd.router.config import InstanceConfig, ProxyConfig  # noqa: E402
from vllm_pd.vllm_server import free_port  # noqa: E402

PREFILL_S_PER_TOKEN = 0.0002
STEP_S = 0.02
BATCH = 8
TTFT_SLO = 1.5
TPOT_SLO = 0.05


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
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    if first is None or last is None or n < ph.output:
        out.append((ph.name, float("inf"), float("inf")))
    else:
        out.append((ph.name, first - t0, (last - first) / max(1, n - 1)))


async def run_case(name: str, roles: list[str], supervisor: bool, phases: list[Phase], seed: int) -> None:
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
    cfg = ProxyConfig(port=free_port(), instances=instances, prefill_policy="least_outstanding",
                      decode_policy="least_outstanding", supervisor=supervisor, supervisor_interval=1.0,
                      supervisor_ttft_slo=TTFT_SLO, supervisor_tpot_slo=TPOT_SLO)
    proxy = ProxyServer(cfg)
    prunner = await serve(proxy)
    url = f"http://127.0.0.1:{cfg.port}"
    rng = random.Random(seed)
    results: list[tuple[str, float, float]] = []
    splits: dict[str, Counter] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for ph in phases:
            end = time.monotonic() + ph.seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one_request(session, url, ph, results)))
                await asyncio.sleep(rng.expovariate(ph.rate))
            splits[ph.name] = Counter(i.active_role or i.role for i in proxy.pool.all())
        await asyncio.gather(*tasks)
    await prunner.cleanup()
    for r in runners:
        await r.cleanup()
    for s in sims:
        assert s.task is not None
        s.task.cancel()
    print(f"  {name}")
    total_good = 0
    total_time = 0.0
    for ph in phases:
        rs = [r for r in results if r[0] == ph.name]
        good = sum(1 for _, ttft, tpot in rs if ttft <= TTFT_SLO and tpot <= TPOT_SLO)
        ttfts = sorted(r[1] for r in rs)
        tpots = sorted(r[2] for r in rs)
        split = splits[ph.name]
        total_good += good
        total_time += ph.seconds
        print(f"    {ph.name:28s} split at end {split.get('prefill', 0)}P{split.get('decode', 0)}D  "
              f"goodput {good / ph.seconds:5.2f} req/s ({good}/{len(rs)} in SLO)  "
              f"TTFT p50 {ttfts[len(ttfts) // 2]:6.2f} s  TPOT p50 {tpots[len(tpots) // 2] * 1e3:6.1f} ms")
    print(f"    overall goodput {total_good / total_time:.2f} req/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    phases = [Phase("A long prompts (3000/16)", 4.0, 3000, 16, args.seconds),
              Phase("B long outputs (200/200)", 5.0, 200, 200, args.seconds)]
    print(f"sim: prefill {PREFILL_S_PER_TOKEN * 1e3:.1f} ms/token, decode step {STEP_S * 1e3:.0f} ms for up to "
          f"{BATCH} streams; SLO TTFT <= {TTFT_SLO} s, TPOT <= {TPOT_SLO * 1e3:.0f} ms; 4 instances")
    for ph in phases:
        print(f"  phase {ph.name}: {ph.rate} req/s for {ph.seconds:.0f} s")
    asyncio.run(run_case("fixed 2P2D", ["prefill", "prefill", "decode", "decode"], False, phases, args.seed))
    asyncio.run(run_case("supervisor, 4 x both", ["both"] * 4, True, phases, args.seed))


if __name__ == "__main__":
    main()

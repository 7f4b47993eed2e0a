"""Proxy overhead: added latency, CPU per request and saturation rate, vllm-pd proxy vs vllm-router.

Every process is separate: two mock vLLM backends (prefill, decode; fixed
TTFT/ITL, see tests/support/mock_backend.py), the router under test, and this
load generator (aiohttp + uvloop). "direct" is the load generator doing both
legs itself against the same backends - the floor any proxy adds to.

CPU layout (2 cores): the router under test (ours, then vllm-router) runs alone
on --router-core; the load generator and both mocks share --load-core, so the
router never competes with its own load. Each process's CPU use over the
measured window is printed; "CPU/req" = the router's CPU seconds / requests.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/proxy.py            # both routers
    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/proxy.py --profile /tmp/proxy.prof --skip-saturation
    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/proxy.py --compare-tree DIR   # A/B: also DIR's vllm_pd proxy
    ... --loop-lag   # also each proxy's event-loop lag in its measured windows (benchmarks/loop_lag.py)
    python3 benchmarks/proxy.py --stacks                                 # client/loop stack comparison

vllm-router: `pip install --no-deps --target /tmp/vr vllm-router` (binary wheel), then --vllm-router-path /tmp/vr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpu_meter import CpuMeter  # noqa: E402 - benchmarks/ is the script's own folder

from vllm_pd.protocol.transfer_params import RemoteDecodeRequest  # noqa: E402
from vllm_pd.router.backend.backend_response import BackendError  # noqa: E402
from vllm_pd.router.backend.http_client import BackendClient  # noqa: E402
from vllm_pd.vllm_server import free_port  # noqa: E402

KV = RemoteDecodeRequest().to_params()


@dataclass
class Layout:
    """Which core runs the router under test and which runs its load (None: no pinning)."""

    router_core: int | None
    load_core: int | None
    router_nice: int = 0  # < 0: the router under test outranks other users' processes on its core

    def prefix(self, core: int | None) -> list[str]:
        return ["taskset", "-c", str(core)] if core is not None else []

    def router_prefix(self) -> list[str]:
        # `nice` before exec, so every thread a router starts (vllm-router runs several) inherits it
        nice = ["nice", "-n", str(self.router_nice)] if self.router_nice else []
        return nice + self.prefix(self.router_core)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def start_mock(layout: Layout, itl: float, ttft: float, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen(
        layout.prefix(layout.load_core)
        + [
            sys.executable,
            "-m",
            "tests.support.mock_backend",
            "--port",
            str(port),
            "--name",
            name,
            "--itl",
            str(itl),
            "--ttft",
            str(ttft),
        ],
        env=_env(),
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health")
    return p, url


# flags this checkout's proxy gets (--proxy-flag), e.g. the request log or a concurrency limit
PROXY_FLAGS: list[str] = []


def proxy_module(tree: str | None) -> str:
    """The proxy command's module in this checkout or in ``tree`` (before the router's packages: flat)."""
    flat = tree is not None and (Path(tree) / "vllm_pd" / "router" / "command_proxy.py").exists()
    return "vllm_pd.router.command_proxy" if flat else "vllm_pd.router.cli.command_proxy"


def start_ours(
    layout: Layout,
    prefill: str,
    decode: str,
    loop: str = "uvloop",
    profile: str | None = None,
    tree: str | None = None,
    lag_out: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Our proxy from this checkout, or from another source tree (``tree``) for an A/B of two versions;
    ``lag_out``: under the loop-lag probe (benchmarks/loop_lag.py), its samples to that file on exit."""
    port = free_port()
    env = _env()
    if tree:
        env["PYTHONPATH"] = tree
    if loop == "asyncio":
        env["VLLM_PD_PROXY_LOOP"] = "asyncio"
    # cProfile writes its file when the proxy exits on SIGTERM (it stops cleanly)
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    main = [str(ROOT / "benchmarks" / "loop_lag.py"), lag_out] if lag_out else ["-m", proxy_module(tree)]
    p = subprocess.Popen(
        layout.router_prefix()
        + [
            sys.executable,
            *prof,
            *main,
            "--port",
            str(port),
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--prefill-policy",
            "round_robin",
            "--decode-policy",
            "round_robin",
            "--log-level",
            "WARNING",
            *(PROXY_FLAGS if tree is None else []),
        ],
        env=env,
        cwd=tree or None,
    )  # `python -m` puts the working directory first on sys.path
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health")
    return p, url


def start_vllm_router(layout: Layout, path: str, prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = _env()
    env["PYTHONPATH"] = path + os.pathsep + env["PYTHONPATH"]
    p = subprocess.Popen(
        layout.router_prefix()
        + [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--policy",
            "round_robin",
            "--log-level",
            "error",
            "--prometheus-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", 60)
    return p, url


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


BODY = {"model": "mock-model", "prompt": "benchmark prompt " * 32, "temperature": 0}


@dataclass
class Sample:
    total: float  # seconds, request sent -> last byte
    ttfb: float  # seconds, request sent -> first body byte (the first SSE event when streaming)


JSON_HEADERS = [("Content-Type", "application/json")]


async def _request(
    client: BackendClient, url: str | None, direct: tuple[str, str] | None, stream: bool, max_tokens: int
) -> Sample:
    """One client request. direct=(prefill, decode) runs both legs here, as a zero-cost proxy would."""
    body = dict(BODY, max_tokens=max_tokens, stream=stream)
    t0 = time.perf_counter()
    if direct is not None:
        pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params=KV)
        r = await client.request("POST", direct[0], "/v1/completions", json.dumps(pbody).encode(), JSON_HEADERS)
        try:
            kv = json.loads(await r.read())["kv_transfer_params"]
        finally:
            r.close()
        body["kv_transfer_params"] = kv
        target = direct[1]
    else:
        assert url is not None
        target = url
    ttfb = None
    r = await client.request("POST", target, "/v1/completions", json.dumps(body).encode(), JSON_HEADERS)
    try:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.read()!r}")
        while await r.readany():
            if ttfb is None:
                ttfb = time.perf_counter() - t0
    finally:
        r.close()
    total = time.perf_counter() - t0
    return Sample(total, ttfb if ttfb is not None else total)


@dataclass
class LoadResult:
    samples: list[Sample]
    rate: float  # completed requests/s in the measured window
    cpu: dict[str, float]  # name -> CPU seconds per wall second in the window (1.0 = one core)
    router_cpu_per_req: float | None  # seconds
    wall: float = 0.0  # seconds measured
    round_p99s: list[float] = field(default_factory=list)  # total p99 of each pooled round, seconds

    @staticmethod
    def pooled(rounds: list[LoadResult]) -> LoadResult:
        """Several interleaved rounds as one: samples pooled, rates and CPU over the summed windows."""
        wall = sum(r.wall for r in rounds)
        samples = [s for r in rounds for s in r.samples]
        cpu = {k: sum(r.cpu[k] * r.wall for r in rounds) / wall for k in rounds[0].cpu}
        per_req = None
        if rounds[0].router_cpu_per_req is not None:
            per_req = sum((r.router_cpu_per_req or 0.0) * len(r.samples) for r in rounds) / len(samples)
        p99s = [pct([s.total for s in r.samples], 0.99) for r in rounds]
        return LoadResult(samples, len(samples) / wall, cpu, per_req, wall, p99s)


async def closed_loop(
    url: str | None,
    direct: tuple[str, str] | None,
    concurrency: int,
    seconds: float,
    stream: bool,
    max_tokens: int,
    meters: dict[str, CpuMeter],
    router: str | None,
    stagger: float = 0.0,
) -> LoadResult:
    """`concurrency` clients each sending the next request when the last one ended; the first quarter
    (at most 1 s) is warm-up, not measured. Client i starts after a random delay in [0, stagger): with
    fixed backend latencies, clients that all start at once stay in lockstep forever and hit the router
    in bursts of `concurrency` requests, which no real traffic does."""
    samples: list[Sample] = []
    errors = 0
    client = BackendClient()  # the proxy's own client: the cheapest load generator at hand
    stop_at = time.perf_counter() + seconds
    warm = min(1.0, seconds / 4)
    cpu0: dict[str, float] = {}
    done_at_warm = 0

    async def mark_warm() -> None:
        nonlocal done_at_warm
        await asyncio.sleep(warm)
        cpu0.update({k: m.seconds() for k, m in meters.items()})
        done_at_warm = len(samples)

    async def worker() -> None:
        nonlocal errors
        await asyncio.sleep(random.uniform(0, stagger))
        while time.perf_counter() < stop_at:
            try:
                samples.append(await _request(client, url, direct, stream, max_tokens))
            except (BackendError, TimeoutError, RuntimeError):
                errors += 1

    t_warm = time.perf_counter() + warm
    await asyncio.gather(mark_warm(), *(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t_warm
    cpu = {k: (m.seconds() - cpu0[k]) / wall for k, m in meters.items()}
    client.close()
    if errors:
        print(f"    ({errors} errors)")
    measured = samples[done_at_warm:]
    per_req = cpu[router] * wall / len(measured) if router and measured else None
    return LoadResult(measured, len(measured) / wall, cpu, per_req, wall)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _cpu_line(res: LoadResult) -> str:
    parts = [f"{k} {v * 100:3.0f}%" for k, v in res.cpu.items()]
    if res.router_cpu_per_req is not None:
        parts.append(f"router CPU/req {res.router_cpu_per_req * 1e3:.3f} ms")
    line = "      cpu (% of one core): " + ", ".join(parts)
    if len(res.round_p99s) > 1:  # one disturbed round sets a pooled p99: show each
        line += "; total p99 per round " + " / ".join(f"{p * 1e3:.0f}" for p in res.round_p99s) + " ms"
    return line


@dataclass
class Routers:
    """The running processes of one suite: mocks plus the routers under test."""

    layout: Layout
    procs: list[subprocess.Popen] = field(default_factory=list)
    entries: list[tuple[str, str | None, int | None]] = field(default_factory=list)  # (name, url, pid)
    backends: tuple[str, str] = ("", "")
    mock_pids: list[int] = field(default_factory=list)
    lag_files: dict[str, str] = field(default_factory=dict)  # router name -> its loop-lag samples (--loop-lag)
    # (streams, router name) -> the measured windows (time.monotonic()) of its rounds
    windows: dict[tuple[int, str], list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        layout: Layout,
        ttft: float,
        itl: float,
        vr_path: str | None,
        profile: str | None,
        compare_tree: str | None = None,
        loop_lag: bool = False,
    ) -> Routers:
        r = cls(layout)
        if loop_lag:
            r.lag_files = {
                name: f"/tmp/proxy-loop-lag-{os.getpid()}-{i}.json"
                for i, name in enumerate(("vllm-pd proxy", "vllm-pd other tree"))
            }
        try:
            pp, purl = start_mock(layout, itl, ttft, "p0")
            dp, durl = start_mock(layout, itl, ttft, "d0")
            r.procs += [pp, dp]
            r.mock_pids = [pp.pid, dp.pid]
            r.backends = (purl, durl)
            r.entries.append(("direct (no proxy)", None, None))
            ours, ours_url = start_ours(layout, purl, durl, profile=profile, lag_out=r.lag_files.get("vllm-pd proxy"))
            r.procs.append(ours)
            r.entries.append(("vllm-pd proxy", ours_url, ours.pid))
            if compare_tree:
                other, other_url = start_ours(
                    layout, purl, durl, tree=compare_tree, lag_out=r.lag_files.get("vllm-pd other tree")
                )
                r.procs.append(other)
                r.entries.append(("vllm-pd other tree", other_url, other.pid))
            if vr_path:
                try:
                    vr, vr_url = start_vllm_router(layout, vr_path, purl, durl)
                    r.procs.append(vr)
                    r.entries.append(("vllm-router", vr_url, vr.pid))
                except (TimeoutError, OSError) as e:
                    print(f"vllm-router did not start: {e!r}")
        except BaseException:
            stop(r.procs)
            raise
        return r

    def run(
        self, concurrency: int, seconds: float, stream: bool, max_tokens: int, rounds: int, stagger: float = 0.0
    ) -> dict[str, LoadResult]:
        """`rounds` interleaved rounds (direct, ours, vllm-router, direct, ...) so that load from outside
        this benchmark hits every router alike; results pooled per router."""
        out: dict[str, list[LoadResult]] = {name: [] for name, _, _ in self.entries}
        for _ in range(rounds):
            for name, url, pid in self.entries:
                meters = {"loadgen": CpuMeter([None], tree=False), "mocks": CpuMeter(list(self.mock_pids))}
                if pid is not None:
                    meters["router"] = CpuMeter([pid])
                direct = self.backends if url is None else None
                t0 = time.monotonic() + min(1.0, seconds / 4)  # (closed_loop's warm-up is not measured)
                out[name].append(
                    asyncio.run(
                        closed_loop(
                            url,
                            direct,
                            concurrency,
                            seconds,
                            stream,
                            max_tokens,
                            meters,
                            "router" if pid is not None else None,
                            stagger,
                        )
                    )
                )
                self.windows.setdefault((concurrency, name), []).append((t0, time.monotonic()))
        return {name: LoadResult.pooled(rs) for name, rs in out.items()}


def _layout(args: argparse.Namespace) -> Layout:
    layout = (
        Layout(None, None, args.router_nice)
        if args.no_pin
        else Layout(args.router_core, args.load_core, args.router_nice)
    )
    if layout.load_core is not None:
        os.sched_setaffinity(0, {layout.load_core})
    return layout


def _latency_level(rs: Routers, args: argparse.Namespace, streams: int, stagger: float) -> None:
    """Added latency of each router over direct at ``streams`` concurrent streams."""
    print(
        f"\n[latency] {streams} concurrent streams, {args.rounds} rounds of {args.seconds:.0f} s "
        f"(first second not measured), client starts spread over {stagger * 1e3:.0f} ms"
    )
    res = rs.run(streams, args.seconds, True, args.tokens, args.rounds, stagger)
    base = res.pop("direct (no proxy)")
    b_tot, b_fb = pct([s.total for s in base.samples], 0.5), pct([s.ttfb for s in base.samples], 0.5)
    b_tot99, b_fb99 = pct([s.total for s in base.samples], 0.99), pct([s.ttfb for s in base.samples], 0.99)
    print(
        f"  {'direct (no proxy)':18s} total p50 {b_tot * 1e3:7.2f} p99 {b_tot99 * 1e3:7.2f} ms   "
        f"TTFB p50 {b_fb * 1e3:7.2f} p99 {b_fb99 * 1e3:7.2f} ms  "
        f"({len(base.samples)} req, {base.rate:.0f} req/s)"
    )
    print(_cpu_line(base))
    for name, r in res.items():
        tot, fb = [s.total for s in r.samples], [s.ttfb for s in r.samples]
        print(
            f"  {name:18s} total p50 {pct(tot, 0.5) * 1e3:7.2f} p99 {pct(tot, 0.99) * 1e3:7.2f} ms   "
            f"TTFB p50 {pct(fb, 0.5) * 1e3:7.2f} p99 {pct(fb, 0.99) * 1e3:7.2f} ms  "
            f"({len(r.samples)} req, {r.rate:.0f} req/s)"
        )
        print(
            f"  {'':18s} added: total p50 {(pct(tot, 0.5) - b_tot) * 1e3:+6.2f} ms p99 "
            f"{(pct(tot, 0.99) - b_tot99) * 1e3:+6.2f} ms   "
            f"TTFB p50 {(pct(fb, 0.5) - b_fb) * 1e3:+6.2f} ms p99 "
            f"{(pct(fb, 0.99) - b_fb99) * 1e3:+6.2f} ms   (goal: added p50 <= 1 ms, p99 <= 5 ms)"
        )
        print(_cpu_line(r))
    if base.cpu.get("loadgen", 0.0) + base.cpu.get("mocks", 0.0) > 0.9:
        print("  (the load core was busy > 90 % even direct: the figures above include its own queueing)")


def _print_loop_lag(rs: Routers) -> None:
    """Each proxy's event-loop lag (10 ms probe, benchmarks/loop_lag.py) in its measured windows."""
    print("\n[loop lag] how late a 10 ms timer fired in the proxy during its measured rounds")
    samples = {}
    for name, path in rs.lag_files.items():
        try:
            with open(path) as f:
                samples[name] = json.load(f)
            os.unlink(path)
        except (OSError, ValueError) as e:
            print(f"  {name}: no samples ({e!r})")
    for (streams, name), windows in rs.windows.items():
        if name not in samples:
            continue
        lags = [lag for t, lag in samples[name] if any(a <= t <= b for a, b in windows)]
        print(
            f"  {streams:5d} streams  {name:18s} lag p50 {pct(lags, 0.5) * 1e3:6.2f}  "
            f"p99 {pct(lags, 0.99) * 1e3:6.2f}  max {max(lags, default=float('nan')) * 1e3:6.2f} ms  "
            f"({len(lags)} ticks)"
        )


def run_suite(args: argparse.Namespace) -> None:
    layout = _layout(args)
    print(
        f"backends: mock prefill+decode, ttft={args.ttft * 1e3:.0f} ms itl={args.itl * 1e3:.0f} ms, "
        f"{args.tokens} output tokens, prompt {len(BODY['prompt'])} chars; cores={os.cpu_count()}; "
        f"router on core {layout.router_core} (nice {layout.router_nice}), "
        f"load generator + mocks on core {layout.load_core}; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    if not args.skip_latency:
        rs = Routers.start(
            layout, args.ttft, args.itl, args.vllm_router_path, args.profile, args.compare_tree, args.loop_lag
        )
        try:
            stagger = 0.0 if args.lockstep else 2 * args.ttft + args.itl * (args.tokens - 1)
            for streams in args.streams:  # the same mocks and routers for every level: one run
                _latency_level(rs, args, streams, stagger)
        finally:
            stop(rs.procs)
        if rs.lag_files:
            _print_loop_lag(rs)
    if args.skip_saturation:
        return
    print(
        f"\n[saturation] non-streaming, max_tokens=2, zero-delay backends, concurrency {args.sat_concurrency}, "
        f"{args.rounds} rounds of {args.seconds:.0f} s"
    )
    rs = Routers.start(
        layout, 0.0, 0.0, args.vllm_router_path, args.profile and args.profile + ".saturation", args.compare_tree
    )
    try:
        res = rs.run(args.sat_concurrency, args.seconds, False, 2, args.rounds)
    finally:
        stop(rs.procs)
    for name, r in res.items():
        print(f"  {name:18s} {r.rate:8.0f} req/s  p50 {pct([s.total for s in r.samples], 0.5) * 1e3:7.2f} ms")
        print(_cpu_line(r))
    if "vllm-router" in res:
        ours, vr = res["vllm-pd proxy"], res["vllm-router"]
        line = f"  saturation: vllm-pd proxy = {ours.rate / vr.rate:.2f} x vllm-router (target >= 1.1)"
        if ours.router_cpu_per_req and vr.router_cpu_per_req:
            line += (
                f"; CPU per request {ours.router_cpu_per_req * 1e3:.3f} ms vs "
                f"{vr.router_cpu_per_req * 1e3:.3f} ms = {ours.router_cpu_per_req / vr.router_cpu_per_req:.2f} x"
            )
        print(line)


# ---------------------------------------------------------------- stack comparison
async def _client_rate(kind: str, url: str, concurrency: int, seconds: float) -> float:
    body = json.dumps(dict(BODY, max_tokens=2)).encode()
    n = 0
    stop_at = time.perf_counter() + seconds
    if kind == "aiohttp":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def w() -> None:
                nonlocal n
                while time.perf_counter() < stop_at:
                    async with s.post(
                        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                    n += 1

            await asyncio.gather(*(w() for _ in range(concurrency)))
    elif kind == "vllm-pd":
        client = BackendClient()

        async def w2() -> None:
            nonlocal n
            while time.perf_counter() < stop_at:
                r = await client.request("POST", url, "/v1/completions", body, JSON_HEADERS)
                await r.read()
                r.close()
                n += 1

        await asyncio.gather(*(w2() for _ in range(concurrency)))
        client.close()
    else:
        import httpx

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as c:

            async def w() -> None:
                nonlocal n
                while time.perf_counter() < stop_at:
                    r = await c.post(
                        url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
                    )
                    r.read()
                    n += 1

            await asyncio.gather(*(w() for _ in range(concurrency)))
    return n / seconds


def run_stacks(args: argparse.Namespace) -> None:
    layout = _layout(args)
    procs: list[subprocess.Popen] = []
    try:
        # the client under test has the load core to itself here; the mock it calls gets the router core
        mp, murl = start_mock(Layout(None, layout.router_core), 0.0, 0.0, "m")
        procs.append(mp)
        print("[client library] requests/s one process sends to a zero-delay mock, concurrency 64")
        for kind in ("vllm-pd", "aiohttp", "httpx"):
            for loop in ("asyncio", "uvloop"):
                import uvloop

                # an explicit loop factory: main() installed uvloop's policy, which asyncio.run would follow
                factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.SelectorEventLoop
                with asyncio.Runner(loop_factory=factory) as runner:
                    rate = runner.run(_client_rate(kind, murl, 64, args.seconds))
                print(f"  {kind:8s} {loop:8s} {rate:8.0f} req/s")
        stop(procs)
        procs = []
        mp, murl = start_mock(layout, 0.0, 0.0, "m")
        mp2, murl2 = start_mock(layout, 0.0, 0.0, "m2")
        procs += [mp, mp2]
        print("[proxy event loop] vllm-pd proxy saturation, non-streaming, concurrency 128")
        for loop in ("asyncio", "uvloop"):
            p, url = start_ours(layout, murl, murl2, loop)
            res = asyncio.run(
                closed_loop(url, None, 128, args.seconds, False, 2, {"router": CpuMeter([p.pid])}, "router")
            )
            print(f"  {loop:8s} {res.rate:8.0f} req/s  p50 {pct([x.total for x in res.samples], 0.5) * 1e3:.2f} ms")
            print(_cpu_line(res))
            stop([p])
    finally:
        stop(procs)


class _CpuFieldMeter:
    """User or system CPU seconds of a process tree (CpuMeter sums both)."""

    def __init__(self, pid: int, field_name: str) -> None:
        self._root = psutil.Process(pid)
        self._field = field_name

    def seconds(self) -> float:
        total = 0.0
        for p in [self._root, *self._root.children(recursive=True)]:
            try:
                total += getattr(p.cpu_times(), self._field)
            except psutil.Error:
                pass
        return total


def run_cpu_split(args: argparse.Namespace) -> None:
    """User and system CPU per request of each router at the same closed-loop load (64 clients, below
    saturation), rounds interleaved: the per-core cost, whatever share of its core a router gets."""
    layout = _layout(args)
    rs = Routers.start(layout, 0.0, 0.0, args.vllm_router_path, None, args.compare_tree)
    stream = args.split_tokens > 2
    print(
        f"[cpu per request] {'streaming ' + str(args.split_tokens) + ' events' if stream else 'non-streaming'}, "
        f"zero-delay backends, 64 clients, {args.rounds} rounds of {args.seconds:.0f} s"
    )
    out: dict[str, list[tuple[float, float, int]]] = {}
    try:
        for _ in range(args.rounds):
            for name, url, pid in rs.entries:
                if pid is None:
                    continue
                meters = {"user": _CpuFieldMeter(pid, "user"), "sys": _CpuFieldMeter(pid, "system")}
                res = asyncio.run(closed_loop(url, None, 64, args.seconds, stream, args.split_tokens, meters, None))
                out.setdefault(name, []).append(
                    (res.cpu["user"] * res.wall, res.cpu["sys"] * res.wall, len(res.samples))
                )
    finally:
        stop(rs.procs)
    for name, rounds in out.items():
        n = sum(r[2] for r in rounds)
        user, sys_ = sum(r[0] for r in rounds) / n, sum(r[1] for r in rounds) / n
        print(
            f"  {name:18s} user {user * 1e6:6.1f} us  sys {sys_ * 1e6:6.1f} us  total {(user + sys_) * 1e6:6.1f} us"
            f" per request  ({n} requests)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--streams",
        type=int,
        nargs="+",
        default=[100],
        help="concurrent streams of the latency phase; several levels run one after the other against "
        "the same mocks and routers (e.g. --streams 200 1000)",
    )
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--itl", type=float, default=0.05)
    ap.add_argument("--ttft", type=float, default=0.02)
    ap.add_argument("--seconds", type=float, default=4.0, help="per router and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per phase")
    ap.add_argument("--sat-concurrency", type=int, default=128)
    ap.add_argument("--vllm-router-path", default="/tmp/vr" if Path("/tmp/vr/vllm_router").exists() else None)
    ap.add_argument("--skip-saturation", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--prompt-chars", type=int, default=544, help="prompt size (the default is ~136 tokens)")
    ap.add_argument("--router-core", type=int, default=1, help="core of the router under test")
    ap.add_argument("--load-core", type=int, default=0, help="core of the load generator and the mocks")
    ap.add_argument("--no-pin", action="store_true", help="let every process float over all cores")
    ap.add_argument(
        "--router-nice",
        type=int,
        default=0,
        help="nice value of the router under test (e.g. -10 "
        "on a shared machine: CFS shares a core per thread, so against other users' processes a "
        "router with more threads would get more of it)",
    )
    ap.add_argument("--lockstep", action="store_true", help="start all latency clients at once (bursts)")
    ap.add_argument(
        "--compare-tree",
        metavar="DIR",
        help="also run the proxy of another source tree (e.g. a "
        "`git worktree` of the previous commit), interleaved with this one",
    )
    ap.add_argument("--profile", metavar="FILE", help="run our proxy under cProfile, writing FILE")
    ap.add_argument(
        "--loop-lag",
        action="store_true",
        help="run each vllm-pd proxy under a 10 ms event-loop lag "
        "probe (benchmarks/loop_lag.py) and print its lag in the measured rounds",
    )
    ap.add_argument(
        "--proxy-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for this checkout's proxy, e.g. --proxy-flag=--request-log=/dev/null (repeatable; "
        "--compare-tree's proxy runs without them)",
    )
    ap.add_argument("--stacks", action="store_true", help="compare client libraries and event loops instead")
    ap.add_argument(
        "--cpu-split",
        action="store_true",
        help="user/system CPU per request of each router at a fixed load below saturation instead",
    )
    ap.add_argument("--split-tokens", type=int, default=2, help="with --cpu-split: output tokens (> 2: stream)")
    args = ap.parse_args()
    BODY["prompt"] = ("benchmark prompt " * (args.prompt_chars // 17 + 1))[: args.prompt_chars]
    PROXY_FLAGS.extend(args.proxy_flag)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.stacks:
        run_stacks(args)
    elif args.cpu_split:
        run_cpu_split(args)
    else:
        run_suite(args)


if __name__ == "__main__":
    main()

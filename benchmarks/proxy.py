"""Proxy overhead: added latency and saturation rate, vllm-pd proxy vs vllm-router, same mock backends.

Every process is separate: two mock vLLM backends (prefill, decode; fixed
TTFT/ITL, see vllm_pd/router/mock_backend.py), the router under test, and this
load generator (aiohttp + uvloop). "direct" is the load generator doing both
legs itself against the same backends - the floor any proxy adds to.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/proxy.py            # both routers
    python3 benchmarks/proxy.py --stacks                                 # client/loop stack comparison

vllm-router: `pip install --no-deps --target /tmp/vr vllm-router` (binary wheel), then --vllm-router-path /tmp/vr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_pd.vllm_server import free_port  # noqa: E402

KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
      "remote_host": None, "remote_port": None}


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


def start_mock(itl: float, ttft: float, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "vllm_pd.router.mock_backend", "--port", str(port), "--name", name,
                          "--itl", str(itl), "--ttft", str(ttft)], env=_env())
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health")
    return p, url


def start_ours(prefill: str, decode: str, loop: str = "uvloop") -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = _env()
    if loop == "asyncio":
        env["VLLM_PD_PROXY_LOOP"] = "asyncio"
    p = subprocess.Popen([sys.executable, "-m", "vllm_pd.router.command_proxy", "--port", str(port),
                          "--prefill", prefill, "--decode", decode, "--prefill-policy", "round_robin",
                          "--decode-policy", "round_robin", "--log-level", "ERROR"], env=env)
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health")
    return p, url


def start_vllm_router(path: str, prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = _env()
    env["PYTHONPATH"] = path + os.pathsep + env["PYTHONPATH"]
    p = subprocess.Popen([sys.executable, "-m", "vllm_router.launch_router", "--port", str(port),
                          "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                          "--policy", "round_robin", "--log-level", "error",
                          "--prometheus-port", str(free_port())],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", 60)
    return p, url


BODY = {"model": "mock-model", "prompt": "benchmark prompt " * 32, "temperature": 0}


async def _request(session: aiohttp.ClientSession, url: str | None, direct: tuple[str, str] | None,
                   stream: bool, max_tokens: int) -> float:
    """One client request; returns its latency in seconds. direct=(prefill, decode) does both legs here."""
    body = dict(BODY, max_tokens=max_tokens, stream=stream)
    t0 = time.perf_counter()
    if direct is not None:
        pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params=KV)
        async with session.post(direct[0] + "/v1/completions", json=pbody) as r:
            kv = (await r.json())["kv_transfer_params"]
        body["kv_transfer_params"] = kv
        target = direct[1]
    else:
        assert url is not None
        target = url
    async with session.post(target + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - t0


async def closed_loop(url: str | None, direct: tuple[str, str] | None, concurrency: int, seconds: float,
                      stream: bool, max_tokens: int) -> tuple[list[float], float]:
    lat: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_at = time.perf_counter() + seconds
        warm_until = time.perf_counter() + min(1.0, seconds / 4)

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                try:
                    t = await _request(session, url, direct, stream, max_tokens)
                except (aiohttp.ClientError, RuntimeError):
                    errors += 1
                    continue
                if time.perf_counter() > warm_until:
                    lat.append(t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        measured = time.perf_counter() - warm_until
    if errors:
        print(f"    ({errors} errors)")
    return lat, len(lat) / measured


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_suite(args: argparse.Namespace) -> None:
    procs: list[subprocess.Popen] = []
    try:
        pp, purl = start_mock(args.itl, args.ttft, "p0")
        dp, durl = start_mock(args.itl, args.ttft, "d0")
        procs += [pp, dp]
        routers: list[tuple[str, str | None]] = [("direct (no proxy)", None)]
        ours, ours_url = start_ours(purl, durl)
        procs.append(ours)
        routers.append(("vllm-pd proxy", ours_url))
        if args.vllm_router_path:
            try:
                vr, vr_url = start_vllm_router(args.vllm_router_path, purl, durl)
                procs.append(vr)
                routers.append(("vllm-router", vr_url))
            except (TimeoutError, OSError) as e:
                print(f"vllm-router did not start: {e!r}")
        print(f"backends: mock prefill+decode, ttft={args.ttft * 1e3:.0f} ms itl={args.itl * 1e3:.0f} ms, "
              f"{args.tokens} output tokens, prompt {len(BODY['prompt'])} chars; cores={os.cpu_count()}")
        print(f"\n[latency] {args.streams} concurrent streams, {args.seconds:.0f} s each")
        base = None
        for name, url in routers:
            direct = (purl, durl) if url is None else None
            lat, rate = asyncio.run(closed_loop(url, direct, args.streams, args.seconds, True, args.tokens))
            p50, p99 = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
            if base is None:
                base = (p50, p99)
                print(f"  {name:18s} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  ({len(lat)} req, {rate:.0f} req/s)")
            else:
                print(f"  {name:18s} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  added p50 {p50 - base[0]:+7.2f} ms"
                      f"  added p99 {p99 - base[1]:+7.2f} ms  ({len(lat)} req, {rate:.0f} req/s)")
        if args.skip_saturation:
            return
        print(f"\n[saturation] non-streaming, max_tokens=2, zero-delay backends, concurrency {args.sat_concurrency}")
        for p in procs:
            p.terminate()
            p.wait(10)
        pp, purl = start_mock(0.0, 0.0, "p0")
        dp, durl = start_mock(0.0, 0.0, "d0")
        procs = [pp, dp]
        sat_routers: list[tuple[str, str | None]] = [("direct (no proxy)", None)]
        ours, ours_url = start_ours(purl, durl)
        procs.append(ours)
        sat_routers.append(("vllm-pd proxy", ours_url))
        if args.vllm_router_path:
            try:
                vr, vr_url = start_vllm_router(args.vllm_router_path, purl, durl)
                procs.append(vr)
                sat_routers.append(("vllm-router", vr_url))
            except (TimeoutError, OSError) as e:
                print(f"vllm-router did not start: {e!r}")
        rates = {}
        for name, url in sat_routers:
            direct = (purl, durl) if url is None else None
            lat, rate = asyncio.run(closed_loop(url, direct, args.sat_concurrency, args.seconds, False, 2))
            rates[name] = rate
            print(f"  {name:18s} {rate:8.0f} req/s  p50 {pct(lat, 0.5) * 1e3:7.2f} ms")
        if "vllm-router" in rates:
            print(f"  vllm-pd proxy = {rates['vllm-pd proxy'] / rates['vllm-router']:.2f} x vllm-router")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


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
                    async with s.post(url + "/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                    n += 1
            await asyncio.gather(*(w() for _ in range(concurrency)))
    else:
        import httpx
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as c:
            async def w() -> None:
                nonlocal n
                while time.perf_counter() < stop_at:
                    r = await c.post(url + "/v1/completions", content=body,
                                     headers={"Content-Type": "application/json"})
                    r.read()
                    n += 1
            await asyncio.gather(*(w() for _ in range(concurrency)))
    return n / seconds


def run_stacks(args: argparse.Namespace) -> None:
    procs: list[subprocess.Popen] = []
    try:
        mp, murl = start_mock(0.0, 0.0, "m")
        procs.append(mp)
        print("[client library] requests/s one process sends to a zero-delay mock, concurrency 64")
        for kind in ("aiohttp", "httpx"):
            for loop in ("asyncio", "uvloop"):
                if loop == "uvloop":
                    import uvloop
                    rate = uvloop.run(_client_rate(kind, murl, 64, args.seconds))
                else:
                    rate = asyncio.run(_client_rate(kind, murl, 64, args.seconds))
                print(f"  {kind:8s} {loop:8s} {rate:8.0f} req/s")
        mp2, murl2 = start_mock(0.0, 0.0, "m2")
        procs.append(mp2)
        print("[proxy event loop] vllm-pd proxy saturation, non-streaming, concurrency 128")
        for loop in ("asyncio", "uvloop"):
            p, url = start_ours(murl, murl2, loop)
            lat, rate = asyncio.run(closed_loop(url, None, 128, args.seconds, False, 2))
            print(f"  {loop:8s} {rate:8.0f} req/s  p50 {pct(lat, 0.5) * 1e3:.2f} ms")
            p.terminate()
            p.wait(10)
    finally:
        for p in procs:
            p.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--itl", type=float, default=0.05)
    ap.add_argument("--ttft", type=float, default=0.02)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--sat-concurrency", type=int, default=128)
    ap.add_argument("--vllm-router-path", default="/tmp/vr" if Path("/tmp/vr/vllm_router").exists() else None)
    ap.add_argument("--skip-saturation", action="store_true")
    ap.add_argument("--stacks", action="store_true", help="compare client libraries and event loops instead")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    if args.stacks:
        run_stacks(args)
    else:
        run_suite(args)


if __name__ == "__main__":
    main()

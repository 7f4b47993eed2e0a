"""End-to-end latency of 1P1D on real vLLM CPU servers, side by side in one run with
a plain 1-core instance and with vLLM's own NixlConnector 1P1D.

    python3 benchmarks/pd_latency.py [--lengths 128 512 1024 2048] [--requests 5] [--rounds 3] [--no-nixl]
        [--transports tcp tcp+secret]   # "+secret": the pair authenticates with a deployment secret

Prefill is pinned to core 0 and decode to core 1; the plain instance gets core 0
alone, in its own phase. Pinning covers each instance's whole process tree (API
server, engine core, worker: ``taskset``), not only vLLM's OpenMP threads. Phases
alternate over ``--rounds`` (plain, ours, plain, ours, ...; NIXL once at the end):
each round prints its own ratio and the summary pools every round's samples, so a
host that drifts between two phases shows as spread instead of passing for a
result. Every prompt is unique (no prefix-cache hits), 32 output tokens, greedy,
requests one at a time. TTFT is measured as a client behind a proxy sees it: from
sending the prefill leg to the first streamed token of the decode leg.

Targets (issue 2): our TTFT <= 1.15 x plain 1-core and <= 0.5 x stock NIXL; an
idle PD pair uses ~0 % CPU (printed beside a plain instance's idle, which is
vLLM's own floor). Also printed: the layer-wise overlap of push mode
(time from prefill's last layer to "all KV landed" vs the whole transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from cpu_meter import CpuMeter  # benchmarks/ is the script's own folder

from vllm_pd.protocol.transfer_params import AwaitedPrefill, RemoteDecodeRequest
from vllm_pd.small_model import ModelSpec, ensure_model
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port

OUTPUT_TOKENS = 32
BENCH_MODEL = ModelSpec(
    layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1024, max_positions=4096
)  # 8 KiB of KV per token, like the NIXL baseline's model


def spec(model: Path, cores: str, ktc: dict[str, Any] | None, env: dict[str, str] | None = None) -> VllmServerSpec:
    return VllmServerSpec(
        model=str(model),
        port=free_port(),
        kv_transfer_config=ktc,
        cpu_cores=cores,
        max_model_len=4096,
        served_model_name="bench",
        kv_cache_bytes="1g",
        env=env or {},
        extra_args=["--seed", "0"],
        pin_processes=True,
    )


def start(specs: list[VllmServerSpec], log_dir: Path) -> list[VllmServer]:
    servers: list[VllmServer] = []
    try:
        for s in specs:
            servers.append(VllmServer(s, log_dir / f"{s.port}.log").start())
        for server in servers:
            server.wait_healthy(timeout=900)
    except BaseException:
        stop(servers)  # one server failing to start must not leave the others running
        raise
    return servers


def stop(servers: list[VllmServer]) -> None:
    for s in servers:
        s.stop()


class Prompts:
    """Unique token-id prompts: the first tokens differ per request, so nothing hits a prefix cache."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.n = 0

    def make(self, length: int) -> list[int]:
        self.n += 1
        head = [5 + (self.n * 7919) % 3990, 5 + (self.n * 104729) % 3990]
        return (head + [self.rng.randrange(5, 4000) for _ in range(length)])[:length]


def stream_ttft(client: httpx.Client, url: str, body: dict[str, Any], t0: float) -> tuple[float, float]:
    """(ttft, total) in seconds from t0, reading decode's SSE stream."""
    ttft = None
    with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
    return ttft or float("nan"), time.perf_counter() - t0


def run_plain(client: httpx.Client, server: VllmServer, prompt: list[int]) -> tuple[float, float]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
    return stream_ttft(client, server.url, body, time.perf_counter())


def run_pd(
    client: httpx.Client,
    p: VllmServer,
    d: VllmServer,
    prompt: list[int],
    params: dict[str, Any],
    load_ask: dict[str, str],
) -> tuple[float, float]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
    t0 = time.perf_counter()
    leg = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    r = client.post(p.url + "/v1/completions", json=leg, timeout=600)
    r.raise_for_status()
    return stream_ttft(client, d.url, dict(body, kv_transfer_params={**r.json()["kv_transfer_params"], **load_ask}), t0)


def run_pd_beside(
    client: httpx.Client,
    p: VllmServer,
    d: VllmServer,
    prompt: list[int],
    decode_endpoint: str,
    mode: str,
    load_ask: dict[str, str],
) -> tuple[float, float]:
    """Our proxy's flow: the decode leg goes out with the prefill leg, waiting for prefill's announcement."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
    transfer_id = uuid.uuid4().hex  # the transfer's name in both legs, as our proxy gives it
    params = RemoteDecodeRequest(mode, decode_endpoint, transfer_id).to_params()
    t0 = time.perf_counter()
    awaited = AwaitedPrefill(transfer_id, mode).to_params()
    decode_leg = _pool.submit(
        stream_ttft, _decode_client, d.url, dict(body, kv_transfer_params={**awaited, **load_ask}), t0
    )
    r = client.post(
        p.url + "/v1/completions", json=dict(body, max_tokens=1, stream=False, kv_transfer_params=params), timeout=600
    )
    r.raise_for_status()
    return decode_leg.result()


# vLLM's own per-request histograms: where the time goes inside each server
SERVER_TIMES = {"prefill": "vllm:request_prefill_time_seconds", "queue": "vllm:request_queue_time_seconds"}
BREAKDOWN: dict[str, dict[int, list[dict[str, dict[str, float]]]]] = {}  # config -> length -> [server -> ms]


def server_times(client: httpx.Client, servers: dict[str, VllmServer]) -> dict[str, dict[str, float]]:
    return {
        role: {
            f"{key}_{part}": metric(client, s.url, f"{name}_{part}")
            for key, name in SERVER_TIMES.items()
            for part in ("sum", "count")
        }
        for role, s in servers.items()
    }


def mean_ms(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for role in after:
        a, b = after[role], before[role]
        out[role] = {
            k: (a[f"{k}_sum"] - b[f"{k}_sum"]) / max(a[f"{k}_count"] - b[f"{k}_count"], 1) * 1e3 for k in SERVER_TIMES
        }
    return out


Samples = dict[int, list[tuple[float, float]]]  # length -> [(ttft, total) in ms] of one configuration


def measure(
    name: str,
    fn: Any,
    lengths: list[int],
    n: int,
    prompts: Prompts,
    client: httpx.Client,
    servers: dict[str, VllmServer],
) -> Samples:
    fn(prompts.make(64))  # warm-up (NIXL's handshake, first-request costs)
    out: Samples = {}
    for length in lengths:
        before = server_times(client, servers)
        out[length] = [(ttft * 1e3, total * 1e3) for ttft, total in (fn(prompts.make(length)) for _ in range(n))]
        BREAKDOWN.setdefault(name, {}).setdefault(length, []).append(mean_ms(before, server_times(client, servers)))
        ttft, total = medians(out[length])
        print(f"  {name:<28} L={length:<5} TTFT {ttft:7.1f} ms  total {total:7.1f} ms", flush=True)
    return out


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def idle_cpu(servers: list[VllmServer], seconds: float = 5.0) -> float:
    """CPU use of the servers' whole process trees while idle, in % of one core."""
    meter = CpuMeter([s.pid for s in servers])
    time.sleep(2.0)
    c0 = meter.seconds()
    time.sleep(seconds)
    return (meter.seconds() - c0) / seconds * 100


def metric(client: httpx.Client, url: str, name: str) -> float:
    total = 0.0
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ours_ktc(role: str, kv_port: int, transport: str, secret_file: str | None = None) -> dict[str, Any]:
    return {
        "kv_connector": "PDConnector",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "transport": transport,
            "host": "127.0.0.1",
            **({"secret_file": secret_file} if secret_file else {}),
        },
    }


def secret_file(log_dir: Path) -> str:
    """A deployment secret for a "+secret" pair (as `vllm-pd up` makes one)."""
    from vllm_pd.connector.deployment_secret import write_new_secret

    return write_new_secret(log_dir / "deployment-secret")


# "beside": both legs at once, decode waiting for prefill's announcement (our proxy); otherwise
# prefill's answer first, then the decode leg (vLLM's example proxies). push: prefill writes each
# layer into decode while computing; pull: decode reads the KV once prefill is done. Decode's load:
# its default (load_mode auto: layer-wise on an idle decode, as here), or "async" (what auto does
# on a busy decode: the request waits off the batch for its whole KV, then one more engine step).
MODES = ("push beside", "pull beside", "push beside async", "pull beside async", "push", "pull")
_pool = ThreadPoolExecutor(1)
# its own connection pool, made once: creating an httpx.Client costs tens of ms (SSL context)
_decode_client = httpx.Client()


def plain_phase(args: argparse.Namespace, model: Path, prompts: Prompts, client: httpx.Client) -> tuple[Samples, float]:
    """The plain 1-core instance on core 0: its samples and its idle CPU (vLLM's own floor)."""
    [plain] = start([spec(model, "0", None)], args.log_dir)
    try:
        samples = measure(
            "plain 1-core",
            lambda pr: run_plain(client, plain, pr),
            args.lengths,
            args.requests,
            prompts,
            client,
            {"plain": plain},
        )
        return samples, idle_cpu([plain])
    finally:
        stop([plain])


def ours_name(args: argparse.Namespace, mode: str, transport: str) -> str:
    return f"vllm-pd 1P1D {mode}" + (f" [{transport}]" if len(args.transports) > 1 else "")


def ours_phase(
    args: argparse.Namespace,
    model: Path,
    prompts: Prompts,
    client: httpx.Client,
    overlap: dict[str, float],
    transport: str,
) -> tuple[dict[str, Samples], float]:
    """Our 1P1D pair (prefill core 0, decode core 1), each mode in turn; adds push beside's overlap counters."""
    pk, dk = free_port(), free_port()
    transport, _, secured = transport.partition("+")
    secret = secret_file(args.log_dir) if secured else None
    p, d = start(
        [
            spec(model, "0", ours_ktc("kv_producer", pk, transport, secret)),
            spec(model, "1", ours_ktc("kv_consumer", dk, transport, secret)),
        ],
        args.log_dir,
    )
    endpoint = f"{transport}://127.0.0.1:{dk}"
    out: dict[str, Samples] = {}
    try:
        for mode in args.modes:
            transfer_mode = mode.split()[0]
            load_ask = {"load_mode": "async"} if mode.endswith("async") else {}
            params = RemoteDecodeRequest(transfer_mode, endpoint if transfer_mode == "push" else None).to_params()
            counters = ("transfers", "tail_seconds", "span_seconds")
            before = {k: metric(client, p.url, f"vllm:pd_push_{k}_total") for k in counters}
            if "beside" in mode:
                fn = lambda pr: run_pd_beside(client, p, d, pr, endpoint, transfer_mode, load_ask)  # noqa: E731
            else:
                fn = lambda pr: run_pd(client, p, d, pr, params, load_ask)  # noqa: E731
            name = ours_name(args, mode, transport + ("+secret" if secured else ""))
            out[name] = measure(name, fn, args.lengths, args.requests, prompts, client, {"prefill": p, "decode": d})
            if mode == "push beside":
                time.sleep(1.0)
                for k in counters:
                    overlap[k] = overlap.get(k, 0.0) + metric(client, p.url, f"vllm:pd_push_{k}_total") - before[k]
        return out, idle_cpu([p, d])
    finally:
        stop([p, d])


def nixl_phase(
    args: argparse.Namespace, model: Path, prompts: Prompts, client: httpx.Client
) -> tuple[Samples, float] | None:
    try:
        import nixl  # noqa: F401
    except ImportError:
        print("NIXL phase skipped: the `nixl` package is not installed (pip install nixl)", flush=True)
        return None
    print("phase: vLLM NixlConnector 1P1D (prefill core 0, decode core 1)", flush=True)
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    envs = [
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} for _ in range(2)
    ]
    p, d = start([spec(model, "0", ktc, envs[0]), spec(model, "1", ktc, envs[1])], args.log_dir)
    try:
        params = RemoteDecodeRequest().to_params()  # vLLM's standard prefill leg, as NixlConnector's proxies send it
        samples = measure(
            "NIXL 1P1D",
            lambda pr: run_pd(client, p, d, pr, params, {}),
            args.lengths,
            args.requests,
            prompts,
            client,
            {"prefill": p, "decode": d},
        )
        return samples, idle_cpu([p, d])
    finally:
        stop([p, d])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--requests", type=int, default=5, help="requests per length, configuration and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of (plain phase, our phase) one after the other: a ratio is only as good as the "
        "host is steady between the phases it compares, so each round gives its own ratio",
    )
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument(
        "--transport",
        "--transports",
        dest="transports",
        nargs="+",
        choices=[t + s for t in ("tcp", "shm", "nixl") for s in ("", "+secret")],
        default=["tcp"],
        help="our connector's transport(s): one pair per transport and round (+secret: with a deployment secret)",
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="configurations of ours to run")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-bench-logs"))
    args = ap.parse_args()
    model = ensure_model(BENCH_MODEL)
    prompts = Prompts(seed=1)
    client = httpx.Client()
    rounds: list[dict[str, Samples]] = []  # per round: config -> its samples
    idle: dict[str, list[float]] = {}
    overlap: dict[str, float] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}, phase: plain instance on core 0", flush=True)
        plain, plain_idle = plain_phase(args, model, prompts, client)
        rounds.append({"plain 1-core": plain})
        idle.setdefault("plain 1-core", []).append(plain_idle)
        for transport in args.transports:
            print(
                f"round {r + 1}/{args.rounds}, phase: vllm-pd 1P1D over {transport} (prefill core 0, decode core 1)",
                flush=True,
            )
            ours, pair_idle = ours_phase(args, model, prompts, client, overlap, transport)
            rounds[-1].update(ours)
            idle.setdefault(f"vllm-pd 1P1D [{transport}]", []).append(pair_idle)
    nixl = None if args.no_nixl else nixl_phase(args, model, prompts, client)
    if nixl is not None:
        idle["NIXL 1P1D"] = [nixl[1]]

    # every round's samples pooled per configuration and length; NIXL from its one phase
    pooled: dict[str, Samples] = {}
    for rnd in rounds + ([{"NIXL 1P1D": nixl[0]}] if nixl is not None else []):
        for name, samples in rnd.items():
            for n_tok, rows in samples.items():
                pooled.setdefault(name, {}).setdefault(n_tok, []).extend(rows)
    results = {name: {n_tok: medians(rows) for n_tok, rows in by_len.items()} for name, by_len in pooled.items()}

    print()
    print(f"medians over {args.rounds} round(s) x {args.requests} requests")
    print("| config | " + " | ".join(f"L={n} TTFT / total (ms)" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[n][0]:.0f} / {row[n][1]:.0f}" for n in args.lengths) + " |")
    print()
    plain_row = results["plain 1-core"]
    for name in [ours_name(args, m, t) for t in args.transports for m in args.modes]:
        mode = name.removeprefix("vllm-pd 1P1D ")
        ours_row = results[name]
        cells = []
        for n_tok in args.lengths:
            each = " ".join(
                f"{medians(rnd[name][n_tok])[0] / medians(rnd['plain 1-core'][n_tok])[0]:.2f}" for rnd in rounds
            )
            cells.append(f"L={n_tok}: {ours_row[n_tok][0] / plain_row[n_tok][0]:.2f}x (rounds {each})")
        print(f"TTFT vllm-pd {mode} / plain 1-core (target <= 1.15): " + " ".join(cells))
        if "NIXL 1P1D" in results:
            nixl_row = results["NIXL 1P1D"]
            ratios = " ".join(f"L={n}: {ours_row[n][0] / nixl_row[n][0]:.2f}x" for n in args.lengths)
            print(f"TTFT vllm-pd {mode} / NIXL 1P1D   (target <= 0.5):  {ratios}")
    print()
    print(
        "inside the servers (vLLM's histograms, mean ms per request): prefill = the step(s) computing the prompt "
        "(on decode: the step computing the last prompt token to sample the first output token - with a "
        "layer-wise load it runs beside prefill's forward, waiting per layer); "
        "queue = waiting before that (on decode: for the KV, or for prefill's announcement)"
    )
    for name, rows in BREAKDOWN.items():
        cells = []
        for n_tok in args.lengths:
            parts = rows[n_tok]
            cells.append(
                f"L={n_tok}: "
                + ", ".join(
                    f"{role} prefill {statistics.mean(p[role]['prefill'] for p in parts):.1f} "
                    f"queue {statistics.mean(p[role]['queue'] for p in parts):.1f}"
                    for role in parts[0]
                )
            )
        print(f"  {name}: " + " | ".join(cells))
    plain_idle = statistics.median(idle["plain 1-core"])
    print(
        f"idle CPU of the plain 1-core instance (vLLM's own: API server, gloo's loops): {plain_idle:.1f} % of one core"
    )
    for name, pcts in idle.items():
        if name != "plain 1-core":
            pct = statistics.median(pcts)
            print(
                f"idle CPU of the {name} pair: {pct:.1f} % of one core (2 cores = 200 %) = "
                f"{pct / max(2 * plain_idle, 1e-9):.2f} x two plain instances' idle"
            )
    if overlap.get("transfers"):
        n = overlap["transfers"]
        tail_ms, span_ms = overlap["tail_seconds"] / n * 1e3, overlap["span_seconds"] / n * 1e3
        print(
            f"push overlap: after prefill's last layer, all KV landed in {tail_ms:.2f} ms on average, "
            f"of a {span_ms:.2f} ms transfer (first push to last landed), over {n:.0f} "
            f"transfers: {100 * (1 - tail_ms / max(span_ms, 1e-9)):.0f} % of the transfer hidden behind compute"
        )
    print(json.dumps({"results": results, "idle_cpu_pct": idle, "overlap": overlap}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

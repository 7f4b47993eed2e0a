"""KV memory, bytes moved and TTFT per request for prefill/decode pairs of different KV shapes,
each beside its same-shape peer in one run, on real vLLM CPU servers (1P1D, pull mode).

    python3 benchmarks/kv_shapes.py [--cases hma no-hma p32-d64 p64-d64 p1-d2 p2-d2 state state-p1-d2 nixl-hma
        nixl-p32-d64 nixl-p1-d2 nixl-state nixl-state-p1-d2] [--requests 6] [--length 1500]

Cases (each a fresh P/D pair, prefill on core 0, decode on core 1; TP 2 instances on both):

* ``hma`` / ``no-hma``: the sliding-window model (`make-model --sliding-window 128
  --full-attention-every 4`: 3 windowed layers, 1 full) with vLLM's hybrid KV cache manager
  on (PDConnector declares SupportsHMA) and off (``--disable-hybrid-kv-cache-manager``: every
  layer keeps full-length KV, as vLLM did before for a connector without HMA).
* ``p32-d64`` beside ``p64-d64``: decode's blocks of 64 tokens from a prefill of 32 (re-cut).
* ``p1-d2`` beside ``p2-d2``: decode TP 2 from a prefill of TP 1 (each rank takes a window
  of prefill's blocks) and of TP 2.
* ``state``: a model with a recurrent state (`make-model --arch nemotron_h`: Mamba-2, attention,
  Mamba-2, MLP; prefix caching off - vLLM CPU's align state cache fails 1500-token prompts by
  itself), printed beside ``nixl-state``: prefill computes all but the last token and moves the
  attention KV and the Mamba state after it. ``state-p1-d2`` beside ``state``: the same into a decode
  of TP 2 (each rank reads its share of the state: byte windows of prefill's state block), printed
  beside ``nixl-state-p1-d2``.
* ``nixl-*``: the same shape with vLLM's stock NixlConnector on both sides (its standard
  ``kv_transfer_params``, ``kv_load_failure_policy`` recompute), printed beside ours. Where a pair
  does not start or answer, its row says why instead of a figure.

Per request (unique prompts of ``--length`` tokens, 1 output token on each leg):
the KV prefill holds for decode (vLLM's KV cache usage while held x the KV cache's bytes), the
bytes decode loaded (``vllm:pd_loaded_bytes_total``; ours only), the prompt tokens decode computed
itself (vLLM's ``prompt_tokens_by_source``, any connector: 1 where the KV came from prefill, the
prompt where decode recomputed it), and the decode leg's time to its first token (decode's load +
first step; the prefill leg is not in it). Medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_pd.protocol.transfer_params import RemoteDecodeRequest
from vllm_pd.small_model import ModelSpec, ensure_model
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port

KV_CACHE_BYTES = 256 << 20
COMPUTED = "vllm:prompt_tokens_by_source_total"  # vLLM's, by source: a recompute shows under any connector
WINDOW = 128


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelSpec
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    prefill_tp: int = 1
    decode_tp: int = 1
    peer_of: str = ""  # the same-shape case it is printed beside
    connector: str = "PDConnector"  # or vLLM's "NixlConnector"


SLIDING = ModelSpec(sliding_window=WINDOW, full_attention_every=4)
PLAIN = ModelSpec()
STATE = ModelSpec(arch="nemotron_h")
NO_HMA = ("--disable-hybrid-kv-cache-manager",)
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
CASES = {
    c.name: c
    for c in (
        Case("hma", SLIDING),
        Case("no-hma", SLIDING, NO_HMA, NO_HMA, peer_of="hma"),
        Case("p64-d64", PLAIN, ("--block-size", "64"), ("--block-size", "64")),
        Case("p32-d64", PLAIN, ("--block-size", "32"), ("--block-size", "64"), peer_of="p64-d64"),
        Case("p2-d2", PLAIN, prefill_tp=2, decode_tp=2),
        Case("p1-d2", PLAIN, decode_tp=2, peer_of="p2-d2"),
        Case("nixl-hma", SLIDING, peer_of="hma", connector="NixlConnector"),
        Case(
            "nixl-p32-d64",
            PLAIN,
            ("--block-size", "32"),
            ("--block-size", "64"),
            peer_of="p32-d64",
            connector="NixlConnector",
        ),
        Case("nixl-p1-d2", PLAIN, decode_tp=2, peer_of="p1-d2", connector="NixlConnector"),
        Case("state", STATE, NO_PREFIX_CACHE, NO_PREFIX_CACHE),
        Case("nixl-state", STATE, NO_PREFIX_CACHE, NO_PREFIX_CACHE, peer_of="state", connector="NixlConnector"),
        Case("state-p1-d2", STATE, NO_PREFIX_CACHE, NO_PREFIX_CACHE, decode_tp=2, peer_of="state"),
        Case(
            "nixl-state-p1-d2",
            STATE,
            NO_PREFIX_CACHE,
            NO_PREFIX_CACHE,
            decode_tp=2,
            peer_of="state-p1-d2",
            connector="NixlConnector",
        ),
    )
}


@dataclass
class Figures:
    held_bytes: list[float] = field(default_factory=list)
    loaded_bytes: list[float] = field(default_factory=list)
    decode_ttft_s: list[float] = field(default_factory=list)
    computed_tokens: list[float] = field(default_factory=list)  # prompt tokens decode computed itself
    error: str = ""  # the pair did not start or answer: why
    failed_loads: int = 0  # decode's loads that failed (then recomputed): their TTFT includes the recompute


def server_spec(
    model: Path, tp: int, other_tp: int, core: str, role: str, extra: tuple[str, ...], connector: str = "PDConnector"
) -> VllmServerSpec:
    """One side of a pair; a TP 1 side beside a TP 2 one is left unbound (VLLM_CPU_OMP_THREADS_BIND
    nobind): bound to a core a decode TP rank spins on in vLLM CPU's all-reduce, a prefill starves
    (docs/benchmarks/transfer.md, "P1 -> D2")."""
    kv_port = free_port()
    ktc: dict[str, object] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",  # a failed load is counted (loads failed), not an HTTP 500
    }
    if connector == "PDConnector":
        ktc["kv_port"] = kv_port
        ktc["kv_connector_extra_config"] = {"transport": "tcp", "host": "127.0.0.1", "lease_s": 60.0}
    spec = VllmServerSpec(
        model=str(model),
        port=free_port(),
        kv_transfer_config=ktc,
        cpu_cores="0|1" if tp == 2 else core if other_tp == 1 else "nobind",
        max_model_len=2048,
        served_model_name="bench",
        kv_cache_bytes=f"{KV_CACHE_BYTES >> 20}m",
        extra_args=["--seed", "0", *extra],
    )
    if connector == "NixlConnector":  # its side channel (the handshake) on loopback, a port of its own
        spec.env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port)})
    if tp == 2:
        spec.extra_args += ["--tensor-parallel-size", "2"]
        spec.env["TORCHDYNAMO_DISABLE"] = "1"  # see tests/e2e/test_connector_tp_e2e.py
    return spec


def metric(client: httpx.Client, url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (with ``labels``) on a vLLM server."""
    total = 0.0
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        if (
            line.startswith(name)
            and not line.startswith("#")
            and line.split("{", 1)[0].split(" ")[0] == name
            and all(f'{k}="{v}"' in line for k, v in labels.items())
        ):
            total += float(line.rpartition(" ")[2])
    return total


def run_case(case: Case, requests: int, length: int, log_dir: Path, client: httpx.Client) -> Figures:
    model = ensure_model(case.model)
    servers = [
        VllmServer(
            server_spec(model, case.prefill_tp, case.decode_tp, "0", "kv_producer", case.prefill_args, case.connector),
            log_dir / f"{case.name}-prefill.log",
        ).start(),
        VllmServer(
            server_spec(model, case.decode_tp, case.prefill_tp, "1", "kv_consumer", case.decode_args, case.connector),
            log_dir / f"{case.name}-decode.log",
        ).start(),
    ]
    figures = Figures()
    rng = random.Random(7)
    try:
        for s in servers:
            s.wait_healthy(timeout=900)
        prefill, decode = servers
        failed_before = 0.0
        for i in range(requests + 1):  # the first warms both up and is not counted
            prompt = [rng.randrange(5, 4000) for _ in range(length)]
            body = {"model": "bench", "prompt": prompt, "temperature": 0}
            leg = dict(body, max_tokens=1, kv_transfer_params=RemoteDecodeRequest().to_params())
            p = client.post(prefill.url + "/v1/completions", json=leg, timeout=300).json()
            time.sleep(0.3)  # the held transfer shows in the usage gauge a step later
            held = metric(client, prefill.url, "vllm:kv_cache_usage_perc") * KV_CACHE_BYTES
            loaded = metric(client, decode.url, "vllm:pd_loaded_bytes_total")
            computed = metric(client, decode.url, COMPUTED, source="local_compute")
            t0 = time.perf_counter()
            d = client.post(
                decode.url + "/v1/completions",
                timeout=300,
                json=dict(body, max_tokens=1, kv_transfer_params=p["kv_transfer_params"]),
            )
            ttft = time.perf_counter() - t0
            if d.status_code != 200:
                raise RuntimeError(
                    f"{case.name}: decode answered HTTP {d.status_code}: {d.text[:300]} (logs in {log_dir})"
                )
            if not i:
                failed_before = metric(client, decode.url, "vllm:pd_loads_total", result="failed")
            else:
                figures.held_bytes.append(held)
                figures.loaded_bytes.append(metric(client, decode.url, "vllm:pd_loaded_bytes_total") - loaded)
                figures.decode_ttft_s.append(ttft)
                figures.computed_tokens.append(metric(client, decode.url, COMPUTED, source="local_compute") - computed)
        figures.failed_loads = int(metric(client, decode.url, "vllm:pd_loads_total", result="failed") - failed_before)
    finally:
        for s in servers:
            s.stop()
    return figures


def row(name: str, f: Figures, results: dict[str, Figures], length: int) -> str:
    """One case's cells after its name, its bytes and TTFT beside its peer's (where the peer ran)."""
    peer = CASES[name].peer_of
    mine = CASES[name].connector == "PDConnector"
    theirs = results.get(peer)
    served = theirs is not None and not theirs.error
    loaded = statistics.median(f.loaded_bytes)
    if not mine:
        loaded_cell = "(no counter)"
    else:
        ratio = ""
        if theirs is not None and served and CASES[peer].connector == "PDConnector":
            peer_loaded = statistics.median(theirs.loaded_bytes)
            ratio = f" ({loaded / peer_loaded:.2f}x {peer})" if peer_loaded else ""
        loaded_cell = f"{loaded / 2**20:.2f} MiB{ratio}"
    ttft = statistics.median(f.decode_ttft_s)
    ttft_ratio = ""
    if theirs is not None and served:
        ttft_ratio = f" ({ttft / statistics.median(theirs.decode_ttft_s):.2f}x {peer})"
    return (
        f"{statistics.median(f.held_bytes) / 2**20:.2f} MiB | {loaded_cell} | "
        f"{statistics.median(f.computed_tokens):.0f} of {length} | {ttft * 1e3:.0f} ms{ttft_ratio} | "
        f"{f.failed_loads if mine else '-'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--length", type=int, default=1500)
    args = parser.parse_args()
    results: dict[str, Figures] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="kv-shapes-"))  # kept: the servers' logs, where a case fails
    with httpx.Client() as client:
        for name in args.cases:
            print(f"running {name} (logs in {log_dir}) ...", file=sys.stderr, flush=True)
            try:
                results[name] = f = run_case(CASES[name], args.requests, args.length, log_dir, client)
            except Exception as e:  # a peer that cannot serve this shape: its row says why
                results[name] = Figures(error=f"{type(e).__name__}: {str(e)[:200]}")
                print(f"  {name}: {results[name].error}", file=sys.stderr, flush=True)
                continue
            print(
                f"  {name}: held {f.held_bytes}, loaded {f.loaded_bytes}, decode TTFT {f.decode_ttft_s}, "
                f"failed loads {f.failed_loads}",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n{args.length}-token prompts, {args.requests} requests per case, medians\n")
    print(
        "| case | KV held by prefill | bytes loaded by decode | prompt tokens decode computed | decode leg TTFT "
        "| failed loads |"
    )
    print("|---|---|---|---|---|---|")
    for name, f in results.items():
        if f.error:
            print(f"| {name} | - | - | - | - | did not serve: {f.error} |")
            continue
        print(f"| {name} | {row(name, f, results, args.length)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

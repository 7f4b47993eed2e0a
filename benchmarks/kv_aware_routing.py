"""Prefill routing policies on real vLLM CPU servers: prompt tokens recomputed and TTFT.

    python3 benchmarks/kv_aware_routing.py [--conversations 8] [--turns 3] [--concurrency 4] [--rounds 2]
    python3 benchmarks/kv_aware_routing.py --tokenize-only   # the proxy's tokenize+hash cost per request

One cluster for every policy, in one run: 2 prefill + 1 decode vLLM servers
(BENCH_MODEL, 8 layers; PD connector over tcp, push mode; the KV store on with
a store master unless ``--no-store``; vLLM's prefix cache on, publishing its KV events), in front of
them the proxy (``vllm-pd proxy``, a subprocess) once per prefill policy:
kv_aware (decode kv_aware too, so a prompt decode already holds skips
prefill), kv_aware+store (the same, with ``--store-master``: the store master
is a second location source and prefill legs carry store_fetch hints; store on
only), prefix_aware, least_outstanding, round_robin.

The trace: ``--conversations`` chats of ``--turns`` turns, each turn's prompt
being the whole history (chat template applied by vLLM); conversations share
one of two long system prompts, every run gets its own prompts (a run tag
leads them) so no policy finds another's KV. ``--concurrency`` conversations
run at a time, each one turn after another. A warm-up pass (round robin, not
counted) goes first; then ``--rounds`` passes per policy, the policies' order
rotated each round. Per policy: TTFT p50/p99 of the
streamed answers (first content chunk, at the client), and the prompt tokens
the servers computed (vLLM's ``prompt_tokens_by_source{source="local_compute"}``
summed over all three servers, before/after), against the trace's prompt tokens;
the prompt tokens the prefill servers loaded instead (``source="external_kv_transfer"``
on the prefills: from their own store or fetched from another node's), the KV store
blocks nodes served each other (``vllm:pd_store_served_blocks_total``) and the
proxy's store_fetch hints.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pd_latency import BENCH_MODEL  # noqa: E402
from vllm_pd.connector.store.master_command import spawn_master  # noqa: E402
from vllm_pd.router.cli.local_cluster import LocalCluster  # noqa: E402
from vllm_pd.small_model import ensure_model  # noqa: E402
from vllm_pd.vllm_server import free_port  # noqa: E402

POLICIES = ("kv_aware", "kv_aware+store", "prefix_aware", "least_outstanding", "round_robin")
WORDS = (
    "alpha beta gamma delta river mountain signal vector kernel thread socket buffer window "
    "planet orbit copper silver garden harbor lantern meadow quartz summit timber velvet"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(run: str, n: int, turns: int, seed: int) -> list[list[str]]:
    """Per conversation, its user messages; system prompts come from system_prompt()."""
    rng = random.Random(seed)
    return [[f"[{run}] question {c}.{t}: " + text(rng, 60) for t in range(turns)] for c in range(n)]


def system_prompt(run: str, conversation: int, seed: int) -> str:
    rng = random.Random(seed * 31 + conversation % 2)  # two system prompts, shared by half the chats each
    return f"[{run}] You are assistant {conversation % 2}. " + text(rng, 450)


def stream_chat(
    client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, int]:
    """(TTFT s, answer, prompt tokens) of one streamed chat turn."""
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, parts, prompt_tokens = None, [], 0
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(piece)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts), prompt_tokens


def server_counter(client: httpx.Client, urls: list[str], name: str, label: str = "") -> float:
    """Sum over ``urls`` of the samples of counter ``name`` whose labels include ``label``."""
    total = 0.0
    for url in urls:
        for line in client.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{") and label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def computed_tokens(client: httpx.Client, urls: list[str]) -> float:
    return server_counter(client, urls, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')


def served_blocks(client: httpx.Client, urls: list[str]) -> float:
    """KV store blocks the nodes served each other (node-to-node fetches)."""
    return server_counter(client, urls, "vllm:pd_store_served_blocks_total")


def loaded_tokens(client: httpx.Client, urls: list[str]) -> float:
    """Prompt tokens the connector loaded (on a prefill: from its store or another node's)."""
    return server_counter(client, urls, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')


def start_proxy(
    cluster: LocalCluster, policy: str, model: Path, log: Path, store_master: str | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    base = policy.split("+")[0]
    cmd = [
        sys.executable,
        "-m",
        "vllm_pd.cli",
        "proxy",
        "--port",
        str(port),
        "--tokenizer",
        str(model),
        "--prefill-policy",
        base,
        "--decode-policy",
        "kv_aware" if base == "kv_aware" else "least_outstanding",
    ]
    if policy.endswith("+store"):
        if store_master is None:
            raise SystemExit(f"{policy} needs the store on (drop --no-store)")
        cmd += ["--store-master", store_master]
    for ic in cluster.instances():
        cmd += [f"--{ic.role}", ic.url + (f"@{ic.kv_endpoint}" if ic.kv_endpoint else "")]
        if ic.kv_events:
            cmd += ["--kv-events", f"{ic.url}={ic.kv_events}"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"proxy for {policy} did not start; see {log}")
        time.sleep(0.3)


def run_policy(cluster: LocalCluster, policy: str, tag: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One pass of the trace (prompts led by ``tag``) through a proxy running ``policy``."""
    proc, url = start_proxy(cluster, policy, model, args.log_dir / f"proxy-{tag}.log", args.store_master)
    servers = [s.server.url for s in cluster.servers]
    prefills = [s.server.url for s in cluster.servers if s.role == "prefill"]
    try:
        with httpx.Client() as client:
            time.sleep(1.0)  # KV-event subscriptions join (a late SUB misses nothing it needs here)
            chats = conversations(tag, args.conversations, args.turns, args.seed)
            before = computed_tokens(client, servers), loaded_tokens(client, prefills), served_blocks(client, servers)

            def one(c: int) -> list[tuple[float, int]]:
                messages = [{"role": "system", "content": system_prompt(tag, c, args.seed)}]
                turns = []
                for question in chats[c]:
                    messages.append({"role": "user", "content": question})
                    ttft, answer, prompt_tokens = stream_chat(client, url, messages, args.max_tokens)
                    turns.append((ttft, prompt_tokens))
                    messages.append({"role": "assistant", "content": answer})
                return turns

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                turns = [t for ts in pool.map(one, range(args.conversations)) for t in ts]
            wall = time.perf_counter() - t0
            time.sleep(1.0)  # let the servers' metrics catch up with the last requests
            computed = computed_tokens(client, servers) - before[0]
            loaded = loaded_tokens(client, prefills) - before[1]
            served = served_blocks(client, servers) - before[2]
            proxy_lines = client.get(url + "/metrics").text.splitlines()
            skipped = sum(
                float(line.rsplit(" ", 1)[1])
                for line in proxy_lines
                if line.startswith("vllm_pd_proxy_decode_only") and "holds_prompt" in line
            )
            hints = sum(
                float(line.rsplit(" ", 1)[1])
                for line in proxy_lines
                if line.startswith("vllm_pd_proxy_store_fetch_hints_total")
            )
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "policy": policy,
        "tag": tag,
        "ttfts": [t for t, _ in turns],
        "wall_s": wall,
        "prompt_tokens": sum(n for _, n in turns),
        "computed_prompt_tokens": computed,
        "prefill_skipped": skipped,
        "prefill_loaded_tokens": loaded,
        "store_served_blocks": served,
        "store_fetch_hints": hints,
    }


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's passes together."""
    ttfts = sorted(t for p in passes for t in p["ttfts"])
    return {
        "policy": passes[0]["policy"],
        "requests": len(ttfts),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        **{
            k: sum(p[k] for p in passes)
            for k in (
                "prompt_tokens",
                "computed_prompt_tokens",
                "prefill_skipped",
                "prefill_loaded_tokens",
                "store_served_blocks",
                "store_fetch_hints",
                "wall_s",
            )
        },
    }


def tokenize_cost(model: Path) -> None:
    """The proxy's per-request cost of kv_aware: tokenize (chat template) + vLLM block hashes."""
    from vllm_pd.router.request.block_hashes import VllmBlockHasher
    from vllm_pd.router.request.prompt_tokens import PromptTokenizer
    from vllm_pd.router.request.request_body import CHAT, parse_body

    tok = PromptTokenizer(model, VllmBlockHasher(), cache_size=0)
    for words in (100, 1000, 8000):
        body = {
            "messages": [
                {"role": "system", "content": text(random.Random(1), words)},
                {"role": "user", "content": "go"},
            ]
        }
        req = parse_body(json.dumps(body).encode(), CHAT)
        times, n = [], 0
        for _ in range(20):
            t0 = time.perf_counter()
            blocks = tok.blocks(req)
            assert blocks is not None
            blocks.hashes(128)
            times.append(time.perf_counter() - t0)
            n = len(blocks.token_ids)
        print(f"tokenize+hash {n:>6} tokens: median {1000 * statistics.median(times):.2f} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rounds", type=int, default=2, help="passes per policy, the order rotated each round")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/kv-aware-routing"))
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--no-store", action="store_true", help="the KV store off: only vLLM's prefix caches reuse KV")
    ap.add_argument("--tokenize-only", action="store_true", help="only measure the proxy's tokenize+hash cost")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(BENCH_MODEL)
    tokenize_cost(model)
    if args.tokenize_only:
        return 0
    master, address = spawn_master(free_port())
    store = {} if args.no_store else {"store": {"cpu_bytes": "256m", "master": address}}
    args.store_master = None if args.no_store else address
    cluster = LocalCluster(
        model=str(model),
        n_prefill=2,
        n_decode=1,
        max_model_len=4096,
        kv_events=True,
        log_dir=args.log_dir,
        extra_args=["--served-model-name", "bench", "--seed", "0"],
        connector_extra=store,
    )
    results = []
    try:
        cluster.start()
        cluster.wait_healthy(900)
        run_policy(cluster, "round_robin", "warm-up", model, args)  # one-off costs of new shapes; not counted
        # kv_aware+store reads the store master: without the store there is nothing for it to read
        policies = [p for p in args.policies.split(",") if not (args.no_store and p.endswith("+store"))]
        passes: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for r in range(args.rounds):
            for policy in policies[r % len(policies) :] + policies[: r % len(policies)]:
                one = run_policy(cluster, policy, f"{policy}-{r}", model, args)
                passes[policy].append(one)
                print(json.dumps({k: v for k, v in one.items() if k != "ttfts"}), flush=True)
        results = [summary(passes[p]) for p in policies]
    finally:
        cluster.stop()
        master.kill()
        master.wait()
    print(
        f"{'policy':<18} {'requests':>8} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'prompt tok':>10} "
        f"{'computed':>9} {'loaded':>8} {'served blk':>10} {'hints':>6} {'skipped':>7} {'wall s':>7}"
    )
    for r in results:
        print(
            f"{r['policy']:<18} {r['requests']:>8} {r['ttft_p50_ms']:>11.0f} {r['ttft_p99_ms']:>11.0f} "
            f"{r['prompt_tokens']:>10} {r['computed_prompt_tokens']:>9.0f} {r['prefill_loaded_tokens']:>8.0f} "
            f"{r['store_served_blocks']:>10.0f} {r['store_fetch_hints']:>6.0f} {r['prefill_skipped']:>7.0f} "
            f"{r['wall_s']:>7.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

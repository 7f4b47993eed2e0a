"""What the store's extra keys (LoRA adapter, cache_salt, multimodal inputs; protocol/block_keys.py) cost.

1. Hit rate on the multi-turn trace (vllm_pd/connector/store/trace.py, as
   benchmarks/store_hit_rate.py), the store's CPU-tier policy over the real
   RadixIndex, with three kinds of keys of the same token blocks side by side:
   the keys as the store hashed them before extra keys (a blake3 chain over the
   token ids, written out here), the store's keys now for plain requests
   (RequestKeys with the request_extra_keys of vLLM's Request, as the connector
   computes them: the same keys, so the same hit rate), and the same requests
   with each conversation salted for one of ``--tenants`` tenants
   (``cache_salt``): the system prompts tenants share are then computed once
   per tenant, which is what isolation costs.
2. Key computation per request on the scheduler's path (RequestKeys.get with
   request_extra_keys of vLLM's own Request, the first ask: every block hashed),
   for plain, adapter, salted and multimodal requests, plain as the peer.

    python3 benchmarks/store_key_extras.py [--seeds 3] [--conversations 800]   # ~2 min
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import blake3
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from benchmarks.store_hit_rate import serve
from vllm_pd.connector.store.adaptive_cache import AdaptiveCache, shadow_sample_rate
from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.connector.store.request_keys import RequestKeys
from vllm_pd.connector.store.trace import TraceConfig, TraceRequest, generate
from vllm_pd.connector.store_bridge import request_extra_keys
from vllm_pd.protocol.block_keys import KEY_BYTES, KeySalt, RequestExtraKeys, token_bytes

BLOCK = 16
SALT = KeySalt("bench", "bfloat16", "cpu", BLOCK, 32)
PARAMS = SamplingParams(max_tokens=1)


def tokens_of(blocks: Sequence[int]) -> list[int]:
    """Distinct token ids per trace block id (equal block ids = equal tokens)."""
    return [b * BLOCK + j for b in blocks for j in range(BLOCK)]


def keys_before(token_ids: list[int]) -> list[bytes]:
    """The store's keys before extra keys: key[i] = blake3(key[i-1] || block i's ids as u32 LE)."""
    prev, out, data = SALT.digest(), [], token_bytes(token_ids)
    for start in range(0, len(data) // (4 * BLOCK) * 4 * BLOCK, 4 * BLOCK):
        prev = blake3.blake3(prev + data[start : start + 4 * BLOCK]).digest(length=KEY_BYTES)
        out.append(prev)
    return out


def keyed(requests: list[TraceRequest], extra: dict[int, RequestExtraKeys] | None) -> list[TraceRequest]:
    """The trace with store keys of each request's tokens in place of block ids (``extra`` None:
    the keys before extra keys; else the store's keys now with each conversation's extra keys)."""
    keys = RequestKeys(SALT)
    out = []
    for r in requests:
        tokens = tokens_of(r.saved)
        if extra is None:
            saved = keys_before(tokens)
        else:
            e = extra.get(r.conversation) or request_extra_keys(Request("r", tokens, PARAMS, None))
            saved = keys.get(tokens, extra_keys=e)
        out.append(
            TraceRequest(
                r.time_s,
                r.conversation,
                r.turn,
                tuple(saved[: len(r.prompt)]),  # type: ignore[arg-type]
                tuple(saved),
            )
        )  # type: ignore[arg-type]
    return out


def hit_rate(requests: list[TraceRequest], capacity: int) -> float:
    index, cache = RadixIndex(), AdaptiveCache(capacity, sample_rate=shadow_sample_rate(capacity))
    hit = sum(serve(index, cache, r) for r in requests)
    return hit / sum(len(r.prompt) for r in requests)


def hit_rates(args: argparse.Namespace) -> None:
    print(f"| seed | capacity | of unique | keys before | keys now, plain | keys now, {args.tenants} salted tenants |")
    print("|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        reqs = list(generate(TraceConfig(conversations=args.conversations, seed=seed)))
        before, plain = keyed(reqs, None), keyed(reqs, {})
        assert [r.saved for r in before] == [r.saved for r in plain], "plain requests' keys changed"
        tenants = {c: RequestExtraKeys(cache_salt=f"tenant-{c % args.tenants}") for c in {r.conversation for r in reqs}}
        salted = keyed(reqs, tenants)
        unique = len({b for r in reqs for b in r.saved})
        for frac in (0.02, 0.1, 0.5):
            cap = max(16, int(unique * frac))
            old, new, iso = (hit_rate(r, cap) for r in (before, plain, salted))
            print(f"| {seed} | {cap} | {frac:.0%} | {old:.2%} | {new:.2%} | {iso:.2%} |", flush=True)


def vllm_request(n: int, kind: str) -> Request:
    lora = LoRARequest("sql", 1, "/adapters/sql") if kind in ("adapter", "adapter+salt") else None
    salt = "tenant-a" if kind in ("salt", "adapter+salt") else None
    mm = (
        [
            MultiModalFeatureSpec(
                data=None, modality="image", identifier="0" * 64, mm_position=PlaceholderRange(offset=10, length=576)
            )
        ]
        if kind == "image"
        else None
    )
    return Request(
        kind, list(range(n)), SamplingParams(max_tokens=1), None, lora_request=lora, cache_salt=salt, mm_features=mm
    )


def key_cost_ms(n: int, kind: str, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        req = vllm_request(n, kind)
        keys = RequestKeys(SALT)
        t0 = time.perf_counter()
        keys.get(req.prompt_token_ids or [], request_id="r", extra_keys=request_extra_keys(req))
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def key_costs(args: argparse.Namespace) -> None:
    kinds = ("plain", "adapter", "salt", "adapter+salt", "image")
    print(f"\nkeys of one request, first ask (block {BLOCK}), median of {args.rounds}:")
    print("| prompt tokens | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for n in (1024, 8192, 32768, 131072):
        ms = {k: key_cost_ms(n, k, args.rounds if n < 100_000 else max(3, args.rounds // 4)) for k in kinds}
        cells = [f"{ms['plain']:.2f} ms"] + [f"{ms[k]:.2f} ms ({ms[k] / ms['plain']:.2f}x)" for k in kinds[1:]]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=800)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    t0 = time.perf_counter()
    hit_rates(args)
    key_costs(args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

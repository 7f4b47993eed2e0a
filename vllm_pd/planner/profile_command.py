"""``vllm-pd profile URL``: measure running vLLM instances and write (or extend) a profile file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import aiohttp

from vllm_pd.planner.instance_profiler import InstanceProfiler, ProfilePlan
from vllm_pd.planner.latency_profile import (
    InstanceProfile,
    LatencyProfile,
    ProfileError,
    load_profile,
    merge_samples,
    save_profile,
)
from vllm_pd.planner.profile_spread import describe

logger = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ProfilePlan()
    p.add_argument("url", help="the instance's OpenAI API, e.g. http://127.0.0.1:8100")
    p.add_argument("--out", type=Path, default=Path("profile.json"), help="profile file (default profile.json)")
    p.add_argument("--tp", type=int, default=1, help="the instance's tensor-parallel size (default 1)")
    p.add_argument(
        "--append",
        action="store_true",
        help="add this TP size to an existing --out (replacing its entry for the same TP)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="add this measurement's samples to --out's entry for the same TP and fit them all again "
        "(profiles taken minutes apart on a shared host differ; pooled they describe it better)",
    )
    p.add_argument(
        "--pd-url",
        help="a PD proxy over a prefill/decode pair of such instances: measures the "
        "KV hand-over (else --kv-fixed-ms/--kv-ms-per-token)",
    )
    p.add_argument(
        "--relay-url",
        help="a proxy in front of this instance alone: prefill and decode are measured "
        "through it, the proxy's hop and token relaying included",
    )
    p.add_argument(
        "--neighbour-url",
        help="another instance on the same host (on a PD pair, the prefill instance): "
        "measures how they slow each other; leave out for instances on "
        "separate hosts/GPUs",
    )
    p.add_argument(
        "--prefill-url",
        help="the prefill instance of the pair behind --pd-url (default: --neighbour-url "
        "when --pd-url is given): measured too, point by point in turn with URL; "
        "the plan takes its prefill fit for prefill instances",
    )
    p.add_argument("--prefill-relay-url", help="a proxy in front of the prefill instance alone (as --relay-url)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help="draw prompt token ids below this (default: read from the served model)",
    )
    p.add_argument(
        "--kv-fixed-ms",
        type=float,
        default=d.kv_fixed_ms,
        help="without --pd-url: the KV hand-over's fixed cost in ms (kv_ms = fixed + per token x t)",
    )
    p.add_argument(
        "--kv-ms-per-token",
        type=float,
        default=d.kv_ms_per_token,
        help="without --pd-url: the KV hand-over's ms per prompt token",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="the instance's step token budget (vLLM CPU's API server default: 2048 x TP)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="the instance's --max-num-seqs: no decode batch above it is measured",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="the instance's --max-model-len: no prompt or context above it is measured",
    )
    p.add_argument("--prefill-tokens", type=_ints, default=d.prefill_tokens, help="prompt lengths, comma-separated")
    p.add_argument(
        "--decode-batches",
        type=_ints,
        default=d.decode_batches,
        help="decode batch sizes measured, comma-separated (each keeps its own step level; "
        "batches between are interpolated)",
    )
    p.add_argument(
        "--decode-contexts",
        type=_ints,
        default=d.decode_contexts,
        help="decode context lengths measured (tokens), comma-separated",
    )
    p.add_argument("--repeats", type=int, default=d.repeats, help="prefill and KV hand-over points")
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=d.decode_repeats,
        help="decode points (their scatter around the fit is the decode spread)",
    )
    p.add_argument(
        "--wake-idle-ms",
        type=_ints,
        default=d.wake_idle_ms,
        help="idle times before a lone prefill, to measure what waking the instance costs",
    )
    p.add_argument(
        "--wake-repeats",
        type=int,
        default=d.wake_repeats,
        help="back to back / after idle pairs per --wake-idle-ms value (0: not measured)",
    )
    p.add_argument(
        "--kv-repeats",
        type=int,
        default=d.kv_repeats,
        help="KV hand-over samples per prompt length (with --pd-url; their spread weighs them)",
    )
    p.add_argument(
        "--join-tokens",
        type=_ints,
        default=d.join_tokens,
        help="prompts of the PD requests joining decode, to measure what a join costs its running steps "
        "(needs --pd-url and --neighbour-url)",
    )
    p.add_argument(
        "--join-repeats",
        type=int,
        default=d.join_repeats,
        help="beside plain prefills / beside joins pairs per --join-tokens value (0: not measured)",
    )


def run(args: argparse.Namespace) -> int:
    plan = ProfilePlan(
        prefill_tokens=args.prefill_tokens,
        decode_batches=args.decode_batches,
        decode_contexts=args.decode_contexts,
        repeats=args.repeats,
        decode_repeats=args.decode_repeats,
        wake_idle_ms=args.wake_idle_ms,
        wake_repeats=args.wake_repeats,
        kv_repeats=args.kv_repeats,
        join_tokens=args.join_tokens,
        join_repeats=args.join_repeats,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_fixed_ms=args.kv_fixed_ms,
        kv_ms_per_token=args.kv_ms_per_token,
        vocab_size=args.vocab_size,
    )
    try:
        profiler = InstanceProfiler(
            args.url, plan, args.pd_url, args.relay_url, args.neighbour_url, args.prefill_url, args.prefill_relay_url
        )
        model, insts = asyncio.run(profiler.run_all(args.tp))
        profile = _combined(args, model, insts)
    except (TimeoutError, ProfileError, OSError, aiohttp.ClientError) as e:
        print(f"vllm-pd profile: {e or type(e).__name__}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug of ours: said in one line, the traceback at debug level
        logger.debug("vllm-pd profile failed", exc_info=True)
        print(f"vllm-pd profile: failed: {type(e).__name__}: {e} (--log-level DEBUG shows where)", file=sys.stderr)
        return 1
    save_profile(profile, args.out)
    print(
        f"{args.url}: vocabulary of {profiler.vocab_size} token ids (prompts drawn below it)"
        + (" as --vocab-size says" if args.vocab_size else ", as the server accepts them")
    )
    inst = insts[-1]
    spread = inst.decode_spread
    tail = (
        f" (spread p50 {spread[len(spread) // 2]:.2f}, p90 {spread[int(0.9 * len(spread))]:.2f} x the fit, "
        f"over {inst.decode_spread_window_ms:.0f} ms)"
        if spread
        else ""
    )
    neighbours = (
        f"; beside a neighbour: decode step x{inst.beside_prefill:.2f} while it prefills, prefill "
        f"x{inst.beside_decode:.2f} while it decodes"
        if inst.neighbour_samples
        else ""
    )
    levels = (
        " (per batch at no context: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in inst.decode_levels) + " ms)"
        if inst.decode_levels
        else ""
    )
    points = ", ".join(f"+{ms:.1f} ms after {idle:.0f} ms" for idle, ms in inst.wake_after_idle)
    wake = f"; a prefill after idle {points}" if points else ""
    joins = (
        f"; a decode leg joining costs the running steps {inst.join.a:.2f} + {inst.join.b:.4f}*t ms"
        if inst.join_samples
        else ""
    )
    print(
        f"wrote {args.out}: tp={inst.tp} prefill_ms = {inst.prefill.a:.2f} + {inst.prefill.b:.4f}*tokens + "
        f"{inst.prefill.c:.2e}*sum(prompt^2) + {inst.prefill.d:.2f}*prompts; decode_step_ms = "
        f"{inst.decode.a:.2f} + {inst.decode.b:.3f}*batch + {inst.decode.c:.2e}*context{levels}{tail}; "
        f"kv_ms = {inst.kv.a:.2f} + {inst.kv.b:.4f}*t; a request's first decode steps +{inst.first_step_ms:.2f} ms"
        f"{wake}{neighbours}{joins}"
    )
    for line in describe(LatencyProfile(model, insts, source=args.url)):
        print(line)
    return 0


def _combined(args: argparse.Namespace, model: str, insts: list[InstanceProfile]) -> LatencyProfile:
    """The profile to write: these instances alone, or with ``--append``/``--merge`` into ``--out``'s (an
    instance merges into the entry of its TP and role)."""
    source = " ".join(dict.fromkeys(i.url for i in insts if i.url)) or args.url
    if not ((args.append or args.merge) and args.out.exists()):
        return LatencyProfile(model, insts, source=source)
    old = load_profile(args.out)
    if old.model != model:
        raise ProfileError(f"{args.out}: model {old.model!r}, but {args.url} serves {model!r}")
    kept = [i for i in old.instances if i.tp != args.tp]
    if args.merge and args.tp in old.tps():
        before = {i.role: i for i in old.members(args.tp)}
        # a profile of one instance (no role) merges into the instance measured in full (decode of a pair)
        same = [before.get(i.role) or (before.get("") if i.role != "prefill" else None) for i in insts]
        insts = [merge_samples(o, i) if o is not None else i for o, i in zip(same, insts)]
    return LatencyProfile(model, sorted(kept + insts, key=lambda i: i.tp), source=f"{old.source} {source}".strip())

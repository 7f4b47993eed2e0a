"""Synthetic multi-turn chat traces at block granularity, shaped like public ones.

Shape (ShareGPT / LMSYS-Chat multi-turn statistics and Mooncake's FAST'25
"conversation" trace): a few shared system prompts with Zipf popularity;
conversations arriving as a Poisson process; a geometric number of turns; each
turn's prompt = system prompt + the whole history + a new user message, and the
reply joins the history; lognormal message lengths and think times. Each
request lists the block ids of its prompt (the prefix a store can serve) and of
prompt + reply (what the store saves after it finishes). Block ids stand for
chained keys: equal id = equal prefix.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_pd.errors import StoreError


@dataclass(frozen=True)
class TraceConfig:
    conversations: int = 2000
    arrival_rate: float = 1.0  # new conversations per second
    system_prompts: int = 8
    system_prompt_zipf: float = 1.1
    system_prompt_blocks: tuple[int, int] = (8, 64)  # uniform range, in blocks
    single_turn_fraction: float = 0.5  # LMSYS-Chat-1M: ~2 turns on average, most chats have one
    mean_turns: float = 5.0  # geometric, for multi-turn conversations
    max_turns: int = 24
    user_blocks_median: float = 4.0  # lognormal medians, in blocks
    reply_blocks_median: float = 12.0
    length_sigma: float = 0.8
    think_time_median_s: float = 40.0
    think_time_sigma: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations <= 0 or self.arrival_rate <= 0 or self.mean_turns < 2:
            raise StoreError("conversations, arrival_rate must be > 0 and mean_turns >= 2")
        if not 0.0 <= self.single_turn_fraction <= 1.0:
            raise StoreError("single_turn_fraction must be in [0, 1]")


@dataclass(frozen=True)
class TraceRequest:
    time_s: float
    conversation: int
    turn: int
    prompt: tuple[int, ...]  # block ids of the prompt
    saved: tuple[int, ...]  # block ids of prompt + reply (full blocks the store keeps)


def _lognormal_int(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def generate(cfg: TraceConfig) -> Iterator[TraceRequest]:
    """Requests in time order."""
    rng = random.Random(cfg.seed)
    ids = itertools.count(1)
    weights = [1.0 / (i + 1) ** cfg.system_prompt_zipf for i in range(cfg.system_prompts)]
    prompts = [
        tuple(next(ids) for _ in range(rng.randint(*cfg.system_prompt_blocks))) for _ in range(cfg.system_prompts)
    ]
    # heap of (time, conversation, turn, history)
    pending: list[tuple[float, int, int, tuple[int, ...], int]] = []
    t = 0.0
    for conv in range(cfg.conversations):
        t += rng.expovariate(cfg.arrival_rate)
        turns = 1
        if rng.random() >= cfg.single_turn_fraction:
            turns = 2
            while turns < cfg.max_turns and rng.random() > 1.0 / max(1.0, cfg.mean_turns - 1):
                turns += 1
        system = rng.choices(prompts, weights)[0]
        heapq.heappush(pending, (t, conv, 0, system, turns))
    while pending:
        time_s, conv, turn, history, turns = heapq.heappop(pending)
        user_blocks = _lognormal_int(rng, cfg.user_blocks_median, cfg.length_sigma)
        prompt = history + tuple(next(ids) for _ in range(user_blocks))
        saved = prompt + tuple(next(ids) for _ in range(_lognormal_int(rng, cfg.reply_blocks_median, cfg.length_sigma)))
        yield TraceRequest(time_s, conv, turn, prompt, saved)
        if turn + 1 < turns:
            think = rng.lognormvariate(math.log(cfg.think_time_median_s), cfg.think_time_sigma)
            heapq.heappush(pending, (time_s + think, conv, turn + 1, saved, turns))

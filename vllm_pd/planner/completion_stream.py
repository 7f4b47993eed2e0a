"""What the profiler sends a served model and how it reads the answer: streamed completions of token-id prompts.

A measurement is a stream whose every event carries tokens: vLLM reports a bad request (a token id out of
the model's vocabulary, a prompt over ``max_model_len``) as an error event *inside* a 200 stream, and such a
stream, any event that is not a completion chunk, or fewer tokens than asked (``ignore_eos``), is a
:class:`MeasurementError` naming what came - never a sample. Tokens are counted by the ids each event carries
(``return_token_ids``): vLLM merges tokens into one event when its stream falls behind; a server that sends
no ids counts one token an event.

Prompts are random ids below the served model's vocabulary size, which :func:`served_vocabulary` reads from
the server itself: vLLM rejects a prompt holding an id past the model's vocabulary (its tokenizer's or its
embedding's, the larger), so the largest id it accepts is found by doubling and bisection, one-token
prompts, about twenty requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp

from vllm_pd.planner.latency_profile import ProfileError

logger = logging.getLogger(__name__)

FIRST_ID = 5  # ids below this are the special tokens of most vocabularies (pad, bos, eos, unk): left out
VOCAB_PROBE_START = 512  # the smallest vocabulary a probe tries first (vllm-pd make-model's minimum)
VOCAB_PROBE_CAP = 1 << 20  # a server accepting every id below this has no bound the profiler needs


class MeasurementError(ProfileError):
    """A stream that carried an error, an event with no token, or fewer tokens than asked."""


class OutOfVocabulary(MeasurementError):
    """The server refused a prompt's token id as out of its vocabulary."""


@dataclass
class Stream:
    ttft: float  # seconds
    stamps: list[float]  # arrival time of each token


class UniquePrompts:
    """Random token-id prompts from ``[FIRST_ID, vocab_size)``: unique, so a prefix cache never hits."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= FIRST_ID + 1:
            raise ProfileError(f"vocab_size: {vocab_size} leaves no token ids to draw prompts from")
        self._rng = random.Random(seed)
        self._max = vocab_size

    def make(self, length: int) -> list[int]:
        return [self._rng.randrange(FIRST_ID, self._max) for _ in range(length)]


async def model_name(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        if r.status != 200:
            raise ProfileError(f"{url}/v1/models: HTTP {r.status}")
        data = (await r.json()).get("data") or []
    if not data:
        raise ProfileError(f"{url}/v1/models: no model served")
    return str(data[0]["id"])


def _tokens_of(event: bytes, where: str) -> int:
    """The tokens one ``data:`` event carries (a stream error or a non-token event: MeasurementError)."""
    try:
        obj = json.loads(event)
    except ValueError:
        raise MeasurementError(f"{where}: the stream carried a line that is not JSON: {event[:200]!r}") from None
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        kind = OutOfVocabulary if "out of vocabulary" in str(message) else MeasurementError
        raise kind(f"{where}: the stream carried an error: {message}")
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if (
        not isinstance(choices, list)
        or not choices
        or not isinstance(choices[0], dict)
        or not isinstance(choices[0].get("text"), str)
    ):
        raise MeasurementError(f"{where}: the stream carried an event that is not a token: {event[:200]!r}")
    if choices[0].get("finish_reason") == "error":
        raise MeasurementError(f"{where}: the stream ended in an error: {event[:200]!r}")
    ids = choices[0].get("token_ids")
    return len(ids) if isinstance(ids, list) else 1  # a server not sending them: one token an event


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    first: asyncio.Event | None = None,
) -> Stream:
    """One streamed completion of exactly ``max_tokens`` tokens; ``first`` is set as its first token arrives."""
    # token_ids: vLLM sends two tokens in one event when its stream falls behind (seen on a busy machine)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    where = f"{url}/v1/completions"
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with session.post(where, json=body) as r:
        if r.status != 200:
            text = (await r.text())[:200]
            kind = OutOfVocabulary if "out of vocabulary" in text else ProfileError
            raise kind(f"{where}: HTTP {r.status}: {text}")
        async for line in r.content:
            line = line.strip()
            if not line or line.startswith(b":"):  # the blank line between events; an SSE comment
                continue
            if not line.startswith(b"data:"):
                raise MeasurementError(f"{where}: the stream carried a line that is not an event: {line[:200]!r}")
            event = line[5:].strip()
            if event == b"[DONE]":
                break
            n = _tokens_of(event, where)
            stamps.extend([time.perf_counter()] * n)
            if first is not None and stamps:
                first.set()
    if len(stamps) != max_tokens:
        raise MeasurementError(
            f"{where}: the stream carried {len(stamps)} tokens, not the {max_tokens} asked "
            f"(a {len(prompt)}-token prompt; is it within the server's max_model_len?)"
        )
    return Stream(stamps[0] - t0, stamps)


async def accepts_token(session: aiohttp.ClientSession, url: str, model: str, token_id: int) -> bool:
    """Whether the server takes a one-token prompt of ``token_id`` (False: out of its vocabulary)."""
    try:
        await stream_completion(session, url, model, [token_id], 1)
    except OutOfVocabulary:
        return False
    return True


async def served_vocabulary(session: aiohttp.ClientSession, url: str, model: str) -> int:
    """The served model's vocabulary size: one more than the largest token id the server accepts."""
    if not await accepts_token(session, url, model, FIRST_ID + 1):
        raise ProfileError(f"{url}: refused token id {FIRST_ID + 1} as out of vocabulary: no ids to draw from")
    lo, hi = FIRST_ID + 1, VOCAB_PROBE_START - 1  # lo accepted; hi to try
    while hi < VOCAB_PROBE_CAP and await accepts_token(session, url, model, hi):
        lo, hi = hi, 2 * hi + 1
    if hi >= VOCAB_PROBE_CAP:
        logger.warning("%s accepted every token id below %d: prompts are drawn below that", url, VOCAB_PROBE_CAP)
        return VOCAB_PROBE_CAP
    while hi - lo > 1:  # lo accepted, hi refused
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await accepts_token(session, url, model, mid) else (lo, mid)
    return lo + 1

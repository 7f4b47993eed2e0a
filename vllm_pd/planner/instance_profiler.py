"""Measure a running vLLM instance through its OpenAI API and fit an :class:`InstanceProfile`.

Prompts are token-id lists (exact lengths, every one unique so the prefix cache never hits) sent as
streaming completions with ``ignore_eos``:

- prefill: ``batch`` concurrent one-token requests of ``tokens`` each (batch x tokens within one
  step's token budget); the slowest TTFT is one step of ``batch`` prompts of ``tokens``.
- decode: ``batch`` concurrent requests of ``context`` prompt tokens, ``decode_repeats`` times; the mean
  gap between tokens in the second half of each stream (when every request of the batch is decoding)
  is one step. The points' scatter around the fit is the decode spread, over windows as long as those
  second halves.

With ``relay_url`` (a proxy in front of this instance alone) prefill and decode are measured through it,
as a client of the deployment sees them: the proxy's hop and its relaying of every token then count, on
the cores they share with the instance. Without one, decode goes through ``pd_url`` if given.
- KV hand-over: through a PD proxy (``pd_url``), a lone request's TTFT minus a lone prefill's measured
  here is prefill's end to decode's first token (transfer tail, decode's last layer, second hop);
  without one, a fixed model.

HTTP and detokenisation costs stay inside the fitted constants, as a client of the deployment sees them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from vllm_pd.planner.latency_profile import InstanceProfile, ProfileError, fit_instance

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfilePlan:
    prefill_tokens: tuple[int, ...] = (32, 128, 512, 1024, 1536)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (64, 512, 1024)
    decode_tokens: int = 24
    repeats: int = 2
    decode_repeats: int = 3
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    max_token_id: int = 4000  # prompt ids are drawn below this (inside any vocabulary we serve)
    kv_fixed_ms: float = 5.0  # the KV model when no PD proxy is measured
    kv_ms_per_token: float = 0.005


@dataclass
class _Stream:
    ttft: float  # seconds
    stamps: list[float]  # arrival time of each token event


class UniquePrompts:
    """Random token-id prompts: unique, so a prefix cache never hits."""

    def __init__(self, max_token_id: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._max = max_token_id

    def make(self, length: int) -> list[int]:
        return [self._rng.randrange(5, self._max) for _ in range(length)]


async def model_name(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        if r.status != 200:
            raise ProfileError(f"{url}/v1/models: HTTP {r.status}")
        data = (await r.json()).get("data") or []
    if not data:
        raise ProfileError(f"{url}/v1/models: no model served")
    return str(data[0]["id"])


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                            max_tokens: int) -> _Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise ProfileError(f"{url}/v1/completions: HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise ProfileError(f"{url}/v1/completions: the stream carried no token")
    return _Stream(stamps[0] - t0, stamps)


class InstanceProfiler:
    def __init__(self, url: str, plan: ProfilePlan, pd_url: str | None = None, relay_url: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.pd_url = pd_url.rstrip("/") if pd_url else None
        self.relay_url = relay_url.rstrip("/") if relay_url else None
        self.plan = plan
        self._prompts = UniquePrompts(plan.max_token_id)

    async def run(self, tp: int) -> tuple[str, InstanceProfile]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            model = await model_name(session, self.url)
            # the first requests pay one-off costs (graph warm-up, connections): keep them out
            await self._batch(session, self.relay_url or self.url, model, [64, 64], 4)
            prefill = await self._prefill(session, model)
            decode, window_ms = await self._decode(session, model)
            kv = await self._kv(session, model, prefill) if self.pd_url else []
        # no PD pair measured: two points of the fixed model stand in for samples
        kv = kv or [(0, self.plan.kv_fixed_ms), (1000, self.plan.kv_fixed_ms + 1000 * self.plan.kv_ms_per_token)]
        inst = fit_instance(tp, prefill, decode, kv, self.plan.max_num_batched_tokens, self.plan.max_num_seqs,
                            window_ms)
        return model, inst

    async def _batch(self, session: aiohttp.ClientSession, url: str, model: str, lengths: list[int],
                     max_tokens: int) -> list[_Stream]:
        return list(await asyncio.gather(*(stream_completion(session, url, model, self._prompts.make(n), max_tokens)
                                           for n in lengths)))

    async def _prefill(self, session: aiohttp.ClientSession, model: str) -> list[tuple[int, int, float]]:
        p = self.plan
        out = []
        for tokens in (t for t in p.prefill_tokens if t < p.max_model_len):
            for batch in (b for b in p.prefill_batches if b * tokens <= p.max_num_batched_tokens):
                url = self.relay_url or self.url
                ms = [max(s.ttft for s in await self._batch(session, url, model, [tokens] * batch, 1)) * 1e3
                      for _ in range(p.repeats)]
                out.append((tokens, batch, statistics.median(ms)))
                logger.info("prefill %d x %d tokens: %.1f ms", batch, tokens, out[-1][2])
        return out

    async def _decode(self, session: aiohttp.ClientSession,
                      model: str) -> tuple[list[tuple[int, int, float]], float]:
        """([(batch, summed context, mean step ms)], the median window those means span in ms)."""
        p = self.plan
        url = self.relay_url or self.pd_url or self.url
        out, windows = [], []
        half = p.decode_tokens // 2
        for _ in range(p.decode_repeats):
            for context in (c for c in p.decode_contexts if c + p.decode_tokens < p.max_model_len):
                for batch in (b for b in p.decode_batches if b <= p.max_num_seqs):
                    streams = await self._batch(session, url, model, [context] * batch, p.decode_tokens)
                    gaps = [(s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) for s in streams]
                    mean_context = context + (half + p.decode_tokens) // 2
                    out.append((batch, batch * mean_context, statistics.median(gaps) * 1e3))
                    windows.append(statistics.median(s.stamps[-1] - s.stamps[half] for s in streams) * 1e3)
                    logger.info("decode batch %d context %d: %.2f ms/step", batch, context, out[-1][2])
        return out, statistics.median(windows) if windows else 0.0

    async def _kv(self, session: aiohttp.ClientSession, model: str,
                  prefill: list[tuple[int, int, float]]) -> list[tuple[int, float]]:
        assert self.pd_url is not None
        alone = {t: ms for t, b, ms in prefill if b == 1}
        out = []
        for tokens in sorted(alone):
            ms = [(await self._batch(session, self.pd_url, model, [tokens], 2))[0].ttft * 1e3
                  for _ in range(self.plan.repeats)]
            # decode's first forward overlaps prefill's (layer-wise load): what is left after prefill's end
            out.append((tokens, max(0.0, statistics.median(ms) - alone[tokens])))
            logger.info("PD hand-over %d tokens: %.1f ms", tokens, out[-1][1])
        return out

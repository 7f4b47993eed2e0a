"""Measure running vLLM instances through their OpenAI API and fit an :class:`InstanceProfile` of each.

Prompts are token-id lists from the served model's own vocabulary (exact lengths, every one unique so the
prefix cache never hits) sent as streaming completions with ``ignore_eos`` (vllm_pd.planner.completion_stream:
a stream carrying an error or a non-token event fails the measurement, naming it).

The instance at ``url`` is measured in full; with a PD pair (``pd_url``) its prefill instance
(``prefill_url``, by default ``neighbour_url``) is measured too, as the instance that will do the pair's
prefills: prefill, decode and the wake-up of each, point by point in turn (the same minutes of the machine's
drift in both), so the plan takes the prefill instance's prefill fit for prefill instances and says how far
the instances differ. Every profile run checks the speed of each instance - a lone prefill and a lone
decode step, the same requests - at its start, midway and at its end: its drift, kept in the profile
(``speed_checks``) with the prefill samples' scatter around their fit (``prefill_spread``).

- prefill: ``batch`` concurrent one-token requests of ``tokens`` each (batch x tokens within one
  step's token budget), ``repeats`` samples a point; the slowest TTFT is one step of ``batch`` prompts of
  ``tokens``.
- decode: ``batch`` concurrent requests of ``context`` prompt tokens, ``decode_repeats`` times; the mean
  gap between tokens in the second half of each stream (when every request of the batch is decoding)
  is one step. The points' scatter around the fit is the decode spread, over windows as long as those
  second halves. A lone stream's first half less as many such steps is its first steps' extra time.

With ``relay_url`` (a proxy in front of this instance alone; ``prefill_relay_url`` for the prefill
instance) prefill and decode are measured through it, as a client of the deployment sees them: the proxy's
hop and its relaying of every token then count, on the cores they share with the instance. Without one,
decode goes through ``pd_url`` if given.
- wake-up after idle: a lone prefill right after another request and one after ``wake_idle_ms`` of
  idleness, pairs interleaved; the difference of their medians per idle time.
- the same wake-up through a PD proxy (``pd_url``): a lone request's TTFT through the pair (two out), back
  to back and after each idle time (the pair's path wakes otherwise than the relay's).
- KV hand-over: through a PD proxy (``pd_url``), a lone request's TTFT through the pair back to back less
  the prefill instance's own TTFT of a prompt as long, back to back, ``kv_repeats`` pairs a length: prefill's
  end to decode's first token (transfer tail, decode's last layer, second hop) - the simulator adds it to the
  prefill instance's prefill (and the pair's wake-up after idleness), so it comes to the TTFT measured
  through the pair. Without a PD proxy, a fixed model.
- neighbours (with ``neighbour_url``, another instance on the same host - on a PD pair the prefill
  instance): a lone request's steady decode step (as decode measures it) alone and while the neighbour
  runs back-to-back prefills, and a lone prefill's TTFT alone and while the neighbour decodes a batch of
  long streams, interleaved ``neighbour_repeats`` times; the medians' ratios are the profile's
  ``beside_prefill`` and ``beside_decode``.
- joins (with ``neighbour_url`` and ``pd_url``): the lone request's steady step while the neighbour runs
  back-to-back plain prefills of ``t`` tokens, and while back-to-back PD requests of ``t`` tokens (two out:
  prefill on the neighbour, the KV pushed here, one decode step) join this instance, with how many joined
  in the measured window; interleaved ``join_repeats`` times per ``join_tokens`` length.

The pair's terms (hand-over, the pair's wake-up, neighbour factors, joins) are kept in both instances'
profiles. HTTP and detokenisation costs stay inside the fitted constants, as a client of the deployment
sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_pd.planner.completion_stream import (
    MeasurementError,
    Stream,
    UniquePrompts,
    model_name,
    served_vocabulary,
    stream_completion,
)
from vllm_pd.planner.latency_profile import InstanceProfile, ProfileError, fit_instance, resolved_wake_points

__all__ = ["InstanceProfiler", "MeasurementError", "ProfilePlan", "UniquePrompts", "stream_completion"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfilePlan:
    prefill_tokens: tuple[int, ...] = (32, 128, 512, 1024, 1536)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    # every small batch: a step's cost need not be linear in it (on a CPU batch 2 was 20 % dearer than 1 and 3)
    decode_batches: tuple[int, ...] = (1, 2, 3, 4, 8)
    decode_contexts: tuple[int, ...] = (64, 512, 1024)
    decode_tokens: int = 24
    repeats: int = 2
    decode_repeats: int = 3
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    vocab_size: int | None = None  # prompt ids are drawn below this; None: read from the served model
    kv_fixed_ms: float = 5.0  # the KV model when no PD proxy is measured
    kv_ms_per_token: float = 0.005
    neighbour_repeats: int = 4  # alone/beside pairs per neighbour factor
    neighbour_context: int = 512  # the lone decoding request's prompt
    neighbour_prefill_tokens: int = 1024  # the neighbour's back-to-back prompts
    neighbour_probe_tokens: int = 512  # the lone prefill measured beside the decoding neighbour
    neighbour_streams: int = 4  # the neighbour's decode batch
    neighbour_stream_tokens: int = 64  # the prompt of each of those streams
    neighbour_settle_s: float = 0.1  # after cancelling the neighbour's streams, before the next measurement
    # idle times before a lone prefill (wake-up cost); past 1 s too: vLLM's processes stop spinning and block
    wake_idle_ms: tuple[int, ...] = (30, 100, 300, 1000, 3000)
    wake_repeats: int = 6  # back to back / after idle pairs per idle time (0: not measured)
    wake_tokens: int = 128  # the lone prefill's prompt
    kv_repeats: int = 3  # pair / prefill instance TTFT pairs per prompt length (the hand-over's samples)
    speed_tokens: int = 512  # the speed checks' lone prefill and the lone decode stream's prompt
    speed_repeats: int = 2  # requests of each kind per speed check (their median)
    join_tokens: tuple[int, ...] = (128, 640)  # prompts of the PD requests joining decode (join cost)
    join_repeats: int = 4  # beside-plain-prefills / beside-joins pairs per prompt length (0: not measured)


@dataclass
class _Target:
    """An instance measured, the URLs its prefills and decode streams go through, and what it measured."""

    url: str
    prefill_url: str
    decode_url: str
    role: str  # "prefill" or "decode" of a PD pair, "" (the one instance profiled)
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)
    first_steps: list[float] = field(default_factory=list)
    wake: list[tuple[float, float, float]] = field(default_factory=list)
    checks: list[tuple[float, int, float, int, float]] = field(default_factory=list)


class InstanceProfiler:
    def __init__(
        self,
        url: str,
        plan: ProfilePlan,
        pd_url: str | None = None,
        relay_url: str | None = None,
        neighbour_url: str | None = None,
        prefill_url: str | None = None,
        prefill_relay_url: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.pd_url = pd_url.rstrip("/") if pd_url else None
        self.relay_url = relay_url.rstrip("/") if relay_url else None
        self.neighbour_url = neighbour_url.rstrip("/") if neighbour_url else None
        self.plan = plan
        self._prompts = UniquePrompts(plan.vocab_size or 1 << 20)
        self.main = _Target(self.url, self.relay_url or self.url, self.relay_url or self.pd_url or self.url, "")
        self.targets = [self.main]
        pair_prefill = prefill_url or (neighbour_url if pd_url else None)
        if pair_prefill:
            direct = pair_prefill.rstrip("/")
            via = prefill_relay_url.rstrip("/") if prefill_relay_url else direct
            self.targets.insert(0, _Target(direct, via, via, "prefill"))
            self.main.role = "decode"
        self.vocab_size = plan.vocab_size
        self._t0 = 0.0

    @property
    def prefill_target(self) -> _Target:
        """The instance that does a pair's prefills (the one measured in full if none other was given)."""
        return self.targets[0]

    async def run(self, tp: int) -> tuple[str, InstanceProfile]:
        """The instance at ``url`` alone (:meth:`run_all`'s last)."""
        model, instances = await self.run_all(tp)
        return model, instances[-1]

    async def run_all(self, tp: int) -> tuple[str, list[InstanceProfile]]:
        """Every instance given, the pair's prefill instance first."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            model = await model_name(session, self.url)
            for target in self.targets[:-1]:
                other = await model_name(session, target.url)
                if other != model:
                    raise ProfileError(f"{target.url} serves {other!r}, {self.url} {model!r}: not one pair")
            if self.vocab_size is None:
                self.vocab_size = await served_vocabulary(session, self.url, model)
                logger.info("%s: vocabulary of %d token ids (prompts are drawn below it)", self.url, self.vocab_size)
            self._prompts = UniquePrompts(self.vocab_size)
            self._t0 = time.perf_counter()
            # the first requests pay one-off costs (graph warm-up, connections): keep them out
            for target in self.targets:
                await self._batch(session, target.prefill_url, model, [64, 64], 4)
                await self._batch(session, target.decode_url, model, [64], 4)
            await self._speed_check(session, model)
            await self._prefill(session, model)
            await self._decode(session, model)
            await self._speed_check(session, model)
            for target in self.targets:
                target.wake = await self._wake(session, model, target.prefill_url, 1)
            pd_wake = await self._wake(session, model, self.pd_url, 2) if self.pd_url else []
            kv = await self._kv(session, model) if self.pd_url else []
            neighbour = await self._neighbour(session, model) if self.neighbour_url else []
            join = await self._joins(session, model) if self.neighbour_url and self.pd_url else []
            await self._speed_check(session, model)
        # no PD pair measured: two points of the fixed model stand in for samples
        kv = kv or [(0, self.plan.kv_fixed_ms), (1000, self.plan.kv_fixed_ms + 1000 * self.plan.kv_ms_per_token)]
        # where the pair's wake-up is noise, the prefill instance's own (where resolved) stands in
        floor = resolved_wake_points(self.prefill_target.wake) if self.prefill_target is not self.main else []
        p = self.plan
        return model, [
            fit_instance(
                tp,
                t.prefill,
                t.decode,
                kv,
                p.max_num_batched_tokens,
                p.max_num_seqs,
                statistics.median(t.windows) if t.windows else 0.0,
                neighbour,
                t.first_steps,
                t.wake,
                join,
                pd_wake,
                url=t.url,
                role=t.role,
                speed_checks=t.checks,
                pd_wake_floor=floor,
            )
            for t in self.targets
        ]

    async def _batch(
        self, session: aiohttp.ClientSession, url: str, model: str, lengths: list[int], max_tokens: int
    ) -> list[Stream]:
        return list(
            await asyncio.gather(
                *(stream_completion(session, url, model, self._prompts.make(n), max_tokens) for n in lengths)
            )
        )

    async def _speed_check(self, session: aiohttp.ClientSession, model: str) -> None:
        """Each instance's lone prefill of ``speed_tokens`` and a lone stream's steady step, as :meth:`_prefill`
        and :meth:`_decode` measure them (medians of ``speed_repeats``), into its ``checks``."""
        p = self.plan
        tokens = min(p.speed_tokens, p.max_model_len - p.decode_tokens - 1)
        half = p.decode_tokens // 2
        for target in self.targets:
            prefill = [
                (await self._batch(session, target.prefill_url, model, [tokens], 1))[0].ttft * 1e3
                for _ in range(p.speed_repeats)
            ]
            steps = []
            for _ in range(p.speed_repeats):
                (s,) = await self._batch(session, target.decode_url, model, [tokens], p.decode_tokens)
                steps.append((s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) * 1e3)
            check = (
                round(time.perf_counter() - self._t0, 1),
                tokens,
                round(statistics.median(prefill), 3),
                tokens + (half + p.decode_tokens) // 2,
                round(statistics.median(steps), 3),
            )
            target.checks.append(check)
            logger.info(
                "%s speed check at %.0f s: a lone %d-token prefill %.1f ms, a lone decode step %.2f ms",
                target.url,
                check[0],
                tokens,
                check[2],
                check[4],
            )

    async def _prefill(self, session: aiohttp.ClientSession, model: str) -> None:
        """Every point on every instance in turn, ``repeats`` samples each, into each one's ``prefill``."""
        p = self.plan
        for tokens in (t for t in p.prefill_tokens if t < p.max_model_len):
            for batch in (b for b in p.prefill_batches if b * tokens <= p.max_num_batched_tokens):
                for _ in range(p.repeats):
                    for target in self.targets:
                        streams = await self._batch(session, target.prefill_url, model, [tokens] * batch, 1)
                        target.prefill.append((tokens, batch, max(s.ttft for s in streams) * 1e3))
                for target in self.targets:
                    ms = [m for t, b, m in target.prefill[-p.repeats :]]
                    logger.info("%s prefill %d x %d tokens: %.1f ms", target.url, batch, tokens, statistics.median(ms))

    async def _decode(self, session: aiohttp.ClientSession, model: str) -> None:
        """Every point on every instance in turn into each one's ``decode`` [(batch, summed context, mean step
        ms)], ``windows`` (the window those means span, ms) and ``first_steps`` (a lone stream's first gaps less
        as many steady steps, ms)."""
        p = self.plan
        half = p.decode_tokens // 2
        for _ in range(p.decode_repeats):
            for context in (c for c in p.decode_contexts if c + p.decode_tokens < p.max_model_len):
                for batch in (b for b in p.decode_batches if b <= p.max_num_seqs):
                    for target in self.targets:
                        streams = await self._batch(
                            session, target.decode_url, model, [context] * batch, p.decode_tokens
                        )
                        gaps = [(s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) for s in streams]
                        mean_context = context + (half + p.decode_tokens) // 2
                        target.decode.append((batch, batch * mean_context, statistics.median(gaps) * 1e3))
                        target.windows.append(statistics.median(s.stamps[-1] - s.stamps[half] for s in streams) * 1e3)
                        if batch == 1:  # alone, its first gaps are its own first steps (in a batch, others' prompts)
                            s = streams[0]
                            target.first_steps.append((s.stamps[half] - s.stamps[0] - half * gaps[0]) * 1e3)
                        logger.info(
                            "%s decode batch %d context %d: %.2f ms/step",
                            target.url,
                            batch,
                            context,
                            target.decode[-1][2],
                        )

    async def _wake(
        self, session: aiohttp.ClientSession, model: str, url: str, max_tokens: int
    ) -> list[tuple[float, float, float]]:
        """[(idle ms, a lone request's TTFT back to back, its TTFT after that idle time)] through ``url``,
        ``max_tokens`` out, pairs interleaved."""
        p = self.plan
        tokens = min(p.wake_tokens, p.max_model_len - 2)
        out = []
        for _ in range(p.wake_repeats):
            for idle in p.wake_idle_ms:
                (hot,) = await self._batch(session, url, model, [tokens], max_tokens)
                await asyncio.sleep(idle / 1e3)
                (cold,) = await self._batch(session, url, model, [tokens], max_tokens)
                out.append((float(idle), hot.ttft * 1e3, cold.ttft * 1e3))
        for idle_ms, hot_ms, cold_ms in out[-len(p.wake_idle_ms) :]:
            logger.info(
                "%s: a lone request's TTFT after %.0f ms idle: %.1f ms (back to back %.1f ms)",
                url,
                idle_ms,
                cold_ms,
                hot_ms,
            )
        return out

    async def _kv(self, session: aiohttp.ClientSession, model: str) -> list[tuple[int, float]]:
        """[(prompt tokens, the pair's TTFT less the prefill instance's)], ``kv_repeats`` a length: each side
        back to back (its first request after the other side's is left out: an idle instance wakes slower)."""
        assert self.pd_url is not None
        p = self.plan
        prefill_url = self.prefill_target.prefill_url
        out = []
        for tokens in (t for t in p.prefill_tokens if t < p.max_model_len - 2):
            alone = [
                s.ttft
                for s in [await self._one(session, prefill_url, model, tokens, 1) for _ in range(p.kv_repeats + 1)][1:]
            ]
            pair = [
                s.ttft
                for s in [await self._one(session, self.pd_url, model, tokens, 2) for _ in range(p.kv_repeats + 1)][1:]
            ]
            out += [(tokens, round((b - a) * 1e3, 3)) for a, b in zip(alone, pair)]
            logger.info(
                "PD hand-over %d tokens: %.1f ms (the pair's TTFT %.1f ms, the prefill instance's %.1f ms)",
                tokens,
                statistics.median(ms for _, ms in out[-p.kv_repeats :]),
                statistics.median(pair) * 1e3,
                statistics.median(alone) * 1e3,
            )
        return out

    async def _one(self, session: aiohttp.ClientSession, url: str, model: str, tokens: int, out: int) -> Stream:
        return (await self._batch(session, url, model, [tokens], out))[0]

    async def _neighbour(self, session: aiohttp.ClientSession, model: str) -> list[tuple[str, float, float]]:
        """[(kind, alone ms, beside ms)]: ``"decode"`` a lone request's step alone / beside the neighbour's
        prefills, ``"prefill"`` a lone prefill alone / beside the neighbour's decoding, interleaved."""
        assert self.neighbour_url is not None
        other = await model_name(session, self.neighbour_url)
        out: list[tuple[str, float, float]] = []
        for _ in range(self.plan.neighbour_repeats):
            alone = await self._lone_step(session, model)
            async with self._neighbour_prefilling(session, other):
                beside = await self._lone_step(session, model)
            out.append(("decode", alone, beside))
            logger.info("decode step beside a prefilling neighbour: %.2f ms (alone %.2f ms)", beside, alone)
        for _ in range(self.plan.neighbour_repeats):
            alone = await self._lone_prefill(session, model)
            async with self._neighbour_decoding(session, other):
                beside = await self._lone_prefill(session, model)
            out.append(("prefill", alone, beside))
            logger.info("prefill beside a decoding neighbour: %.1f ms (alone %.1f ms)", beside, alone)
        return out

    async def _joins(self, session: aiohttp.ClientSession, model: str) -> list[tuple[int, float, float, float]]:
        """[(prompt tokens, the lone step beside the neighbour's plain prefills ms, beside PD joins ms, joins per
        second in that step's window)], interleaved."""
        assert self.neighbour_url is not None and self.pd_url is not None
        other = await model_name(session, self.neighbour_url)
        p = self.plan
        out: list[tuple[int, float, float, float]] = []
        for _ in range(p.join_repeats):
            for tokens in (t for t in p.join_tokens if t < p.max_model_len - 2):
                async with self._back_to_back(session, self.neighbour_url, other, tokens, 1, []):
                    plain = await self._lone_step(session, model)
                done: list[float] = []
                window: list[float] = []
                async with self._back_to_back(session, self.pd_url, model, tokens, 2, done):
                    joins = await self._lone_step(session, model, window)
                span = window[1] - window[0]  # 0 only from a server that sends every token at once
                rate = sum(window[0] <= t < window[1] for t in done) / span if span > 0 else 0.0
                out.append((tokens, plain, joins, rate))
                logger.info(
                    "decode step beside %.1f joins/s of %d tokens: %.2f ms (beside plain prefills %.2f ms)",
                    rate,
                    tokens,
                    joins,
                    plain,
                )
        return out

    @contextlib.asynccontextmanager
    async def _back_to_back(
        self, session: aiohttp.ClientSession, url: str, model: str, tokens: int, out: int, done: list[float]
    ) -> AsyncIterator[None]:
        """Requests of ``tokens`` prompt tokens, ``out`` out, one after the other until the block ends (the last
        one is let finish); each one's end (time.perf_counter) goes to ``done``."""
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await stream_completion(session, url, model, self._prompts.make(tokens), out)
                done.append(time.perf_counter())

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
        await task  # the load failed: its error, not a measurement without it

    async def _lone_step(self, session: aiohttp.ClientSession, model: str, window: list[float] | None = None) -> float:
        """A lone request's mean step (ms) over the second half of its stream, measured as :meth:`_decode` does;
        ``window`` gets that half's start and end (time.perf_counter)."""
        p = self.plan
        context = min(p.neighbour_context, p.max_model_len - p.decode_tokens - 1)
        (s,) = await self._batch(session, self.relay_url or self.pd_url or self.url, model, [context], p.decode_tokens)
        half = p.decode_tokens // 2
        if window is not None:
            window[:] = [s.stamps[half], s.stamps[-1]]
        return (s.stamps[-1] - s.stamps[half]) / (len(s.stamps) - 1 - half) * 1e3

    async def _lone_prefill(self, session: aiohttp.ClientSession, model: str) -> float:
        """A lone prefill's TTFT (ms), measured as :meth:`_prefill` does."""
        tokens = min(self.plan.neighbour_probe_tokens, self.plan.max_model_len - 2)
        (s,) = await self._batch(session, self.relay_url or self.url, model, [tokens], 1)
        return s.ttft * 1e3

    @contextlib.asynccontextmanager
    async def _neighbour_prefilling(self, session: aiohttp.ClientSession, model: str) -> AsyncIterator[None]:
        """The neighbour prefills one-token requests back to back until the block ends (the last one is
        let finish: one step, not an abort to wait out)."""
        assert self.neighbour_url is not None
        tokens = min(self.plan.neighbour_prefill_tokens, self.plan.max_model_len - 2)
        async with self._back_to_back(session, self.neighbour_url, model, tokens, 1, []):
            yield

    @contextlib.asynccontextmanager
    async def _neighbour_decoding(self, session: aiohttp.ClientSession, model: str) -> AsyncIterator[None]:
        """The neighbour decodes a batch of long streams from before the block (each has its first token)
        to its end; they are then cancelled."""
        assert self.neighbour_url is not None
        p = self.plan
        tokens = min(p.neighbour_stream_tokens, p.max_model_len // 2)
        firsts = [asyncio.Event() for _ in range(p.neighbour_streams)]
        streams = [
            asyncio.create_task(
                stream_completion(
                    session,
                    self.neighbour_url,
                    model,
                    self._prompts.make(tokens),
                    p.max_model_len - tokens - 1,
                    first=e,
                )
            )
            for e in firsts
        ]
        ready: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in firsts)))
        waits: list[asyncio.Future[Any]] = [ready, *streams]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            self._check_streams(streams, "before decoding")
            yield
            self._check_streams(streams, "during the measurement: lower neighbour_probe_tokens")
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        await asyncio.sleep(p.neighbour_settle_s)  # the neighbour aborts them at its next step

    def _check_streams(self, streams: list[asyncio.Task[Stream]], when: str) -> None:
        for task in streams:
            if task.done():
                task.result()  # its error, if it failed
                raise ProfileError(f"{self.neighbour_url}: a neighbour stream ended {when}")

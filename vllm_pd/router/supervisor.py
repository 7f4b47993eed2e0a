"""Supervisor: picks the role each ``both`` instance serves from observed load.

Instances started as kv_both can run either leg. Every interval the
supervisor estimates the pressure on each side - prefill: queued prompt tokens
times the recent prefill latency per token; decode: running streams times the
recent time per output token - and gives the ``both`` instances to the sides in
proportion, so the prefill/decode split follows the traffic mix. Dedicated
prefill/decode instances keep their role. An instance's switch takes effect
for new requests only; in-flight legs finish where they are.
"""

from __future__ import annotations

import asyncio
import logging

from vllm_pd.router.instance_pool import InstancePool

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, pool: InstancePool, interval: float = 2.0) -> None:
        self._pool = pool
        self.interval = interval
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.rebalance()

    def pressures(self) -> tuple[float, float]:
        """(prefill, decode) demand in seconds of work, from counts and latency averages."""
        insts = [i for i in self._pool.all() if i.healthy and not i.draining]
        prefill_tokens = sum(i.outstanding_tokens["prefill"] for i in insts)
        decode_streams = sum(i.outstanding["decode"] for i in insts)
        ttfts = [i.ttft.value for i in insts if i.ttft.value is not None]
        tpots = [i.tpot.value for i in insts if i.tpot.value is not None]
        # unmeasured sides count one second per queued unit, so either side can grow from zero
        prefill = sum(i.outstanding["prefill"] for i in insts) * (sum(ttfts) / len(ttfts) if ttfts else 1.0)
        decode = decode_streams * (sum(tpots) / len(tpots) if tpots else 1.0) * 16
        if prefill_tokens == 0 and decode_streams == 0:
            return 0.0, 0.0
        return prefill, decode

    def rebalance(self) -> dict[str, str]:
        """Assign every flexible instance a role; returns url -> role for logging and tests."""
        flexible = sorted((i for i in self._pool.all() if i.role == "both" and i.healthy and not i.draining),
                          key=lambda i: i.url)
        if not flexible:
            return {}
        prefill_p, decode_p = self.pressures()
        if prefill_p == 0 and decode_p == 0:
            return {i.url: i.active_role or "either" for i in flexible}
        fixed_p = sum(1 for i in self._pool.all() if i.role == "prefill" and i.healthy)
        fixed_d = sum(1 for i in self._pool.all() if i.role == "decode" and i.healthy)
        total = len(flexible) + fixed_p + fixed_d
        want_p = round(total * prefill_p / (prefill_p + decode_p)) - fixed_p
        # decode must always exist; prefill may vanish (decode-only fallback covers it)
        want_p = max(0, min(len(flexible) - (0 if fixed_d else 1), want_p))
        # keep instances in their current role where possible (fewer switches)
        current_p = [i for i in flexible if i.active_role == "prefill"]
        others = [i for i in flexible if i.active_role != "prefill"]
        ordered = current_p + others
        result = {}
        for n, inst in enumerate(ordered):
            role = "prefill" if n < want_p else "decode"
            if inst.active_role != role:
                logger.info("supervisor: %s now serves %s (pressure prefill=%.2f decode=%.2f)",
                            inst.url, role, prefill_p, decode_p)
            inst.active_role = role
            result[inst.url] = role
        return result

"""Supervisor: picks the role each ``both`` instance serves from what clients see.

Instances started as kv_both can run either leg. Every interval the
supervisor compares how far each side is from its target - prefill by the
recent time to first token (TTFT / ttft_slo, or the prefill queue depth when
that says more), decode by the recent time per output token (TPOT / tpot_slo) -
and moves one ``both`` instance from the side with headroom to the side that
is behind. So the prefill/decode split follows the traffic mix: long prompts
pull instances to prefill, long outputs pull them to decode. One move per
interval and a 20 % dead band keep it from flapping; a move affects new
requests only, in-flight legs finish where they are. Dedicated prefill/decode
instances keep their role, and at least one decoder always remains.
"""

from __future__ import annotations

import logging

from vllm_pd.router.instance_pool import Instance, InstancePool
from vllm_pd.router.periodic_task import PeriodicTask

logger = logging.getLogger(__name__)

DEAD_BAND = 1.2


class Supervisor(PeriodicTask):
    run_first = False

    def __init__(self, pool: InstancePool, interval: float = 2.0, ttft_slo: float = 2.0,
                 tpot_slo: float = 0.1) -> None:
        self._pool = pool
        self.interval = interval
        self.ttft_slo = ttft_slo
        self.tpot_slo = tpot_slo
        self.moves = 0

    async def tick(self) -> None:
        self.rebalance()

    def _flexible(self) -> list[Instance]:
        return sorted((i for i in self._pool.all() if i.role == "both" and i.healthy and not i.draining),
                      key=lambda i: i.url)

    def pressures(self) -> tuple[float, float]:
        """(prefill, decode): each side's recent latency over its target (> 1 = missing it)."""
        ttft = self._pool.recent_ttft.value or 0.0
        tpot = self._pool.recent_tpot.value or 0.0
        prefillers = self._pool.eligible("prefill")
        queued = sum(i.outstanding["prefill"] for i in self._pool.all())
        # a deep prefill queue predicts TTFT before completions report it
        per_prefill = [i.ttft.value for i in prefillers if i.ttft.value is not None]
        queue_ttft = queued / max(1, len(prefillers)) * (sum(per_prefill) / len(per_prefill) if per_prefill else 0)
        return max(ttft, queue_ttft) / self.ttft_slo, tpot / self.tpot_slo

    def rebalance(self) -> dict[str, str]:
        """Assign every flexible instance a role; returns url -> role."""
        flexible = self._flexible()
        if not flexible:
            return {}
        for n, inst in enumerate(i for i in flexible if i.active_role is None):
            # first assignment: alternate, decode first (a decoder must always exist)
            inst.active_role = "decode" if n % 2 == 0 else "prefill"
        prefill_p, decode_p = self.pressures()
        prefill_side = [i for i in flexible if i.active_role == "prefill"]
        decode_side = [i for i in flexible if i.active_role == "decode"]
        fixed_decoders = sum(1 for i in self._pool.all() if i.role == "decode" and i.healthy and not i.draining)
        move: tuple[Instance, str] | None = None
        if prefill_p > 1 and prefill_p > DEAD_BAND * decode_p and decode_side \
                and len(decode_side) + fixed_decoders > 1:
            # the least loaded decoder switches (its streams finish there)
            move = (min(decode_side, key=lambda i: i.outstanding["decode"]), "prefill")
        elif decode_p > 1 and decode_p > DEAD_BAND * prefill_p and prefill_side:
            move = (min(prefill_side, key=lambda i: i.outstanding["prefill"]), "decode")
        if move is not None:
            inst, role = move
            logger.info("supervisor: %s now serves %s (ttft/slo=%.2f tpot/slo=%.2f)", inst.url, role,
                        prefill_p, decode_p)
            inst.active_role = role
            self.moves += 1
        return {i.url: i.active_role or "decode" for i in flexible}

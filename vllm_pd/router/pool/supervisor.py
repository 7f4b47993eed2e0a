"""Supervisor: picks the role each ``both`` instance serves from what clients see.

Instances started as kv_both can run either leg. Every interval the
supervisor compares how far each side is from its target - prefill by the
recent time to first token (TTFT / ttft_slo, or the prefill queue depth when
that says more), decode by the recent time per output token (TPOT / tpot_slo) -
and moves one ``both`` instance from the side with headroom to the side that
is behind. So the prefill/decode split follows the traffic mix: long prompts
pull instances to prefill, long outputs pull them to decode. One move per
interval and a 20 % dead band keep it from flapping. When both sides miss
their targets, whichever split is in place, each move makes the other side
miss: a move undoing the last one within ``REVERSAL_MEMORY`` intervals must
then be asked for by a pressure above the one that made that move, by the
dead band, on ``REVERSAL_CONFIRM`` intervals in a row, unless the traffic
changed since (prompts in flight ``MIX_CHANGE`` x longer or shorter) - the
supervisor keeps the split whose worst miss is smaller instead
of alternating between the two (seen on real servers: 16 streams on two
single-core instances, 0P2D <-> 1P1D every few seconds). A move affects new
requests only, in-flight legs finish where they are, and after a move the observed
latencies count again only from samples taken under the new split. Dedicated prefill/decode
instances keep their role, and at least one decoder always remains.

Given the planner's latency profile (``supervisor_profile``), it also predicts both sides from the
current queues with the planner's cost model (vllm_pd.planner.role_pressure), acting on a backlog
before completions report it, and moves an instance only if the model predicts that the side it
leaves can spare it. With no prefill instance (every ``both`` decoding and computing its own prompts)
the model's TPOT replaces the observed one, which prompt computation between decode steps inflates:
so a prompt-heavy load can take an instance back to prefill.
"""

from __future__ import annotations

import logging

from vllm_pd.planner.latency_profile import InstanceProfile, ProfileError, load_profile
from vllm_pd.planner.role_pressure import SplitLoad, move_helps
from vllm_pd.planner.role_pressure import pressures as predicted_pressures
from vllm_pd.router.config import ConfigError
from vllm_pd.router.pool.instance_pool import Ewma, Instance, InstancePool
from vllm_pd.router.pool.periodic_task import PeriodicTask

logger = logging.getLogger(__name__)

DEAD_BAND = 1.2
REVERSAL_MEMORY = 10  # intervals during which undoing the last move needs a greater pressure than made it
REVERSAL_CONFIRM = 3  # ... on this many intervals in a row (one burst of slow first tokens is not a trend)
MIX_CHANGE = 2.0  # ... unless the prompts in flight have grown or shrunk this much since: the traffic changed
MIN_SAMPLES = 3  # an observed latency counts once this many samples were taken since the last move


def _fresh(signal: Ewma) -> float:
    return (signal.value or 0.0) if signal.count >= MIN_SAMPLES else 0.0


def _mix_changed(then: float | None, now: float | None) -> bool:
    """Whether the mean prompt in flight grew or shrank ``MIX_CHANGE`` x (unknown on either side: no)."""
    if not then or not now:
        return False
    return not 1 / MIX_CHANGE < now / then < MIX_CHANGE


def supervisor_profile(path: str | None) -> InstanceProfile | None:
    """The instance profile the supervisor predicts with (the file's smallest TP: how ``both`` servers run)."""
    if path is None:
        return None
    try:
        profile = load_profile(path)
        return profile.for_tp(profile.tps()[0])
    except ProfileError as e:
        raise ConfigError(f"supervisor_profile: {e}") from None


class Supervisor(PeriodicTask):
    run_first = False

    def __init__(
        self,
        pool: InstancePool,
        interval: float = 2.0,
        ttft_slo: float = 2.0,
        tpot_slo: float = 0.1,
        profile: InstanceProfile | None = None,
    ) -> None:
        self._pool = pool
        self.profile = profile
        self.interval = interval
        self.ttft_slo = ttft_slo
        self.tpot_slo = tpot_slo
        self.moves = 0
        self._ticks = 0
        # (role moved to, the pressure asking, tick, mean prompt tokens in flight then)
        self._last_move: tuple[str, float, int, float | None] | None = None
        self._reversal_asked = 0  # intervals in a row a move back has outweighed the last move's pressure
        self._mix_observed: float | None = None  # the prompt mix the observed latencies were taken under

    async def tick(self) -> None:
        self.rebalance()

    def _flexible(self) -> list[Instance]:
        return sorted(
            (i for i in self._pool.all() if i.role == "both" and i.healthy and not i.draining), key=lambda i: i.url
        )

    def pressures(self) -> tuple[float, float]:
        """(prefill, decode): each side's recent latency over its target (> 1 = missing it)."""
        ttft = _fresh(self._pool.recent_ttft)
        tpot = _fresh(self._pool.recent_tpot)
        prefillers = self._pool.eligible("prefill")
        queued = sum(i.outstanding["prefill"] for i in self._pool.all())
        # a deep prefill queue predicts TTFT before completions report it
        per_prefill = [i.ttft.value for i in prefillers if i.ttft.value is not None]
        queue_ttft = queued / max(1, len(prefillers)) * (sum(per_prefill) / len(per_prefill) if per_prefill else 0)
        observed = max(ttft, queue_ttft) / self.ttft_slo, tpot / self.tpot_slo
        if self.profile is None:
            return observed
        load = self.split_load()
        predicted = predicted_pressures(self.profile, load, self.ttft_slo, self.tpot_slo)
        if load.prefillers < 1:
            # No prefill instance: decoders compute prompts themselves (the proxy's fallback). The model has
            # no such path - its "infinite TTFT" would pull a decoder back every interval (flapping) - so
            # TTFT is the observed one. TPOT observed there is slowed by the prompts computed between decode
            # steps as much as by decoding: taken as decode pressure, a prompt-heavy load would keep every
            # instance decoding. The model's TPOT is decode's own work, so it stands for decode alone.
            return observed[0], predicted[1]
        return max(observed[0], predicted[0]), max(observed[1], predicted[1])

    def split_load(self) -> SplitLoad:
        """What the proxy has in flight now, per side, for the cost model."""
        insts = self._pool.all()

        def total(counter: str, role: str) -> int:
            return sum(getattr(i, counter)[role] for i in insts)

        # decode legs still waiting for their prompt (on prefill, or computed by decode itself) are not
        # decoding: counted, a prompt-heavy queue read as a big decode batch and kept decoders from moving
        waiting = [sum(i.awaiting_first[k] for i in insts) for k in (0, 1)]
        return SplitLoad(
            len(self._pool.eligible("prefill")),
            len(self._pool.eligible("decode")),
            total("outstanding", "prefill"),
            total("outstanding_tokens", "prefill"),
            total("outstanding", "decode") - waiting[0],
            total("outstanding_tokens", "decode") - waiting[1],
        )

    def rebalance(self) -> dict[str, str]:
        """Assign every flexible instance a role; returns url -> role."""
        self._ticks += 1
        flexible = self._flexible()
        if not flexible:
            return {}
        for n, inst in enumerate(i for i in flexible if i.active_role is None):
            # first assignment: alternate, decode first (a decoder must always exist)
            inst.active_role = "decode" if n % 2 == 0 else "prefill"
        self._follow_the_mix()
        prefill_p, decode_p = self.pressures()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "supervisor tick %d: ttft/slo=%.2f tpot/slo=%.2f, %s, mean prompt in flight %s, last move %s",
                self._ticks,
                prefill_p,
                decode_p,
                self.split_load(),
                self._prompt_mix(),
                self._last_move,
            )
        prefill_side = [i for i in flexible if i.active_role == "prefill"]
        decode_side = [i for i in flexible if i.active_role == "decode"]
        fixed_decoders = sum(1 for i in self._pool.all() if i.role == "decode" and i.healthy and not i.draining)
        move: tuple[Instance, str] | None = None
        if prefill_p > 1 and prefill_p > DEAD_BAND * decode_p and decode_side and len(decode_side) + fixed_decoders > 1:
            # the least loaded decoder switches (its streams finish there)
            move = (min(decode_side, key=lambda i: i.outstanding["decode"]), "prefill")
        elif decode_p > 1 and decode_p > DEAD_BAND * prefill_p and prefill_side:
            move = (min(prefill_side, key=lambda i: i.outstanding["prefill"]), "decode")
        receiving = prefill_p if move is not None and move[1] == "prefill" else decode_p
        if (
            move is not None
            and self.profile is not None
            and not move_helps(
                self.profile, self.split_load(), move[1], self.ttft_slo, self.tpot_slo, receiving, DEAD_BAND
            )
        ):
            logger.debug("supervisor: moving %s to %s would not help (cost model)", move[0].url, move[1])
            move = None
        if move is not None and self._holds_back(move[1], receiving):
            logger.debug(
                "supervisor: not moving %s back to %s yet (%.2f does not outweigh the last move's pressure)",
                move[0].url,
                move[1],
                receiving,
            )
            move = None
        if move is not None:
            inst, role = move
            self._last_move = (role, receiving, self._ticks, self._prompt_mix())
            self._reversal_asked = 0
            self._mix_observed = self._prompt_mix()
            logger.info(
                "supervisor: %s now serves %s (ttft/slo=%.2f tpot/slo=%.2f)", inst.url, role, prefill_p, decode_p
            )
            inst.active_role = role
            self.moves += 1
            # what clients saw so far describes the split that was: TPOT taken while every instance also
            # computed prompts would, kept, move the instance straight back (flapping)
            self._pool.restart_recent()
        return {i.url: i.active_role or "decode" for i in flexible}

    def _holds_back(self, role: str, pressure: float) -> bool:
        """Whether a move to ``role`` undoes a recent move and has not yet outweighed the pressure that made it
        (by the dead band) on ``REVERSAL_CONFIRM`` intervals in a row. That pressure describes the other split
        under the traffic of its time: once the prompts in flight are ``MIX_CHANGE`` x longer or shorter, it no
        longer holds anything back."""
        if self._last_move is None:
            return False
        last_role, last_pressure, tick, mix_then = self._last_move
        if last_role == role or self._ticks - tick >= REVERSAL_MEMORY:
            return False
        if _mix_changed(mix_then, self._prompt_mix()):
            return False
        self._reversal_asked = self._reversal_asked + 1 if pressure > DEAD_BAND * last_pressure else 0
        return self._reversal_asked < REVERSAL_CONFIRM

    def _follow_the_mix(self) -> None:
        """Once the prompts in flight are ``MIX_CHANGE`` x longer or shorter than when the observed latencies
        started, forget those: short prompts' first tokens said nothing about long prompts' (an EWMA full of
        them lagged a prompt-heavy burst until it was over)."""
        mix = self._prompt_mix()
        if mix is None:
            return
        if self._mix_observed is None:
            self._mix_observed = mix
        elif _mix_changed(self._mix_observed, mix):
            logger.debug(
                "supervisor: prompts in flight %.0f tokens on average, were %.0f: observed latencies restart",
                mix,
                self._mix_observed,
            )
            self._pool.restart_recent()
            self._mix_observed = mix

    def _prompt_mix(self) -> float | None:
        """Mean prompt tokens of the requests in flight (each has one decode leg; its tokens: prompt and
        max_tokens), None with none in flight."""
        legs = sum(i.outstanding["decode"] for i in self._pool.all())
        tokens = sum(i.outstanding_tokens["decode"] for i in self._pool.all())
        return tokens / legs if legs and tokens else None

"""Discrete-event simulation of a colocated or prefill/decode-disaggregated vLLM deployment.

Each instance runs engine steps back to back while it has work, roughly as vLLM's scheduler does:

- prefill instances: FCFS over their queue, up to ``max_num_batched_tokens`` prompt tokens per step
  (a long prompt is split into chunks).
- decode instances: continuous batching, every running request gains one token per step. The proxy
  sends both legs at once, so a request is live on its decode instance from its arrival. As prefill's
  last step starts, a decode instance with no other live request takes a layer-wise load: its forward
  runs beside prefill's and the first token comes ``kv_ms(prompt)`` after prefill's end (the instance
  is held meanwhile). Otherwise the load is async: the KV is usable ``transfer_ms(prompt)`` after
  prefill's end and the request joins the next step, which yields its first token. (Our connector's
  ``load_mode: auto``.)
- colocated instances: running requests decode first, the rest of the step's token budget goes to
  waiting prompts (chunked prefill); a prompt's last chunk yields its first token.

Step times come from the :class:`~vllm_pd.planner.latency_profile.InstanceProfile`; the decode part of a
step is scaled by the instance's current factor from the profile's decode spread, drawn again (seeded)
once it has held for the profile's spread window. Instances on one host slow each other: a step's decode
part is scaled by the profile's ``beside_prefill`` if any other instance of the simulation is, as the step
starts, in a step with prompt chunks, and its prefill part by ``beside_decode`` if any other instance is
then in a step that decodes. Sampling the neighbours' state at the step's start is the approximation: a
neighbour's step that begins or ends midway does not change a step already planned (and a decode
instance held by a layer-wise load counts as neither). With both factors 1.0 (the default, and instances
on separate hosts) nothing changes. A step holding requests' first decode steps takes longer by each
such request's draw from the profile's ``first_step_samples`` (floored at 0; requests vary: their first
gaps ran 0.5-14 ms here; ``first_step_ms`` without samples). A step with prompt chunks that starts after
its instance idled takes the profile's ``wake_ms`` of that idle time longer, ``pd_wake_ms`` on a prefill
instance (the pair's path, measured through it; a decode instance's wake-up happens as the request arrives,
beside the prefill, so it costs nothing of its own). A decode leg arriving at a decode
instance that is decoding others adds the profile's ``join_ms`` of its prompt to that instance's next step
that decodes (its HTTP leg, scheduling and KV intake take the instance's core; on an idle instance that is
part of the measured hand-over). Requests reach the instance
with the fewest outstanding requests, then the fewest outstanding tokens, taking turns among instances
equal in both, as the proxy's least_outstanding policy does (router/routing/policies.py ``_load``; one
turn counter per role). A leg's tokens are the proxy's: a prefill leg its prompt, until its prefill ends;
a decode leg (colocated: the request) its prompt plus its output tokens, from its arrival until it ends.

Each instance steps as the instance that will do its work was measured: a prefill instance of a PD
deployment as the profile's prefill instance, a decode instance as its decode instance (the profile's
instances of that role in turn when there are more instances than measured; a profile of one instance:
that one for all), colocated instances as every instance measured, in the profile's order, in turn. The
hand-over is the decode instance's (measured through the pair, with its steps).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_pd.errors import ConfigError
from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile
from vllm_pd.planner.workload import TraceRequest


@dataclass(frozen=True)
class Deployment:
    """``prefill`` = 0: ``decode`` colocated instances; else nP x mD disaggregated."""

    prefill: int
    decode: int
    tp_prefill: int = 1
    tp_decode: int = 1

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def devices(self) -> int:
        return self.prefill * self.tp_prefill + self.decode * self.tp_decode

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated x{self.decode}" + (f" tp{self.tp_decode}" if self.tp_decode > 1 else "")
        tps = f" tp{self.tp_prefill}/{self.tp_decode}" if (self.tp_prefill, self.tp_decode) != (1, 1) else ""
        return f"{self.prefill}P{self.decode}D{tps}"


@dataclass
class SimRequest:
    spec: TraceRequest
    prefilled: int = 0
    generated: int = 0
    first_token: float | None = None
    finish: float | None = None
    decoder: _Instance | None = None  # the decode instance the proxy picked at arrival (colocated: its one)

    @property
    def context(self) -> int:
        return self.spec.input_tokens + self.generated

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.spec.arrival

    @property
    def tpot(self) -> float:
        assert self.first_token is not None and self.finish is not None
        n = self.spec.output_tokens
        return (self.finish - self.first_token) / (n - 1) if n > 1 else 0.0


@dataclass
class _Instance:
    profile: InstanceProfile
    role: str  # prefill | decode | both
    rng: random.Random
    waiting: deque[SimRequest] = field(default_factory=deque)  # prompts to prefill
    running: list[SimRequest] = field(default_factory=list)  # decoding
    awaiting: int = 0  # decode: live requests whose KV is not here yet
    busy: bool = False
    factor: float = 1.0  # the decode spread's current draw
    factor_until: float = float("-inf")
    step_prefill: bool = False  # the current step has prompt chunks
    step_decode: bool = False  # the current step decodes
    idle_since: float = float("-inf")  # when its last step ended (idle since the start: a full wake-up)
    joins_ms: float = 0.0  # decode: what arriving decode legs cost, not yet charged to a step that decodes
    leg_tokens: int = 0  # the tokens of the legs it holds, as the proxy counts them (its tie-break)

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running) + self.awaiting

    def spread(self, t: float) -> float:
        """The decode spread's factor at ``t``: the current draw until its window ends."""
        s = self.profile.decode_spread
        if not s:
            return 1.0
        if t >= self.factor_until:
            self.factor = s[self.rng.randrange(len(s))]
            self.factor_until = t + self.profile.decode_spread_window_ms / 1e3
        return self.factor

    def first_steps(self) -> float:
        """A request's first decode steps' extra time: a draw from the profile's samples (never below 0)."""
        samples = self.profile.first_step_samples
        return max(0.0, samples[self.rng.randrange(len(samples))]) if samples else self.profile.first_step_ms

    def plan_step(
        self, t: float, neighbour_prefills: bool = False, neighbour_decodes: bool = False
    ) -> tuple[float, list[tuple[SimRequest, int]], list[SimRequest]]:
        """(duration in s, prompt chunks [(request, tokens)], decoding requests) of the next step.

        ``neighbour_prefills``/``neighbour_decodes``: another instance is in a step with prompt chunks /
        that decodes (the profile's ``beside_prefill``/``beside_decode`` then apply).
        """
        decoding = self.running[: self.profile.max_num_seqs] if self.role != "prefill" else []
        budget = self.profile.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[SimRequest, int]] = []
        if self.role != "decode":
            for req in self.waiting:
                if budget <= 0 or len(decoding) + len(chunks) >= self.profile.max_num_seqs:
                    break
                take = min(budget, req.spec.input_tokens - req.prefilled)
                chunks.append((req, take))
                budget -= take
        context = sum(r.context for r in decoding)
        spread = self.spread(t) if decoding else 1.0
        p = self.profile
        ms = p.mixed_ms(
            [t for _, t in chunks],
            len(decoding),
            context,
            spread,
            p.beside_prefill if neighbour_prefills else 1.0,
            p.beside_decode if neighbour_decodes else 1.0,
        )
        ms += sum(self.first_steps() for r in decoding if r.generated == 1)
        if decoding:
            ms, self.joins_ms = ms + self.joins_ms, 0.0
        if chunks:
            idle_ms = (t - self.idle_since) * 1e3
            ms += p.pd_wake_ms(idle_ms) if self.role == "prefill" else p.wake_ms(idle_ms)
        return ms / 1e3, chunks, decoding


@dataclass
class Simulation:
    """One run of ``deployment`` over ``requests``; :meth:`run` returns the finished requests."""

    profile: LatencyProfile
    deployment: Deployment
    seed: int = 0  # the decode spread's draws
    _events: list = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _turns: dict[str, itertools.count] = field(default_factory=dict)  # least_outstanding's tie-breaks, per role

    def __post_init__(self) -> None:
        d = self.deployment
        rngs = (random.Random(self.seed * 1000 + i) for i in itertools.count())
        if d.colocated:
            both = self.profile.members(d.tp_decode)
            self.prefillers = [_Instance(both[i % len(both)], "both", next(rngs)) for i in range(d.decode)]
            self.decoders = self.prefillers
        else:
            p, dec = self.profile.for_role(d.tp_prefill, "prefill"), self.profile.for_role(d.tp_decode, "decode")
            self.prefillers = [_Instance(p[i % len(p)], "prefill", next(rngs)) for i in range(d.prefill)]
            self.decoders = [_Instance(dec[i % len(dec)], "decode", next(rngs)) for i in range(d.decode)]
        if not self.decoders:
            raise ConfigError(f"deployment {d.label}: needs at least one decode instance")
        self.instances = self.decoders if d.colocated else self.prefillers + self.decoders

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, requests: list[TraceRequest]) -> list[SimRequest]:
        sims = [SimRequest(r) for r in requests]
        for req in sims:
            self._at(req.spec.arrival, functools.partial(self._arrive, req=req))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            fn(t)
        return sims

    def _arrive(self, t: float, req: SimRequest) -> None:
        if not self.deployment.colocated:
            req.decoder = dec = self._least_outstanding(self.decoders, "decode")
            dec.awaiting += 1
            dec.leg_tokens += _decode_leg_tokens(req)
            if dec.running:  # an idle decode instance's intake is in the request's own hand-over (kv)
                dec.joins_ms += dec.profile.join_ms(req.spec.input_tokens)
        inst = self._least_outstanding(self.prefillers, "prefill")
        if self.deployment.colocated:
            req.decoder = inst
        inst.leg_tokens += _decode_leg_tokens(req) if self.deployment.colocated else req.spec.input_tokens
        inst.waiting.append(req)
        self._kick(t, inst)

    def _least_outstanding(self, instances: list[_Instance], role: str) -> _Instance:
        best = min((i.outstanding, i.leg_tokens) for i in instances)
        tied = [i for i in instances if (i.outstanding, i.leg_tokens) == best]
        return tied[next(self._turns.setdefault(role, itertools.count())) % len(tied)]

    def _kv_ready(self, t: float, req: SimRequest) -> None:
        """An async load is done: the request joins its decode instance's next step."""
        inst = req.decoder
        assert inst is not None
        inst.awaiting -= 1
        inst.running.append(req)
        self._kick(t, inst)

    def _layerwise_done(self, t: float, req: SimRequest) -> None:
        """Decode's forward beside prefill's is done: the first token, and the instance is free."""
        inst = req.decoder
        assert inst is not None
        inst.awaiting -= 1
        inst.busy = False
        inst.running.append(req)
        self._emit_token(t, inst, req)
        self._kick(t, inst)

    def _kick(self, t: float, inst: _Instance) -> None:
        if inst.busy or not (inst.waiting or (inst.running and inst.role != "prefill")):
            return
        duration, chunks, decoding = inst.plan_step(t, *self._neighbours_of(inst))
        inst.busy = True
        inst.step_prefill, inst.step_decode = bool(chunks), bool(decoding)
        # prefill announces a prompt as its last chunk's step starts; an idle decode then loads layer-wise
        layerwise = [
            r
            for r, n in chunks
            if inst.role == "prefill" and r.prefilled + n >= r.spec.input_tokens and self._takes_layerwise(r)
        ]
        for req in layerwise:
            assert req.decoder is not None
            req.decoder.busy = True
        self._at(t + duration, lambda t_end: self._step_done(t_end, inst, chunks, decoding, layerwise))

    def _neighbours_of(self, inst: _Instance) -> tuple[bool, bool]:
        """(another instance is in a step with prompt chunks, another is in a step that decodes)."""
        if inst.profile.beside_prefill == 1.0 and inst.profile.beside_decode == 1.0:
            return False, False  # nothing to scale: skip the look
        others = [i for i in self.instances if i is not inst]
        return any(i.step_prefill for i in others), any(i.step_decode for i in others)

    @staticmethod
    def _takes_layerwise(req: SimRequest) -> bool:
        dec = req.decoder
        return dec is not None and not dec.busy and not dec.running and dec.awaiting == 1

    def _step_done(
        self,
        t: float,
        inst: _Instance,
        chunks: list[tuple[SimRequest, int]],
        decoding: list[SimRequest],
        layerwise: list[SimRequest],
    ) -> None:
        inst.busy = False
        inst.idle_since = t
        inst.step_prefill = inst.step_decode = False
        for req in decoding:
            self._emit_token(t, inst, req)
        for req, tokens in chunks:
            req.prefilled += tokens
            if req.prefilled < req.spec.input_tokens:
                continue
            inst.waiting.remove(req)
            if inst.role == "prefill":
                n = req.spec.input_tokens
                inst.leg_tokens -= n
                assert req.decoder is not None
                hand_over = req.decoder.profile  # measured through the pair, with the decode instance's steps
                done, ms = (
                    (self._layerwise_done, hand_over.kv_ms(n))
                    if req in layerwise
                    else (self._kv_ready, hand_over.transfer_ms(n))
                )
                self._at(t + ms / 1e3, functools.partial(done, req=req))
            else:  # colocated: the last chunk samples the first token
                inst.running.append(req)
                self._emit_token(t, inst, req)
        self._kick(t, inst)

    @staticmethod
    def _emit_token(t: float, inst: _Instance, req: SimRequest) -> None:
        req.generated += 1
        if req.first_token is None:
            req.first_token = t
        if req.generated >= req.spec.output_tokens:
            req.finish = t
            inst.running.remove(req)
            inst.leg_tokens -= _decode_leg_tokens(req)


def _decode_leg_tokens(req: SimRequest) -> int:
    """What the proxy counts for a decode leg (router/flow/pd_flow.py: prompt tokens + max_tokens)."""
    return req.spec.input_tokens + req.spec.output_tokens


def simulate(
    profile: LatencyProfile, deployment: Deployment, requests: list[TraceRequest], seed: int = 0
) -> list[SimRequest]:
    return Simulation(profile, deployment, seed).run(requests)

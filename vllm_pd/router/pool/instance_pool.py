"""The set of backend vLLM instances and their live state.

An instance is eligible for new requests of a role when it serves that role,
is healthy, not draining, not busy (it answered 429/503 with ``Retry-After``:
until then other instances serve), and its circuit breaker lets requests through. Load
(outstanding requests and tokens) is counted from the moment a leg is chosen
until that leg ends - for decode, until the stream to the client ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vllm_pd.protocol.transfer_params import PROTOCOL_KEY
from vllm_pd.router.config import ROLES, ConfigError, InstanceConfig, ProxyConfig
from vllm_pd.router.pool.circuit_breaker import CircuitBreaker

logger = logging.getLogger(__name__)

MAX_BUSY_S = 60.0  # the longest a Retry-After keeps an instance out


class Ewma:
    """Exponentially weighted moving average; None until the first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0  # samples added

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.count += 1


@dataclass(eq=False)
class Instance:
    url: str
    role: str  # configured role: prefill | decode | both
    kv_endpoint: str | None
    breaker: CircuitBreaker
    healthy: bool = True
    draining: bool = False
    # for "both" instances the supervisor picks the role they serve now (None = either)
    active_role: str | None = None
    outstanding: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    outstanding_tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    # decode legs (and their tokens) that have not yet produced a token: their prompt is still being
    # computed, here or on prefill (a decode leg goes out beside its prefill leg) - not decoding yet
    awaiting_first: list[int] = field(default_factory=lambda: [0, 0])
    ttft: Ewma = field(default_factory=Ewma)  # seconds, prefill leg (or decode-only first token)
    tpot: Ewma = field(default_factory=Ewma)  # seconds per output token on decode
    models: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> path (its /v1/models card)
    added_at: float = field(default_factory=time.monotonic)
    busy_until: float = 0.0  # time.monotonic() until which it asked for no requests (Retry-After); 0: never
    kv_peers: tuple[str, ...] = ()  # a prefill's KV endpoints (one per TP rank), learned from its answers

    def learn_kv_peers(self, kv_params: dict) -> None:
        """The KV endpoints a prefill answer of our connector names (other connectors' answers teach nothing)."""
        endpoints = kv_params.get("remote_endpoints") or [kv_params.get("remote_endpoint")]
        if kv_params.get(PROTOCOL_KEY) and all(isinstance(e, str) and e for e in endpoints):
            self.kv_peers = tuple(endpoints)

    def busy_for(self) -> float:
        """Seconds it still asked for no requests (0.0: none)."""
        return max(0.0, self.busy_until - time.monotonic()) if self.busy_until else 0.0

    def mark_busy(self, seconds: float) -> None:
        """It answered 429/503 with Retry-After: ``seconds`` (capped: a backend cannot take itself out for long)."""
        self.busy_until = max(self.busy_until, time.monotonic() + min(seconds, MAX_BUSY_S))
        logger.info("instance %s asked for no requests for %.1f s (Retry-After)", self.url, seconds)

    def serves(self, role: str) -> bool:
        if self.role == "both":
            return self.active_role in (None, role)
        return self.role == role

    def eligible(self, role: str) -> bool:
        return (
            self.serves(role)
            and self.healthy
            and not self.draining
            and self.breaker.allows()
            and not (self.busy_until and time.monotonic() < self.busy_until)
        )

    @property
    def load(self) -> int:
        return self.outstanding["prefill"] + self.outstanding["decode"]

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "active_role": self.active_role,
            "kv_endpoint": self.kv_endpoint,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state.value,
            "outstanding": dict(self.outstanding),
            "outstanding_tokens": dict(self.outstanding_tokens),
            "ttft_s": self.ttft.value,
            "tpot_s": self.tpot.value,
            "models": list(self.models),
            "busy_s": round(self.busy_for(), 3),
        }


class InFlightLeg:
    """One leg in flight: counts its load on an instance until ``finish()`` (idempotent).

    Not a "lease" (that word names prefill holding a request's KV for decode, docs/design/names.md)."""

    def __init__(self, instance: Instance, role: str, tokens: int) -> None:
        self.instance, self.role, self.tokens = instance, role, tokens
        instance.outstanding[role] += 1
        instance.outstanding_tokens[role] += tokens
        instance.breaker.on_send()
        self._finished = False
        self._awaiting = role == "decode"
        if self._awaiting:
            instance.awaiting_first[0] += 1
            instance.awaiting_first[1] += tokens

    def first_token(self) -> None:
        """The leg produced its first token: a decode leg is decoding from now on. Idempotent."""
        if self._awaiting:
            self._awaiting = False
            self.instance.awaiting_first[0] -= 1
            self.instance.awaiting_first[1] -= self.tokens

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.first_token()
            self.instance.outstanding[self.role] -= 1
            self.instance.outstanding_tokens[self.role] -= self.tokens


class InstancePool:
    def __init__(self, config: ProxyConfig) -> None:
        self._config = config
        self._instances: dict[str, Instance] = {}
        # what clients saw recently (all instances): the supervisor's signals
        self.recent_ttft = Ewma(0.1)
        self.recent_tpot = Ewma(0.1)
        self.recent_since = 0.0  # requests sent before this do not count in them
        for ic in config.instances:
            self.add(ic)

    def restart_recent(self) -> None:
        """Forget what clients saw so far (the supervisor, after changing the split those samples describe);
        requests sent before now no longer count (they still run where the old split sent them)."""
        self.recent_ttft = Ewma(self.recent_ttft.alpha)
        self.recent_tpot = Ewma(self.recent_tpot.alpha)
        self.recent_since = time.monotonic()

    def observe(self, signal: Ewma, sent: float, value: float) -> None:
        """A client-side latency of a request sent at ``sent`` (monotonic), for ``recent_ttft``/``recent_tpot``."""
        if sent >= self.recent_since:
            signal.add(value)

    def add(self, ic: InstanceConfig) -> Instance:
        if ic.url in self._instances:
            raise ConfigError(f"url: instance {ic.url} already exists")
        inst = Instance(
            url=ic.url,
            role=ic.role,
            kv_endpoint=ic.kv_endpoint,
            breaker=CircuitBreaker(self._config.breaker_failures, self._config.breaker_cooldown),
        )
        if ic.kv_endpoint is not None and ic.role != "decode":
            inst.kv_peers = (ic.kv_endpoint,)  # a prefill's KV endpoint given (URL@tcp://...): no answer needed first
        self._instances[ic.url] = inst
        logger.info("instance added: %s role=%s kv=%s", ic.url, ic.role, ic.kv_endpoint)
        return inst

    def remove(self, url: str) -> Instance:
        inst = self.get(url)
        del self._instances[inst.url]
        logger.info("instance removed: %s", url)
        return inst

    def drain(self, url: str) -> Instance:
        """No new requests go to ``url``; those in flight finish (``remove`` it once its load is 0)."""
        inst = self.get(url)
        if not inst.draining:
            inst.draining = True
            logger.info("instance draining: %s (%d in flight)", inst.url, inst.load)
        return inst

    def undrain(self, url: str) -> Instance:
        inst = self.get(url)
        if inst.draining:
            inst.draining = False
            logger.info("instance undrained: %s", inst.url)
        return inst

    def get(self, url: str) -> Instance:
        inst = self._instances.get(url.rstrip("/"))
        if inst is None:
            raise KeyError(url)
        return inst

    def set_role(self, url: str, role: str) -> Instance:
        if role not in ROLES:
            raise ConfigError(f"role: {role!r} is not one of {ROLES}")
        inst = self.get(url)
        inst.role = role
        inst.active_role = None
        return inst

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def eligible(self, role: str, exclude: set[str] = frozenset()) -> list[Instance]:  # type: ignore[assignment]
        return [i for i in self._instances.values() if i.url not in exclude and i.eligible(role)]

    def has_role(self, role: str) -> bool:
        return any(i.serves(role) for i in self._instances.values())

    def busy_wait(self, role: str) -> float | None:
        """Seconds until the first instance of ``role`` that asked for no requests (Retry-After) takes
        them again; None when none of them did."""
        waits = [i.busy_for() for i in self._instances.values() if i.serves(role) and i.healthy and not i.draining]
        waits = [w for w in waits if w > 0]
        return min(waits) if waits else None

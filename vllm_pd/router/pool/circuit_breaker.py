"""Per-instance circuit breaker: closed -> open after N consecutive failures ->
half-open after a cooldown (one probe request) -> closed on success."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class BreakerState(str, Enum):  # noqa: UP042 - StrEnum would change str(state), which logs show
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failures: int = 5, cooldown: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_limit = failures
        self.cooldown = cooldown
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self._state = BreakerState.CLOSED

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown:
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        return self._state

    def allows(self) -> bool:
        """Whether a request may be sent now (half-open lets exactly one probe through)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probe_in_flight:
            return True
        return False

    def on_send(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def record_success(self) -> None:
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._probe_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_limit:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_in_flight = False

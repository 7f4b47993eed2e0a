"""The launcher's port picking (servers themselves are exercised by every e2e test)."""

from __future__ import annotations

import socket

from vllm_pd import vllm_server
from vllm_pd.vllm_server import free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    low = vllm_server._ephemeral_low()
    if low - vllm_server._LOW_PORT >= 1000:
        # where bind(0) hands out ports to everyone else (vLLM's own internal ports too)
        assert all(vllm_server._LOW_PORT <= p < low for p in ports)
    for p in ports[:8]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_picked(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken, taken])
        real = vllm_server.random.randrange
        # the random pick lands on the busy port first: it must be skipped, not returned
        monkeypatch.setattr(vllm_server.random, "randrange", lambda a, b: next(picks, None) or real(a, b))
        monkeypatch.setattr(vllm_server, "_ephemeral_low", lambda: 60000)
        assert free_port() != taken

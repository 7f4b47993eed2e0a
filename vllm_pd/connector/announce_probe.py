"""Decode's scheduler asks whether the prefill it awaits an announcement from is still there.

A decode leg sent beside its prefill leg waits, unscheduled, for prefill's announcement of
the KV. Prefill may simply be busy (its queue is long), so the wait is long
(``transfer_timeout_s``) - but a prefill that cannot reach decode (a one-way cut the proxy
does not see, a paused host) would hold the request that long for nothing. Once the wait
passes ``push_wait_s``, the prefill instance the proxy named is pinged (the transport's
PingMessage, answered by its transport threads even while its engine computes) every
``peer_probe_s``; a ping that is not answered within that long ends the wait, and decode
computes the prompt itself. Pings go from the scheduler's process without blocking it: a
ping is a future looked at on the scheduler's next pass.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from vllm_pd.connector.transport import Transport, create_transport
from vllm_pd.protocol.control import PingMessage
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass
class _Ping:
    future: Future[bytes | None] | None = None
    answered_at: float = 0.0


class AnnounceProbe:
    def __init__(self, probe_s: float) -> None:
        self.probe_s = probe_s
        self._pings: dict[str, _Ping] = {}  # endpoint -> its last ping
        self._clients: dict[str, Transport] = {}  # scheme -> a client-only transport (control messages only)

    def _client(self, endpoint: str) -> Transport:
        scheme = endpoint.split("://", 1)[0]
        if scheme not in self._clients:
            # no block bytes go out: no checksum, so no vllm_pd._C loaded for it
            self._clients[scheme] = create_transport(scheme, checksum="none")
        return self._clients[scheme]

    def lost(self, endpoint: str) -> bool:
        """True if ``endpoint`` left a ping unanswered for ``probe_s``; pings it when its last
        answer is older than that (never blocks)."""
        now = time.monotonic()
        ping = self._pings.setdefault(endpoint, _Ping())
        fut = ping.future
        if fut is not None and fut.done():
            ping.future = None
            if fut.exception() is not None:
                logger.warning(
                    "prefill %s did not answer a ping within %.1fs: %s", endpoint, self.probe_s, fut.exception()
                )
                return True
            ping.answered_at = now
        if ping.future is None and now - ping.answered_at >= self.probe_s:
            try:
                ping.future = self._client(endpoint).notify(endpoint, PingMessage().encode(), timeout=self.probe_s)
            except Exception as e:
                logger.warning("prefill %s cannot be pinged: %s", endpoint, e)
                return True
        return False

    def forget(self, endpoints: tuple[str, ...]) -> None:
        """Nothing waits on these any more (their pings in flight end on their own)."""
        for endpoint in endpoints:
            self._pings.pop(endpoint, None)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

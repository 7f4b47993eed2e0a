"""Graceful shutdown: stop accepting, let in-flight requests finish within a grace period, then stop.

On SIGTERM (``vllm-pd proxy``) the listening socket closes, idle keep-alive
connections close, and every busy connection closes after its answer, so a
load balancer or client moves to another proxy while nothing in flight is cut.
Requests still running when the grace period (``--drain-grace``) ends are
cancelled as a client disconnect would cancel them: both legs' connections to
vLLM close (vLLM aborts the requests), and KV that prefill holds for a decode
that will never take it is released through ``release_remote_kv`` before the
process exits. A second signal ends the grace period at once.
"""

from __future__ import annotations

import asyncio
import logging

from vllm_pd.router.server.app import RunningProxy

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds between looks at the in-flight count (only while draining)


async def drain(running: RunningProxy, grace: float, hurry: asyncio.Event | None = None) -> int:
    """Drain and stop ``running``; returns how many requests were cancelled at the end of ``grace`` seconds
    (or when ``hurry`` is set)."""
    http, proxy = running.http, running.proxy
    proxy.metrics.draining = True
    http.stop_accepting()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    logger.info("draining: %d requests in flight, up to %.1f s to finish", http.busy(), grace)
    while http.busy() and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(_POLL)
    left = http.busy()
    if left:
        logger.warning("drain: cancelling %d requests still running (both legs; held KV is released)", left)
    if proxy.flow is not None:
        proxy.flow.cancel_background_legs()
    await running.cleanup()
    logger.info("drained and stopped")
    return left

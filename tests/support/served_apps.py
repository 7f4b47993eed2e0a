"""aiohttp apps served on 127.0.0.1 from a thread of their own, for tests that run a client (the
profiler) in the test's thread against fake OpenAI servers (tests/integration/test_planner_profile*.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from aiohttp import web


def serve_apps(*apps: web.Application) -> Iterator[list[str]]:
    """Yields the apps' URLs once each listens; stops them after (use: ``for urls in serve_apps(...)``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = [web.AppRunner(app) for app in apps]

    async def start(runner: web.AppRunner) -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    urls = [asyncio.run_coroutine_threadsafe(start(r), loop).result(10) for r in runners]
    yield urls
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)

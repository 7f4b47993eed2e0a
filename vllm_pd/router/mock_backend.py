"""A mock vLLM OpenAI server for the proxy's tests and benchmarks.

It speaks the PD protocol of vLLM's connectors (a prefill request with
``do_remote_decode`` answers with ``kv_transfer_params``), streams SSE with a
fixed TTFT and inter-token latency, records every request it sees and every
client that went away, and fails on demand. It stands in for vLLM where the
test is about the proxy, not the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class SeenRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    cancelled: bool = False
    finished: bool = False


@dataclass
class MockBackend:
    name: str = "mock"
    model: str = "mock-model"
    ttft: float = 0.0
    itl: float = 0.0
    cached_tokens: int | None = None  # reported in usage.prompt_tokens_details when set
    kv_params: bool = True  # answer do_remote_decode with kv_transfer_params
    seen: list[SeenRequest] = field(default_factory=list)
    # failure injection: each entry is consumed by one request
    failures: list[str] = field(default_factory=list)
    record: bool = True

    def fail_next(self, *modes: str) -> None:
        """Queue failures: "500", "400", "hang", "break:<k>" (cut the stream after k events), "empty"."""
        self.failures.extend(modes)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = SeenRequest(request.path, body, {k.lower(): v for k, v in request.headers.items()})
        if self.record:
            self.seen.append(seen)
        failure = self.failures.pop(0) if self.failures else None
        try:
            return await self._answer(request, body, seen, failure)
        except asyncio.CancelledError:
            seen.cancelled = True
            raise
        except ConnectionResetError:
            seen.cancelled = True
            return web.Response()

    async def _answer(self, request: web.Request, body: dict, seen: SeenRequest,
                      failure: str | None) -> web.StreamResponse:
        if failure == "500":
            return web.json_response({"error": {"message": "injected", "type": "InternalServerError"}}, status=500)
        if failure == "400":
            return web.json_response({"error": {"message": "bad prompt", "type": "BadRequestError",
                                                "param": "prompt", "code": 400}}, status=400)
        if failure == "hang":
            await asyncio.sleep(3600)
        chat = request.path.endswith("chat/completions")
        n_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        prompt = body.get("prompt") if not chat else json.dumps(body.get("messages"))
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        rid = request.headers.get("X-Request-Id", "x")
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                                 "total_tokens": prompt_tokens + n_tokens}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        kvp = body.get("kv_transfer_params") or {}
        await asyncio.sleep(self.ttft)
        if not body.get("stream"):
            await asyncio.sleep(self.itl * max(0, n_tokens - 1))
            text = "".join(f" t{i}" for i in range(n_tokens))
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out: dict[str, Any] = {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                                   "model": self.model, "choices": [choice], "usage": usage,
                                   "served_by": self.name}
            if kvp.get("do_remote_decode") and self.kv_params:
                out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                             "remote_engine_id": self.name, "remote_block_ids": [1, 2, 3],
                                             "remote_request_id": rid, "remote_host": "127.0.0.1",
                                             "remote_port": 5600}
            seen.finished = True
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        break_after = int(failure.split(":")[1]) if failure and failure.startswith("break:") else None
        if failure == "empty":
            return resp
        for i in range(n_tokens):
            if i:
                await asyncio.sleep(self.itl)
            if break_after is not None and i == break_after:
                # a dying server: cut the connection mid-stream
                assert request.transport is not None
                request.transport.close()
                return resp
            delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            chunk = {"id": f"cmpl-{rid}", "model": self.model, "served_by": self.name,
                     "choices": [{"index": 0, **delta, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": f"cmpl-{rid}", "model": self.model, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        seen.finished = True
        return resp


async def start_backend(backend: MockBackend, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(backend.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, f"http://{host}:{sock.getsockname()[1]}"


def main() -> None:
    """Run mock backends as a standalone process (for benchmarks against other routers)."""
    p = argparse.ArgumentParser(description="mock vLLM OpenAI server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="mock")
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--itl", type=float, default=0.0)
    a = p.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        b = MockBackend(name=a.name, ttft=a.ttft, itl=a.itl, record=False)
        await start_backend(b, port=a.port)
        while True:
            await asyncio.sleep(3600)

    asyncio.run(run())


if __name__ == "__main__":
    main()

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

from vllm_pd.protocol.transfer_params import asks_remote_decode
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse, json_response
from vllm_pd.router.http.http_server import Handler, HttpServer


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
    # a partitioned host: nothing is answered until it is reachable again (what arrived meanwhile is
    # answered then, as TCP would deliver it once the link is back); with fail_next("hang"), never
    unreachable: bool = False
    seen: list[SeenRequest] = field(default_factory=list)
    # failure injection: each entry is consumed by one request
    failures: list[str] = field(default_factory=list)
    record: bool = True

    def fail_next(self, *modes: str) -> None:
        """Queue failures, one per request:

        - "500", "400": an error answer; "429:<s>", "503:<s>": that status with ``Retry-After: <s>``
          ("429" alone: none);
        - "hang": never answer; "reset": abort the connection before any answer;
        - "break:<k>": cut the stream after k events; "stall:<k>": send nothing more after k events
          (the connection stays open); "empty": a stream with no event;
        - "huge:<n>": a 200 answer of n bytes (a JSON string that never ends; streamed: one SSE event
          that never ends), sent 64 KiB at a time as the reader takes them; "huge-stall:<n>": the same,
          then nothing more (the connection stays open);
        - "truncate": the answer cut short - a JSON body shorter than its Content-Length, or a stream cut
          in the middle of its first event;
        - "garbage:<k>": a stream whose event k is not JSON (k=0: the first).
        """
        self.failures.extend(modes)

    def _failure(self, body: dict[str, Any]) -> str | None:
        """The next queued failure, else the one the request's ``mock_fail`` names for this backend
        (``{"p0": "huge:1000000"}``: how a client of a mock in another process asks for one)."""
        if self.failures:
            return self.failures.pop(0)
        asked = body.get("mock_fail")
        mode = asked.get(self.name) if isinstance(asked, dict) else None
        return mode if isinstance(mode, str) else None

    def routes(self) -> dict[str, dict[str, Handler]]:
        return {
            "/v1/completions": {"POST": self._completion},
            "/v1/chat/completions": {"POST": self._completion},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
        }

    async def _health(self, request: HttpRequest) -> HttpResponse:
        while self.unreachable:
            await asyncio.sleep(0.05)
        return HttpResponse(b"", content_type="text/plain")

    async def _models(self, request: HttpRequest) -> HttpResponse:
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completion(self, request: HttpRequest) -> HttpResponse | StreamResponse:
        body = json.loads(request.body)
        seen = SeenRequest(request.path, body, dict(request.headers))
        if self.record:
            self.seen.append(seen)
        failure = self._failure(body)
        try:
            while self.unreachable:
                await asyncio.sleep(0.05)
            return await self._answer(request, body, seen, failure)
        except asyncio.CancelledError:
            seen.cancelled = True
            raise
        except ConnectionResetError:
            seen.cancelled = True
            return HttpResponse(b"")

    async def _answer(
        self, request: HttpRequest, body: dict, seen: SeenRequest, failure: str | None
    ) -> HttpResponse | StreamResponse:
        if failure == "500":
            return json_response({"error": {"message": "injected", "type": "InternalServerError"}}, status=500)
        if failure == "400":
            return json_response(
                {"error": {"message": "bad prompt", "type": "BadRequestError", "param": "prompt", "code": 400}},
                status=400,
            )
        if failure == "hang":
            await asyncio.sleep(3600)
        if failure == "reset":
            request.conn.transport.abort()  # type: ignore[union-attr]
            return HttpResponse(b"")
        if failure and failure.split(":")[0] in ("429", "503"):
            code, _, wait = failure.partition(":")
            busy = json_response({"error": {"message": "busy", "type": "ServiceUnavailable"}}, status=int(code))
            busy.headers = {"Retry-After": wait} if wait else None
            return busy
        if failure and failure.startswith(("huge:", "huge-stall:")):
            mode, size = failure.split(":")
            return await _huge(request, int(size), bool(body.get("stream")), stall=mode == "huge-stall")
        if failure == "truncate" and not body.get("stream"):
            request.conn.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                b'{"choices": [{"text": "cut'
            )
            request.conn.close()
            return HttpResponse(b"")
        chat = request.path.endswith("chat/completions")
        n_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        prompt = body.get("prompt") if not chat else json.dumps(body.get("messages"))
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        rid = request.headers.get("x-request-id", "x")
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_tokens,
            "total_tokens": prompt_tokens + n_tokens,
        }
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
            out: dict[str, Any] = {
                "id": f"cmpl-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "model": self.model,
                "choices": [choice],
                "usage": usage,
                "served_by": self.name,
            }
            if asks_remote_decode(kvp) and self.kv_params:
                # a NixlConnector-style answer: the proxy passes any connector's params on verbatim
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_block_ids": [1, 2, 3],
                    "remote_request_id": rid,
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                }
            seen.finished = True
            return json_response(out)
        resp = StreamResponse(200, {"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        break_after = int(failure.split(":")[1]) if failure and failure.startswith("break:") else None
        garbage_at = int(failure.split(":")[1]) if failure and failure.startswith("garbage:") else None
        stall_after = int(failure.split(":")[1]) if failure and failure.startswith("stall:") else None
        if failure == "empty":
            return resp
        if failure == "truncate":
            await resp.write(b'data: {"choices": [{"te')
            request.conn.close()
            return resp
        for i in range(n_tokens):
            if i:
                await asyncio.sleep(self.itl)
            if i == stall_after:
                await asyncio.sleep(3600)
            if break_after is not None and i == break_after:
                # a dying server: cut the connection mid-stream
                request.conn.close()
                return resp
            if i == garbage_at:
                await resp.write(b"data: <html>not json</html>\n\n")
                continue
            delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            chunk = {
                "id": f"cmpl-{rid}",
                "model": self.model,
                "served_by": self.name,
                "choices": [{"index": 0, **delta, "finish_reason": None}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": f"cmpl-{rid}", "model": self.model, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        seen.finished = True
        return resp


_PIECE = b"x" * 65536


async def _huge(request: HttpRequest, size: int, stream: bool, stall: bool = False) -> StreamResponse:
    """A 200 answer of ``size`` bytes that never becomes valid: the same 64 KiB piece over and over, each
    written once the reader took the last (so this side never holds more than a piece or two); ``stall``:
    then silence instead of the answer's end."""
    resp = StreamResponse(200, {"Content-Type": "text/event-stream" if stream else "application/json"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"text": "' if stream else b'{"choices": [{"text": "')
    sent = 0
    while sent < size:
        await resp.write(_PIECE)
        sent += len(_PIECE)
        if not request.conn.write_paused:
            await asyncio.sleep(0)  # let the reader run: its pace, not ours
    if stall:
        await asyncio.sleep(3600)
    await resp.write_eof()
    return resp


async def start_backend(backend: MockBackend, host: str = "127.0.0.1", port: int = 0) -> tuple[HttpServer, str]:
    """Serve ``backend``; the caller stops it with ``cleanup()`` of the returned server."""
    server = HttpServer(backend.routes(), max_body=64 * 1024 * 1024)
    await server.start(host, port, backlog=4096)
    return server, f"http://{host}:{server.port}"


def main() -> None:
    """Run mock backends as a standalone process (for benchmarks against other routers)."""
    p = argparse.ArgumentParser(description="mock vLLM OpenAI server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
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
        await start_backend(b, host=a.host, port=a.port)
        while True:
            await asyncio.sleep(3600)

    asyncio.run(run())


if __name__ == "__main__":
    main()

"""OpenAI-style errors: one exception type, one JSON body shape.

Every failure the proxy reports to a client goes through :class:`ProxyError`, so
the body is always ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm_pd.errors import RouterError


@dataclass
class ProxyError(RouterError):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = field(default=None, compare=False)  # e.g. Allow, Retry-After

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_event(self) -> bytes:
        """The error as a final SSE event (used once bytes already reached the client)."""
        return b"data: " + self.json_bytes() + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str = "no_healthy_instance") -> ProxyError:
    return ProxyError(503, message, "service_unavailable", None, code)


def upstream_error(message: str, status: int = 502, code: str = "upstream_error") -> ProxyError:
    return ProxyError(status, message, "upstream_error", None, code)

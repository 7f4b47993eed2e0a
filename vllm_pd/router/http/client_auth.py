"""Client authentication with an API key, as ``vllm serve --api-key`` does it.

Every route under ``/v1`` needs ``Authorization: Bearer <key>``; ``/health``
and ``/metrics`` stay open (as in vLLM) and the admin API has its own token.
A missing or wrong key gets 401 with an OpenAI-style body. Keys are compared
as SHA-256 digests in constant time, so neither their length nor a prefix
leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac

from vllm_pd.errors import ConfigError
from vllm_pd.router.http.errors import ProxyError
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse
from vllm_pd.router.http.http_server import Handler

GUARDED_PREFIX = "/v1"


def check_api_key(key: str | None, name: str) -> None:
    """Raises ValueError naming ``name`` for a key no HTTP header can carry."""
    if key is not None and (not key or not key.isascii() or not key.isprintable() or " " in key):
        raise ConfigError(f"{name}: must be a non-empty string of printable ASCII without spaces")


def bearer(key: str) -> str:
    """The Authorization header value that carries ``key``."""
    return f"Bearer {key}"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ClientAuth:
    def __init__(self, api_key: str) -> None:
        self._digest = _digest(api_key)

    def check(self, request: HttpRequest) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(token.strip()), self._digest):
            raise ProxyError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def protect(self, routes: dict[str, dict[str, Handler]]) -> None:
        """Wrap every handler of the guarded routes (in place) so it runs only for an authenticated client."""
        for path, methods in routes.items():
            if path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/"):
                for method, handler in methods.items():
                    methods[method] = self._guard(handler)

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: HttpRequest) -> HttpResponse | StreamResponse:
            self.check(request)
            return await handler(request)

        return guarded

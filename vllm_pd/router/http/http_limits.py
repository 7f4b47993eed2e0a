"""What one client connection of the proxy's HTTP server may cost: head size, URL, time to send a request.

The server (http_server.py) checks these inline while httptools parses, so a
request within them costs nothing extra. A head over ``max_header_bytes`` or
with more than ``max_headers`` fields is answered 431, a URL over
``max_url_bytes`` 414; a client that takes longer than ``header_timeout`` to
send a head, or ``body_timeout`` to send the body after it, gets 408 and is
dropped (a slow client otherwise holds its connection and buffers until the
keep-alive sweep). With the body cap (413) and at most a few pipelined requests
read ahead, the memory of a connection is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_pd.router.http.errors import ProxyError

# uvicorn (h11) allows a 16 KiB head, aiohttp 8 KiB per field: room for long cookies or tokens
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_URL_BYTES = 8 * 1024
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds from connect (or a request's first byte) to its head
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds from the head to the end of the body

    def sweep_interval(self, keepalive_interval: float) -> float:
        """How often the server looks for connections past a deadline: often enough that none outlives
        its deadline by more than half of it."""
        return max(0.05, min(keepalive_interval, self.header_timeout / 2, self.body_timeout / 2))


def head_too_large(limit: int) -> ProxyError:
    return ProxyError(431, f"request head larger than {limit} bytes", code="headers_too_large")


def too_many_headers(limit: int) -> ProxyError:
    return ProxyError(431, f"more than {limit} header fields", code="headers_too_large")


def url_too_long(limit: int) -> ProxyError:
    return ProxyError(414, f"URL longer than {limit} bytes", code="url_too_long")


def read_timed_out(what: str, seconds: float) -> ProxyError:
    return ProxyError(408, f"the request's {what} did not arrive within {seconds} s", code="request_timeout")

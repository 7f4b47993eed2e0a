"""TCP transport: block bytes on the socket, zero-copy both ways.

Sends hand the registered region's memory to the kernel with ``sendmsg`` (no
concatenation); receives ``recv_into`` the destination blocks directly. One
persistent connection per peer, TCP_NODELAY, 8 MiB socket buffers. Endpoint:
``tcp://host:port``.
"""

from __future__ import annotations

import socket
from typing import Any

from vllm_pd.connector.transport.stream import StreamTransport
from vllm_pd.connector.transport.wire import BlockChannel, SocketChannel, configure_socket
from vllm_pd.errors import ConfigError


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError naming the endpoint."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if rest == endpoint or not sep or not host or not port.isdigit():
        raise ConfigError(f"bad tcp endpoint {endpoint!r} (expected tcp://host:port)")
    return host.strip("[]"), int(port)


class TcpTransport(StreamTransport):
    name = "tcp"
    scheme = "tcp"

    def _listen(self, host: str, port: int) -> tuple[socket.socket, str]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Set before listen so accepted sockets inherit large windows.
        configure_socket(sock)
        sock.bind((host, port))
        sock.listen(128)
        bound_port = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        return sock, f"tcp://{shown}:{bound_port}"

    def _dial_address(self, endpoint: str) -> tuple[int, Any]:
        host, port = parse_tcp_endpoint(endpoint)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return family, (host, port)

    def _new_channel(self) -> BlockChannel:
        return SocketChannel()

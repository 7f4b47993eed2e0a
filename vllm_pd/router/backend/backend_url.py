"""Where the admin API lets the proxy connect: instance URLs and KV endpoints checked before they are added.

An admin call names an address the proxy (health checks, legs) and prefill
(the KV push) will connect to, so a leaked admin token must not turn the proxy
into a way to reach arbitrary hosts. Refused always: link-local addresses (the
cloud metadata service at 169.254.169.254 among them), other clouds' metadata
addresses, unspecified, multicast and broadcast. With ``backend_networks``
set, every address a host name resolves to must lie in one of those networks.

A name is resolved when it is added; a DNS answer that changes later is not
re-checked (pin instances by IP, or keep ``backend_networks`` to networks the
operator controls).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

from vllm_pd.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_REFUSED: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "255.255.255.255/32",
        "100.100.100.200/32",  # Alibaba Cloud's metadata service
        "::/128",
        "fe80::/10",
        "ff00::/8",
        "fd00:ec2::254/128",  # AWS's metadata service over IPv6
    )
)


def parse_networks(values: Any, key: str) -> list[Network]:
    """CIDR strings to networks; ValueError naming ``key`` for anything else."""
    if not isinstance(values, list):
        raise ConfigError(f"{key}: expected a list of CIDR networks, got {values!r}")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(ipaddress.ip_network(v, strict=False))
        except (TypeError, ValueError):
            raise ConfigError(f"{key}[{i}]: {v!r} is not a network such as 10.0.0.0/8 or fd00::/8") from None
    return out


def _refusal(addr: Address, networks: list[Network]) -> str | None:
    """Why the proxy will not connect to ``addr`` (None: it may)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    for net in _REFUSED:
        if addr.version == net.version and addr in net:
            return f"{addr} is in {net}, where the proxy never connects (link-local, metadata, multicast)"
    if networks and not any(addr.version == n.version and addr in n for n in networks):
        return f"{addr} is outside backend_networks ({', '.join(map(str, networks))})"
    return None


class BackendAddressPolicy:
    """Checks the host of a URL the admin API is asked to add."""

    def __init__(self, networks: list[Network]) -> None:
        self._networks = networks

    async def check(self, url: str, key: str) -> None:
        """Raises ValueError naming ``key`` when ``url``'s host is, or resolves to, a refused address."""
        parts = urlsplit(url)
        host = parts.hostname
        if not host:
            raise ConfigError(f"{key}: {url!r} names no host")
        try:
            addrs = await _addresses(host, parts.port or 0)
        except ValueError as e:
            raise ConfigError(f"{key}: {url!r}: {e}") from None
        for addr in addrs:
            why = _refusal(addr, self._networks)
            if why is not None:
                raise ConfigError(f"{key}: {url!r}: {why}")


async def _addresses(host: str, port: int) -> set[Address]:
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot resolve {host!r}: {e}") from None
    # sockaddr[0] is the address text; an IPv6 one may carry a "%zone" suffix
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}

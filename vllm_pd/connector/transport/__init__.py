"""Transports: move KV blocks between registered memory regions of two processes.

``create_transport(name, **options)`` builds one by name:

* ``"tcp"`` - :class:`~vllm_pd.connector.transport.tcp.TcpTransport`, any two hosts.
* ``"shm"`` - :class:`~vllm_pd.connector.transport.shm.ShmTransport`, same host,
  bytes through POSIX shared memory.

Options (both): ``checksum`` ("crc32c" default, needs vllm_pd._C; "blake3", "crc32", "none"),
``connect_timeout`` (s), ``revoke_wait`` (s); shm also ``slot_nbytes``, ``slots``.

Place for the next transports (same interface, base.Transport; add a branch in
``create_transport`` and a module here):

* ``"cuda_ipc"`` - same-host GPU->GPU via cudaIpcGetMemHandle on the regions.
* ``"nixl"``     - RDMA/UCX via NIXL: regions registered with the NIXL agent,
  push = one-sided WRITE, fetch = READ, notify = NIXL notifications.
* ``"deepep"``   - DeepEP's low-latency RDMA buffers.
"""

from __future__ import annotations

from typing import Any

from vllm_pd.connector.exceptions import ConfigError
from vllm_pd.connector.transport.base import BlockBatch, BlockSink, MemoryRegion, Transport

TRANSPORT_NAMES = ("tcp", "shm")


def create_transport(name: str, **options: Any) -> Transport:
    """Build the transport called ``name``; ConfigError on an unknown name or option."""
    if name == "tcp":
        from vllm_pd.connector.transport.tcp import TcpTransport as cls
    elif name == "shm":
        from vllm_pd.connector.transport.shm import ShmTransport as cls  # type: ignore[assignment]
    else:
        raise ConfigError(f"transport: unknown name {name!r} (one of: {', '.join(TRANSPORT_NAMES)})")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"transport {name!r}: bad option: {e}") from None
    except ValueError as e:
        raise ConfigError(f"transport {name!r}: {e}") from None


__all__ = ["BlockBatch", "BlockSink", "MemoryRegion", "Transport", "create_transport"]

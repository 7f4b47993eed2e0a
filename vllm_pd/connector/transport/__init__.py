"""Transports: move KV blocks between registered memory regions of two processes.

``create_transport(name, **options)`` builds one by name:

* ``"tcp"`` - :class:`~vllm_pd.connector.transport.tcp.TcpTransport`, any two hosts.
* ``"shm"`` - :class:`~vllm_pd.connector.transport.shm.ShmTransport`, same host,
  bytes through POSIX shared memory.
* ``"nixl"`` - :class:`~vllm_pd.connector.transport.nixl.NixlTransport`, bytes by NIXL
  (UCX: cma on one host, RDMA or tcp between hosts) straight between the registered
  regions, host or GPU memory; a TCP control connection for requests and answers. Needs
  the optional ``nixl`` package (``pip install 'vllm-pd[nixl]'``).

Options (all): ``checksum`` ("crc32c" default, needs vllm_pd._C; "blake3", "crc32", "none"),
``connect_timeout`` (s), ``revoke_wait`` (s); shm also ``slot_nbytes``, ``slots``; nixl also
``target_progress`` ("auto", "always", "never").

Place for the next transports (same interface, base.Transport; add a branch in
``create_transport`` and a module here):

* ``"cuda_ipc"`` - same-host GPU->GPU via cudaIpcGetMemHandle on the regions.
* ``"deepep"``   - DeepEP's low-latency RDMA buffers.
"""

from __future__ import annotations

from typing import Any

from vllm_pd.connector.transport.base import BlockBatch, BlockSink, MemoryRegion, Transport
from vllm_pd.errors import ConfigError

TRANSPORT_NAMES = ("tcp", "shm", "nixl")


def create_transport(name: str, **options: Any) -> Transport:
    """Build the transport called ``name``; ConfigError on an unknown name or option."""
    if name == "tcp":
        from vllm_pd.connector.transport.tcp import TcpTransport as cls
    elif name == "shm":
        from vllm_pd.connector.transport.shm import ShmTransport as cls  # type: ignore[assignment]
    elif name == "nixl":
        # nixl itself is imported when regions are registered: a client that only notifies
        # (release.py in the proxy) needs no NIXL
        from vllm_pd.connector.transport.nixl import NixlTransport as cls  # type: ignore[assignment]
    else:
        raise ConfigError(f"transport: unknown name {name!r} (one of: {', '.join(TRANSPORT_NAMES)})")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"transport {name!r}: bad option: {e}") from None
    except ValueError as e:
        raise ConfigError(f"transport {name!r}: {e}") from None


__all__ = ["BlockBatch", "BlockSink", "MemoryRegion", "Transport", "create_transport"]

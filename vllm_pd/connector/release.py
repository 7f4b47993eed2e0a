"""Release a prefill instance's held KV from outside vLLM (the proxy).

When the decode leg will never run - the client went away between the legs,
or a retry re-runs prefill elsewhere - the proxy calls this with the
``kv_transfer_params`` prefill returned, so the blocks are freed now instead of
when the lease ends.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_pd.connector.control import ReleaseMessage
from vllm_pd.connector.transfer_params import RemotePrefill
from vllm_pd.connector.transport import Transport, create_transport
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

_lock = threading.Lock()
_clients: dict[str, Transport] = {}


def _transport(endpoint: str) -> Transport:
    """One client-only transport per process and endpoint scheme (connections are reused)."""
    scheme = endpoint.split("://", 1)[0]
    with _lock:
        if scheme not in _clients:
            _clients[scheme] = create_transport(scheme)
        return _clients[scheme]


def release_remote_kv(kv_transfer_params: dict[str, Any] | None, timeout: float = 2.0) -> bool:
    """Tell the prefill instance named in ``kv_transfer_params`` to free that request's KV.

    Blocking (call it from a thread in async code). True if prefill acknowledged;
    False if the params are not ours or prefill could not be reached (its lease
    frees the blocks anyway)."""
    remote = RemotePrefill.from_params(kv_transfer_params)
    if remote is None:
        return False
    try:
        fut = _transport(remote.endpoint).notify(remote.endpoint, ReleaseMessage(remote.transfer_id).encode(),
                                                 timeout=timeout)
        fut.result(timeout=timeout + 1.0)
        return True
    except Exception as e:  # noqa: BLE001 - the lease is the backstop
        logger.warning("could not release KV of %s at %s: %s", remote.transfer_id, remote.endpoint, e)
        return False

"""Release a prefill instance's held KV: from decode's workers, and from outside vLLM (the proxy).

When the decode leg will never run - the client went away between the legs,
or a retry re-runs prefill elsewhere - the proxy calls this with the
``kv_transfer_params`` prefill returned, so the blocks are freed now instead of
when the lease ends. Every TP rank of prefill holds its own shard of the KV, so
every rank is told.

Imports no torch (the proxy's process never loads it).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from vllm_pd.connector.device.kv_geometry import releasers
from vllm_pd.connector.transport import Transport, create_transport
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.control import ReleaseMessage
from vllm_pd.protocol.kv_shape import KVShape
from vllm_pd.protocol.transfer_params import RemotePrefill, TransferParamsError
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

_lock = threading.Lock()
_clients: dict[tuple[str, bytes | None, TlsSettings | None], Transport] = {}


def _transport(endpoint: str, secret: DeploymentSecret | None, tls: TlsSettings | None) -> Transport:
    """One client-only transport per process, endpoint scheme, secret and TLS (connections are reused)."""
    scheme = endpoint.split("://", 1)[0]
    key = (scheme, secret.value if secret is not None else None, tls if scheme == "tcp" else None)
    with _lock:
        if key not in _clients:
            # only control messages go out, no block bytes: no checksum, so no vllm_pd._C (and torch) loaded
            _clients[key] = create_transport(
                scheme, checksum="none", secret=secret, **({"tls": key[2]} if key[2] is not None else {})
            )
        return _clients[key]


# decode's releases are sent off the model's thread and retried: a release lost to one slow
# answer (a prefill rank busy computing) would hold that rank's blocks for the whole lease
RELEASE_ATTEMPTS = 4
RELEASE_TIMEOUT_S = 5.0
RELEASE_BACKOFF_S = 1.0


def send_release(
    transport: Transport, peer: str, transfer_id: str, attempt: int = 1, releaser: int = -1, of: int = 1
) -> None:
    """Tell ``peer`` (one prefill rank) to free ``transfer_id`` (``releaser`` of ``of`` decode
    ranks reading it, see ReleaseMessage); never blocks, retries with backoff.

    A release is idempotent (one the peer already applied, or one for a transfer it never held,
    changes nothing), so a retry after an unanswered attempt is safe."""

    def retry_or_give_up(fut: Future[bytes | None] | None, error: BaseException | None) -> None:
        error = error if fut is None else fut.exception()
        if error is None:
            return
        if attempt >= RELEASE_ATTEMPTS:
            logger.warning(
                "release of %s at %s failed %d times (%s): its lease frees it", transfer_id, peer, attempt, error
            )
            return
        timer = threading.Timer(
            RELEASE_BACKOFF_S * attempt, send_release, (transport, peer, transfer_id, attempt + 1, releaser, of)
        )
        timer.daemon = True
        timer.start()

    try:
        fut = transport.notify(peer, ReleaseMessage(transfer_id, releaser, of).encode(), timeout=RELEASE_TIMEOUT_S)
    except Exception as e:
        retry_or_give_up(None, e)
        return
    fut.add_done_callback(lambda f: retry_or_give_up(f, None))


def release_rank_share(transport: Transport, remote: RemotePrefill, rank: int, tp_size: int) -> None:
    """Decode's TP rank ``rank`` (of ``tp_size``) tells its share of prefill's ranks to free ``remote``'s
    KV (see :meth:`RemotePrefill.release_endpoints`); never blocks, each release retried."""
    for peer in remote.release_endpoints(rank, tp_size):
        send_release(transport, peer, remote.transfer_id)


def release_plan_share(
    transport: Transport, remote: RemotePrefill, remote_shape: KVShape, local_shape: KVShape, rank: int
) -> None:
    """Decode's TP rank ``rank`` tells the prefill ranks it is a releaser of (``kv_geometry.releasers``:
    those it read from, and its share of those nobody read) that it is done; each frees ``remote``'s
    KV once all of its releasers are. Never blocks, each release retried."""
    for source, ranks in releasers(remote_shape, local_shape).items():
        if rank in ranks:
            send_release(transport, remote.endpoint_for_rank(source), remote.transfer_id, releaser=rank, of=len(ranks))


class DecodeRelease:
    """The one route by which a decode TP rank tells prefill's ranks it is done with a transfer's KV:
    after a load (its job), and for KV it never read (announced pushes no request claimed, loads the
    scheduler dropped or refused). Never blocks; each release is retried (:func:`send_release`)."""

    def __init__(self, transport: Transport, rank: int, tp_size: int) -> None:
        self._transport, self._rank, self._tp_size = transport, rank, tp_size

    def done_reading(self, remote: RemotePrefill, local_shape: KVShape | None) -> None:
        """After a load. ``local_shape``: ours where a plan took shares of prefill's ranks (the prefill
        ranks we read from, and our share of those nobody read; each frees once every decode rank
        reading it is done); None (no plan: refused, or a side without a shape): as :meth:`never_read`."""
        if local_shape is not None and remote.shape is not None:
            release_plan_share(self._transport, remote, remote.shape, local_shape, self._rank)
        else:
            self.never_read(remote)

    def never_read(self, remote: RemotePrefill) -> None:
        """Nothing of ``remote`` was read here: our rank's share of prefill's ranks frees it (the
        shares of all decode ranks together cover every prefill rank)."""
        release_rank_share(self._transport, remote, self._rank, self._tp_size)


def release_remote_kv(
    kv_transfer_params: dict[str, Any] | None,
    timeout: float = 2.0,
    secret: DeploymentSecret | None = None,
    tls: TlsSettings | None = None,
) -> bool:
    """Tell every TP rank of the prefill instance named in ``kv_transfer_params`` to free that
    request's KV (``secret``, ``tls``: the deployment's, which the instances' KV endpoints require).

    Blocking (call it from a thread in async code); the ranks are told at once. True if every
    rank acknowledged; False if the params are not ours or a rank could not be reached (its
    lease frees the blocks anyway)."""
    try:
        remote = RemotePrefill.parse(kv_transfer_params)
    except TransferParamsError as e:  # another connector's answer, or a broken one: nothing of ours to free
        logger.warning("no KV released: %s", e)
        return False
    if remote is None:
        return False
    message = ReleaseMessage(remote.transfer_id).encode()
    sent: list[tuple[str, Future[bytes | None]]] = []
    ok = True
    for endpoint in remote.release_endpoints():
        try:
            sent.append((endpoint, _transport(endpoint, secret, tls).notify(endpoint, message, timeout=timeout)))
        except Exception as e:
            logger.warning("could not release KV of %s at %s: %s", remote.transfer_id, endpoint, e)
            ok = False
    for endpoint, fut in sent:
        try:
            fut.result(timeout=timeout + 1.0)
        except Exception as e:
            logger.warning("could not release KV of %s at %s: %s", remote.transfer_id, endpoint, e)
            ok = False
    return ok

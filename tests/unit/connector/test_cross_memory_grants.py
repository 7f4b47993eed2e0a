"""Who may read a worker's memory (cross_memory.py): never any process - under Yama scope 1 only
the one authenticated peer the worker granted, while its connection lasts.

The first test runs the real kernel check and needs Yama ptrace_scope 1 (Ubuntu's default); this
CI VM has no Yama, so it is skipped here, reported as such. The others pin the grant's rules with
the Yama calls replaced (the one thing that cannot run on a kernel without Yama)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os

import pytest

from vllm_pd.connector.transport.cross_memory import PeerMemory, ReaderGrants, local_info, yama_scope
from vllm_pd.errors import TransferCorrupted

UNPRIVILEGED = 65534  # nobody: no CAP_SYS_PTRACE, so Yama's rules apply to it


def _drop_privileges() -> None:
    if os.geteuid() == 0:
        os.setgid(UNPRIVILEGED)
        os.setuid(UNPRIVILEGED)
        # a change of credentials makes a process non-dumpable (unreadable even to a granted
        # peer); a worker started as that user is dumpable
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE


def _worker(reader_pid: int, grant: bool, conn) -> None:
    _drop_privileges()
    from vllm_pd.connector.transport.cross_memory import READER_GRANTS

    secret = ctypes.create_string_buffer(b"prompt token ids", 16)
    granted = READER_GRANTS.grant(reader_pid, authenticated=True) if grant else None
    conn.send((os.getpid(), ctypes.addressof(secret), granted))
    conn.recv()  # until the test is done


def _reader(conn) -> None:
    _drop_privileges()
    local_info()  # loads libc
    pid, address = conn.recv()
    try:
        conn.send(PeerMemory(pid).read(address, 16))
    except TransferCorrupted as e:
        conn.send(str(e))


@pytest.mark.skipif(
    yama_scope() != 1,
    reason=f"needs Yama ptrace_scope 1 (this kernel: {'no Yama' if yama_scope() is None else f'scope {yama_scope()}'})",
)
@pytest.mark.parametrize("grant", [True, False], ids=["granted", "negative-control"])
def test_only_the_granted_peer_reads_a_worker(grant: bool) -> None:
    ctx = mp.get_context("fork")
    peer_end, peer_conn = ctx.Pipe()
    other_end, other_conn = ctx.Pipe()
    worker_end, worker_conn = ctx.Pipe()
    peer = ctx.Process(target=_reader, args=(peer_conn,))
    other = ctx.Process(target=_reader, args=(other_conn,))  # same user, not the peer, not an ancestor
    peer.start()
    other.start()
    worker = ctx.Process(target=_worker, args=(peer.pid, grant, worker_conn))
    worker.start()
    try:
        pid, address, granted = worker_end.recv()
        assert granted == ("granted" if grant else None)
        peer_end.send((pid, address))
        other_end.send((pid, address))
        got_peer, got_other = peer_end.recv(), other_end.recv()
        assert got_other != b"prompt token ids"  # an unrelated process of the same user: refused
        assert (got_peer == b"prompt token ids") is grant
    finally:
        worker_end.send(None)
        for p in (peer, other, worker):
            p.join(10)
            if p.is_alive():
                p.kill()


class _Yama:
    """Stands in for the kernel's Yama (absent here): its scope and the one ptracer it keeps."""

    def __init__(self, scope: int | None) -> None:
        self.scope, self.ptracer, self.calls = scope, 0, []

    def set_ptracer(self, pid: int) -> bool:
        self.calls.append(pid)
        self.ptracer = pid
        return True


def test_one_authenticated_reader_at_a_time_for_as_long_as_its_connections() -> None:
    yama = _Yama(1)
    grants = ReaderGrants(lambda: yama.scope, yama.set_ptracer)
    assert grants.grant(101, authenticated=False) is None  # never a peer without the secret
    assert yama.calls == []
    assert grants.grant(101, authenticated=True) == "granted" and yama.ptracer == 101
    assert grants.grant(101, authenticated=True) == "granted"  # its second connection
    assert grants.grant(202, authenticated=True) is None  # a second reader keeps the rings
    grants.revoke(202)  # not ours to revoke
    grants.revoke(101)
    assert yama.ptracer == 101  # one connection of 101 is still open
    grants.revoke(101)
    assert yama.ptracer == 0 and grants.reader is None  # withdrawn with the last one
    assert grants.grant(202, authenticated=True) == "granted" and yama.ptracer == 202
    assert -1 not in yama.calls  # never PR_SET_PTRACER_ANY


@pytest.mark.parametrize(("scope", "want"), [(None, "open"), (0, "open"), (2, None), (3, None)])
def test_other_scopes_grant_nothing(scope: int | None, want: str | None) -> None:
    yama = _Yama(scope)
    assert ReaderGrants(lambda: yama.scope, yama.set_ptracer).grant(101, authenticated=True) == want
    assert yama.calls == []  # "open": the kernel's own rules let the user's processes read


def test_a_refused_prctl_grants_nothing() -> None:
    grants = ReaderGrants(lambda: 1, lambda pid: False)
    assert grants.grant(101, authenticated=True) is None and grants.reader is None

"""The launcher's port picking and its clean-up after a killed server (servers themselves are
exercised by every e2e test)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing import shared_memory

from vllm_pd import vllm_server
from vllm_pd.shm_leftovers import group_members, remove_orphans, used_shm
from vllm_pd.vllm_server import free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    low = vllm_server._ephemeral_low()
    if low - vllm_server._LOW_PORT >= 1000:
        # where bind(0) hands out ports to everyone else (vLLM's own internal ports too)
        assert all(vllm_server._LOW_PORT <= p < low for p in ports)
    for p in ports[:8]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_picked(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken, taken])
        real = vllm_server.random.randrange
        # the random pick lands on the busy port first: it must be skipped, not returned
        monkeypatch.setattr(vllm_server.random, "randrange", lambda a, b: next(picks, None) or real(a, b))
        monkeypatch.setattr(vllm_server, "_ephemeral_low", lambda: 60000)
        assert free_port() != taken


_HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
own = shared_memory.SharedMemory(create=True, size=1 << 20)
peer = shared_memory.SharedMemory(name=sys.argv[1])  # also used by a live process (the test)
for seg in (own, peer):  # as vLLM's queues: the killed process never unlinks them
    resource_tracker.unregister(seg._name, "shared_memory")
print(own.name, flush=True)
time.sleep(60)
"""


def test_a_killed_groups_own_shm_files_are_removed_and_shared_ones_kept() -> None:
    shared = shared_memory.SharedMemory(create=True, size=1 << 20)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, shared.name], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    try:
        own = "/dev/shm/" + proc.stdout.readline().strip().lstrip("/")
        used = used_shm(group_members(proc.pid))
        assert {own, "/dev/shm/" + shared.name.lstrip("/")} <= used
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert os.path.exists(own)  # what SIGKILL leaves behind
        assert remove_orphans(used) == [own]
        assert not os.path.exists(own)
        assert os.path.exists("/dev/shm/" + shared.name.lstrip("/"))  # the live process still uses it
    finally:
        proc.kill()
        shared.close()
        shared.unlink()

"""The master as a real process on a free port; killing it must not break nodes."""

import subprocess
import sys
import time

import pytest

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.keys import KeySalt, chain_keys
from vllm_pd.connector.store.master import MasterIndex, Publish
from vllm_pd.connector.store.master_client import MasterClient
from vllm_pd.connector.store.plans import SaveResult, StoreReport
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.vllm_server import free_port

SALT = KeySalt("m", "bfloat16", "cpu", 4, 2)
KEYS = chain_keys(list(range(40)), SALT)


def test_master_index_longest_prefix_across_nodes_and_expiry():
    idx = MasterIndex(node_ttl_s=10)
    idx.publish(Publish("a", "tcp://a", [(k, None) for k in KEYS[:3]]), now=0)
    idx.publish(Publish("b", "tcp://b", [(k, None) for k in KEYS[:6]]), now=0)
    assert idx.lookup(KEYS, None, now=1) == ("b", "tcp://b", 6)
    assert idx.lookup(KEYS, "b", now=1) == ("a", "tcp://a", 3)
    idx.publish(Publish("b", "tcp://b", [], KEYS[4:6]), now=2)
    assert idx.lookup(KEYS, None, now=3)[2] == 4
    idx.publish(Publish("a", "tcp://a", []), now=8)  # a heartbeats, b stays silent
    assert idx.lookup(KEYS, None, now=15) == ("a", "tcp://a", 3)
    assert idx.num_keys == 3


def eventually(fn, timeout=20.0):
    """fn() until truthy: a master process may take seconds to start on a loaded 2-core box."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = fn()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def wait_ready(address):
    probe = MasterClient(address, "probe", "", lambda: [], timeout_s=1.0, retry_after_s=0.0)
    eventually(lambda: probe.flush(force=True))
    probe.close()


@pytest.fixture
def master():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c",
                             f"from vllm_pd.connector.store.master import serve; serve('tcp://127.0.0.1:{port}')"])
    yield proc, f"tcp://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_publish_lookup_then_master_killed_falls_back(master):
    proc, address = master
    wait_ready(address)
    chain = [(k, KEYS[i - 1] if i else None) for i, k in enumerate(KEYS[:5])]
    node_a = MasterClient(address, "a", "tcp://a:1", lambda: chain[:2], timeout_s=2.0)
    node_b = MasterClient(address, "b", "tcp://b:1", lambda: [], timeout_s=2.0)
    assert node_a.flush()  # first contact: a snapshot of a's index
    for key, parent in chain[2:]:
        node_a.inserted(key, parent)
    assert node_a.flush()  # then batches of changes
    hit = node_b.lookup(KEYS)
    assert hit is not None and (hit.node, hit.endpoint, hit.blocks) == ("a", "tcp://a:1", 5)
    assert node_a.lookup(KEYS) is None  # a does not get its own blocks back
    proc.kill()
    proc.wait()
    node_b.timeout_s = 0.1
    t0 = time.monotonic()
    assert node_b.lookup(KEYS) is None  # falls back, bounded by the timeout
    assert time.monotonic() - t0 < 1.0 and not node_b.available
    assert node_b.lookup(KEYS) is None  # and does not retry until the back-off passes
    node_a.close()
    node_b.close()


def test_scheduler_publishes_commits_and_resyncs_after_master_restart(tmp_path):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", f"from vllm_pd.connector.store.master import serve; serve('{address}')"]
    proc = subprocess.Popen(cmd)
    try:
        wait_ready(address)
        cfg = StoreConfig(cpu_bytes=64 * 1024, master=address, master_timeout_s=2.0, node_id="p0")
        sched = StoreScheduler(cfg, SALT, slot_nbytes=1024, endpoint="tcp://p0:1")
        reader = MasterClient(address, "d0", "", lambda: [], timeout_s=2.0)
        toks = list(range(12))
        op = sched.plan_save("r", toks, [0, 1, 2])
        sched.on_worker_report(StoreReport(saves=[SaveResult("r", op.keys, [])]))
        sched.build_plan()  # flushes to the master
        assert reader.lookup(chain_keys(toks, SALT)).blocks == 3
        proc.kill()
        proc.wait()
        proc = subprocess.Popen(cmd)  # a fresh master knows nothing
        wait_ready(address)
        assert reader.lookup(chain_keys(toks, SALT)) is None
        sched.master.retry_after_s = sched.master.heartbeat_s = reader.retry_after_s = 0.0
        sched.build_plan()  # heartbeat: the node learns it is unknown and republishes a snapshot
        hit = eventually(lambda: sched.build_plan() is not None and reader.lookup(chain_keys(toks, SALT)))
        assert hit.blocks == 3
        reader.close()
    finally:
        proc.kill()
        proc.wait()

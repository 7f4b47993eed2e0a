"""The master as a real process on a free port; killing it must not break nodes."""

import subprocess
import sys
import time

import msgspec
import pytest

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.master import MasterIndex
from vllm_pd.connector.store.master_client import MasterClient, MasterLink
from vllm_pd.connector.store.plans import SaveResult, StoreReport
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.protocol.block_keys import KeySalt, chain_keys
from vllm_pd.protocol.store_index import Holders, Lookup, NodeInfo, Nodes, Publish, Reply, Request
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
    link = MasterLink(address, timeout_s=1.0, retry_after_s=0.0)
    eventually(lambda: link.call(Nodes()) is not None)  # read-only: no node of its own in the index
    link.close()


@pytest.fixture
def master():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from vllm_pd.connector.store.master import serve; serve('tcp://127.0.0.1:{port}')"]
    )
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
        assert sched.master is not None
        sched.master.stop_heartbeat()  # this test is about the engine's own path (the idle one: below)
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


def _serve(address: str, node_ttl_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from vllm_pd.connector.store.master import serve; serve('{address}', node_ttl_s={node_ttl_s})",
        ]
    )


def test_an_idle_node_keeps_its_keys_on_the_master_and_resyncs_a_restarted_one():
    """An engine with no requests makes no steps and so never flushes: without the heartbeat thread
    the master forgets its keys after node_ttl_s (the control node below), and a chat's next turn
    minutes later would be routed and fetched as if nothing were stored."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = _serve(address, node_ttl_s=1.0)
    chain = [(k, KEYS[i - 1] if i else None) for i, k in enumerate(KEYS[:4])]
    idle = MasterClient(address, "idle", "tcp://idle:1", lambda: chain, timeout_s=2.0, heartbeat_s=0.3)
    control = MasterClient(address, "control", "tcp://control:1", lambda: chain[:2], timeout_s=2.0)
    reader = MasterClient(address, "reader", "", lambda: [], timeout_s=2.0, retry_after_s=0.0)
    try:
        wait_ready(address)
        assert idle.flush() and control.flush()  # each engine's last step, then nothing
        idle.start_heartbeat()
        time.sleep(2.5)  # > node_ttl_s: the master expires silent nodes on lookups
        hit = reader.lookup(KEYS)
        assert hit is not None and (hit.node, hit.blocks) == ("idle", 4)
        assert reader.call(Holders(KEYS[:4])).held == {"idle": 4}  # the control node expired
        proc.kill()
        proc.wait()
        proc = _serve(address, node_ttl_s=1.0)  # a fresh master knows nothing; the idle node tells it all
        hit = eventually(lambda: reader.lookup(KEYS))
        assert (hit.node, hit.blocks) == ("idle", 4)
    finally:
        for client in (idle, control, reader):
            client.close()
        proc.kill()
        proc.wait()


def test_a_heartbeat_never_waits_for_the_engine_publishing():
    address = f"tcp://127.0.0.1:{free_port()}"
    node = MasterClient(address, "n", "", lambda: [], timeout_s=0.1)
    link = MasterLink(address, timeout_s=0.1)
    with node._sending:  # the engine's flush holds it
        t0 = time.monotonic()
        assert node.beat(link) is False
        assert time.monotonic() - t0 < 0.05
    node.close()
    link.close()


# ---- protocol version 2: what the proxy's kv_aware routing asks ------------------------------------

SALT_B = KeySalt("m", "bfloat16", "cpu", 8, 2)  # another block size: other keys for the same tokens


def test_master_index_lists_nodes_with_salt_and_instance_url_from_snapshots():
    idx = MasterIndex(node_ttl_s=10)
    idx.publish(Publish("a", "tcp://a", [], snapshot=True, salt=SALT, instance_url="http://a:8000"), now=0)
    idx.publish(Publish("b", "tcp://b", []), now=0)  # a version 1 node: no snapshot fields
    idx.publish(Publish("a", "tcp://a", [(KEYS[0], None)]), now=1)  # a batch keeps what the snapshot said
    assert idx.nodes(now=2) == [NodeInfo("a", "tcp://a", "http://a:8000", SALT), NodeInfo("b", "tcp://b")]
    idx.publish(Publish("a", "tcp://a", []), now=9)
    assert [n.node for n in idx.nodes(now=15)] == ["a"]  # b went silent: expired


def test_master_index_holders_counts_each_nodes_leading_blocks():
    idx = MasterIndex(node_ttl_s=10)
    idx.publish(Publish("a", "tcp://a", [(k, None) for k in KEYS[:3]]), now=0)
    idx.publish(Publish("b", "tcp://b", [(k, None) for k in KEYS[:6]]), now=0)
    idx.publish(Publish("c", "tcp://c", [(k, None) for k in KEYS[1:6]]), now=0)  # no first block: holds none
    assert idx.holders(KEYS, now=1) == {"a": 3, "b": 6}
    assert idx.holders(KEYS[:2], now=1) == {"a": 2, "b": 2}
    assert idx.holders(chain_keys(list(range(40)), SALT_B), now=1) == {}  # another salt's keys: nobody
    assert idx.holders([], now=1) == {}
    idx.publish(Publish("b", "tcp://b", [], [KEYS[2]]), now=2)  # b evicts its third block
    assert idx.holders(KEYS, now=3) == {"a": 3, "b": 2}


def test_master_answers_each_request_kind():
    idx = MasterIndex()
    assert idx.answer(Request(1, Publish("a", "tcp://a", [(KEYS[0], None)], snapshot=True, salt=SALT)), 0).known
    assert idx.answer(Request(2, Nodes()), 0).nodes == [NodeInfo("a", "tcp://a", "", SALT)]
    assert idx.answer(Request(3, Holders(KEYS)), 0).held == {"a": 1}
    reply = idx.answer(Request(4, Lookup(KEYS)), 0)
    assert (reply.seq, reply.node, reply.blocks) == (4, "a", 1)


def test_protocol_is_backwards_tolerant_with_version_1():
    """A version 1 node's publish decodes on a version 2 master, a version 2 publish on a version 1
    master (the new fields ignored), and a version 1 node reads a version 2 reply."""

    class PublishV1(msgspec.Struct, tag="publish"):
        node: str
        endpoint: str
        inserts: list[tuple[bytes, bytes | None]] = []
        removes: list[bytes] = []
        snapshot: bool = False

    class LookupV1(msgspec.Struct, tag="lookup"):
        keys: list[bytes]
        exclude: str | None = None

    class RequestV1(msgspec.Struct):
        seq: int
        body: PublishV1 | LookupV1

    class ReplyV1(msgspec.Struct):
        seq: int
        ok: bool = True
        node: str | None = None
        endpoint: str | None = None
        blocks: int = 0
        known: bool = True

    v1 = msgspec.msgpack.encode(RequestV1(1, PublishV1("a", "tcp://a", [(KEYS[0], None)], snapshot=True)))
    assert msgspec.msgpack.decode(v1, type=Request).body == Publish("a", "tcp://a", [(KEYS[0], None)], snapshot=True)
    v2 = msgspec.msgpack.encode(
        Request(1, Publish("a", "tcp://a", [], snapshot=True, salt=SALT, instance_url="http://a:1"))
    )
    assert msgspec.msgpack.decode(v2, type=RequestV1).body == PublishV1("a", "tcp://a", snapshot=True)
    reply = Reply(7, node="a", endpoint="tcp://a", blocks=2, nodes=[NodeInfo("a", "tcp://a", "", SALT)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=ReplyV1) == ReplyV1(7, True, "a", "tcp://a", 2)
    with pytest.raises(msgspec.DecodeError):  # a version 1 master drops the new requests (the asker times out)
        msgspec.msgpack.decode(msgspec.msgpack.encode(Request(2, Nodes())), type=RequestV1)


def test_node_publishes_salt_and_instance_url_and_the_proxy_reads_them(master):
    proc, address = master
    wait_ready(address)
    cfg = StoreConfig.from_dict(
        {
            "cpu_bytes": 64 * 1024,
            "master": address,
            "master_timeout_s": 2.0,
            "node_id": "p0",
            "instance_url": "http://10.0.0.5:8000/",
        }
    )
    sched = StoreScheduler(cfg, SALT, slot_nbytes=1024, endpoint="tcp://p0:1")
    link = MasterLink(address, timeout_s=2.0)
    try:
        # announced when built, before any request (an idle instance is still a fetch target)
        assert NodeInfo("p0", "tcp://p0:1", "http://10.0.0.5:8000", SALT) in link.call(Nodes()).nodes
        op = sched.plan_save("r", list(range(12)), [0, 1, 2])
        sched.on_worker_report(StoreReport(saves=[SaveResult("r", op.keys, [])]))
        reply = link.call(Nodes())
        assert reply is not None
        assert NodeInfo("p0", "tcp://p0:1", "http://10.0.0.5:8000", SALT) in reply.nodes
        assert link.call(Holders(chain_keys(list(range(12)), SALT))).held == {"p0": 3}
    finally:
        link.close()
        sched.master.close()


@pytest.mark.parametrize("value", ["10.0.0.5:8000", "tcp://h:1", "http://h:1/v1", 8000, ""])
def test_instance_url_is_validated_naming_the_key(value):
    from vllm_pd.errors import ConfigError

    with pytest.raises(ConfigError, match="store.instance_url"):
        StoreConfig.from_dict({"instance_url": value})


def test_local_cluster_sets_each_stores_instance_url():
    from vllm_pd.router.cli.local_cluster import _with_instance_url

    extra = {"transport": "tcp", "store": {"cpu_bytes": "1g"}}
    assert _with_instance_url(extra, "127.0.0.1", 8123)["store"] == {
        "cpu_bytes": "1g",
        "instance_url": "http://127.0.0.1:8123",
    }
    assert extra["store"] == {"cpu_bytes": "1g"}  # the cluster's shared dict is not changed
    mine = {"store": {"instance_url": "http://lb:1"}}
    assert _with_instance_url(mine, "h", 1) is mine
    assert _with_instance_url({"transport": "tcp"}, "h", 1) == {"transport": "tcp"}  # no store: nothing to say

"""A node-to-node fetch lands layer by layer: the loader copies layer i of the
fetched blocks into vLLM's cache as soon as layer i arrived, so the forward's
wait for layer 0 does not wait for the whole fetch; a layer that fails after
earlier layers were copied makes those blocks load errors (recomputed), never
used KV. Two store nodes over the real TCP transport and a real master; the
only stand-in is a gate on the asker's per-layer completions (the wire
delivers layers in order in microseconds, too fast to observe the overlap)."""

import threading
from concurrent.futures import Future

import torch

from tests.support.store_nodes import LAYERS, TOKS, Node, master, nodes, save_on  # noqa: F401 - fixtures
from vllm_pd.errors import TransportError


def gate_later_layers(node: Node, fail: bool = False) -> threading.Event:
    """Hold back (or fail) the completion of every layer but 0 of the node's fetches until the event."""
    exchange = node.worker.exchange
    fetch = exchange.transport.fetch
    gate = threading.Event()

    def gated(peer, transfer_id, region, remote, local, timeout):
        done = fetch(peer, transfer_id, region, remote, local, timeout)
        if remote[0] % LAYERS == 0:
            return done
        out: Future[None] = Future()

        def later() -> None:
            gate.wait(10)
            try:
                done.result()
                if fail:
                    raise TransportError("injected: this layer never arrived")
                out.set_result(None)
            except Exception as exc:
                out.set_exception(exc)

        threading.Thread(target=later, daemon=True).start()
        return out

    exchange.transport.fetch = gated
    return gate


def start_fetch_load(b: Node, local: int = 0) -> None:
    _, remote = b.sched.match_with_remote(TOKS[:-1])
    op, missing = b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    assert op is not None and not missing and op.from_peer == [False] * local + [True] * (3 - local)
    b.worker.execute(b.sched.build_plan())


def finish_step(b: Node) -> None:
    for layer in range(LAYERS):
        b.worker.wait_layer(layer)
    b.sched.on_worker_report(b.worker.report())


def test_layer_0_is_copied_before_the_later_layers_arrive(nodes):  # noqa: F811
    a, b, _ = nodes
    save_on(a)
    gate = gate_later_layers(b)
    before = [kv.clone() for kv in b.kv]
    start_fetch_load(b)
    b.worker.wait_layer(0)  # returns although layer 1 has not "arrived"
    assert torch.equal(b.kv[0][[20, 21, 22]], a.kv[0][[3, 7, 9]])
    assert torch.equal(b.kv[1], before[1])  # layer 1 not touched yet
    gate.set()
    finish_step(b)
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][[20, 21, 22]], a.kv[layer][[3, 7, 9]])
    assert b.worker.take_load_errors() == set()
    assert b.sched.match(TOKS) == 12


def test_a_later_layer_failing_makes_the_fetched_blocks_load_errors(nodes):  # noqa: F811
    a, b, _ = nodes
    save_on(a)
    b.sched.plan_save("r-b0", TOKS[:4], [5])  # b holds the first block itself
    b.step()
    gate = gate_later_layers(b, fail=True)
    start_fetch_load(b, local=1)
    b.worker.wait_layer(0)
    assert torch.equal(b.kv[0][[21, 22]], a.kv[0][[7, 9]])  # layer 0 of the peer blocks was copied ...
    gate.set()
    finish_step(b)
    assert b.worker.take_load_errors() == {21, 22}  # ... but they count as failed: vLLM recomputes them
    assert torch.equal(b.kv[1][20], b.kv[1][5])  # the local block loaded whole
    assert b.sched.match(TOKS) == 4  # nothing of the failed fetch committed
    assert b.sched.slots.free_count == b.sched.slots.num_slots - 1  # its reserved slots given back

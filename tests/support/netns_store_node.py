"""One KV store node on its own host, run by tests/integration/test_netns_store.py (``ip netns exec``).

``serve NAME MASTER HOST SEED``: save the blocks of test_store_peer.TOKS, publish them to the
master, print ``{"endpoint", "digest"}`` and serve them to other nodes until stdin closes.
``load NAME MASTER HOST SEED``: ask for the same tokens - found through the master on whichever
node holds them - fetch them, and print ``{"hit", "node", "digest", "errors", "seconds"}``.
A digest is the sha256 of the blocks' bytes, layer by layer, so the two ends compare them.
The master and the other node are reached with the deployment secret in VLLM_PD_SECRET.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from tests.support.store_nodes import LAYERS, TOKS, Node, save_on
from vllm_pd.connector.deployment_secret import load_secret

SAVED_IDS = [3, 7, 9]  # where the serving node's blocks sit (save_on's default)
LOADED_IDS = [20, 21, 22]  # where the loading node lands them


def digest(node: Node, block_ids: list[int]) -> str:
    h = hashlib.sha256()
    for layer in range(LAYERS):
        h.update(node.kv[layer][block_ids].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(role: str, name: str, master: str, host: str, seed: str) -> None:
    node = Node(name, master, int(seed), host=host, secret=load_secret(None))
    try:
        if role == "serve":
            save_on(node, SAVED_IDS)
            print(
                json.dumps({"endpoint": node.worker.exchange.endpoint, "digest": digest(node, SAVED_IDS)}), flush=True
            )
            sys.stdin.read()
            return
        t0 = time.monotonic()
        hit, remote = node.sched.match_with_remote(TOKS[:-1])
        out: dict = {"hit": hit, "node": remote.node if remote else None, "errors": [], "digest": None}
        if remote is not None:
            node.sched.plan_load("r-load", TOKS[:-1], 0, hit, LOADED_IDS, remote=remote)
            node.step()
            out["errors"] = sorted(node.worker.take_load_errors())
            out["digest"] = digest(node, LOADED_IDS)
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    finally:
        node.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

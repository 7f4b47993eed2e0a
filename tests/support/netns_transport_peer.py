"""One end of a KV transport on its own host, run by tests/integration/test_netns_transport.py (``ip netns exec``).

``serve NAME HOST``: KV regions with seeded contents behind transport NAME on HOST, every block
granted for fetching as transfer "granted"; prints the endpoint, serves until stdin closes.
``client NAME HOST PEER``: its own (zeroed) regions on HOST; fetches every layer from PEER, checks
the bytes against the same seeded contents, then pushes layer 0 back (transfer "back").
Both authenticate with the deployment secret in VLLM_PD_SECRET, where it is set.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.support.transport_harness import RecordingSink, make_regions
from vllm_pd.connector.deployment_secret import load_secret
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch

LAYERS, BLOCKS = 4, 16


def main(role: str, name: str, host: str, peer: str = "") -> None:
    seeded = make_regions(LAYERS, BLOCKS, seed=1)
    regions = seeded if role == "serve" else make_regions(LAYERS, BLOCKS, seed=None)
    transport = create_transport(name, secret=load_secret(None))
    transport.register_regions(regions)
    sink = RecordingSink(regions)
    endpoint = transport.start(sink, host, 0)
    try:
        if role == "serve":
            transport.allow_fetch("granted", list(range(BLOCKS)))
            print(json.dumps({"endpoint": endpoint}), flush=True)
            sys.stdin.read()
            return
        ids = list(range(BLOCKS))
        for layer in range(LAYERS):
            transport.fetch(peer, "granted", layer, ids, ids, timeout=30).result(timeout=35)
        fetched = all(torch.equal(regions[i].tensor, seeded[i].tensor) for i in range(LAYERS))
        transport.push(peer, BlockBatch("back", 0, tuple(ids), regions[0].block_nbytes), ids, timeout=30).result(
            timeout=35
        )
        print(json.dumps({"endpoint": endpoint, "fetched_exact": fetched, "pushed": True}), flush=True)
    finally:
        transport.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

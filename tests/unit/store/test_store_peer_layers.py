"""A node-to-node fetch lands layer by layer: the pool's region serves single layers of a slot. (Two store
nodes through a real master, layer 0 copied before the later layers arrive:
tests/integration/test_store_peer_layers.py.)"""

import pytest
import torch

from tests.unit.store.test_store_peer import SCOPE


@pytest.mark.parametrize("layers", [1, 4])
def test_the_pool_region_serves_single_layers_of_a_slot(layers):
    from vllm_pd.connector.store.cpu_pool import CpuBlockPool
    from vllm_pd.connector.store.pool_exchange import PoolExchange, SlotDirectory
    from vllm_pd.protocol.block_keys import KeySalt, chain_keys

    keys = chain_keys(list(range(12)), KeySalt("m", "bf16", "cpu", 4, layers))
    pools = [CpuBlockPool(4, layers, 32) for _ in range(2)]
    pools[0].data.copy_(torch.arange(pools[0].data.numel(), dtype=torch.int64).view(pools[0].data.shape) % 251)
    a, b = (PoolExchange(p, SlotDirectory(), timeout_s=1.0) for p in pools)
    try:
        for ex in (a, b):
            ex.start("127.0.0.1", "127.0.0.1")
        for i, key in enumerate(keys):
            a.directory.put(key, 3 - i, a.pool.checksum(3 - i), SCOPE)
        fetch = b.start_fetch(a.endpoint, keys, [0, 1, 2], SCOPE)
        assert fetch.granted == 3
        for layer in range(layers):
            assert fetch.layer_landed(layer)
            assert torch.equal(b.pool.data[[0, 1, 2], layer], a.pool.data[[3, 2, 1], layer])
        assert len(fetch.finish()) == 3 and fetch.finish() == fetch.finish()
    finally:
        a.close()
        b.close()

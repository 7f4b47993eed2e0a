import torch

from vllm_pd.connector.store.cpu_pool import CpuBlockPool, SlotAllocator, checksum
from vllm_pd.connector.store.disk_tier import HEADER_BYTES, DiskTier
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, RequestExtraKeys, chain_keys

SALT = KeySalt("m", "bfloat16", "cpu", 4, 2)
KEYS = chain_keys(list(range(40)), SALT)
SCOPE = NO_EXTRA_KEYS.scope(SALT)


def test_slot_allocator_all_or_nothing():
    a = SlotAllocator(3)
    s = a.alloc(2)
    assert a.alloc(2) is None and a.free_count == 1
    a.free(s)
    assert a.free_count == 3


def test_pool_layer_copies_round_trip():
    pool = CpuBlockPool(4, 2, 2 * 4 * 8 * 2)
    kv = [torch.randn(8, 2, 4, 8).to(torch.bfloat16) for _ in range(2)]
    for layer in range(2):
        pool.save_layer(layer, [3, 0], kv[layer].view(torch.uint8), [5, 6])
    out = [torch.zeros_like(t) for t in kv]
    for layer in range(2):
        pool.load_layer(layer, [0, 3], out[layer].view(torch.uint8), [1, 2])
    assert torch.equal(out[0][1], kv[0][6]) and torch.equal(out[1][2], kv[1][5])


def test_disk_capacity_bound_holds(tmp_path):
    payload = memoryview(bytes(range(256)) * 4)
    size = HEADER_BYTES + len(payload)
    disk = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=3 * size)
    for i, key in enumerate(KEYS[:6]):
        assert disk.write(key, KEYS[i - 1] if i else None, payload, SCOPE).result()
        assert disk.used_bytes <= 3 * size
    files = list(tmp_path.rglob("*"))
    assert sum(p.is_file() for p in files) == 3
    committed, evicted = disk.drain()
    assert len(committed) == 6 and evicted == KEYS[:3]
    disk.close()


def test_disk_restart_rebuilds_and_drops_bad_files(tmp_path):
    payload = memoryview(b"x" * 1000)
    disk = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    for i, key in enumerate(KEYS[:3]):
        disk.write(key, KEYS[i - 1] if i else None, payload, SCOPE).result()
    disk.close()
    (disk.dir / "zz").mkdir()
    (disk.dir / "zz" / "garbage").write_bytes(b"not a block")
    (disk.dir / "zz" / "half.tmp").write_bytes(b"crashed mid-write")
    truncated = disk.dir / KEYS[2].hex()[:2] / KEYS[2].hex()
    truncated.write_bytes(truncated.read_bytes()[:-10])
    again = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    committed, _ = again.drain()
    assert committed == [(KEYS[0], None, SCOPE), (KEYS[1], KEYS[0], SCOPE)]
    assert not (disk.dir / "zz" / "garbage").exists() and not (disk.dir / "zz" / "half.tmp").exists()
    dst = bytearray(1000)
    assert again.read_into(KEYS[1], memoryview(dst)).result() == checksum(b"x" * 1000)  # verified: its sum
    assert bytes(dst) == b"x" * 1000
    # another model's salt never sees these files
    other = DiskTier(tmp_path, KeySalt("other", "bfloat16", "cpu", 4, 2).digest(), 0, capacity_bytes=1 << 20)
    assert other.drain() == ([], [])
    again.close()
    other.close()


def test_disk_blocks_keep_their_scope_and_a_read_for_another_scope_fails(tmp_path):
    """A block file records what it was written for (adapter, cache salt); after a restart the
    index learns it back, and a read asking for another scope gets nothing (the file is kept)."""
    lora = RequestExtraKeys(lora=("sql", "/a/sql")).scope(SALT)
    payload = memoryview(b"y" * 1000)
    disk = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    disk.write(KEYS[0], None, payload, lora).result()
    disk.close()
    again = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    assert again.drain()[0] == [(KEYS[0], None, lora)]
    dst = bytearray(1000)
    assert again.read_into(KEYS[0], memoryview(dst), SCOPE).result() is None
    assert bytes(dst) == bytes(1000) and KEYS[0] in again
    assert again.read_into(KEYS[0], memoryview(dst), lora).result() == checksum(payload)
    again.close()


def test_files_of_the_format_without_scope_are_dropped(tmp_path):
    """They were written while keys ignored adapters and cache salts: their KV may be another
    tenant's under a plain prompt's key."""
    disk = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    disk.write(KEYS[0], None, memoryview(b"z" * 100), SCOPE).result()
    disk.close()
    path = disk.dir / KEYS[0].hex()[:2] / KEYS[0].hex()
    old = path.read_bytes()
    path.write_bytes(b"VPDKVB01" + old[8:])
    again = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    assert again.drain() == ([], []) and not path.exists()
    again.close()

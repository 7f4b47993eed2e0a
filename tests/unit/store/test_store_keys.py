import subprocess
import sys

import pytest

from vllm_pd.protocol.block_keys import KEY_BYTES, KeySalt, chain_keys

SALT = KeySalt(model="m", dtype="bfloat16", kv_layout="cpu", block_size=4, num_layers=2)


def test_keys_chain_and_prefix_property():
    a = chain_keys(list(range(10)), SALT)
    assert len(a) == 2 and all(len(k) == KEY_BYTES for k in a)  # the partial tail has no key
    b = chain_keys(list(range(8)) + [99, 98, 97, 96], SALT)
    assert b[:2] == a[:2] and len(b) == 3
    c = chain_keys([0, 1, 2, 3, 5, 5, 6, 7], SALT)
    assert c[0] == a[0] and c[1] != a[1]
    # continuing a chain gives the same keys as hashing the whole sequence
    assert chain_keys(list(range(4, 8)), SALT, parent=a[0]) == a[1:2]


@pytest.mark.parametrize(
    "field,value",
    [("model", "x"), ("dtype", "fp8"), ("kv_layout", "flash"), ("tp_size", 2), ("pp_size", 2), ("extra", "lora1")],
)
def test_salt_changes_every_key(field, value):
    other = KeySalt(**{**SALT.__dict__, field: value})
    assert chain_keys(list(range(8)), other)[0] != chain_keys(list(range(8)), SALT)[0]


def test_keys_identical_across_processes_with_different_hash_seeds():
    code = (
        "from vllm_pd.protocol.block_keys import KeySalt, chain_keys;"
        "print(chain_keys(list(range(40)), KeySalt('m','bfloat16','cpu',4,2))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
        ).stdout.strip()
        for seed in ("1", "2", "random")
    }
    assert outs == {chain_keys(list(range(40)), SALT)[-1].hex()}


def test_bad_input_is_an_error():
    with pytest.raises(ValueError):
        chain_keys([1, -2, 3, 4], SALT)
    with pytest.raises(ValueError):
        KeySalt("m", "bf16", "cpu", block_size=0, num_layers=1)

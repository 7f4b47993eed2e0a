"""Admin API auth and operations; flag/YAML config errors that name the key."""

from __future__ import annotations

import pytest

from tests.support.mock_backend import MockBackend, start_backend
from tests.support.router_harness import harness, run
from vllm_pd.router.config import ConfigError, InstanceConfig, ProxyConfig, load_yaml, parse_instance_flag

TOKEN = {"Authorization": "Bearer s3cret"}


def test_admin_requires_token_and_is_off_without_one() -> None:
    async def go() -> None:
        async with harness() as h:
            async with h.session.get(h.url + "/admin/instances", headers=TOKEN) as r:
                assert r.status == 403
        async with harness(admin_token="s3cret") as h:
            async with h.session.get(h.url + "/admin/instances") as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_token"
            async with h.session.get(h.url + "/admin/instances", headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
            async with h.session.get(h.url + "/admin/instances", headers=TOKEN) as r:
                assert r.status == 200 and len((await r.json())["instances"]) == 2

    run(go)


def test_admin_add_drain_role_remove() -> None:
    async def go() -> None:
        async with harness(admin_token="s3cret", decode_policy="round_robin") as h:
            extra = MockBackend(name="d9")
            runner, url = await start_backend(extra)
            try:
                async with h.session.post(
                    h.url + "/admin/instances", headers=TOKEN, json={"url": url, "role": "decode"}
                ) as r:
                    assert r.status == 201
                async with h.session.post(
                    h.url + "/admin/instances", headers=TOKEN, json={"url": url, "role": "decode"}
                ) as r:
                    assert r.status == 400  # duplicate
                async with h.session.post(
                    h.url + "/admin/instances", headers=TOKEN, json={"url": "ftp://x", "role": "decode"}
                ) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "url"
                async with h.session.post(
                    h.url + "/admin/instances", headers=TOKEN, json={"url": "http://127.0.0.1:1", "role": "boss"}
                ) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "role"
                for _ in range(4):
                    await h.post("/v1/completions", {"prompt": "q " * 40, "max_tokens": 1})
                assert len(extra.seen) == 2
                d0 = h.backend_urls["d0"]
                async with h.session.post(h.url + "/admin/instances/drain", headers=TOKEN, json={"url": d0}) as r:
                    assert r.status == 200 and (await r.json())["draining"] is True
                for _ in range(2):
                    await h.post("/v1/completions", {"prompt": "q " * 40, "max_tokens": 1})
                assert len(extra.seen) == 4
                # turn the old prefill into a decode: no prefill left -> decode-only
                p0 = h.backend_urls["p0"]
                async with h.session.post(
                    h.url + "/admin/instances/role", headers=TOKEN, json={"url": p0, "role": "decode"}
                ) as r:
                    assert r.status == 200
                async with h.session.delete(h.url + "/admin/instances", headers=TOKEN, params={"url": url}) as r:
                    assert r.status == 200
                async with h.session.delete(h.url + "/admin/instances", headers=TOKEN, params={"url": url}) as r:
                    assert r.status == 404
                status, _ = await h.post("/v1/completions", {"prompt": "q " * 40, "max_tokens": 1})
                assert status == 200 and "kv_transfer_params" not in h.prefills[0].seen[-1].body
            finally:
                await runner.cleanup()

    run(go)


def test_instance_flag_parsing() -> None:
    ic = parse_instance_flag("http://127.0.0.1:8200@tcp://127.0.0.1:14600", "decode")
    assert ic == InstanceConfig("http://127.0.0.1:8200", "decode", "tcp://127.0.0.1:14600")
    assert (
        parse_instance_flag("http://127.0.0.1:8200@shm://127.0.0.1:14600", "decode").kv_endpoint
        == "shm://127.0.0.1:14600"
    )
    with pytest.raises(ConfigError, match="kv_endpoint"):
        parse_instance_flag("http://127.0.0.1:8200@udp://127.0.0.1:14600", "decode")
    with pytest.raises(ConfigError, match="kv_endpoint"):
        parse_instance_flag("http://127.0.0.1:8200@127.0.0.1:14600", "decode")
    with pytest.raises(ConfigError, match="url"):
        parse_instance_flag("127.0.0.1:8200", "decode")


@pytest.mark.parametrize(
    "text,key",
    [
        ("prot: 5\n", "prot"),
        ("port: '80'\n", "port"),
        ("port: 70000\n", "port"),
        ("prefill_timeout: true\n", "prefill_timeout"),
        ("prefill_timeout: -1\n", "prefill_timeout"),
        ("kv_mode: shove\n", "kv_mode"),
        ("decode_policy: prefix_aware\n", "decode_policy"),
        ("instances: {}\n", "instances"),
        ("instances:\n  - {url: 'http://a:1'}\n", "instances[0].role"),
        ("instances:\n  - {url: 'http://a:1', role: decode, kv: x}\n", "instances[0].kv"),
        ("instances:\n  - {url: 'http://a:1', role: dec}\n", "instances[0].role"),
        ("instances:\n  - {url: 'http://a:1', role: decode}\n  - {url: 'http://a:1', role: prefill}\n", "instances"),
        ("[1, 2]\n", "mapping at the top level"),
        ("a: [\n", "invalid YAML"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, text: str, key: str) -> None:
    f = tmp_path / "proxy.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        ProxyConfig(**load_yaml(f))
    assert key in str(e.value)


def test_yaml_good(tmp_path) -> None:
    f = tmp_path / "proxy.yaml"
    f.write_text(
        "port: 9000\nkv_mode: push\nprefill_policy: round_robin\ninstances:\n"
        "  - {url: 'http://127.0.0.1:8100', role: prefill}\n"
        "  - {url: 'http://127.0.0.1:8200/', role: decode, kv_endpoint: 'tcp://127.0.0.1:14600'}\n"
    )
    cfg = ProxyConfig(**load_yaml(f))
    assert cfg.port == 9000 and cfg.instances[1].url == "http://127.0.0.1:8200"
    assert cfg.instances[1].kv_endpoint == "tcp://127.0.0.1:14600"


def test_example_config_loads() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "router" / "proxy.yaml"
    cfg = ProxyConfig(**load_yaml(path))
    assert [i.role for i in cfg.instances] == ["prefill", "prefill", "decode", "both"]

"""Client API keys, the proxy's own key for the instances, admin URL checks, https:// instances."""

from __future__ import annotations

import argparse
import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest

from tests.support.mock_backend import MockBackend
from tests.support.router_harness import harness, run
from vllm_pd.router.cli import command_proxy
from vllm_pd.router.config import ConfigError, InstanceConfig, ProxyConfig
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.router.server.app import ProxyServer, serve
from vllm_pd.vllm_server import free_port

ERROR_KEYS = {"message", "type", "param", "code"}
ADMIN = {"Authorization": "Bearer adm"}
BODY = {"prompt": "hello there " * 10, "max_tokens": 2}


def test_api_key_guards_v1_routes_only() -> None:
    async def go() -> None:
        async with harness(api_key="k-123") as h:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "k-123"},
                {"Authorization": "Basic k-123"},
            ):
                async with h.session.post(h.url + "/v1/completions", json=BODY, headers=headers) as r:
                    err = (await r.json())["error"]
                    assert r.status == 401 and set(err) == ERROR_KEYS and err["code"] == "invalid_api_key"
                    assert r.headers["WWW-Authenticate"] == "Bearer"
            async with h.session.get(h.url + "/v1/models") as r:
                assert r.status == 401
            async with h.session.head(h.url + "/v1/models") as r:
                assert r.status == 401 and await r.read() == b""
            assert not h.prefills[0].seen and not h.decodes[0].seen  # nothing reached an instance
            ok = {"Authorization": "Bearer k-123"}
            async with h.session.post(h.url + "/v1/completions", json=BODY, headers=ok) as r:
                assert r.status == 200
            async with h.session.get(h.url + "/v1/models", headers={"Authorization": "bearer k-123"}) as r:
                assert r.status == 200
            for path in ("/health", "/metrics"):  # open, as with vllm serve --api-key
                async with h.session.get(h.url + path) as r:
                    assert r.status in (200, 503)
            # without --backend-api-key the client's own Authorization goes on to the instances
            assert h.decodes[0].seen[0].headers["authorization"] == "Bearer k-123"

    run(go)


def test_backend_key_replaces_the_clients_on_legs_and_health_checks() -> None:
    async def go() -> None:
        async with harness(api_key="client-key", backend_api_key="inst-key") as h:
            health_auth: list[str | None] = []

            async def health(req: HttpRequest) -> HttpResponse:
                health_auth.append(req.headers.get("authorization"))
                return HttpResponse(b"", content_type="text/plain")

            for runner in h.runners.values():
                runner.routes["/health"]["GET"] = health
            await h.proxy.health.check_all()
            assert health_auth and set(health_auth) == {"Bearer inst-key"}
            status, _ = await h.post("/v1/completions", BODY, headers={"Authorization": "Bearer client-key"})
            assert status == 200
            legs = h.prefills[0].seen + h.decodes[0].seen
            assert len(legs) == 2 and {leg.headers["authorization"] for leg in legs} == {"Bearer inst-key"}

    run(go)


@pytest.mark.parametrize(
    "url,kv,param",
    [
        ("http://169.254.169.254", None, "url"),  # the cloud metadata service
        ("http://169.254.1.1:8000", None, "url"),
        ("http://[fe80::1]:8000", None, "url"),
        ("http://[::ffff:169.254.169.254]:80", None, "url"),
        ("http://0.0.0.0:8000", None, "url"),
        ("http://100.100.100.200:80", None, "url"),
        ("http://user:pw@127.0.0.1:8000", None, "url"),
        ("http://127.0.0.1:8000/v1", None, "url"),
        ("http://127.0.0.1:8000?x=1", None, "url"),
        ("http://127.0.0.1:99999", None, "url"),
        ("gopher://127.0.0.1:70", None, "url"),
        ("http://no-such-host.invalid:8000", None, "url"),
        ("http://127.0.0.1:8000", "tcp://169.254.169.254:5000", "kv_endpoint"),
        ("http://127.0.0.1:8000", "tcp://127.0.0.1", "kv_endpoint"),
    ],
)
def test_admin_refuses_addresses_it_must_not_connect_to(url: str, kv: str | None, param: str) -> None:
    async def go() -> None:
        async with harness(admin_token="adm") as h:
            body = {"url": url, "role": "decode", **({"kv_endpoint": kv} if kv else {})}
            async with h.session.post(h.url + "/admin/instances", headers=ADMIN, json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == param, err
            assert len(h.proxy.pool.all()) == 2

    run(go)


def test_admin_allow_list_of_backend_networks() -> None:
    async def go() -> None:
        async with harness(admin_token="adm", backend_networks=["10.0.0.0/8", "fd00::/8"]) as h:

            async def add(url: str) -> int:
                async with h.session.post(
                    h.url + "/admin/instances", headers=ADMIN, json={"url": url, "role": "decode"}
                ) as r:
                    return r.status

            assert await add("http://127.0.0.1:8000") == 400
            assert await add("http://localhost:8000") == 400  # resolved, then checked
            assert await add("http://10.1.2.3:8000") == 201
            assert await add("http://[fd00::5]:8000") == 201

    run(go)


def _self_signed(tmp: Path) -> tuple[str, str]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_https_instances_with_verification_options(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def one_proxy(**kw: object) -> tuple[int, bool]:
        backends = [MockBackend(name="p0"), MockBackend(name="d0")]
        servers = [HttpServer(b.routes(), 1 << 20) for b in backends]
        for s in servers:
            await s.start("127.0.0.1", 0, tls=server_tls)
        cfg = ProxyConfig(
            port=free_port(),
            health_interval=60,
            instances=[
                InstanceConfig(f"https://127.0.0.1:{servers[0].port}", "prefill"),
                InstanceConfig(f"https://localhost:{servers[1].port}", "decode"),
            ],
            **kw,
        )  # type: ignore[arg-type]
        proxy = ProxyServer(cfg, run_health_checks=False)
        running = await serve(proxy)
        try:
            assert proxy.client is not None
            reader, writer = await asyncio.open_connection("127.0.0.1", cfg.port)
            import json

            raw = json.dumps(BODY).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(raw), raw)
            )
            answer = await reader.read()
            writer.close()
            return int(answer.split()[1]), bool(backends[1].seen)
        finally:
            await running.cleanup()
            for s in servers:
                await s.cleanup()

    async def go() -> None:
        assert await one_proxy(backend_ca_file=cert) == (200, True)
        assert await one_proxy(backend_tls_verify=False) == (200, True)
        status, reached = await one_proxy()  # the system's CAs do not know this certificate
        assert status == 502 and not reached

    run(go)


def test_config_and_flags_name_the_key(tmp_path: Path) -> None:
    (tmp_path / "garbage.pem").write_text("not a certificate")
    for kw, key in (
        ({"api_key": ""}, "api_key"),
        ({"backend_api_key": "a b"}, "backend_api_key"),
        ({"backend_networks": ["10.0.0.0/8", "nope"]}, r"backend_networks\[1\]"),
        ({"backend_ca_file": str(tmp_path / "none.pem")}, "backend_ca_file"),
        ({"backend_ca_file": str(tmp_path / "garbage.pem")}, "backend_ca_file"),
        ({"max_header_bytes": 0}, "max_header_bytes"),
        ({"header_timeout": 0}, "header_timeout"),
        ({"max_concurrent_requests": -1}, "max_concurrent_requests"),
    ):
        with pytest.raises(ConfigError, match=key):
            ProxyConfig(**kw)  # type: ignore[arg-type]
    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    cfg = command_proxy.config_from_args(
        p.parse_args(
            [
                "--api-key",
                "a",
                "--backend-api-key",
                "b",
                "--backend-network",
                "10.0.0.0/8",
                "--backend-network",
                "127.0.0.0/8",
                "--no-backend-tls-verify",
                "--max-header-bytes",
                "1000",
                "--max-headers",
                "7",
                "--max-url-bytes",
                "99",
                "--header-timeout",
                "2",
                "--body-timeout",
                "3",
                "--max-concurrent-requests",
                "4",
                "--max-queued-requests",
                "5",
            ]
        )
    )
    assert (cfg.api_key, cfg.backend_api_key, cfg.backend_networks, cfg.backend_tls_verify) == (
        "a",
        "b",
        ["10.0.0.0/8", "127.0.0.0/8"],
        False,
    )
    assert (
        cfg.max_header_bytes,
        cfg.max_headers,
        cfg.max_url_bytes,
        cfg.header_timeout,
        cfg.body_timeout,
        cfg.max_concurrent_requests,
        cfg.max_queued_requests,
    ) == (1000, 7, 99, 2, 3, 4, 5)
    with pytest.raises(ConfigError, match="backend_networks"):
        command_proxy.config_from_args(p.parse_args(["--backend-network", "x"]))

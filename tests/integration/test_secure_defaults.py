"""Secure defaults: without a deployment secret the KV endpoints and the store master listen on
loopback only; beyond it needs a secret or an explicit insecure_network (which warns)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.deployment_secret import SECRET_ENV
from vllm_pd.connector.worker.worker import advertised_host
from vllm_pd.errors import ConfigError
from vllm_pd.vllm_server import free_port


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    return str(path)


def test_without_a_secret_the_kv_endpoint_is_loopback_only() -> None:
    cfg = PDConnectorConfig.from_extra_config({})
    assert cfg.secret is None and cfg.bind_host == "127.0.0.1" and not cfg.insecure
    assert advertised_host(cfg) == "127.0.0.1"  # what peers are told matches what listens
    with pytest.raises(ConfigError, match="kv_connector_extra_config.bind_host.*insecure_network"):
        PDConnectorConfig.from_extra_config({"bind_host": "0.0.0.0"})


def test_a_secret_opens_every_interface(secret_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = PDConnectorConfig.from_extra_config({"secret_file": secret_file})
    assert cfg.secret is not None and cfg.bind_host == "0.0.0.0" and not cfg.insecure
    assert "0123456789" not in repr(cfg)  # never logged with the config
    monkeypatch.setenv(SECRET_ENV, "fedcba9876543210fedcba9876543210")
    assert PDConnectorConfig.from_extra_config({"bind_host": "0.0.0.0"}).secret is not None


def test_insecure_network_is_explicit() -> None:
    cfg = PDConnectorConfig.from_extra_config({"insecure_network": True})
    assert cfg.bind_host == "0.0.0.0" and cfg.insecure  # the worker warns at start


@pytest.mark.parametrize(
    ("extra", "env", "names"),
    [
        ({"secret_file": "/nonexistent/secret"}, None, "kv_connector_extra_config.secret_file: cannot read"),
        ({"secret_file": ""}, None, "kv_connector_extra_config.secret_file"),
        ({}, "short", f"{SECRET_ENV}: the secret is 5 bytes"),
        ({}, "", f"{SECRET_ENV}: the secret is empty"),
        ({"insecure_network": "yes"}, None, "kv_connector_extra_config.insecure_network"),
    ],
)
def test_secret_errors_name_the_key(extra, env, names, monkeypatch: pytest.MonkeyPatch) -> None:
    if env is not None:
        monkeypatch.setenv(SECRET_ENV, env)
    with pytest.raises(ConfigError, match=names):
        PDConnectorConfig.from_extra_config(extra)


def test_store_master_refuses_a_wide_bind_without_a_secret() -> None:
    cmd = [sys.executable, "-m", "vllm_pd.cli", "store-master", "--host", "0.0.0.0", "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env_without_secret())
    assert out.returncode != 0 and "--insecure-network" in out.stderr


def test_store_master_listens_on_loopback_by_default() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_pd.cli", "store-master", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env=_env_without_secret(),
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on" in line:
                assert f"tcp://127.0.0.1:{port}" in line
                break
        else:
            pytest.fail("the master never said where it listens")
    finally:
        proc.kill()
        proc.wait()


def _env_without_secret() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def test_tls_keys_come_together_and_only_for_tcp(tmp_path) -> None:
    from tests.support.tls_certs import issue, make_ca

    make_ca(tmp_path)
    tls = issue(tmp_path, "node")
    keys = {"tls_cert": tls.cert_file, "tls_key": tls.key_file, "tls_ca": tls.ca_file}
    cfg = PDConnectorConfig.from_extra_config(keys)
    assert cfg.tls == tls
    with pytest.raises(ConfigError, match="kv_connector_extra_config.tls_ca: TLS needs"):
        PDConnectorConfig.from_extra_config({"tls_cert": tls.cert_file, "tls_key": tls.key_file})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.tls_cert: TLS is for the tcp transport"):
        PDConnectorConfig.from_extra_config({**keys, "transport": "shm"})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.tls_ca"):
        PDConnectorConfig.from_extra_config({**keys, "tls_ca": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.tls_cert"):
        PDConnectorConfig.from_extra_config({**keys, "tls_cert": tls.key_file})


def test_up_makes_a_secret_file_only_its_user_reads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vllm_pd.router.cli.command_up import cluster_secret

    path = cluster_secret(tmp_path / "logs")
    assert path is not None and os.stat(path).st_mode & 0o777 == 0o600
    assert PDConnectorConfig.from_extra_config({"secret_file": path}).secret is not None
    again = cluster_secret(tmp_path / "logs")
    assert again == path and open(path).read() != ""  # a new cluster, a new secret
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123456789ab")
    assert cluster_secret(tmp_path / "other") is None  # the servers inherit the variable instead

"""The pieces of the proxy's Kubernetes discovery that need no server: pods -> instances, label selectors,
the configuration (flags and YAML), and the in-cluster credentials (a service account directory made here,
as no cluster can run here)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path

import certifi
import msgspec
import pytest

from tests.support.k8s_api_standin import StandInApiServer, make_pod
from vllm_pd.router.cli import command_proxy
from vllm_pd.router.config import ConfigError, K8sDiscoveryConfig, load_yaml
from vllm_pd.router.k8s.k8s_api import ApiError, KubeApi
from vllm_pd.router.k8s.k8s_pods import Pod, PodConfigError, is_routable, pod_target
from vllm_pd.router.k8s.k8s_selector import parse_selector


def _pod(**kw) -> Pod:
    raw = make_pod("d0", {"role": "decode"}, kw.pop("ip", "10.1.2.3"), **kw)
    return msgspec.convert(raw, Pod)


def test_pod_target_ports_and_kv_endpoint() -> None:
    assert pod_target(_pod(), 8000).url == "http://10.1.2.3:8000"  # no annotation, no port named http
    assert pod_target(_pod(http_port=9000), 8000).url == "http://10.1.2.3:9000"
    annotated = _pod(http_port=9000, annotations={"vllm-pd/http-port": "9100", "vllm-pd/kv-port": "14579"})
    assert pod_target(annotated, 8000) == pod_target(annotated, 1)
    assert pod_target(annotated, 8000).url == "http://10.1.2.3:9100"
    assert pod_target(annotated, 8000).kv_endpoint == "tcp://10.1.2.3:14579"
    nixl = _pod(annotations={"vllm-pd/kv-port": "14579", "vllm-pd/kv-transport": "nixl"})
    assert pod_target(nixl, 8000).kv_endpoint == "nixl://10.1.2.3:14579"
    templated = _pod(annotations={"vllm-pd/kv-endpoint": "tcp://$(POD_IP):15000"})
    assert pod_target(templated, 8000).kv_endpoint == "tcp://10.1.2.3:15000"
    named = make_pod("d0", {}, "10.1.2.3")
    named["spec"]["containers"][0]["ports"] = [{"name": "kv", "containerPort": 14600}]
    assert pod_target(msgspec.convert(named, Pod), 8000).kv_endpoint == "tcp://10.1.2.3:14600"
    assert pod_target(_pod(), 8000).kv_endpoint is None
    v6 = pod_target(_pod(ip="fd00::5", annotations={"vllm-pd/kv-port": "1"}), 8000)
    assert v6.url == "http://[fd00::5]:8000" and v6.kv_endpoint == "tcp://[fd00::5]:1"
    with pytest.raises(PodConfigError, match="vllm-pd/kv-port"):
        pod_target(_pod(annotations={"vllm-pd/kv-port": "14579x"}), 8000)
    with pytest.raises(PodConfigError, match="vllm-pd/http-port"):
        pod_target(_pod(annotations={"vllm-pd/http-port": "70000"}), 8000)


def test_only_running_ready_pods_with_an_ip_that_are_not_terminating_are_routable() -> None:
    assert is_routable(_pod())
    assert not is_routable(_pod(ready=False)) and pod_target(_pod(ready=False), 8000) is None
    assert not is_routable(_pod(ip=""))
    pending = make_pod("d0", {}, "10.1.2.3")
    pending["status"]["phase"] = "Pending"
    assert not is_routable(msgspec.convert(pending, Pod))
    terminating = make_pod("d0", {}, "10.1.2.3")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert not is_routable(msgspec.convert(terminating, Pod))
    assert not is_routable(Pod())  # a pod just created: no status yet


@pytest.mark.parametrize(
    "selector,labels,match",
    [
        ("app=vllm,role=decode", {"app": "vllm", "role": "decode"}, True),
        ("app=vllm,role=decode", {"app": "vllm", "role": "prefill"}, False),
        ("app==vllm, role!=prefill", {"app": "vllm"}, True),
        ("role in (prefill, decode),app", {"app": "x", "role": "decode"}, True),
        ("role notin (prefill),!canary", {"role": "decode", "canary": "1"}, False),
        ("vllm-pd.io/role=decode", {"vllm-pd.io/role": "decode"}, True),
    ],
)
def test_selector_matches(selector: str, labels: dict[str, str], match: bool) -> None:
    assert all(r.matches(labels) for r in parse_selector(selector)) is match


@pytest.mark.parametrize("selector", ["", "role=decode,", "role=de code", "role in prefill", "=decode", "role=(x)"])
def test_bad_selector_is_refused(selector: str) -> None:
    with pytest.raises(ValueError):
        parse_selector(selector)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    return p.parse_args(list(argv))


def test_discovery_flags_and_yaml(tmp_path: Path) -> None:
    cfg = command_proxy.config_from_args(
        _args(
            "--service-discovery",
            "k8s",
            "--k8s-namespace",
            "llm",
            "--prefill-selector",
            "app=x,role=prefill",
            "--decode-selector",
            "app=x,role=decode",
            "--k8s-port",
            "9000",
        )
    )
    assert cfg.kubernetes == K8sDiscoveryConfig(
        prefill_selector="app=x,role=prefill", decode_selector="app=x,role=decode", namespace="llm", http_port=9000
    )
    assert cfg.instances == []
    f = tmp_path / "p.yaml"
    f.write_text("kubernetes:\n  decode_selector: role=decode\n  namespace: a\n")
    from_file = command_proxy.config_from_args(_args("--config", str(f), "--k8s-namespace", "b"))
    assert from_file.kubernetes.decode_selector == "role=decode" and from_file.kubernetes.namespace == "b"
    assert command_proxy.config_from_args(_args("--config", str(f), "--service-discovery", "static")).kubernetes is None
    assert command_proxy.config_from_args(_args("--decode", "http://a:1")).kubernetes is None


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--service-discovery", "k8s"], "kubernetes"),  # no selector at all
        (["--service-discovery", "k8s", "--decode-selector", "role=de code"], "kubernetes.decode_selector"),
        (["--service-discovery", "k8s", "--decode-selector", "a", "--k8s-port", "0"], "kubernetes.http_port"),
        (["--service-discovery", "k8s", "--decode-selector", "a", "--k8s-api-url", "x"], "kubernetes.api_url"),
        (["--decode-selector", "role=decode"], "decode_selector"),  # without --service-discovery k8s
    ],
)
def test_discovery_flag_errors_name_the_key(argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}"):
        command_proxy.config_from_args(_args(*argv))


@pytest.mark.parametrize(
    "text,key",
    [
        ("kubernetes: [role=decode]\n", "kubernetes"),
        ("kubernetes:\n  decode_selectr: a\n", "kubernetes.decode_selectr"),
        ("kubernetes:\n  decode_selector: a\n  http_port: '80'\n", "kubernetes.http_port"),
        ("kubernetes:\n  decode_selector: a\n  watch_timeout: 0\n", "kubernetes.watch_timeout"),
    ],
)
def test_yaml_kubernetes_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"^{key}"):
        load_yaml(f)


def test_in_cluster_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ApiError, match="KUBERNETES_SERVICE_HOST"):
        KubeApi.in_cluster(tmp_path)
    monkeypatch.setattr(command_proxy, "install_uvloop", lambda: None)  # keep the default loop for the session
    assert command_proxy.run(_args("--service-discovery", "k8s", "--decode-selector", "a", "--port", "1")) == 2

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ApiError, match="ca.crt"):
        KubeApi.in_cluster(tmp_path)  # no CA in the service account directory
    # certifi's bundle (httpx brings it) stands in for the cluster's CA
    shutil.copy(certifi.where(), tmp_path / "ca.crt")
    (tmp_path / "token").write_text("token-1\n")
    api = KubeApi.in_cluster(tmp_path)
    assert api.base_url == "https://[fd00::1]:443"

    async def token_is_sent_and_reread() -> list[str]:
        server = StandInApiServer("llm")
        await server.start()
        plain = KubeApi(server.url, token_path=tmp_path / "token")
        try:
            await plain.list_pods("llm", "a=b")
            (tmp_path / "token").write_text("token-2")  # the kubelet rotated it
            await plain.list_pods("llm", "a=b")
            with pytest.raises(ApiError, match="404"):
                await plain.list_pods("other-namespace", "a=b")
        finally:
            await plain.close()
            await api.close()
            await server.stop()
        return server.authorizations

    assert asyncio.run(token_is_sent_and_reread()) == ["Bearer token-1", "Bearer token-2"]

"""The Kubernetes manifests (deploy/kubernetes): valid against the Kubernetes API schemas, and consistent with
the code they run - the connector accepts their settings, the proxy's flags parse and its selectors pick the
pods they should, the KV endpoint the proxy derives matches what the pod listens on.

No cluster can run here: the schemas are the ones kubernetes-validate bundles (offline), for the oldest and
the newest Kubernetes checked; kustomize is rendered by tests/support/kustomize_lite.py, checked against
``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from tests.support.kustomize_lite import render
from vllm_pd.cli import build_parser
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.router.cli import command_proxy
from vllm_pd.router.k8s.k8s_pods import Pod, pod_target
from vllm_pd.router.k8s.k8s_selector import parse_selector

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
VARIANTS = ("base", "gpu")
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def _objects(variant: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(DEPLOY / variant)}


def _pod_template(objects: dict, name: str) -> dict[str, Any]:
    return objects[("Deployment", name)]["spec"]["template"]


def _container(objects: dict, name: str) -> dict[str, Any]:
    containers = _pod_template(objects, name)["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_valid_against_the_kubernetes_schemas(variant: str, version: str) -> None:
    errors = []
    for (kind, name), obj in _objects(variant).items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)  # strict: unknown fields are errors too
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{kind}/{name}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_the_schema_check_catches_a_wrong_field() -> None:
    deployment = _objects("base")[("Deployment", "vllm-pd-decode")]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendering_matches_kubectl_kustomize(variant: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / variant)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    expected = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert _objects(variant) == expected


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


def _env(objects: dict, container: dict[str, Any], pod_ip: str) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = objects[("ConfigMap", ref["name"])]["data"][ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = pod_ip
    return env


def _kv_transfer_config(objects: dict, role: str) -> dict[str, Any]:
    container = _container(objects, f"vllm-pd-{role}")
    argv = [_expand(a, _env(objects, container, "10.0.0.9")) for a in container["command"] + container["args"]]
    assert argv[:2] == ["vllm", "serve"]
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_vllm_and_the_connector_accept_the_kv_transfer_config(variant: str) -> None:
    from vllm.config import KVTransferConfig

    objects = _objects(variant)
    for role, kv_role in KV_ROLES.items():
        raw = _kv_transfer_config(objects, role)
        kv = KVTransferConfig(**raw)
        assert kv.kv_connector == "PDConnector" and kv.kv_role == kv_role
        connector = PDConnectorConfig.from_extra_config(raw["kv_connector_extra_config"])
        assert connector.transport == ("nixl" if variant == "gpu" else "tcp")
        store = StoreConfig.from_dict(connector.store)
        master = objects[("Service", "vllm-pd-store-master")]["spec"]["ports"][0]["port"]
        assert store.master == f"tcp://vllm-pd-store-master:{master}"
    assert _kv_transfer_config(objects, "decode")["kv_load_failure_policy"] == "recompute"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_proxy_finds_the_pods_of_each_role_with_their_kv_endpoint(variant: str) -> None:
    objects = _objects(variant)
    proxy = _container(objects, "vllm-pd-proxy")
    args = build_parser().parse_args(proxy["command"][1:])
    cfg = command_proxy.config_from_args(args)
    assert cfg.kubernetes is not None and cfg.instances == []
    labels = {role: _pod_template(objects, f"vllm-pd-{role}")["metadata"]["labels"] for role in KV_ROLES}
    labels["proxy"] = _pod_template(objects, "vllm-pd-proxy")["metadata"]["labels"]
    for role, selector in cfg.kubernetes.selectors().items():
        picked = {r for r, lab in labels.items() if all(req.matches(lab) for req in parse_selector(selector))}
        assert picked == {role}
    for role in KV_ROLES:
        template = _pod_template(objects, f"vllm-pd-{role}")
        pod = msgspec.convert(
            {
                **template,
                "status": {
                    "phase": "Running",
                    "podIP": "10.0.0.9",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
            Pod,
        )
        target = pod_target(pod, cfg.kubernetes.http_port)
        transport = PDConnectorConfig.from_extra_config(
            _kv_transfer_config(objects, role)["kv_connector_extra_config"]
        ).transport
        kv_port = _kv_transfer_config(objects, role)["kv_port"]
        assert target is not None and target.kv_endpoint == f"{transport}://10.0.0.9:{kv_port}"
        command = _container(objects, f"vllm-pd-{role}")["command"]
        assert target.url == f"http://10.0.0.9:{command[command.index('--port') + 1]}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_resources_anti_affinity_and_rbac(variant: str) -> None:
    objects = _objects(variant)
    for name in ("vllm-pd-prefill", "vllm-pd-decode", "vllm-pd-proxy"):
        template = _pod_template(objects, name)
        container = _container(objects, name)
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert "memory" in container["resources"]["limits"] and "cpu" in container["resources"]["requests"]
        term = template["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0][
            "podAffinityTerm"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == template["metadata"]["labels"]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == ("1" if variant == "gpu" and name != "vllm-pd-proxy" else None)
    account = _pod_template(objects, "vllm-pd-proxy")["spec"]["serviceAccountName"]
    binding = objects[("RoleBinding", "vllm-pd-proxy-pod-reader")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "vllm-pd"}]
    (rule,) = objects[("Role", binding["roleRef"]["name"])]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    master = _container(objects, "vllm-pd-store-master")
    master_args = build_parser().parse_args(master["command"][1:])
    assert master_args.port == master["ports"][0]["containerPort"]


SECRET_REF = {"name": "vllm-pd-secret", "key": "secret"}  # not optional: no pod runs without it


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_kv_plane_process_takes_the_deployment_secret_from_a_secret(variant: str, monkeypatch) -> None:
    """The servers, the store master and the proxy all get VLLM_PD_SECRET from the same Secret; with
    it the connector listens beyond loopback (without it, it would listen on 127.0.0.1 only)."""
    from vllm_pd.connector.deployment_secret import SECRET_ENV

    objects = _objects(variant)
    for name in ("vllm-pd-prefill", "vllm-pd-decode", "vllm-pd-store-master", "vllm-pd-proxy"):
        env = {v["name"]: v for v in _container(objects, name).get("env", [])}
        assert env.get(SECRET_ENV, {}).get("valueFrom", {}).get("secretKeyRef") == SECRET_REF, name
    raw = _kv_transfer_config(objects, "prefill")["kv_connector_extra_config"]
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert PDConnectorConfig.from_extra_config(raw).bind_host == "127.0.0.1"
    monkeypatch.setenv(SECRET_ENV, "a-secret-as-kubectl-would-create-it-0123456789")
    assert PDConnectorConfig.from_extra_config(raw).bind_host == "0.0.0.0"
    master = _container(objects, "vllm-pd-store-master")["command"]
    assert "--insecure-network" not in master  # it binds 0.0.0.0 because the secret is set

"""Kubernetes pods as the proxy reads them (only the fields it needs), and the instance a pod stands for.

A pod is routable when it runs, is Ready, has a pod IP and is not being
deleted. Its instance is ``http://<podIP>:<port>``, the port from the
``vllm-pd/http-port`` annotation, else the container port named ``http``,
else the configured default. Its KV endpoint (push mode) comes from, in order:
the ``vllm-pd/kv-endpoint`` annotation (``$(POD_IP)`` in it is the pod's IP),
the ``vllm-pd/kv-port`` annotation, the container port named ``kv``; the last
two with the ``vllm-pd/kv-transport`` annotation's scheme (default tcp).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from vllm_pd.errors import ConfigError

ANNOTATION_HTTP_PORT = "vllm-pd/http-port"
ANNOTATION_KV_ENDPOINT = "vllm-pd/kv-endpoint"
ANNOTATION_KV_PORT = "vllm-pd/kv-port"
ANNOTATION_KV_TRANSPORT = "vllm-pd/kv-transport"
POD_IP_PLACEHOLDER = "$(POD_IP)"


class ObjectMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    deletionTimestamp: str | None = None


class ContainerPort(msgspec.Struct, omit_defaults=True):
    containerPort: int
    name: str | None = None


class Container(msgspec.Struct, omit_defaults=True):
    name: str = ""
    ports: list[ContainerPort] = []


class PodSpec(msgspec.Struct, omit_defaults=True):
    containers: list[Container] = []


class PodCondition(msgspec.Struct, omit_defaults=True):
    type: str
    status: str


class PodStatus(msgspec.Struct, omit_defaults=True):
    phase: str = ""
    podIP: str | None = None
    conditions: list[PodCondition] = []


class Pod(msgspec.Struct, omit_defaults=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)

    @property
    def key(self) -> str:
        return self.metadata.uid or f"{self.metadata.namespace}/{self.metadata.name}"


class ListMeta(msgspec.Struct):
    resourceVersion: str = ""


class PodList(msgspec.Struct):
    items: list[Pod] = []
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)


class Status(msgspec.Struct):
    """What the API server answers instead of an object when something failed (410 Gone among others)."""

    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct):
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK | ERROR
    object: msgspec.Raw  # a Pod, or a Status for ERROR


@dataclass(frozen=True)
class PodTarget:
    """The instance a routable pod stands for."""

    url: str
    kv_endpoint: str | None


class PodConfigError(ConfigError):
    """A pod's annotations or ports do not say how to reach it; the message names the annotation."""


def is_routable(pod: Pod) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)
    return ready and pod.status.phase == "Running" and bool(pod.status.podIP) and pod.metadata.deletionTimestamp is None


def pod_target(pod: Pod, default_http_port: int) -> PodTarget | None:
    """The instance of a routable pod, None for one that is not; PodConfigError for bad annotations."""
    if not is_routable(pod):
        return None
    ip = pod.status.podIP
    assert ip is not None
    host = f"[{ip}]" if ":" in ip else ip  # IPv6
    annotations = pod.metadata.annotations
    http_port = _port(annotations, ANNOTATION_HTTP_PORT) or _named_port(pod, "http") or default_http_port
    return PodTarget(f"http://{host}:{http_port}", _kv_endpoint(pod, host))


def _kv_endpoint(pod: Pod, host: str) -> str | None:
    annotations = pod.metadata.annotations
    endpoint = annotations.get(ANNOTATION_KV_ENDPOINT)
    if endpoint is not None:
        return endpoint.replace(POD_IP_PLACEHOLDER, host)
    port = _port(annotations, ANNOTATION_KV_PORT) or _named_port(pod, "kv")
    if port is None:
        return None
    return f"{annotations.get(ANNOTATION_KV_TRANSPORT, 'tcp')}://{host}:{port}"


def _port(annotations: dict[str, str], name: str) -> int | None:
    raw = annotations.get(name)
    if raw is None:
        return None
    if not raw.strip().isdigit() or not 0 < int(raw) < 65536:
        raise PodConfigError(f"annotation {name}: {raw!r} is not a port")
    return int(raw)


def _named_port(pod: Pod, name: str) -> int | None:
    for container in pod.spec.containers:
        for port in container.ports:
            if port.name == name:
                return port.containerPort
    return None

"""Renders the kustomizations under deploy/kubernetes without kustomize, for tests on machines without it.

Only what those kustomizations use: ``resources`` (files and directories with
a kustomization.yaml), ``namespace`` (objects and ServiceAccount subjects),
``images`` and ``patches`` by ``path`` as strategic merge patches, merging
lists of the Kubernetes merge keys below (other lists are replaced). Where
kubectl is installed the tests check that this renders what ``kubectl
kustomize`` renders.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# strategic merge patch: list field -> the key its items are merged by (from the Kubernetes API schemas)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def render(directory: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch_entry in spec.get("patches", []):
        patch = yaml.safe_load((directory / patch_entry["path"]).read_text())
        i = next(
            i
            for i, d in enumerate(docs)
            if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]
        )
        docs[i] = merge(docs[i], patch)
    for image in spec.get("images", []):
        for container in _containers(docs):
            name = container.get("image", "").split(":")[0]
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = spec["namespace"]
            for subject in doc.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = spec["namespace"]
    return docs


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` applied to ``base`` (a new object) as a strategic merge patch."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field)
    if isinstance(base, list) and isinstance(patch, list) and key is not None:
        out = copy.deepcopy(base)
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def _containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pod_specs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return [c for spec in pod_specs for c in spec.get("containers", []) + spec.get("initContainers", [])]

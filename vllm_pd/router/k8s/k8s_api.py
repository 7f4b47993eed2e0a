"""A minimal Kubernetes API client for the proxy's discovery: LIST and WATCH pods, nothing else.

Why not the ``kubernetes`` package: two GET requests do not justify its size
and its threads. Why httpx and not the proxy's own client (http_client.py):
the API server speaks TLS with the cluster's CA, which that client does not.

In a pod it uses the service account (token and CA under
/var/run/secrets/kubernetes.io/serviceaccount, the API at
KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT); the token is read again for
every request, since the kubelet rotates it. With an explicit URL (tests, a
``kubectl proxy``) no credentials are needed.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec

from vllm_pd.errors import RouterError
from vllm_pd.router.k8s.k8s_pods import Pod, PodList, Status, WatchEvent

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(RouterError):
    """The API server answered with an error, or could not be reached."""


class ResourceExpired(ApiError):
    """410 Gone: the resourceVersion a watch started from is too old; LIST again."""


class KubeApi:
    def __init__(
        self, base_url: str, token_path: Path | None = None, ca_path: Path | None = None, connect_timeout: float = 5.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token_path = token_path
        try:
            verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_path)) if ca_path else True
        except (OSError, ssl.SSLError) as e:
            raise ApiError(f"the cluster's CA {ca_path}: {e}") from None
        self._connect_timeout = connect_timeout
        self._client = httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(30.0, connect=connect_timeout))

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ApiError(
                "not in a Kubernetes pod (KUBERNETES_SERVICE_HOST/PORT unset): give the API's URL (--k8s-api-url)"
            )
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", sa_dir / "token", sa_dir / "ca.crt")

    async def close(self) -> None:
        await self._client.aclose()

    async def list_pods(self, namespace: str, selector: str) -> PodList:
        try:
            r = await self._client.get(
                self._pods_url(namespace), params={"labelSelector": selector}, headers=self._headers()
            )
        except httpx.HTTPError as e:
            raise ApiError(f"LIST pods: {e!r}") from None
        _raise_for_status(r.status_code, r.content, "LIST pods")
        try:
            return msgspec.json.decode(r.content, type=PodList)
        except msgspec.DecodeError as e:
            raise ApiError(f"LIST pods: unexpected answer: {e}") from None

    async def watch_pods(
        self, namespace: str, selector: str, resource_version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, Pod]]:
        """(event type, pod) as they come, from after ``resource_version`` until the server ends the watch
        (about ``timeout_s``); BOOKMARK events carry only a resourceVersion. Raises ResourceExpired on 410."""
        params = {
            "labelSelector": selector,
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, round(timeout_s))),
        }
        # a silent connection is dead well after the server's own timeout and its bookmarks
        timeout = httpx.Timeout(connect=self._connect_timeout, read=timeout_s + 30.0, write=10.0, pool=10.0)
        try:
            async with self._client.stream(
                "GET", self._pods_url(namespace), params=params, headers=self._headers(), timeout=timeout
            ) as r:
                if r.status_code != 200:
                    _raise_for_status(r.status_code, await r.aread(), "WATCH pods")
                async for line in r.aiter_lines():
                    if line.strip():
                        yield _decode_event(line)
        except httpx.HTTPError as e:
            raise ApiError(f"WATCH pods: {e!r}") from None

    def _pods_url(self, namespace: str) -> str:
        return f"{self.base_url}/api/v1/namespaces/{namespace}/pods"

    def _headers(self) -> dict[str, str]:
        if self._token_path is None:
            return {}
        try:
            return {"Authorization": f"Bearer {self._token_path.read_text().strip()}"}
        except OSError as e:
            raise ApiError(f"service account token {self._token_path}: {e}") from None


def _decode_event(line: str) -> tuple[str, Pod]:
    try:
        event = msgspec.json.decode(line, type=WatchEvent)
        if event.type == "ERROR":
            status = msgspec.json.decode(event.object, type=Status)
            _raise_for_status(status.code or 500, event.object, "WATCH pods")
        return event.type, msgspec.json.decode(event.object, type=Pod)
    except msgspec.DecodeError as e:
        raise ApiError(f"WATCH pods: unexpected event: {e}") from None


def _raise_for_status(code: int, body: bytes, what: str) -> None:
    if code == 200:
        return
    try:
        message = msgspec.json.decode(body, type=Status).message
    except msgspec.DecodeError:
        message = body[:200].decode(errors="replace")
    if code == 410:
        raise ResourceExpired(f"{what}: 410 Gone: {message}")
    raise ApiError(f"{what}: HTTP {code}: {message}")


def service_account_namespace(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> str | None:
    try:
        return (sa_dir / "namespace").read_text().strip() or None
    except OSError:
        return None

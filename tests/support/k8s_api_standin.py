"""A stand-in Kubernetes API server for the proxy's discovery tests: no cluster can run here.

It serves what the discovery uses of the real one, from memory: LIST
``/api/v1/namespaces/<ns>/pods?labelSelector=...`` and WATCH (the same with
``watch=1&resourceVersion=N``: newline-delimited JSON events in a chunked
response). Pods are plain dicts with the fields a real pod has; the test
changes them (``put``, ``set_ready``, ``delete``) and every open watch gets the
event. ``compact()`` forgets the event history, as etcd compaction does, so a
watch from an older version gets the real server's answer: a 200 stream with one
ERROR event holding a 410 Status. ``restart()`` drops every connection and
listens again on the same port, as an API server that restarts.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse, json_response
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.router.k8s.k8s_selector import parse_selector


def make_pod(
    name: str,
    labels: dict[str, str],
    ip: str,
    ready: bool = True,
    http_port: int | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API server returns it (the fields that matter, plus some that do not)."""
    ports = [{"name": "http", "containerPort": http_port, "protocol": "TCP"}] if http_port else []
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "",
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": annotations or {},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm-pd:test", "ports": ports}], "nodeName": "node-1"},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "hostIP": "10.0.0.1",
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


class StandInApiServer:
    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, pod) since the last compact
        self.compacted_at = self.version
        self.requests: list[str] = []  # "LIST" / "WATCH <version>", in order
        self.authorizations: list[str] = []  # the Authorization header of each request ("" when none)
        self._watchers: list[tuple[list, asyncio.Queue]] = []
        self._server: HttpServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        self._server = HttpServer({path: {"GET": self._pods}}, max_body=1 << 20)
        await self._server.start("127.0.0.1", self.port)
        self.port = self._server.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.cleanup()
            self._server = None
            self._watchers.clear()

    async def restart(self, down_s: float = 0.0) -> None:
        await self.stop()
        await asyncio.sleep(down_s)
        await self.start()

    # ---------------------------------------------------------------- what the test changes
    def put(self, pod: dict[str, Any]) -> None:
        kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
        self._change(kind, pod)

    def set_ready(self, name: str, ready: bool) -> None:
        pod = copy.deepcopy(self.pods[name])
        for cond in pod["status"]["conditions"]:
            if cond["type"] == "Ready":
                cond["status"] = "True" if ready else "False"
        self._change("MODIFIED", pod)

    def delete(self, name: str) -> None:
        self._change("DELETED", self.pods[name])

    def end_watches(self) -> None:
        """End every open watch now, as the server does when a watch times out or it sheds load."""
        for _, queue in self._watchers:
            queue.put_nowait(None)
        self._watchers.clear()

    def compact(self) -> None:
        self.history.clear()
        self.compacted_at = self.version

    def _change(self, kind: str, pod: dict[str, Any]) -> None:
        self.version += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["namespace"] = self.namespace
        pod["metadata"]["resourceVersion"] = str(self.version)
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            del self.pods[name]
        else:
            self.pods[name] = pod
        self.history.append((self.version, kind, pod))
        for requirements, queue in self._watchers:
            if _selected(requirements, pod):
                queue.put_nowait({"type": kind, "object": pod})

    # ---------------------------------------------------------------- the API
    async def _pods(self, request: HttpRequest) -> HttpResponse | StreamResponse:
        query = request.query
        self.authorizations.append(request.headers.get("authorization", ""))
        requirements = parse_selector(query.get("labelSelector", "")) if query.get("labelSelector") else []
        if query.get("watch") in ("1", "true"):
            return await self._watch(
                request,
                requirements,
                int(query.get("resourceVersion") or self.version),
                float(query.get("timeoutSeconds") or 3600),
            )
        self.requests.append("LIST")
        items = [p for p in self.pods.values() if _selected(requirements, p)]
        return json_response(
            {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}, "items": items}
        )

    async def _watch(self, request: HttpRequest, requirements: list, since: int, timeout_s: float) -> StreamResponse:
        self.requests.append(f"WATCH {since}")
        resp = StreamResponse(200, {"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.compacted_at:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {since} ({self.compacted_at})",
            }
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            await resp.write_eof()
            return resp
        queue: asyncio.Queue = asyncio.Queue()
        for version, kind, pod in self.history:
            if version > since and _selected(requirements, pod):
                queue.put_nowait({"type": kind, "object": pod})
        watcher = (requirements, queue)
        self._watchers.append(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), deadline - loop.time())
                except TimeoutError:
                    event = None
                if event is None:  # the watch ends: a normal end of the response
                    await resp.write_eof()
                    return resp
                await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)


def _selected(requirements: list, pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels", {})
    return all(r.matches(labels) for r in requirements)

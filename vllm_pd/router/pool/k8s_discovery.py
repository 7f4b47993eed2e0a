"""Instances from Kubernetes: the pods of one label selector per role, listed then watched.

Per role a task LISTs the selected pods, then WATCHes from the list's
resourceVersion and applies ADDED/MODIFIED/DELETED as they come. After every
change the role's instances are reconciled with its routable pods (see
k8s_pods.py) through the pool's own add/drain/undrain/remove, the path the
admin API takes:

- a pod that becomes routable is added (or undrained, if it came back before
  its instance was removed);
- an instance whose pod went away (deleted, terminating, not Ready) is
  drained: no new requests, those in flight finish; once its load is 0 it is
  removed.

A watch that ends is renewed from the last resourceVersion; 410 Gone (that
version is too old) means LIST again; an unreachable API server is retried
with exponential backoff, then LISTed again, so changes made meanwhile are
not missed. Only instances this discovery added are ever drained or removed:
instances from flags, the YAML file or the admin API are left alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from vllm_pd.router.config import ConfigError, InstanceConfig, K8sDiscoveryConfig
from vllm_pd.router.k8s.k8s_api import ApiError, KubeApi, ResourceExpired, service_account_namespace
from vllm_pd.router.k8s.k8s_pods import Pod, PodConfigError, pod_target
from vllm_pd.router.pool.instance_pool import InstancePool

logger = logging.getLogger(__name__)

BACKOFF_MIN = 0.2  # seconds before the first reconnect


class KubernetesDiscovery:
    def __init__(
        self,
        pool: InstancePool,
        config: K8sDiscoveryConfig,
        api: KubeApi | None = None,
        on_added: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._pool = pool
        self._config = config
        self._api = api or (KubeApi(config.api_url) if config.api_url else KubeApi.in_cluster())
        self.namespace = config.namespace or service_account_namespace() or "default"
        self._on_added = on_added
        self._pods: dict[str, dict[str, Pod]] = {role: {} for role in config.selectors()}
        self._owned: dict[str, str] = {}  # url -> role, the instances this discovery added
        self._drained: set[str] = set()  # those of them it drained (their pods went away)
        self._tasks: list[asyncio.Task[None]] = []
        self.lists = 0  # LISTs done (a watch that expired or lost its server starts over with one)
        self.failures = 0  # API calls that failed (the server unreachable or answering an error)

    def start(self) -> None:
        for role, selector in self._config.selectors().items():
            self._tasks.append(asyncio.create_task(self._follow(role, selector), name=f"k8s-discovery-{role}"))
        self._tasks.append(asyncio.create_task(self._reap_loop(), name="k8s-discovery-reaper"))
        logger.info("discovering instances in namespace %s: %s", self.namespace, self._config.selectors())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._api.close()

    # --------------------------------------------------------------- the API side
    async def _follow(self, role: str, selector: str) -> None:
        backoff = BACKOFF_MIN
        while True:
            try:
                version = await self._list(role, selector)
                backoff = BACKOFF_MIN
                while True:  # renew the watch each time the server ends it
                    version = await self._watch(role, selector, version)
            except ResourceExpired as e:
                logger.info("%s pods: %s; listing again", role, e)
            except Exception as e:
                self.failures += 1
                if isinstance(e, ApiError):
                    logger.warning("%s pods: %s; retrying in %.1f s", role, e, backoff)
                else:
                    logger.exception("%s pods: discovery failed; retrying in %.1f s", role, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._config.backoff_max)

    async def _list(self, role: str, selector: str) -> str:
        pods = await self._api.list_pods(self.namespace, selector)
        self.lists += 1
        self._pods[role] = {pod.key: pod for pod in pods.items}
        await self._reconcile(role)
        return pods.metadata.resourceVersion

    async def _watch(self, role: str, selector: str, version: str) -> str:
        async for kind, pod in self._api.watch_pods(self.namespace, selector, version, self._config.watch_timeout):
            version = pod.metadata.resourceVersion or version
            if kind == "DELETED":
                self._pods[role].pop(pod.key, None)
            elif kind in ("ADDED", "MODIFIED"):
                self._pods[role][pod.key] = pod
            else:  # BOOKMARK: only the version moved
                continue
            await self._reconcile(role)
        return version

    # --------------------------------------------------------------- the pool side
    async def _reconcile(self, role: str) -> None:
        wanted = self._targets(role)
        added = False
        for url, target in wanted.items():
            added |= self._ensure(url, role, target)
        for url, owner in list(self._owned.items()):
            if owner == role and url not in wanted and url not in self._drained and self._known(url):
                self._pool.drain(url)
                self._drained.add(url)
        if added and self._on_added is not None:
            await self._on_added()

    def _targets(self, role: str) -> dict[str, InstanceConfig]:
        wanted: dict[str, InstanceConfig] = {}
        for pod in self._pods[role].values():
            try:
                target = pod_target(pod, self._config.http_port)
                if target is not None:
                    wanted[target.url] = InstanceConfig(url=target.url, role=role, kv_endpoint=target.kv_endpoint)
            except (PodConfigError, ConfigError) as e:
                logger.warning("pod %s is not routed: %s", pod.metadata.name, e)
        return wanted

    def _ensure(self, url: str, role: str, wanted: InstanceConfig) -> bool:
        """Route to ``url``; True when it was added just now."""
        owner = self._owned.get(url)
        if owner is None or not self._known(url):
            try:
                self._pool.add(wanted)
            except ConfigError as e:  # an instance configured by hand already has this URL
                logger.warning("pod instance %s (%s) is not routed: %s", url, role, e)
                return False
            self._owned[url] = role
            return True
        if owner != role:
            logger.warning("pod instance %s is selected as %s and as %s; it stays %s", url, owner, role, owner)
            return False
        inst = self._pool.get(url)
        if url in self._drained:  # its pod is back before the instance was removed
            self._drained.discard(url)
            self._pool.undrain(url)
        inst.kv_endpoint = wanted.kv_endpoint
        return False

    def _known(self, url: str) -> bool:
        """Whether our instance is still in the pool (the admin API may have removed it); forget it if not."""
        try:
            self._pool.get(url)
            return True
        except KeyError:
            self._owned.pop(url, None)
            self._drained.discard(url)
            return False

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reap_interval)
            self.reap()

    def reap(self) -> None:
        """Remove the instances we drained once their last request has finished."""
        for url in list(self._drained):
            if not self._known(url):
                continue
            if self._pool.get(url).load == 0:
                self._pool.remove(url)
                del self._owned[url]
                self._drained.discard(url)

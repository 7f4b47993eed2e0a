"""N prefill + M decode vLLM servers on this machine, configured for the PD connector.

Used by ``vllm-pd up`` and the proxy's end-to-end tests. Every server gets a
free HTTP port, a distinct free KV port, its own CPU cores where the
machine has enough (VLLM_CPU_OMP_THREADS_BIND), so servers do not fight over
the same core's OpenMP threads, and its own GPUs where asked (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_pd import CONNECTOR_NAME
from vllm_pd.errors import ConfigError
from vllm_pd.router.config import InstanceConfig
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port

logger = logging.getLogger(__name__)

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def cpu_bindings(n_servers: int, cores: list[int] | None = None) -> list[str]:
    """One core list per server: disjoint ranges when there are enough cores, else shared single cores."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n_servers <= 0:
        return []
    if len(cores) >= n_servers:
        per = len(cores) // n_servers
        groups = [cores[i * per : (i + 1) * per] for i in range(n_servers)]
        # "a-b" for contiguous groups: the form vLLM's docs use for VLLM_CPU_OMP_THREADS_BIND
        return [
            f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1 and len(g) > 1 else ",".join(map(str, g)) for g in groups
        ]
    return [str(cores[i % len(cores)]) for i in range(n_servers)]


def visible_gpus() -> list[str]:
    """Ids of the GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none without torch.cuda)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    # a child's CUDA_VISIBLE_DEVICES names devices as the machine does, not as our own restricted view
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return inherited[:count] if inherited else [str(i) for i in range(count)]


def gpu_bindings(n_servers: int, per_instance: int, gpus: list[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each server: ``per_instance`` GPUs of its own, in order; None when 0."""
    if per_instance < 0:
        raise ConfigError(f"gpus_per_instance must be >= 0, not {per_instance}")
    if per_instance == 0:
        return [None] * n_servers
    if n_servers * per_instance > len(gpus):
        raise ConfigError(
            f"gpus_per_instance={per_instance} for {n_servers} servers needs "
            f"{n_servers * per_instance} GPUs, {len(gpus)} visible ({','.join(gpus) or 'none'})"
        )
    return [",".join(gpus[i * per_instance : (i + 1) * per_instance]) for i in range(n_servers)]


@dataclass
class LocalServer:
    name: str
    role: str
    server: VllmServer
    kv_port: int
    transport: str = "tcp"
    kv_events_port: int | None = None  # its vLLM KV-event publisher (kv_aware routing)

    @property
    def kv_endpoint(self) -> str:
        return f"{self.transport}://{self.server.spec.host}:{self.kv_port}"

    def instance_config(self) -> InstanceConfig:
        # prefill never receives pushed KV, so only decode-capable instances advertise an endpoint
        push_target = self.role != "prefill" and self.server.spec.kv_transfer_config is not None
        events = None if self.kv_events_port is None else f"tcp://{self.server.spec.host}:{self.kv_events_port}"
        return InstanceConfig(self.server.url, self.role, self.kv_endpoint if push_target else None, events)


@dataclass
class LocalCluster:
    model: str
    n_prefill: int = 1
    n_decode: int = 1
    n_both: int = 0
    host: str = "127.0.0.1"
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vllm-pd-up-")))
    extra_args: list[str] = field(default_factory=list)
    connector: str | None = CONNECTOR_NAME  # None: plain vLLM servers (no KV connector)
    transport: str = "tcp"
    connector_extra: dict = field(default_factory=dict)  # more kv_connector_extra_config keys
    max_model_len: int = 2048
    served_model_name: str | None = None
    # GPUs of each server; 0 = none assigned (CPU, or every server sees every GPU)
    gpus_per_instance: int = 0
    gpus: list[str] = field(default_factory=list)  # the GPUs to hand out (visible_gpus())
    serve_cli: bool = False  # start servers with `vllm serve` (see VllmServerSpec)
    kv_events: bool = False  # each server publishes its prefix cache's KV events (ZMQ) for kv_aware
    secret_file: str | None = None  # the deployment secret every server's KV connections prove
    servers: list[LocalServer] = field(default_factory=list)

    def start(self) -> None:
        roles = ["prefill"] * self.n_prefill + ["decode"] * self.n_decode + ["both"] * self.n_both
        binds = cpu_bindings(len(roles))
        gpu_sets = gpu_bindings(len(roles), self.gpus_per_instance, self.gpus)
        # each server has cores of its own: confine its whole process tree (API server, engine core,
        # worker) to them, not only vLLM's OpenMP threads, so servers never steal each other's cores
        pin = len(set(binds)) == len(binds) and shutil.which("taskset") is not None
        used: set[int] = set()
        counters = {"prefill": 0, "decode": 0, "both": 0}
        for role, cores, gpus in zip(roles, binds, gpu_sets):
            name = f"{role[0]}{counters[role]}"
            counters[role] += 1
            port, kv_port = _distinct_port(used), _distinct_port(used)
            kv_cfg = (
                None
                if self.connector is None
                else {
                    "kv_connector": self.connector,
                    "kv_role": KV_ROLES[role],
                    "kv_port": kv_port,
                    # a KV load that fails is recomputed on decode rather than failing the request
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "transport": self.transport,
                        "host": self.host,
                        **({"secret_file": self.secret_file} if self.secret_file else {}),
                        **_with_instance_url(self.connector_extra, self.host, port),
                    },
                }
            )
            events_port = _distinct_port(used) if self.kv_events else None
            extra = list(self.extra_args)
            if events_port is not None:
                extra += [
                    "--kv-events-config",
                    json.dumps(
                        {
                            "enable_kv_cache_events": True,
                            "publisher": "zmq",
                            # vLLM binds only wildcard endpoints (else it connects): all interfaces
                            "endpoint": f"tcp://*:{events_port}",
                        }
                    ),
                ]
            spec = VllmServerSpec(
                model=self.model,
                port=port,
                host=self.host,
                kv_transfer_config=kv_cfg,
                cpu_cores=cores,
                pin_processes=pin,
                max_model_len=self.max_model_len,
                served_model_name=self.served_model_name,
                extra_args=extra,
                gpus=gpus,
                serve_cli=self.serve_cli,
            )
            server = VllmServer(spec, log_path=self.log_dir / f"{name}.log").start()
            self.servers.append(LocalServer(name, role, server, kv_port, self.transport, events_port))

    def wait_healthy(self, timeout: float = 900.0, progress: Callable[[dict[str, str]], None] | None = None) -> None:
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        pending = {s.name: s for s in self.servers}
        states = {s.name: "starting" for s in self.servers}
        while pending:
            for name, s in list(pending.items()):
                if not s.server.alive():
                    raise RuntimeError(
                        f"vLLM server {name} exited during start-up; log {s.server.log_path}:\n{s.server.log_tail()}"
                    )
                if s.server.healthy():
                    states[name] = f"ready {time.monotonic() - t0:.0f}s"
                    del pending[name]
            if progress:
                progress(states)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM servers {sorted(pending)} not healthy after {timeout:.0f}s (logs in {self.log_dir})"
                )
            time.sleep(1.0)

    def instances(self) -> list[InstanceConfig]:
        return [s.instance_config() for s in self.servers]

    @contextlib.contextmanager
    def running(self, timeout: float = 900.0) -> Iterator[LocalCluster]:
        """Started and healthy inside the ``with`` block; stopped after it, also when the start fails."""
        try:
            self.start()
            self.wait_healthy(timeout)
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        for s in self.servers:
            s.server.stop()


def _with_instance_url(extra: dict, host: str, port: int) -> dict:
    """``extra`` with ``store.instance_url`` set to the server's own URL (unless given): its store
    then tells the master which instance it is, for the proxy's kv_aware routing."""
    store = extra.get("store")
    if not isinstance(store, dict) or "instance_url" in store:
        return extra
    return {**extra, "store": {**store, "instance_url": f"http://{host}:{port}"}}


def _distinct_port(used: set[int]) -> int:
    while True:
        p = free_port()
        # TP rank r listens on kv_port + r: keep neighbours free of each other too
        if p not in used and p + 1 not in used and p - 1 not in used:
            used.add(p)
            return p

"""Prefill, decode and the proxy on three hosts of one machine (tests/support/netns_hosts.py), with a
steady load that a fault strikes: shared by tests/e2e/test_multihost_e2e.py and
benchmarks/partition_failover.py.

The prefill server runs on host "prefill" (core 0), the decode server on host "decode"
(core 1), the proxy as its own process on host "proxy"; the caller is a fourth host on the
bridge. KV goes over tcp (or nixl) across the links.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

from tests.support import e2e_cluster as ec
from tests.support.netns_hosts import NetnsHosts
from tests.support.prompt_catalogue import CATALOGUE
from vllm_pd.vllm_server import VllmServer, free_port

# long prompts: a request spends most of its time in prefill and the KV's transfer
LOAD_KEYS = ("ids1000", "ids1500", "ids640", "text4", "chat3", "ids512", "ids2032")


@dataclass
class ConnectorTimes:
    """Decode's bounds on KV that stalls (kv_connector_extra_config; None: the connector's default),
    and prefill's lease."""

    push_wait_s: float | None = None
    peer_probe_s: float | None = None
    lease_s: float = 20.0


class Server(Protocol):
    """A backend on one host: a vLLM server, or a mock one."""

    @property
    def url(self) -> str: ...

    @property
    def pid(self) -> int | None: ...


@dataclass
class MockServer:
    """tests/support/mock_backend.py as a process on one host (its own process group)."""

    proc: subprocess.Popen[bytes]
    url: str

    @property
    def pid(self) -> int | None:
        return self.proc.pid


@dataclass
class Cluster:
    net: NetnsHosts
    prefill: Server
    decode: Server
    decode_kv: str | None
    log_dir: Path
    proxy_url: str = ""
    proxy_log: Path | None = None
    _proxy: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start_proxy(self, **config: Any) -> None:
        """(Re)start the proxy on host "proxy" with these ProxyConfig fields (none: its defaults, as the
        README starts it)."""
        self.stop_proxy()
        self._proxy, self.proxy_url, self.proxy_log = start_proxy(
            self.net, self.log_dir, self.prefill.url, self.decode.url, self.decode_kv, **config
        )

    def proxy_ready(self) -> bool:
        return proxy_ready(self.proxy_url)

    def stop_proxy(self) -> None:
        if self._proxy is not None:
            self._proxy.kill()
            self._proxy.wait()
            self._proxy = None

    def pause_prefill(self) -> None:
        """SIGSTOP prefill's whole process group: connections stay open, nothing answers."""
        os.killpg(self._pid(self.prefill), signal.SIGSTOP)

    def resume_prefill(self) -> None:
        os.killpg(self._pid(self.prefill), signal.SIGCONT)

    def pause_decode(self) -> None:
        os.killpg(self._pid(self.decode), signal.SIGSTOP)

    def resume_decode(self) -> None:
        os.killpg(self._pid(self.decode), signal.SIGCONT)

    @staticmethod
    def _pid(server: Server) -> int:
        assert server.pid is not None
        return server.pid


def start_proxy(
    net: NetnsHosts, log_dir: Path, prefill_url: str, decode_url: str, decode_kv: str | None, **config: Any
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """The proxy as its own process on host "proxy", over one prefill and one decode, with these
    ProxyConfig fields; returns (process, its URL, its log). The caller kills it."""
    host = net["proxy"]
    port = free_port()
    decode: dict[str, Any] = {"url": decode_url, "role": "decode"}
    if decode_kv is not None:
        decode["kv_endpoint"] = decode_kv
    secret = log_dir / "deployment-secret"  # the cluster's (multihost_cluster), for releases
    full = {
        "host": host.address,
        "port": port,
        **({"secret_file": str(secret)} if secret.exists() else {}),
        **config,
        "instances": [{"url": prefill_url, "role": "prefill"}, decode],
    }
    path = log_dir / f"proxy-{port}.yaml"
    path.write_text(yaml.safe_dump(full))
    log_path = log_dir / f"proxy-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            host.command([sys.executable, "-m", "vllm_pd.cli", "--log-level", "INFO", "proxy", "--config", str(path)]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://{host.address}:{port}"
    if not ec.wait_until(lambda: proxy_ready(url), timeout=60):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"proxy did not start: {log_path.read_text()[-2000:]}")
    return proc, url, log_path


def proxy_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _connector(address: str, kv_port: int, transport: str, times: ConnectorTimes, secret_file: str) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "transport": transport,
        "host": address,
        "lease_s": times.lease_s,
        "secret_file": secret_file,
    }
    extra.update(
        {k: v for k, v in (("push_wait_s", times.push_wait_s), ("peer_probe_s", times.peer_probe_s)) if v is not None}
    )
    return {
        "kv_connector": "PDConnector",
        "kv_role": "kv_both",
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@contextlib.contextmanager
def multihost_cluster(
    model: Path, log_dir: Path, transport: str = "tcp", times: ConnectorTimes | None = None
) -> Iterator[Cluster]:
    """The hosts and both servers (no proxy yet: ``start_proxy``); everything is torn down after."""
    times = times or ConnectorTimes()
    secret_file = ec.write_secret(log_dir)  # across hosts the KV endpoints listen beyond loopback: with a secret
    with NetnsHosts(["prefill", "decode", "proxy"]) as net:
        servers: list[tuple[VllmServer, int]] = []
        cluster: Cluster | None = None
        try:
            for name, cores in (("prefill", "0"), ("decode", "1")):
                host, kv_port = net[name], free_port()
                spec = ec.server_spec(model, cores, _connector(host.address, kv_port, transport, times, secret_file))
                spec.host, spec.netns = host.address, host.netns
                servers.append((VllmServer(spec, log_dir / f"vllm-{name}.log").start(), kv_port))
            for server, _ in servers:
                server.wait_healthy(timeout=900)
            (prefill, _), (decode, decode_kv_port) = servers
            cluster = Cluster(net, prefill, decode, f"{transport}://{net['decode'].address}:{decode_kv_port}", log_dir)
            yield cluster
        finally:
            if cluster is not None:
                cluster.stop_proxy()
            for server, _ in servers:
                if server.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(server.pid, signal.SIGCONT)  # a stopped group would not take SIGTERM
                server.stop()


def start_mock(net: NetnsHosts, host: str, name: str, ttft: float) -> MockServer:
    """A mock backend on ``host`` answering after ``ttft`` seconds."""
    port = free_port()
    proc = subprocess.Popen(
        net[host].command(
            [
                sys.executable,
                "-m",
                "tests.support.mock_backend",
                "--host",
                net[host].address,
                "--port",
                str(port),
                "--name",
                name,
                "--ttft",
                str(ttft),
            ]
        ),
        start_new_session=True,
    )
    mock = MockServer(proc, f"http://{net[host].address}:{port}")
    if not ec.wait_until(lambda: _answers(mock.url), timeout=60, interval=0.2):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"mock backend {name} did not start")
    return mock


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def mock_cluster(log_dir: Path, prefill_ttft: float = 0.3) -> Iterator[Cluster]:
    """The same hosts with mock backends instead of vLLM (no KV moves: decode gets prefill's answer);
    the proxy's model name must include the catalogue's ("small")."""
    with NetnsHosts(["prefill", "decode", "proxy"]) as net:
        mocks: list[MockServer] = []
        cluster: Cluster | None = None
        try:
            mocks.append(start_mock(net, "prefill", "p0", prefill_ttft))
            mocks.append(start_mock(net, "decode", "d0", 0.05))
            cluster = Cluster(net, mocks[0], mocks[1], None, log_dir)
            yield cluster
        finally:
            if cluster is not None:
                cluster.stop_proxy()
            for mock in mocks:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(mock.proc.pid, signal.SIGKILL)
                mock.proc.wait()


# ---- a steady load that a fault strikes ---------------------------------------------------------
@dataclass
class Sent:
    key: str
    start: float
    end: float
    tokens: list[int] | None
    error: str | None = None


def send(url: str, key: str) -> Sent:
    body = CATALOGUE[key]
    t0 = time.monotonic()
    try:
        with httpx.Client() as client:
            r = client.post(url + ec.endpoint_for(body), json=body, timeout=600)
        if r.status_code != 200:
            return Sent(key, t0, time.monotonic(), None, f"HTTP {r.status_code}: {r.text[:300]}")
        ids = r.json()["choices"][0].get("token_ids")  # None from a mock backend
        return Sent(key, t0, time.monotonic(), list(ids) if ids is not None else None)
    except httpx.HTTPError as e:
        return Sent(key, t0, time.monotonic(), None, repr(e))


def load_through(
    url: str,
    fault: Callable[[], None],
    heal: Callable[[], None],
    outage_s: float,
    heal_early: bool = True,
    streams: int = 3,
    busy_s: float = 10.0,
) -> tuple[list[Sent], float]:
    """``streams`` clients send requests back to back from 1 s before the fault until ``busy_s``
    after it (so some go out while the fault is not yet detected); the fault heals after
    ``outage_s`` - or, with ``heal_early``, as soon as every request finished. Returns what was
    sent and when the fault struck."""
    sent: list[Sent] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 1.0 + busy_s

    def stream(i: int) -> None:
        j = 0
        while time.monotonic() < stop_at:
            s = send(url, LOAD_KEYS[(i * 5 + j) % len(LOAD_KEYS)])
            j += 1
            with lock:
                sent.append(s)
            if s.error is not None:
                time.sleep(0.5)  # a refused request (nothing to serve it) is not retried in a tight loop

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the first requests are in flight
    struck = time.monotonic()
    fault()
    try:
        for t in threads:
            t.join(timeout=max(0.0, struck + outage_s - time.monotonic()))
        if not heal_early:
            time.sleep(max(0.0, struck + outage_s - time.monotonic()))
    finally:
        heal()
    for t in threads:
        t.join(timeout=600)
    return sent, struck


def waits_after(sent: list[Sent], struck: float) -> list[float]:
    """For each request still running at the fault or sent during it: seconds from the later of
    the fault and its start to its answer."""
    return [s.end - max(s.start, struck) for s in sent if s.end > struck]

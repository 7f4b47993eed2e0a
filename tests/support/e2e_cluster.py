"""Real vLLM servers for end-to-end tests: started once per session, in phases.

Two cores cannot run three vLLM servers without starving them, so the plain
(reference) instance runs first, alone, over the whole prompt catalogue, and is
stopped before the disaggregated instances start.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.transfer_params import AwaitedPrefill, RemoteDecodeRequest
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port

logger = logging.getLogger(__name__)

MAX_MODEL_LEN = 2048
MAX_TOKENS = 12
# Both instances of a test pair share this host: the same-host transport, whose pushes go as
# layer plans read from prefill's memory (tcp pairs run in the router and store e2e tests).
# VLLM_PD_TEST_TRANSPORT=nixl (or tcp) runs the connector's e2e tests over another transport.
TRANSPORT = os.environ.get("VLLM_PD_TEST_TRANSPORT", "shm")


def write_secret(folder: Path) -> str:
    """A fresh deployment secret in ``folder`` (mode 0600), as `vllm-pd up` makes one; its path."""
    from vllm_pd.connector.deployment_secret import write_new_secret

    return write_new_secret(folder / "deployment-secret")


def connector_config(role: str, kv_port: int, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "PDConnector",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transport": TRANSPORT, "host": "127.0.0.1", **extra},
    }


@dataclass
class Instance:
    server: VllmServer
    kv_port: int | None
    secret_file: str | None = None  # the deployment secret its KV endpoint requires (None: loopback, none)

    @property
    def secret(self) -> DeploymentSecret | None:
        from vllm_pd.connector.deployment_secret import load_secret

        return load_secret(self.secret_file, env={}) if self.secret_file else None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def transport(self) -> str:
        """The transport its connector config names (TRANSPORT unless a test chose another)."""
        spec = getattr(self.server, "spec", None)  # none for a server of VLLM_PD_TEST_CLUSTER
        extra = (spec.kv_transfer_config or {}).get("kv_connector_extra_config", {}) if spec else {}
        return str(extra.get("transport", TRANSPORT))

    @property
    def kv_endpoint(self) -> str:
        return f"{self.transport}://127.0.0.1:{self.kv_port}"


# VLLM_PD_TEST_COMPILE=1: servers without --enforce-eager (vLLM CPU compiles the model with
# torch.compile; slower start-up), to check the connector's per-layer hooks under compilation
COMPILE = os.environ.get("VLLM_PD_TEST_COMPILE") == "1"


def server_spec(model: Path, cores: str, ktc: dict[str, Any] | None) -> VllmServerSpec:
    return VllmServerSpec(
        model=str(model),
        port=free_port(),
        kv_transfer_config=ktc,
        cpu_cores=cores,
        enforce_eager=not COMPILE,
        max_model_len=MAX_MODEL_LEN,
        served_model_name="small",
        extra_args=["--enable-prompt-tokens-details", "--seed", "0"],
    )


# servers started and not yet stopped: a failing e2e test's report shows what their logs say
LIVE: list[Instance] = []
# what a failure report keeps of a server's log: our connector's lines and vLLM's complaints
NOTEWORTHY = ("WARNING", "ERROR", "Traceback", "vllm_pd", "Error:", "KV Transfer metrics")
NOISE = (
    "LD_PRELOAD",
    "Triton is not installed",
    "ulimit",
    "Enforce eager",
    "Inductor compilation",
    "Model Runner V2",
    "SSM cache",
    "KVConnectorBase_V1",
    "DeprecationWarning",
    "FutureWarning",
)


def start_all(specs: list[tuple[VllmServerSpec, int | None]], log_dir: Path) -> list[Instance]:
    instances = [
        Instance(
            VllmServer(spec, log_dir / f"vllm-{spec.port}.log").start(),
            kv_port,
            (spec.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("secret_file"),
        )
        for spec, kv_port in specs
    ]
    LIVE.extend(instances)
    try:
        for inst in instances:
            inst.server.wait_healthy(timeout=900)
    except BaseException:
        stop_all(instances)
        raise
    return instances


def stop_all(instances: list[Instance]) -> None:
    for inst in instances:
        inst.server.stop()
        if inst in LIVE:
            LIVE.remove(inst)


def live_log_digest(lines_per_server: int = 60) -> str:
    """The noteworthy tail of every live server's log: CI keeps only pytest's output."""
    parts = []
    for inst in LIVE:
        path = inst.server.log_path
        text = path.read_text(errors="replace").splitlines() if path is not None and path.exists() else []
        kept = [ln[:400] for ln in text if any(w in ln for w in NOTEWORTHY) and not any(w in ln for w in NOISE)]
        parts.append(
            f"--- {inst.url} ({path}): last {lines_per_server} noteworthy of {len(text)} lines\n"
            + "\n".join(kept[-lines_per_server:])
        )
    return "\n".join(parts)


# ---- requests ---------------------------------------------------------------------------------
def completion_body(prompt: str | list[int], max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return {
        "model": "small",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }


def chat_body(text: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return {
        "model": "small",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }


def endpoint_for(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(url + endpoint_for(body), json=body, timeout=300)
    assert r.status_code == 200, f"{url}: HTTP {r.status_code}: {r.text[:500]}"
    return r.json()


def output_tokens(resp: dict[str, Any]) -> list[int]:
    choice = resp["choices"][0]
    ids = choice.get("token_ids")
    assert ids is not None, f"no token_ids in {resp}"
    return list(ids)


def prefill_leg(body: dict[str, Any], mode: str, decode: Instance | None, transfer_id: str = "") -> dict[str, Any]:
    ask = RemoteDecodeRequest()
    if mode == "push" or transfer_id:
        assert decode is not None
        ask = RemoteDecodeRequest(mode, decode.kv_endpoint, transfer_id)  # type: ignore[arg-type]
    leg = dict(body, max_tokens=1, stream=False, kv_transfer_params=ask.to_params())
    leg.pop("stream_options", None)
    return leg


# the decode leg of mode "beside" runs on this thread, with its own connection pool
_beside_pool = ThreadPoolExecutor(1)
_beside_client = httpx.Client()


def disagg(
    client: httpx.Client,
    prefill: Instance,
    decode: Instance,
    body: dict[str, Any],
    mode: str,
    load_mode: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's standard two-leg PD flow, by hand: (prefill response, decode response).

    modes "push-beside" / "pull-beside": our proxy's flow - the decode leg goes out first, waiting
    for prefill's announcement of the transfer named in both legs, and the prefill leg right after.
    ``load_mode``: the decode leg asks for this load mode instead of decode's configured one."""
    ask = {} if load_mode is None else {"load_mode": load_mode}
    if mode.endswith("-beside"):
        transfer_id, transfer_mode = uuid.uuid4().hex, mode.split("-")[0]
        awaited = AwaitedPrefill(transfer_id, transfer_mode).to_params()  # type: ignore[arg-type]
        leg = _beside_pool.submit(post, _beside_client, decode.url, dict(body, kv_transfer_params={**awaited, **ask}))
        p = post(client, prefill.url, prefill_leg(body, transfer_mode, decode, transfer_id=transfer_id))
        return p, leg.result()
    p = post(client, prefill.url, prefill_leg(body, mode, decode))
    assert p.get("kv_transfer_params"), f"prefill returned no kv_transfer_params: {p}"
    d = post(client, decode.url, dict(body, kv_transfer_params={**p["kv_transfer_params"], **ask}))
    return p, d


def metric(client: httpx.Client, url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples on a vLLM server (0 if absent)."""
    text = client.get(url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(pred: Any, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())

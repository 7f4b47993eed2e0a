"""A planned deployment as a proxy YAML (``vllm-pd proxy --config``) and a ``vllm-pd up`` command line."""

from __future__ import annotations

import yaml

from vllm_pd.planner.pd_simulator import Deployment

FIRST_PORT = 8100  # instance URLs in the YAML are placeholders from here on: edit them to your servers
FIRST_KV_PORT = 5600


def proxy_yaml(d: Deployment, host: str = "127.0.0.1", port: int = 8000) -> str:
    instances = []
    for n in range(d.prefill):
        instances.append({"url": f"http://{host}:{FIRST_PORT + n}", "role": "prefill"})
    for n in range(d.decode):
        inst = {"url": f"http://{host}:{FIRST_PORT + d.prefill + n}", "role": "decode"}
        if not d.colocated:
            inst["kv_endpoint"] = f"tcp://{host}:{FIRST_KV_PORT + n}"
        instances.append(inst)
    tp = (
        f"TP {d.tp_prefill} per prefill and {d.tp_decode} per decode instance"
        if not d.colocated
        else f"TP {d.tp_decode} per instance"
    )
    note = f"# vllm-pd plan: {d.label} ({tp})\n# URLs and KV endpoints are placeholders: point them at your servers\n"
    if d.colocated:
        note += "# colocated: plain vLLM instances, every request runs on one (no prefill leg)\n"
    return note + yaml.safe_dump({"host": host, "port": port, "instances": instances}, sort_keys=False)


def up_command(d: Deployment) -> str:
    """The ``vllm-pd up`` line that starts ``d`` on one machine. ``up`` gives every server one TP size:
    a plan with another TP per role gets its TP 1 line (see :func:`up_runs_tp`)."""
    line = (
        f"vllm-pd up --prefill 0 --decode {d.decode} --connector none"
        if d.colocated
        else f"vllm-pd up --prefill {d.prefill} --decode {d.decode}"
    )
    tp = d.tp_decode
    if up_runs_tp(d) and tp > 1:
        line += f" --gpus-per-instance {tp} -- --tensor-parallel-size {tp}"
    return line


def up_runs_tp(d: Deployment) -> bool:
    """Whether ``vllm-pd up`` can start ``d``'s TP sizes (one size for every server)."""
    return d.colocated or d.tp_prefill == d.tp_decode

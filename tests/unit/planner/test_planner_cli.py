"""``vllm-pd plan`` end to end and ``vllm-pd profile`` of a dead server (no vLLM).

``vllm-pd profile`` against mock servers (the delays it measures back, a neighbour, a PD proxy):
tests/integration/test_planner_profile.py and test_planner_profile_fakes.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from vllm_pd import cli
from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, Poly, save_profile
from vllm_pd.planner.workload import TraceRequest, write_trace
from vllm_pd.router.config import ProxyConfig, load_yaml


def test_profile_of_a_dead_server_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_pd.vllm_server import free_port

    rc = cli.main(["profile", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "p.json")])
    assert rc == 1 and "vllm-pd profile: Cannot connect" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    prof = LatencyProfile("m", [InstanceProfile(1, Poly(20, 0.1, 0), Poly(10, 0.5, 0.001), Poly(5, 0.01))])
    save_profile(prof, tmp_path / "prof.json")
    write_trace([TraceRequest(i * 0.5, 200 + 10 * i, 8) for i in range(40)], tmp_path / "trace.jsonl")
    return tmp_path / "prof.json", tmp_path / "trace.jsonl"


def test_plan_writes_a_config_the_proxy_loads_and_an_up_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prof, trace = _write_inputs(tmp_path)
    out_yaml = tmp_path / "plan.yaml"
    rc = cli.main(
        [
            "plan",
            "--profile",
            str(prof),
            "--workload",
            str(trace),
            "--slo",
            "ttft=500ms,tpot=0.05",
            "--devices",
            "3",
            "--yaml",
            str(out_yaml),
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for label in ("colocated x1", "colocated x3", "1P1D", "2P1D", "1P2D"):
        assert f"| {label} |" in text
    cfg = ProxyConfig(**load_yaml(out_yaml))
    assert cfg.instances
    up_line = next(line for line in text.splitlines() if line.startswith("one machine: "))
    argv = shlex.split(up_line.removeprefix("one machine: "))
    assert argv[0] == "vllm-pd"
    args = cli.build_parser().parse_args(argv[1:])
    roles = [i.role for i in cfg.instances]
    assert (args.prefill, args.decode) == (roles.count("prefill"), roles.count("decode"))


def test_plan_yaml_for_disaggregated_and_colocated(tmp_path: Path) -> None:
    import yaml

    from vllm_pd.planner.deployment_yaml import proxy_yaml, up_command
    from vllm_pd.planner.pd_simulator import Deployment
    from vllm_pd.router.config import config_from_mapping

    pd = ProxyConfig(**config_from_mapping(yaml.safe_load(proxy_yaml(Deployment(2, 3)))))
    assert [i.role for i in pd.instances] == ["prefill"] * 2 + ["decode"] * 3
    assert all(i.kv_endpoint for i in pd.instances if i.role == "decode")
    co = ProxyConfig(**config_from_mapping(yaml.safe_load(proxy_yaml(Deployment(0, 2)))))
    assert [i.role for i in co.instances] == ["decode", "decode"] and not any(i.kv_endpoint for i in co.instances)
    args = cli.build_parser().parse_args(shlex.split(up_command(Deployment(0, 2)))[1:])
    assert (args.prefill, args.decode, args.connector) == (0, 2, "none")
    args = cli.build_parser().parse_args(shlex.split(up_command(Deployment(1, 2, tp_prefill=2, tp_decode=2)))[1:])
    assert (args.prefill, args.decode, args.gpus_per_instance) == (1, 2, 2)
    assert args.vllm_args == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in up_command(Deployment(1, 1, tp_prefill=2, tp_decode=1))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "ttft=1"], "slo.tpot: missing"),
        (["--slo", "ttft=1,tpot=x"], "slo.tpot"),
        (["--slo", "ttft=1,tpot=1", "--deployments", "9P9D"], "--deployments"),
    ],
)
def test_plan_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    prof, trace = _write_inputs(tmp_path)
    rc = cli.main(["plan", "--profile", str(prof), "--workload", str(trace), "--yaml", str(tmp_path / "y"), *argv])
    assert rc == 2 and message in capsys.readouterr().err


def test_plan_with_distributions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prof, _ = _write_inputs(tmp_path)
    rc = cli.main(
        [
            "plan",
            "--profile",
            str(prof),
            "--workload",
            "poisson:2,in=uniform:100:400,out=8",
            "--slo",
            "ttft=1,tpot=0.1",
            "--devices",
            "2",
            "--requests",
            "100",
            "--yaml",
            str(tmp_path / "y.yaml"),
        ]
    )
    assert rc == 0 and "best: " in capsys.readouterr().out

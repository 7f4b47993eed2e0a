"""benchmarks/gpu_check.py rehearsed without a GPU, limited to the imports a bare GPU machine has.

The whole check runs with ``--device standin`` and ``--device cpu`` in a subprocess whose every
Python process (the step processes and the harness processes they spawn) starts with
tests/support/gpu_machine_imports/sitecustomize.py: a module that is neither the standard library, nor one
the bare GPU machine has (torch, Triton, numpy, uvloop, PyYAML), nor in a wheel gpu_check carries,
nor the repository's own, raises ImportError. So an import the GPU machine cannot satisfy fails
here, in CI, not during the minutes a GPU machine is lent. What is mocked is the GPU alone: standin
is tests/support/async_device.py, cpu is vLLM's CPU case; sizes are small and the figures mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "benchmarks"))  # gpu_check imports its siblings as the script does (appended: no shadowing)

import gpu_check  # noqa: E402
import gpu_check_wheels  # noqa: E402

pytestmark = pytest.mark.gpu


def gpu_machine_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that may import only what the GPU machine (plus the wheels) has."""
    allowed = gpu_check_wheels.GPU_MACHINE_MODULES + gpu_check_wheels.carried_modules()
    imports = ROOT / "tests" / "support" / "gpu_machine_imports"
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(imports), str(ROOT)]),
        "VLLM_PD_IMPORT_ALLOW": ",".join(allowed),
        "VLLM_PD_IMPORT_ROOT": str(ROOT),
        "VLLM_PD_IMPORT_BLOCKED_LOG": str(tmp_path / "blocked.log"),
    }


def test_the_blocker_refuses_what_the_gpu_machine_lacks(tmp_path: Path) -> None:
    """Negative control: vLLM, blake3, pyzmq and httptools are not importable under the blocker, and the
    data path's modules are (transfer_params and checksum imported blake3 at the top before this issue)."""
    env = gpu_machine_env(tmp_path)
    for module in ("vllm", "blake3", "zmq", "httptools"):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert proc.returncode != 0 and "not on the bare GPU machine" in proc.stderr, (module, proc.stderr)
    data_path = (
        "vllm_pd.connector.worker.worker",
        "vllm_pd.protocol.transfer_params",
        "vllm_pd.connector.transport.checksum",
        "tests.support.gpu_harness",
    )
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    proc = subprocess.run([sys.executable, "-c", code, *data_path], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("device", ["standin", "cpu"])
def test_gpu_check_runs_every_step_with_only_the_gpu_machines_imports(device: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--device",
            device,
            "--out",
            str(out),
            "--wheels",
            str(tmp_path / "no-wheels"),
        ],
        cwd=ROOT,
        env=gpu_machine_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    seconds = time.monotonic() - started
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert [s["name"] for s in steps] == [s.name for s in gpu_check.STEPS]
    not_ok = [(s["name"], s["status"], s.get("detail"), s.get("log_tail")) for s in steps if s["status"] != "ok"]
    assert not not_ok, not_ok
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "gpu_check.md").read_text().startswith(f"# gpu_check on {device}: all ok")
    assert (out / "gpu_check.log").stat().st_size > 0
    for s in steps:  # one summary line per step, printed as it ends
        assert gpu_check.summary_line(s) in proc.stdout
    # the figures the goals are read from exist (their values mean nothing off a GPU)
    by_name = {s["name"]: s for s in steps}
    for backend in ("triton", "native"):
        assert all("x_hbm" in r for r in by_name[f"ops_mla_{backend}"]["rows"])
        assert all("x_bf16" in r for r in by_name[f"ops_fp8_{backend}"]["rows"])
    for transport in ("tcp", "shm", "nixl"):
        rows = by_name[f"connector_{transport}"]["rows"]
        assert {(r["model"], r["mode"]) for r in rows} == {
            (m.name, mode) for m in _models() for mode in ("push", "pull")
        }
    # the blocker ran in the step processes and in the harness processes they spawned
    assert len({line.split()[0] for line in (tmp_path / "blocked.log").read_text().splitlines()}) >= 4
    print(f"gpu_check --device {device}: {seconds:.0f} s here (budget {report['budget_s']:.0f} s)")


def test_nixl_left_behind_is_a_failed_step_never_a_pass(tmp_path: Path) -> None:
    """When the wheels did not fit, the nixl step says so and fails without running the harness."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / gpu_check_wheels.SKIPPED_MARKER).write_text("skipped: wheel too large (99.0 MiB)\n")
    step = next(s for s in gpu_check.STEPS if s.name == "connector_nixl")
    result = step.run(gpu_check.Context("cuda", folder, tmp_path / "site"))
    assert result["status"] == "failed" and result["key"].startswith("skipped: wheel too large"), result
    assert "nixl" not in " ".join(gpu_check_wheels.carried_modules(include_nixl=False))


def test_a_wrong_kernel_fails_its_ops_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the ops steps (CPU, native backend): an output 2 % off, and a masked GEMM that
    writes the rows it must leave alone, are failures with the shape named."""
    import gpu_check_ops
    import torch

    from vllm_pd.ops import native

    real_mla, real_masked = native.mla_decode, native.m_grouped_fp8_gemm_nt_masked

    def off_mla(*args: object) -> object:
        out, lse = real_mla(*args)
        return out * 1.02, lse

    def all_rows(a, sfa, b, sfb, d, masked_m, expected_m):
        real_masked(a, sfa, b, sfb, d, torch.full_like(masked_m, a.shape[1]), expected_m)

    monkeypatch.setattr(native, "mla_decode", off_mla)
    monkeypatch.setattr(native, "m_grouped_fp8_gemm_nt_masked", all_rows)
    mla = gpu_check_ops.mla("native", torch.device("cpu"), "small")
    assert mla["status"] == "failed" and "out:" in mla["detail"], mla["detail"]
    fp8 = gpu_check_ops.fp8("native", torch.device("cpu"), "small")
    failed = [r for r in fp8["rows"] if not r.get("ok")]
    assert fp8["status"] == "failed" and [r["kind"] for r in failed] == ["masked"], fp8["rows"]


def test_a_step_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    """The env step imports torch: half a second is not enough, and the step says so instead of hanging."""
    step = next(s for s in gpu_check.STEPS if s.name == "env")
    log = tmp_path / "log"
    log.write_text("")
    result = gpu_check._run_child(step, "cpu", tmp_path / "no-wheels", tmp_path / "site", tmp_path, log, 0.5)
    assert result["status"] == "timeout" and result["seconds"] < 30, result


def test_no_step_starts_once_the_budget_is_spent(tmp_path: Path) -> None:
    results = gpu_check.run_all("cpu", tmp_path / "no-wheels", tmp_path / "out", budget_s=gpu_check.MIN_STEP_S - 1)
    assert [r["status"] for r in results] == ["timeout"] * len(gpu_check.STEPS)
    assert all(r["detail"].startswith("not started") for r in results)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert not report["ok"] and "NOT all ok" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_dropping_entries_keeps_a_consistent_wheel(tmp_path: Path) -> None:
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=x,1\nextra/big.so,sha256=y,2\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("extra/big.so", b"\0" * 100)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    gpu_check_wheels._drop_entries(path, ("extra/",))
    with zipfile.ZipFile(path) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
        assert "extra/" not in z.read("pkg-1.0.dist-info/RECORD").decode()


def _models() -> tuple:  # imported late: gpu_check_connector imports the harness (torch)
    import gpu_check_connector

    return gpu_check_connector.MODELS

"""The GPU path proved in one command on a bare GPU machine, in at most ten minutes end to end.

    here (PyPI reachable):  python3 benchmarks/gpu_check.py --fetch-wheels .whl
    on the GPU machine:     python3 benchmarks/gpu_check.py --wheels .whl    (.whl carried; results to $OUT)
    rehearsal (CI):         python3 benchmarks/gpu_check.py --device standin|cpu --out DIR

Steps, cheapest first, NIXL last; each runs in a process group of its own under its own timeout
and what is left of the run's budget, so a hang or a crash costs that step and nothing else:

  env             torch, CUDA, the GPU, nvcc
  wheels          the carried wheels (benchmarks/gpu_check_wheels.py) pip-installed with --no-index
                  into a temporary site folder; every module they carry imports
  build           vllm_pd._C built for sm_90a (setup.py build_ext --inplace); if the CUDA build fails,
                  a CPU-only build so the connector keeps its crc32c (the step still fails)
  ops_mla_triton  benchmarks/gpu_check_ops.py: MLA decode, numerics and x HBM bandwidth,
  ops_mla_native  one step per backend
  ops_fp8_triton  benchmarks/gpu_check_ops.py: FP8 GEMMs, numerics and x bf16 matmul
  ops_fp8_native
  connector_tcp   benchmarks/gpu_check_connector.py: the harness over tcp, shm, nixl
  connector_shm
  connector_nixl

``--device cuda`` (default) runs at full size; ``standin`` / ``cpu`` run the same steps at small
sizes (figures meaningless, every code path, import and file exercised: tests/integration/test_gpu_check.py).
Writes gpu_check.json, gpu_check.md and gpu_check.log to ``--out`` (default $OUT, else
./gpu_check_out) and prints one line per step: name, ok / failed / timeout, the key figure beside
its goal (issue 24's "Goals"), seconds. This parent imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_check_wheels as wheels

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ("cuda", "standin", "cpu")
BUDGET_S = 570.0  # the device machine allows 600 s a command: room for the report and the transfers
MIN_STEP_S = 15.0  # a step is not started with less of the budget left
LOG_TAIL = 3000


@dataclass(frozen=True)
class Context:
    """What a step child knows: the device, sizes, the wheel folder and the site folder it installs into."""

    device: str
    wheels: Path | None
    site: Path

    @property
    def size(self) -> str:
        return "full" if self.device == "cuda" else "small"


# ---- the steps (each runs in its own child process) ---------------------------------------------------


def env_step(ctx: Context) -> dict[str, Any]:
    import platform

    import numpy
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "cpus": os.cpu_count(),
        "triton": _version_of("triton"),
        "nvcc": _first_line(["nvcc", "--version"], last=True),
        "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
    }
    if ctx.device != "cuda":
        return {"status": "ok", "key": f"{ctx.device}: torch {torch.__version__}", **info}
    if not torch.cuda.is_available():
        return {"status": "failed", "key": "no CUDA device", "detail": "torch.cuda.is_available() is False", **info}
    props = torch.cuda.get_device_properties(0)
    info.update(
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        sms=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
    )
    hopper = (props.major, props.minor) == (9, 0)
    return {
        "status": "ok" if hopper else "failed",
        "key": f"{props.name} sm_{props.major}{props.minor}",
        "detail": "" if hopper else "not a Hopper GPU: the sm_90a kernels cannot run here",
        **info,
    }


def wheels_step(ctx: Context) -> dict[str, Any]:
    skipped = wheels.nixl_skipped(ctx.wheels)
    installed = wheels.install(ctx.wheels, ctx.site) if ctx.wheels is not None and ctx.wheels.is_dir() else []
    modules = wheels.carried_modules(include_nixl=skipped is None)
    code = (
        "import importlib, json, sys\nfound = {}\nfor m in sys.argv[1:]:\n"
        "    try:\n        found[m] = importlib.import_module(m).__file__\n"
        "    except Exception as e:\n        found[m] = 'FAILED ' + type(e).__name__ + ': ' + str(e)\n"
        "print(json.dumps(found))"
    )
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True)
    sys.stdout.write(proc.stdout + proc.stderr)
    found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    broken = {m: f for m, f in found.items() if f is None or f.startswith("FAILED")}
    if not found:
        broken = {"python": proc.stderr}
    source = f"{len(installed)} wheels installed" if installed else "no wheel folder: the environment's own"
    problems = [f"{m}: {why}" for m, why in broken.items()] + ([f"nixl {skipped}"] if skipped else [])
    imported = len(found) - len(broken)
    return {
        "status": "failed" if broken else "ok",
        "key": f"{source}, {imported}/{len(modules)} modules import",
        "detail": "; ".join(problems)[-LOG_TAIL:],
        "installed": installed,
        "modules": found,
    }


def build_step(ctx: Context) -> dict[str, Any]:
    if ctx.device != "cuda":
        kernels = _kernels()
        if kernels.get("cpu"):
            return {"status": "ok", "key": "vllm_pd._C present with CPU kernels (not rebuilt off the GPU)", **kernels}
        rc, seconds, tail = _setup_build(gpu=False)
        kernels = _kernels()
        return {
            "status": "ok" if kernels.get("cpu") else "failed",
            "key": f"CPU-only build, {seconds:.0f} s",
            "detail": "" if kernels.get("cpu") else tail,
            "build_s": seconds,
            **kernels,
        }
    rc, seconds, tail = _setup_build(gpu=True)
    kernels = _kernels()
    if kernels.get("cuda"):
        return {"status": "ok", "key": f"sm_90a build {seconds:.0f} s", "build_s": seconds, **kernels}
    detail = f"CUDA build failed (rc {rc}): {tail}"
    rc2, seconds2, tail2 = _setup_build(gpu=False)  # the connector's crc32c needs _C even without CUDA kernels
    kernels = _kernels()
    fallback = "CPU-only build ok" if kernels.get("cpu") else f"CPU-only build failed too: {tail2}"
    return {
        "status": "failed",
        "key": f"no sm_90a kernels after {seconds:.0f} s; {fallback}",
        "detail": detail[-LOG_TAIL:],
        "build_s": seconds + seconds2,
        **kernels,
    }


def ops_step(which: str, backend: str) -> Callable[[Context], dict[str, Any]]:
    def step(ctx: Context) -> dict[str, Any]:
        import gpu_check_ops
        import torch

        device = torch.device("cuda" if ctx.device == "cuda" else "cpu")
        return (gpu_check_ops.mla if which == "mla" else gpu_check_ops.fp8)(backend, device, ctx.size)

    return step


def connector_step(transport: str) -> Callable[[Context], dict[str, Any]]:
    def step(ctx: Context) -> dict[str, Any]:
        skipped = wheels.nixl_skipped(ctx.wheels) if transport == "nixl" else None
        if skipped is not None:
            return {"status": "failed", "key": skipped, "detail": "NIXL was not carried", "goal_met": False}
        import gpu_check_connector

        return gpu_check_connector.transport_step(ctx.device, transport, ctx.size)

    return step


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Context], dict[str, Any]]
    timeout_s: float
    goal: str  # for the steps without a goal of the list: what they establish


STEPS = (
    Step("env", env_step, 60, "a Hopper GPU visible to torch"),
    Step("wheels", wheels_step, 90, "the carried modules import"),
    Step("build", build_step, 300, "vllm_pd._C with sm_90a kernels"),
    Step("ops_mla_triton", ops_step("mla", "triton"), 100, ""),
    Step("ops_mla_native", ops_step("mla", "native"), 100, ""),
    Step("ops_fp8_triton", ops_step("fp8", "triton"), 100, ""),
    Step("ops_fp8_native", ops_step("fp8", "native"), 100, ""),
    Step("connector_tcp", connector_step("tcp"), 120, ""),
    Step("connector_shm", connector_step("shm"), 120, ""),
    Step("connector_nixl", connector_step("nixl"), 150, ""),
)


# ---- helpers of the steps -----------------------------------------------------------------------------


def _version_of(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {e})"


def _first_line(cmd: list[str], last: bool = False) -> str | None:
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (lines[-1] if last else lines[0]) if lines else None


def _kernels() -> dict[str, Any]:
    """What vllm_pd._C provides, asked of a fresh interpreter (the build may have just replaced it)."""
    code = (
        "import json, torch\nfrom vllm_pd.ops import native\nerr = native.load_error()\n"
        "has = lambda key: err is None and all(torch._C._dispatch_has_kernel_for_dispatch_key("
        "f'vllm_pd_C::{op}', key) for op in ('mla_decode', 'fp8_gemm_nt'))\n"
        "import vllm_pd\nfrom pathlib import Path\n"
        "so = sorted(str(p.name) for p in Path(vllm_pd.__file__).parent.glob('_C*.so'))\n"
        "print(json.dumps({'load_error': err, 'cpu': has('CPU'), 'cuda': has('CUDA'), 'so': so}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"load_error": proc.stderr[-LOG_TAIL:], "cpu": False, "cuda": False}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _setup_build(gpu: bool) -> tuple[int, float, str]:
    """``setup.py build_ext --inplace`` (output to this step's log); (exit code, seconds, output tail)."""
    env = {
        **os.environ,
        "VLLM_PD_GPU_KERNELS": "1" if gpu else "0",
        "TORCH_CUDA_ARCH_LIST": "9.0a",
        "MAX_JOBS": str(os.cpu_count() or 4),
    }
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
    return proc.returncode, time.monotonic() - started, "".join(tail)[-LOG_TAIL:]


# ---- the parent: one child per step, the report -------------------------------------------------------


def run_all(
    device: str, wheel_folder: Path, out: Path, budget_s: float, only: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    deadline = time.monotonic() + budget_s
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        site = Path(tmp) / "site"
        for step in (s for s in STEPS if not only or s.name in only):
            left = deadline - time.monotonic()
            if left < MIN_STEP_S:
                result = {
                    "status": "timeout",
                    "key": "not started",
                    "seconds": 0.0,
                    "detail": f"not started: {left:.0f} s of the run's {budget_s:.0f} s budget left",
                }
            else:
                result = _run_child(step, device, wheel_folder, site, Path(tmp), log_path, min(step.timeout_s, left))
            result = {"name": step.name, **result}
            result.setdefault("goal", step.goal)
            results.append(result)
            print(summary_line(result), flush=True)
            write_reports(out, device, results, budget_s)
    return results


def _run_child(
    step: Step, device: str, wheel_folder: Path, site: Path, tmp: Path, log_path: Path, timeout_s: float
) -> dict[str, Any]:
    result_path = tmp / f"{step.name}.json"
    # the folder as given, present or not: the child must not fall back to the default one
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--step",
        step.name,
        "--device",
        device,
        "--wheels",
        str(wheel_folder.resolve()),
        "--site",
        str(site),
        "--result",
        str(result_path),
    ]
    with log_path.open("a") as log:
        log.write(f"\n===== {step.name} ({device}, timeout {timeout_s:.0f} s) =====\n")
        log.flush()
        start_offset = log.tell()
        started = time.monotonic()
        # a session of its own: on a timeout the whole group goes (harness processes, NIXL, nvcc)
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_child_env(step, device, site),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
        seconds = time.monotonic() - started
    tail = _log_tail(log_path, start_offset)
    if timed_out:
        return {"status": "timeout", "key": f"killed after {timeout_s:.0f} s", "seconds": seconds, "log_tail": tail}
    if not result_path.exists():
        return {
            "status": "failed",
            "key": f"no result (exit code {proc.returncode})",
            "seconds": seconds,
            "detail": tail[-600:],
            "log_tail": tail,
        }
    result = dict(json.loads(result_path.read_text()))
    result["seconds"] = seconds
    if result.get("status") != "ok":
        result["log_tail"] = tail
    return result


def _child_env(step: Step, device: str, site: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT), str(site)])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if device != "cuda" and step.name.startswith("ops_"):
        env["TRITON_INTERPRET"] = "1"  # the Triton backend on CPU tensors: the interpreter, set before import
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the step's process group (it was started in its own session), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(log_path: Path, offset: int) -> str:
    with log_path.open("rb") as f:
        f.seek(max(offset, log_path.stat().st_size - LOG_TAIL))
        return f.read().decode(errors="replace")


def summary_line(r: dict[str, Any]) -> str:
    met = {True: "met", False: "missed"}.get(r.get("goal_met"), "")
    goal = f" [goal {r['goal']}{': ' + met if met else ''}]" if r.get("goal") else ""
    return f"{r['name']:15s} {r['status']:7s} {r.get('key', '')}{goal} {r.get('seconds', 0.0):.0f} s"


def write_reports(out: Path, device: str, results: list[dict[str, Any]], budget_s: float) -> None:
    report = {
        "device": device,
        "budget_s": budget_s,
        "seconds": sum(r.get("seconds", 0.0) for r in results),
        "ok": all(r["status"] == "ok" for r in results),
        "steps": results,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# gpu_check on {report['device']}: {'all ok' if report['ok'] else 'NOT all ok'}, "
        f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget",
        "",
        "| step | status | key figure | goal | met | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["steps"]:
        met = {True: "yes", False: "no"}.get(r.get("goal_met"), "")
        lines.append(
            f"| {r['name']} | {r['status']} | {_cell(r.get('key', ''))} | {_cell(r.get('goal', ''))} | "
            f"{met} | {r.get('seconds', 0.0):.0f} |"
        )
    for r in report["steps"]:
        if r.get("detail"):
            lines += ["", f"**{r['name']}**: {_cell(r['detail'])}"]
        rows = r.get("rows") or []
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            lines += ["", f"## {r['name']}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: object) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text.replace("|", "/").replace("\n", " ")


# ---- the child: one step, its result as JSON ----------------------------------------------------------


def run_step(name: str, ctx: Context, result_path: Path) -> None:
    step = next(s for s in STEPS if s.name == name)
    try:
        result = step.run(ctx)
    except Exception as e:
        traceback.print_exc()
        result = {"status": "failed", "key": f"{type(e).__name__}", "detail": f"{type(e).__name__}: {e}"[-LOG_TAIL:]}
    result_path.write_text(json.dumps(result, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=DEVICES, default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="default: $OUT, else ./gpu_check_out")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheel folder (default .whl)")
    ap.add_argument("--fetch-wheels", type=Path, metavar="DIR", help="download the wheels to carry into DIR, and stop")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument(
        "--only",
        nargs="+",
        choices=[s.name for s in STEPS],
        default=(),
        help="run these steps alone (a rerun: wheels and build are needed again on a fresh machine)",
    )
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--site", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        run_step(args.step, Context(args.device, args.wheels if args.wheels.is_dir() else None, args.site), args.result)
        return 0
    if args.fetch_wheels:
        for line in wheels.fetch(args.fetch_wheels, ROOT):
            print(line)
        print(
            "on the GPU machine (carry the folder):  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py "
            f"--wheels {args.fetch_wheels}"
        )
        return 0
    out = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    results = run_all(args.device, args.wheels, out, args.budget_s, tuple(args.only))
    print(
        f"\ngpu_check on {args.device}: {sum(r['status'] == 'ok' for r in results)}/{len(results)} steps ok; "
        f"{out / 'gpu_check.md'}"
    )
    for r in results:
        print(summary_line(r))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

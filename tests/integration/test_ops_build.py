"""The GPU sources must keep compiling although no GPU (and no CUDA torch) is here: the
kernels and their torch bindings are compiled for SM90a with the machine's nvcc."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
def test_cuda_kernels_compile_for_sm90a(tmp_path):
    cmd = [
        NVCC,
        "-std=c++17",
        "-gencode",
        "arch=compute_90a,code=sm_90a",
        "-Xptxas",
        "-v",
        "-c",
        str(ROOT / "csrc/cuda/kernels.cu"),
        "-o",
        str(tmp_path / "kernels.o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # every kernel fits the 48 KB of static shared memory a CTA may have without opt-in
    for line in done.stderr.splitlines():
        if "bytes smem" in line:
            assert int(line.split("bytes smem")[0].split(",")[-1].strip()) <= 48 * 1024, line


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
def test_torch_bindings_compile_for_sm90a(tmp_path):
    """bindings.cu against this torch's headers (compile only: nothing is linked or run).

    A CPU torch wheel ships the c10/cuda headers but not the one CMake generates for CUDA
    builds, so the test writes that one-line header (as a CUDA build of torch has it)."""
    import sysconfig

    from torch.utils import cpp_extension

    stub = tmp_path / "include" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [
        tmp_path / "include",
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
        ROOT / "csrc" / "cuda",
    ]
    cmd = [
        NVCC,
        "-std=c++17",
        "-gencode",
        "arch=compute_90a,code=sm_90a",
        "-c",  # as setup.py
        str(ROOT / "csrc/cuda/bindings.cu"),
        "-o",
        str(tmp_path / "bindings.o"),
        "-DTORCH_EXTENSION_NAME=_C",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *(f"-I{p}" for p in includes),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_cpu_build_gate_ignores_nvcc():
    """setup.py builds GPU sources only for a CUDA/ROCm torch, not because nvcc exists."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("vllm_pd_setup_probe", ROOT / "setup.py")
    source = (ROOT / "setup.py").read_text()
    assert "torch.version.cuda" in source and "torch.version.hip" in source
    if torch.version.cuda is None and torch.version.hip is None:
        namespace: dict = {"__name__": "vllm_pd_setup_probe", "__file__": str(ROOT / "setup.py")}
        code = source.replace("\nsetup(", "\n_unused = dict(")  # evaluate the gate, don't run setup()
        exec(compile(code, str(ROOT / "setup.py"), "exec"), namespace)
        assert namespace["_gpu_flavour"]() is None
        ext = namespace["_extension"]()
        assert all(not s.endswith(".cu") for s in ext.sources), ext.sources
    del spec, sys


# ---- the MLA split plan (csrc/cuda/mla_plan.h), compiled with the host compiler and run here ----

PLAN_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <string>
#include "mla_plan.h"
using namespace vllm_pd::gpu;
// stdin: "plan b rows dim dim_v max_tokens sms cap_env" (cap_env "-" = unset) or "range len splits";
// stdout: one line per command.
int main() {
  char cmd[16];
  while (std::scanf("%15s", cmd) == 1) {
    if (std::string(cmd) == "plan") {
      long long b, rows, dim, dv, max_tokens, sms;
      char env[64];
      std::scanf("%lld %lld %lld %lld %lld %lld %63s", &b, &rows, &dim, &dv, &max_tokens, &sms, env);
      const MlaPlan plan = plan_mla_decode(b, rows, dim, dv, max_tokens, sms);
      int64_t cap = 0;
      std::string error = parse_workspace_cap(std::string(env) == "-" ? nullptr : env, &cap);
      if (error.empty()) error = mla_workspace_error(plan, b, rows, dv, cap);
      std::printf("%lld %lld %lld %lld|%s\n", (long long)plan.splits, (long long)plan.workspace_bytes,
                  (long long)plan.smem_bytes, (long long)cap, error.c_str());
    } else {
      long long len, splits;
      std::scanf("%lld %lld", &len, &splits);
      for (long long s = 0; s < splits; ++s) {
        int64_t begin, end;
        mla_split_range(len, splits, s, &begin, &end);
        std::printf("%lld %lld ", (long long)begin, (long long)end);
      }
      std::printf("\n");
    }
  }
}
"""
CXX = shutil.which("g++") or shutil.which("c++")
H100_SMS = 132
DEEPSEEK = dict(rows=128, dim=576, dim_v=512)  # h_q 128, s_q 1


@pytest.fixture(scope="module")
def plan_driver(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler (g++ / c++) on PATH; setup.py needs one too")
    folder = tmp_path_factory.mktemp("mla_plan")
    (folder / "driver.cpp").write_text(PLAN_DRIVER)
    done = subprocess.run(
        [CXX, "-std=c++17", f"-I{ROOT / 'csrc/cuda'}", str(folder / "driver.cpp"), "-o", str(folder / "driver")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    def run(*commands: str) -> list[str]:
        out = subprocess.run(
            [str(folder / "driver")],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return out.splitlines()

    return run


def _plan(run, batch, context, rows=128, dim=576, dim_v=512, sms=H100_SMS, env="-"):
    line = run(f"plan {batch} {rows} {dim} {dim_v} {context} {sms} {env}")[0]
    numbers, error = line.split("|", 1)
    splits, workspace, smem, cap = map(int, numbers.split())
    return dict(splits=splits, workspace=workspace, smem=smem, cap=cap, error=error)


def _capacity_sized_workspace(batch: int, context: int, rows: int = 128, dim_v: int = 512) -> int:
    """What bindings.cu allocated before the plan: a split per 256 tokens of table capacity."""
    return batch * -(-context // 256) * rows * (dim_v + 2) * 4


def test_mla_workspace_is_bounded_by_the_batch_not_the_table(plan_driver):
    big = _plan(plan_driver, 128, 32768)
    assert big["splits"] == 1 and big["error"] == ""  # 1,024 CTAs already fill 132 SMs
    assert big["workspace"] == 128 * 128 * 514 * 4  # 33.7 MB
    assert _capacity_sized_workspace(128, 32768) > 4 * 10**9  # the former 4.3 GB
    # a longer table (capacity) changes nothing once the SMs are covered
    assert _plan(plan_driver, 128, 1 << 20) == big
    small = _plan(plan_driver, 1, 32768)
    assert small["splits"] == -(-2 * H100_SMS // 8)  # 8 row tiles: 33 splits fill the GPU twice
    assert small["workspace"] < 10 * 2**20
    assert _plan(plan_driver, 1, 100)["splits"] == 1  # never more splits than 256-token chunks


def test_mla_split_ranges_cover_each_sequence_once(plan_driver):
    for length, splits in ((0, 4), (1, 4), (255, 2), (256, 2), (257, 2), (1000, 3), (32768, 33), (5000, 1)):
        bounds = list(map(int, plan_driver(f"range {length} {splits}")[0].split()))
        ranges = list(zip(bounds[::2], bounds[1::2]))
        assert ranges[0][0] == 0 and ranges[-1][1] == length, (length, splits, ranges)
        for (b0, e0), (b1, _) in zip(ranges, ranges[1:]):
            assert e0 == b1 and b0 <= e0, (length, splits, ranges)
        # every non-empty range is at least a chunk, except the sequence's last one
        assert all(e - b >= 256 for b, e in ranges[:-1] if e < length), ranges


def test_mla_workspace_cap_error_names_the_limit_and_the_key(plan_driver):
    over = _plan(plan_driver, 4096, 32768)  # 4,096 x 128 rows x 514 fp32 = 1,028 MiB
    assert over["cap"] == 1024 << 20
    assert "VLLM_PD_MLA_WORKSPACE_MB caps it at 1024 MiB" in over["error"], over["error"]
    assert "set VLLM_PD_MLA_WORKSPACE_MB=1028 or more" in over["error"], over["error"]
    assert _plan(plan_driver, 4096, 32768, env="1028")["error"] == ""
    assert _plan(plan_driver, 4096, 32768, env="1027")["error"].startswith("mla_decode needs a 1028 MiB")
    for bad in ("0", "-5", "lots", "12MB"):
        error = _plan(plan_driver, 1, 1024, env=bad)["error"]
        assert error == f"VLLM_PD_MLA_WORKSPACE_MB='{bad}' is not a positive number of MiB", error


def test_mla_shared_memory_needs_the_opt_in_and_fits_hopper(plan_driver):
    smem = _plan(plan_driver, 1, 1024)["smem"]
    assert 48 * 1024 < smem <= 227 * 1024, smem  # hence cudaFuncSetAttribute before the launch


# ---- every launch and runtime call of the CUDA sources is checked ----

_LAUNCH = re.compile(r"(\w+)(?:<[^<>]*>)?<<<([^>]*)>>>")
_RUNTIME_CALL = re.compile(r"\b(?:cuda|hip)[A-Z]\w*\s*\(")


def _split_arguments(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + [current.strip()]


def unchecked_calls(source: str) -> list[str]:
    """Launches not followed by VLLM_PD_CHECK_LAUNCH, runtime calls outside VLLM_PD_CHECK, and
    launches with dynamic shared memory but no cudaFuncSetAttribute before them."""
    lines = [re.sub(r'"[^"]*"', '""', line.split("//")[0]) for line in source.splitlines()]
    found = []
    for i, line in enumerate(lines):
        launch = _LAUNCH.search(line)
        if launch:
            after = next((x for x in lines[i + 1 :] if x.strip()), "")
            if "VLLM_PD_CHECK_LAUNCH(" not in after:
                found.append(f"line {i + 1}: launch of {launch.group(1)} is not checked")
            config = _split_arguments(launch.group(2))
            if len(config) > 2 and config[2] != "0":
                before = "\n".join(lines[max(0, i - 8) : i])
                if f"cudaFuncSetAttribute({launch.group(1)}" not in before:
                    found.append(
                        f"line {i + 1}: {launch.group(1)} takes dynamic shared memory without "
                        "cudaFuncAttributeMaxDynamicSharedMemorySize"
                    )
        if _RUNTIME_CALL.search(line) and not line.lstrip().startswith("#"):
            if "VLLM_PD_CHECK(" not in line and "VLLM_PD_CHECK(" not in lines[i - 1]:
                found.append(f"line {i + 1}: runtime call not checked: {line.strip()}")
    return found


@pytest.mark.parametrize("name", ["kernels.cu", "bindings.cu"])
def test_cuda_sources_check_every_launch_and_call(name):
    assert unchecked_calls((ROOT / "csrc/cuda" / name).read_text()) == []


def test_launch_lint_finds_what_it_looks_for():
    """Negative control: the unchecked forms the sources had before."""
    source = """
  cudaFuncSetAttribute(mla_split<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  mla_split<T><<<grid, kMlaThreads, smem, stream>>>(p);
  mla_combine<T><<<dim3(p.batch, rows_total), 128, 0, stream>>>(p);
  fp8_gemm<float><<<grid, kGemmThreads, 0, stream>>>(p); break;
"""
    found = unchecked_calls(source)
    assert len(found) == 4, found
    assert "runtime call not checked" in found[0] and all("is not checked" in f for f in found[1:]), found
    assert unchecked_calls('  big<T><<<grid, 256, smem, stream>>>(p);\n  VLLM_PD_CHECK_LAUNCH("big");\n') == [
        "line 1: big takes dynamic shared memory without cudaFuncAttributeMaxDynamicSharedMemorySize"
    ]

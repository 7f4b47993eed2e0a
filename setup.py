"""Builds vllm_pd._C, the native kernels behind the ops' "native" backend.

Project metadata stays in pyproject.toml; this file only declares the extension.
- C++ CPU kernels (csrc/*.cpp, csrc/cpu/*.cpp) are always built.
- CUDA (SM90a) sources are added only when torch itself is a CUDA build, HIP sources (Hygon
  DCU gfx928/gfx936/gfx938, via torch's hipify) only when torch is a ROCm/DTK build: the gate
  is torch.version.cuda / torch.version.hip, never the presence of nvcc (a CPU torch next to
  an installed CUDA toolkit must still build CPU-only).
- VLLM_PD_GPU_KERNELS=0 skips the GPU sources on a GPU torch; HCU_TARGET picks DCU targets.
"""

from __future__ import annotations

import glob
import os

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DCU_TARGETS = ("gfx928", "gfx936", "gfx938")


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _gpu_flavour() -> str | None:
    if os.environ.get("VLLM_PD_GPU_KERNELS", "1") == "0":
        return None
    if torch.version.hip is not None and cpp_extension.ROCM_HOME is not None:
        return "hip"
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        return "cuda"
    return None


def _extension() -> cpp_extension.CppExtension:
    # -fopenmp: at::parallel_for is an inline `#pragma omp parallel` in torch's headers; without
    # it every kernel silently ran on one thread. libgomp.so.1 resolves to the copy torch loaded.
    cxx = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fopenmp"]
    link = ["-fopenmp"]
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    flavour = _gpu_flavour()
    if flavour is None:
        return cpp_extension.CppExtension("vllm_pd._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link)
    sources += _sources("csrc/cuda/*.cu")
    if flavour == "cuda":
        nvcc = ["-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--use_fast_math"]
        macros = [("VLLM_PD_WITH_CUDA", "1")]
    else:
        targets = os.environ.get("HCU_TARGET", ",".join(DCU_TARGETS)).split(",")
        nvcc = ["-O3", "-std=c++17", "-DUSE_HCU", "-DHIP_FP8_TYPE_FNUZ"]
        nvcc += [f"--offload-arch={t}" for t in targets]
        macros = [("VLLM_PD_WITH_CUDA", "1"), ("VLLM_PD_HIP", "1")]
    return cpp_extension.CUDAExtension(
        "vllm_pd._C",
        sources,
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)

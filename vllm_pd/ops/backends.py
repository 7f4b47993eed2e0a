"""Run-time choice of the implementation behind each vllm_pd op.

Backends, best first: "vendor" (FlashMLA / DeepGEMM, including Hygon DCU builds, when
importable), "native" (vllm_pd._C: C++ on CPU, CUDA/HIP kernels when built), "triton"
(portable kernels for Hopper and ROCm/DCU; on CPU tensors only under TRITON_INTERPRET=1) and
"reference" (pure PyTorch, also the test oracle). A backend is forced by the op's `backend`
argument or the VLLM_PD_OPS_BACKEND environment variable; a forced backend that cannot run
is an error that says why, never a silent fallback.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from vllm_pd.errors import OpsError

ENV_VAR = "VLLM_PD_OPS_BACKEND"
BACKENDS = ("vendor", "native", "triton", "reference")
AUTO = "auto"
# Triton is not automatic on CPU: the interpreter is a debugging tool, not a fast path.
_AUTO_ORDER = {
    "cpu": ("native", "reference"),
    "cuda": ("vendor", "native", "triton", "reference"),
}
_MODULES = {
    "vendor": "vllm_pd.ops.vendor",
    "native": "vllm_pd.ops.native",
    "triton": "vllm_pd.ops.triton_backend",
    "reference": "vllm_pd.ops.reference",
}


class OpBackendError(OpsError, RuntimeError):
    """The requested backend does not exist or cannot run this op here."""


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(_MODULES[name])


def unavailable_reason(name: str, op: str, device: torch.device) -> str | None:
    """None if backend `name` can run `op` on `device`, otherwise the reason it cannot."""
    if name == "reference":
        return None
    try:
        module = _module(name)
    except ImportError as e:
        return f"cannot import {_MODULES[name]}: {e}"
    return module.unavailable_reason(op, device)


def _rejection(name: str, op: str, args: tuple) -> str | None:
    """Why backend `name` cannot take these particular arguments (e.g. FlashMLA: block size 64)."""
    rejects = getattr(_module(name), "rejects", None)
    return rejects(op, args) if rejects is not None and args else None


def requested_backend(argument: str | None) -> str:
    name = argument or os.environ.get(ENV_VAR) or AUTO
    if name != AUTO and name not in BACKENDS:
        source = "backend argument" if argument else ENV_VAR
        raise OpBackendError(f"{source}={name!r} is not one of {(AUTO,) + BACKENDS}")
    return name


@functools.cache
def _auto_candidates(op: str, device_type: str) -> tuple[str, ...]:
    device = torch.device(device_type)
    names = _AUTO_ORDER.get(device_type, ())
    return tuple(n for n in names if unavailable_reason(n, op, device) is None) + ("reference",)


def select(op: str, device: torch.device, argument: str | None = None, args: tuple = ()) -> ModuleType:
    """The module implementing `op` for tensors on `device` (see the module docstring).

    `args` are the op's arguments, for backends that only take some shapes or dtypes."""
    name = requested_backend(argument)
    if name == AUTO:
        for candidate in _auto_candidates(op, device.type):
            if _rejection(candidate, op, args) is None:
                return _module(candidate)
    reason = unavailable_reason(name, op, device) or _rejection(name, op, args)
    if reason is not None:
        raise OpBackendError(f"backend {name!r} cannot run {op} on {device.type}: {reason}")
    return _module(name)


def describe(device: torch.device) -> dict[str, dict[str, str]]:
    """For logs and benchmarks: each op's backends on `device` and why each is unavailable."""
    ops = ("mla_decode", "fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked")
    return {op: {name: unavailable_reason(name, op, device) or "available" for name in BACKENDS} for op in ops}

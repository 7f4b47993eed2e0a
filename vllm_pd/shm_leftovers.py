"""Shared-memory files that a killed process group leaves in /dev/shm.

A vLLM server killed with SIGKILL cannot unlink its own segments. That happens to the
fault tests' "machine dies" kill and to a ``stop()`` that had to force the server down.
What it leaves is vLLM's shm_broadcast queues (160-250 MB each, two per server); our
transport's rings are unlinked as soon as both ends map them, so they never stay. When a
real machine dies its memory goes with it. On one host the files
stay in RAM until reboot, and vLLM's start-up refuses to run once /dev/shm is full. So
the launcher notes which files the group maps before it kills, and afterwards removes
those that no live process maps or holds open.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm/"


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid``."""
    pids = []
    for pid in _pids():
        try:
            # the fields after the command's closing parenthesis: state, ppid, pgrp, ...
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(pid)
    return pids


def _mapped(pid: int) -> set[str]:
    paths = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                at = line.find(SHM_DIR)
                if at >= 0:
                    paths.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:
        pass
    return paths


def _open(pid: int) -> set[str]:
    paths = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM_DIR):
                paths.add(target)
    except OSError:
        pass
    return paths


def used_shm(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files these processes map or hold open."""
    out: set[str] = set()
    for pid in pids:
        out |= _mapped(pid) | _open(pid)
    return out


def remove_orphans(paths: Iterable[str]) -> list[str]:
    """Unlink those of ``paths`` that still exist and that no live process uses. Returns them."""
    candidates = {p for p in paths if os.path.exists(p)}
    if not candidates:
        return []
    live = used_shm(_pids())
    removed = []
    for path in sorted(candidates - live):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not remove %s left by a killed server: %s", path, e)
    return removed

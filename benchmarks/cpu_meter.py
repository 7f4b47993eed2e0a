"""CPU seconds of process trees, for the benchmarks' "what did each process use" lines."""

from __future__ import annotations

import psutil


class CpuMeter:
    """CPU seconds (user + system) of processes (pid None: this one), with their children if ``tree``."""

    def __init__(self, pids: list[int | None], tree: bool = True) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]
        self._tree = tree

    def seconds(self) -> float:
        total = 0.0
        for root in self._procs:
            for p in [root, *(root.children(recursive=True) if self._tree else [])]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
        return total

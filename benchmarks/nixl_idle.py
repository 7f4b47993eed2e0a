"""CPU an idle, connected pair of nixl transports uses (and a pair of stock NIXL agents).

Two processes, each pinned to its own core. Each builds a transport (``--transports``,
default nixl and tcp for reference) over push_cost.py's KV cache (64 MiB), both connect both ways (a push, a
fetch and a notify each way), then both sit idle for ``--seconds`` while each measures
its own CPU time and its threads' (/proc/self/task/*/stat). ``stock`` is the same with two
bare NIXL agents made as vLLM's NixlConnector makes them (progress thread on) that did
one READ: what our agent without a progress thread avoids.

Usage: python3 benchmarks/nixl_idle.py [--seconds 5] [--transports nixl tcp stock]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections import Counter

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_ticks() -> Counter[str]:
    """utime + stime clock ticks of this process's threads, by thread name."""
    out: Counter[str] = Counter()
    for thread_id in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread_id}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] += int(fields[11]) + int(fields[12])
    return out


def idle_cpu(seconds: float) -> tuple[float, dict[str, float]]:
    """(process CPU seconds, CPU seconds per thread name) over ``seconds`` of sleep."""
    before, c0 = thread_ticks(), time.process_time()
    time.sleep(seconds)
    after, c1 = thread_ticks(), time.process_time()
    busy = {name: (after[name] - before.get(name, 0)) * TICK_S for name in after}
    return c1 - c0, {k: v for k, v in busy.items() if v > 0}


def _transport_side(name: str, core: int, conn, seconds: float) -> None:
    os.sched_setaffinity(0, {core})
    from push_cost import LandingSink, kv_regions  # benchmarks/ is the script's folder

    from vllm_pd.connector.transport import create_transport
    from vllm_pd.connector.transport.base import BlockBatch

    regions = kv_regions()
    t = create_transport(name)
    t.register_regions(regions)
    ep = t.start(LandingSink(regions), "127.0.0.1", 0)
    t.allow_fetch("idle", list(range(regions[0].num_blocks)))
    conn.send(ep)
    peer = conn.recv()
    nbytes = regions[0].block_nbytes
    t.push(peer, BlockBatch("idle", 0, (0, 1), nbytes), [0, 1], timeout=30).result()
    t.fetch(peer, "idle", 1, [2, 3], [2, 3], timeout=30).result()
    t.notify(peer, b"hi", timeout=30).result()
    conn.send("connected")
    conn.recv()  # both connected: idle now
    conn.send(idle_cpu(seconds))
    conn.recv()
    t.close()


def _stock_side(name: str, core: int, conn, seconds: float) -> None:
    """Two NIXL agents as vLLM's NixlConnector makes them: the progress thread on."""
    os.sched_setaffinity(0, {core})
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"stock-{os.getpid()}", nixl_agent_config(num_threads=4))
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    peer_md, peer_addr = conn.recv()
    peer = agent.add_remote_agent(peer_md)
    handle = agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs([(buf.data_ptr(), 4096, 0)], "DRAM"),
        agent.get_xfer_descs([(peer_addr, 4096, 0)], "DRAM"),
        peer,
    )
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        time.sleep(0.001)
    conn.send("connected")
    conn.recv()
    conn.send(idle_cpu(seconds))
    conn.recv()


def measure(name: str, seconds: float) -> list[tuple[float, dict[str, float]]]:
    ctx = mp.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))
    target = _stock_side if name == "stock" else _transport_side
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [
        ctx.Process(target=target, args=(name, cores[i % len(cores)], pipes[i][1], seconds), daemon=True)
        for i in range(2)
    ]
    for p in procs:
        p.start()
    a, b = (pipe[0] for pipe in pipes)
    ea, eb = a.recv(), b.recv()
    a.send(eb)
    b.send(ea)
    assert a.recv() == "connected" and b.recv() == "connected"
    a.send("go")
    b.send("go")
    results = [a.recv(), b.recv()]
    a.send("stop")
    b.send("stop")
    for p in procs:
        p.join(30)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--transports", nargs="+", default=["nixl", "tcp", "stock"])
    args = p.parse_args(argv)
    print(f"# {args.seconds:.0f} s idle after connecting both ways; CPU seconds per process (busiest threads)")
    for name in args.transports:
        for side, (cpu, threads) in zip("AB", measure(name, args.seconds), strict=True):
            top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:3])
            print(
                f"{name} {side}: {cpu:.3f} CPU-s = {100 * cpu / args.seconds:.1f} % of a core"
                f"{f' ({top})' if top else ''}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What decides how the nixl transport pushes: READ by the receiver or WRITE by the sender.

Both ways the receiver's sink picks destinations that are not registered yet (the push
staging), so the receiver registers them. Then either

* READ: the receiver reads the sender's (registered) blocks into them; or
* WRITE: the receiver sends the destinations' keys back (NIXL partial metadata), the
  sender loads them and writes, then tells the receiver it is done.

Measured between two processes pinned to their own cores, per push of ``--blocks`` blocks
of ``--block-kib`` KiB: READ and WRITE throughput over the same descriptors, the cost of
registering the destinations, of exporting and loading their metadata, and a control
round trip (a nixl transport's notify). WRITE = READ's work + one round trip + export +
load, unless WRITE moves bytes faster.

Usage: python3 benchmarks/nixl_push_design.py [--blocks 64] [--block-kib 256] [--rounds 20] [--touched]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np


def _sender(conn, core: int, nbytes: int) -> None:
    os.sched_setaffinity(0, {core})
    import torch

    from vllm_pd.connector.transport.nixl_agent import LocalAgent
    from vllm_pd.protocol.nixl_messages import DRAM

    agent = LocalAgent(f"sender-{os.getpid()}", host_only=True)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    agent.register(np.array([src.data_ptr()]), np.array([nbytes]), DRAM, 0)
    conn.send((agent.metadata(), src.data_ptr(), agent.probe[0]))
    peer = agent.load_peer(conn.recv())
    while (msg := conn.recv()) is not None:
        kind, payload = msg
        if kind == "probe":
            agent.read_probe(peer, payload, time.monotonic() + 10)
            conn.send("ok")
        elif kind == "write":  # the WRITE design: load the destinations' keys, write, say done
            metadata, dests, lengths = payload
            t0 = time.perf_counter()
            agent.load_peer(metadata)
            t1 = time.perf_counter()
            srcs = src.data_ptr() + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            agent.transfer("WRITE", srcs, lengths, DRAM, 0, dests, DRAM, 0, peer, time.monotonic() + 30)
            conn.send((t1 - t0, time.perf_counter() - t1))
        elif kind == "pump":  # progress while the receiver sets up its connection to us
            end = time.monotonic() + payload
            while time.monotonic() < end:
                agent.progress()
                time.sleep(0.0005)
            conn.send("ok")
    agent.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--touched", action="store_true", help="destinations' pages faulted in before the push")
    args = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[-1]})
    import torch

    from vllm_pd.connector.transport.nixl_agent import LocalAgent
    from vllm_pd.protocol.nixl_messages import DRAM

    block = args.block_kib << 10
    nbytes = args.blocks * block
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, cores[0], nbytes), daemon=True)
    proc.start()
    metadata, src_addr, probe_addr = conn.recv()
    agent = LocalAgent(f"receiver-{os.getpid()}", host_only=True)
    conn.send(agent.metadata())
    peer = agent.load_peer(metadata)
    conn.send(("pump", 2.0))  # the sender progresses while we connect to it
    agent.read_probe(peer, probe_addr, time.monotonic() + 10)
    assert conn.recv() == "ok"
    conn.send(("probe", agent.probe[0]))  # and its connection to us (for WRITE)
    t_end = time.monotonic() + 10
    while not conn.poll(0.0005) and time.monotonic() < t_end:
        agent.progress()
    assert conn.recv() == "ok"

    lengths = np.full(args.blocks, block)
    srcs = src_addr + np.arange(args.blocks) * block
    rows: dict[str, list[float]] = {k: [] for k in ("register", "read", "export", "load", "write", "rtt")}
    for _ in range(args.rounds):
        # fresh staging for each design (WRITE must not find pages READ already faulted in)
        bufs = [[torch.empty(block, dtype=torch.uint8) for _ in range(args.blocks)] for _ in range(2)]
        if args.touched:
            for b in bufs[0] + bufs[1]:
                b.zero_()
        read_dests, write_dests = (np.array([t.data_ptr() for t in side]) for side in bufs)
        t0 = time.perf_counter()
        handle = agent.register(read_dests, lengths, DRAM, 0)
        t1 = time.perf_counter()
        agent.transfer("READ", read_dests, lengths, DRAM, 0, srcs, DRAM, 0, peer, time.monotonic() + 30)
        t2 = time.perf_counter()
        agent.deregister(handle)
        handle = agent.register(write_dests, lengths, DRAM, 0)
        t3 = time.perf_counter()
        descs = agent._agent.get_reg_descs(
            np.stack([write_dests, lengths, np.zeros_like(write_dests)], axis=1).astype(np.uint64), "DRAM"
        )
        exported = agent._agent.get_partial_agent_metadata(descs, False)
        t4 = time.perf_counter()
        conn.send(("write", (exported, write_dests, lengths)))
        load_s, write_s = conn.recv()
        t5 = time.perf_counter()
        agent.deregister(handle)
        rows["register"].append(t1 - t0)
        rows["read"].append(t2 - t1)
        rows["export"].append(t4 - t3)
        rows["load"].append(load_s)
        rows["write"].append(write_s)
        rows["rtt"].append(t5 - t4 - load_s - write_s)  # the pipe's round trip, less the sender's work
    conn.send(None)
    proc.join(10)
    agent.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    mib = nbytes / (1 << 20)
    print(
        f"# {args.blocks} blocks x {args.block_kib} KiB = {mib:.1f} MiB per push, fresh destinations "
        f"({'pages touched' if args.touched else 'pages untouched'}), "
        f"medians of {args.rounds}; sender core {cores[0]}, receiver core {cores[-1]}"
    )
    print(
        f"register the destinations: {med['register'] * 1e6:.0f} us ({med['register'] * 1e6 / args.blocks:.1f} "
        "us per block) - both designs"
    )
    print(f"READ by the receiver:  {med['read'] * 1e3:.2f} ms = {nbytes / med['read'] / 1e9:.2f} GB/s")
    print(f"WRITE by the sender:   {med['write'] * 1e3:.2f} ms = {nbytes / med['write'] / 1e9:.2f} GB/s")
    print(
        f"WRITE's extra steps: export keys {med['export'] * 1e6:.0f} us + load them {med['load'] * 1e6:.0f} us "
        f"+ one more round trip (control pipe here {med['rtt'] * 1e6:.0f} us)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The connector's data path between two processes, without vLLM: the GPU harness.

A prefill process and a decode process each run the connector's worker
(``PDConnectorWorker``: sender, loader, transport) on a KV cache built exactly as vLLM
0.32 allocates it for one of its attention backends (tests/support/vllm_kv_cache.py: one flat
buffer, a ``[B, H, N, C]`` view per layer in the resolved layout, kernel blocks where the
backend splits a block), registered as vLLM registers it, and driven as vLLM drives it:
per step ``begin_step``, per layer a synthetic forward (a matmul the size of a layer's,
then the layer's KV write) on the compute stream followed by ``save_kv_layer``; decode's
forward calls ``wait_for_layer_load`` before reading each layer. Decode's blocks are then
compared byte for byte with what prefill wrote (deterministic contents, regenerated on
decode's side), and decode checks prefill announced its own block format.

``HarnessSpec`` (``run(HarnessSpec(...))`` -> ``HarnessResult``):

* ``device``: ``cuda`` (a GPU machine, which has CUDA torch but no vLLM), ``cpu`` (vLLM's
  CPU case: direct access where the layout keeps blocks back to back, events complete at
  once) or ``standin`` (tests/support/async_device.py: KV staged through host rows and every device
  operation run later on stream threads, so CI covers the GPU ordering on a CPU).
* ``transport``: tcp | shm | nixl.
* ``backend``: FLASH_ATTN | FLASHINFER | FLASHMLA | CUTLASS_MLA | TRITON_MLA (Hopper) |
  CPU_ATTN (vLLM's CPU backend: LBHNC, blocks of a multiple of 32 tokens).
* ``kv_layout``: LBHNC | LBNHC | LHBNC | BLHNC | BLNHC | BHLNC, one the backend runs; ""
  (default) = what vLLM resolves with this connector: LBHNC for attention, the backend's
  first choice (LBNHC) for MLA.
* ``model``: ``llama3-8b`` (8 KV heads of 128, bf16, 16-token blocks) or ``deepseek-v3``
  (MLA: one 576-wide latent, bf16, 64-token blocks). ``layers`` / ``kv_heads`` /
  ``block_size``: 0 = the model's own (32 / 8 / 16 and 61 / 1 / 64: full size, for a GPU);
  the defaults keep CPU runs small (4 layers). ``block_size=128`` with FLASHMLA (or
  FLASHINFER) splits each block into two 64-token kernel blocks.
* ``num_blocks`` (blocks in the cache), ``blocks_per_request``, ``modes`` (one request each,
  in turn), ``rounds``, ``hidden`` (the synthetic forward: [tokens, hidden] @ [hidden,
  hidden] per layer; 0 = the KV write alone), ``host_staging_bytes``, ``timeout_s``.
* Prefill and decode of different shapes (``kv_geometry``): ``prefill_tp`` / ``decode_tp``
  (a process per TP rank, each holding its ranks' KV heads, vLLM's sharding), and
  ``prefill_block_size`` / ``decode_block_size`` (0 = ``block_size``); ``tokens``: the prompt
  (0 = ``blocks_per_request`` of prefill's blocks). The KV is then one per (head, token) over
  the whole model: decode's blocks must hold exactly their heads' tokens, whatever the shapes.

Used by tests/integration/test_gpu_harness.py, benchmarks/gpu_transfer.py and benchmarks/gpu_check.py.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from tests.support import vllm_kv_cache as replay
from vllm_pd.connector.device.kv_geometry import BlockFormat, rank_heads
from vllm_pd.connector.device.kv_layout import KVLayout


@dataclass(frozen=True)
class HarnessSpec:
    device: str = "cpu"  # cuda | cpu | standin
    transport: str = "tcp"
    backend: str = "FLASH_ATTN"  # tests/support/vllm_kv_cache.py BACKENDS
    kv_layout: str = ""  # "" = what vLLM resolves with this connector
    model: str = "llama3-8b"  # llama3-8b | deepseek-v3
    layers: int = 4  # 0 = the model's
    kv_heads: int = 0  # 0 = the model's
    block_size: int = 0  # 0 = the model's
    num_blocks: int = 64
    blocks_per_request: int = 8
    modes: tuple[str, ...] = ("push", "pull")  # one request each, in turn
    rounds: int = 1
    hidden: int = 1024  # the synthetic forward: [tokens, hidden] @ [hidden, hidden] per layer
    host_staging_bytes: int = 256 << 20
    timeout_s: float = 60.0
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_block_size: int = 0  # 0 = block_size
    decode_block_size: int = 0
    tokens: int = 0  # 0 = blocks_per_request blocks of prefill's

    def kv_model(self, side: str = "prefill") -> replay.KVModel:
        """One TP rank's KV cache shape on ``side`` (its heads, its block size)."""
        whole = replay.model(self.model, layers=self.layers, block_size=self.block_size, kv_heads=self.kv_heads)
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        bs = (self.prefill_block_size if side == "prefill" else self.decode_block_size) or whole.block_size
        return replace(whole, block_size=bs, num_kv_heads=len(rank_heads(self.total_kv_heads, tp, 0)))

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (MLA: its one latent, on every rank)."""
        return replay.model(self.model, kv_heads=self.kv_heads).num_kv_heads

    @property
    def num_tokens(self) -> int:
        return self.tokens or self.blocks_per_request * self.kv_model("prefill").block_size

    def blocks(self, side: str) -> int:
        """Blocks of the prompt on ``side``."""
        return -(-self.num_tokens // self.kv_model(side).block_size)

    def layout(self) -> KVLayout:
        return replay.resolved_layout(replay.BACKENDS[self.backend], self.kv_layout)

    def request_nbytes(self) -> int:
        """KV bytes one request moves between equal shapes (every layer's blocks)."""
        m = self.kv_model()
        return m.num_layers * self.blocks_per_request * m.page_nbytes()

    def shaped_nbytes(self, mode: str) -> int:
        """KV bytes one request moves to all decode ranks: each its heads, a push prefill's whole
        blocks' tokens of them, a read every token decode's blocks take from prefill's."""
        p, d = self.kv_model("prefill"), self.kv_model("decode")
        if mode == "push":
            tokens = self.blocks("prefill") * p.block_size
        else:
            tokens = min(self.blocks("prefill") * p.block_size, self.blocks("decode") * d.block_size)
        return p.num_layers * self.decode_tp * d.num_kv_heads * tokens * p.content_nbytes


@dataclass
class RequestResult:
    mode: str
    exact: bool
    load_ok: bool
    from_push: int
    fetched: int
    nbytes: int
    forward_s: float  # prefill's step: forward launched and finished, sends queued
    baseline_forward_s: float  # the same step with nothing to send, just before
    first_save_at: float  # prefill, monotonic: first layer handed to the sender
    forward_end_at: float  # prefill: the step's forward complete on the device
    landed_at: float  # decode: every layer in its blocks


@dataclass
class HarnessResult:
    spec: HarnessSpec
    requests: list[RequestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _device(spec: HarnessSpec) -> tuple[torch.device, Any]:
    """(where the tensors live, the KVDevice to run them on)."""
    if spec.device == "standin":
        from tests.support.async_device import AsyncStandInDevice

        return torch.device("cpu"), AsyncStandInDevice(compute_delay_s=0.002, copy_delay_s=0.001)
    from vllm_pd.connector.device.kv_device import kv_device_for

    device = torch.device(spec.device)
    return device, kv_device_for([torch.empty(0, device=device)])


def _host_syncs_fail(device: torch.device, on: bool) -> None:
    """On CUDA, while on, a synchronising op raises: the connector's hooks and copies must never
    make the host wait (the harness's own set-up and checks run outside)."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error" if on else "default")


def model_kv(spec: HarnessSpec, layer: int, request: int) -> torch.Tensor:
    """A request's KV of ``layer`` over the whole model: [heads, tokens, C] bytes (tokens padded to
    either side's whole blocks), random, the same in every process."""
    m = spec.kv_model()
    tokens = max(spec.blocks(side) * spec.kv_model(side).block_size for side in ("prefill", "decode"))
    g = torch.Generator().manual_seed(1_000_003 * request + layer)
    return torch.randint(0, 256, (spec.total_kv_heads, tokens, m.content_nbytes), generator=g, dtype=torch.uint8)


def block_contents(
    spec: HarnessSpec, layer: int, request: int, side: str, rank: int, kv_format: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank`` of ``side``'s blocks of a request's prompt, of ``layer``: ([n, block_nbytes]
    bytes, each row a block's bytes in memory order; the same shape of bools: which bytes hold a
    token of the prompt)."""
    m = spec.kv_model(side)
    heads = rank_heads(spec.total_kv_heads, spec.prefill_tp if side == "prefill" else spec.decode_tp, rank)
    n, bs = spec.blocks(side), m.block_size
    kv = model_kv(spec, layer, request)[heads.start : heads.stop, : n * bs]
    valid = (torch.arange(n * bs) < spec.num_tokens).view(1, -1, 1).expand(kv.shape)
    return _memory_order(kv, n, kv_format).to(device), _memory_order(valid, n, kv_format).to(device)


def _memory_order(kv: torch.Tensor, n: int, kv_format: str) -> torch.Tensor:
    """[H, n * N, C] as n blocks of ``kv_format``'s memory order (kernel blocks K within a block)."""
    fmt = BlockFormat.parse(kv_format)
    h, tokens, c = kv.shape
    k = fmt.size("K")
    named = kv.reshape(h, n, k, tokens // (n * k), c)  # H, B, K, N, C
    axes = {"H": 0, "K": 2, "N": 3, "C": 4}
    order = [axes[d] for d, _ in fmt.dims if d in axes]
    order = [a for a in (0, 2, 3, 4) if a not in order] + order  # dims of one element first
    return named.permute(1, *order).reshape(n, -1)


def _block_ids(spec: HarnessSpec, request: int, side: int, n: int | None = None) -> list[int]:
    g = torch.Generator().manual_seed(7919 * request + side)
    return torch.randperm(spec.num_blocks, generator=g)[: n or spec.blocks_per_request].tolist()


class _Forward:
    """A layer's compute, launched on the device's compute stream."""

    def __init__(self, spec: HarnessSpec, device: torch.device, kv_device: Any) -> None:
        tokens = spec.num_tokens
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.hidden = spec.hidden  # 0: no compute, the KV write alone (to measure the transfer by itself)
        self.x = torch.randn(tokens, spec.hidden, dtype=dtype, device=device)
        self.w = torch.randn(spec.hidden, spec.hidden, dtype=dtype, device=device) / max(1, spec.hidden) ** 0.5
        self.kv_device = kv_device

    def layer(self, then: Any = None) -> None:
        def work() -> None:
            if self.hidden:
                self.x = torch.tanh(self.x @ self.w)
            if then is not None:
                then()

        self.kv_device.launch(self.kv_device.compute_stream(), work)

    def finish(self) -> None:
        self.kv_device.record(self.kv_device.compute_stream()).synchronize()


def _worker(spec: HarnessSpec, side: str, rank: int, base_port: int):
    from vllm_pd.connector.config import PDConnectorConfig
    from vllm_pd.connector.device.block_copies import byte_blocks
    from vllm_pd.connector.worker.worker import PDConnectorWorker
    from vllm_pd.protocol.kv_shape import KVGroup

    device, kv_device = _device(spec)
    layout = spec.layout()
    m = spec.kv_model(side)
    cache = replay.allocate(m, replay.BACKENDS[spec.backend], layout, spec.num_blocks, device)
    config = PDConnectorConfig.from_extra_config(
        {
            "transport": spec.transport,
            "host": "127.0.0.1",
            "bind_host": "127.0.0.1",
            "transfer_timeout_s": spec.timeout_s,
            "host_staging_bytes": spec.host_staging_bytes,
            "load_mode": "layerwise",
        }
    )
    tp = spec.prefill_tp if side == "prefill" else spec.decode_tp
    worker = PDConnectorWorker(
        config,
        block_size=m.block_size,
        tp_rank=rank,
        base_port=base_port,
        is_producer=side == "prefill",
        is_consumer=side != "prefill",
        tp_size=tp,
        kv_heads=spec.total_kv_heads,
        groups=(KVGroup("full", m.block_size, ""),),
        layer_groups=dict.fromkeys(cache.views, 0),
    )
    # as PDConnector.register_kv_caches: vLLM's views, the scheduler's block count, the resolved layout
    worker.register_kv_caches(cache.views, spec.num_blocks, device=kv_device, kv_layout=layout.name)
    views = [byte_blocks(r) for r in worker.regions]  # [num_blocks, ...] bytes, each block in memory order
    return worker, cache.views, views, device, kv_device


def _prefill_main(spec: HarnessSpec, conn: Any, rank: int, base_port: int) -> None:
    from vllm_pd.connector.step_specs import FinishedSend, SendSpec, WorkerStep
    from vllm_pd.protocol.transfer_params import RemotePrefill

    worker, kv, views, device, kv_device = _worker(spec, "prefill", rank, base_port)
    forward = _Forward(spec, device, kv_device)
    conn.send(worker.endpoint)
    prefill_endpoints, decode_endpoint = conn.recv()
    names = list(kv)
    n, bs, tokens = spec.blocks("prefill"), worker.block_size, spec.num_tokens
    timings = []
    for r, mode in enumerate(_requests(spec)):
        block_ids = _block_ids(spec, r, side=100 + rank, n=n)
        contents = [
            block_contents(spec, i, r, "prefill", rank, worker.kv_format, device)[0] for i in range(spec.layers)
        ]
        idx = torch.tensor(block_ids, device=device)
        baseline = _step(worker, forward, names, None, views, idx, contents)
        transfer_id, request_id = f"t{r}", f"p{r}"
        ep0 = prefill_endpoints[0]
        host, port = ep0.split("://", 1)[1].rsplit(":", 1)
        announcement = RemotePrefill(
            transfer_id,
            "harness",
            ep0,
            host,
            int(port),
            tuple(block_ids),
            tokens,
            bs,
            mode,
            tp_size=spec.prefill_tp,
            endpoints=tuple(prefill_endpoints) if spec.prefill_tp > 1 else (),
            kv_format=worker.kv_format,
            shape=worker.shape,
        ).to_params()
        send = SendSpec(
            transfer_id,
            tuple(block_ids),
            0,
            tokens,
            tokens,
            decode_endpoint if mode == "push" else None,
            announcement=announcement,
            announce_endpoint=decode_endpoint,
        )
        first_save, forward_s, forward_end = _step(worker, forward, names, send, views, idx, contents)
        worker.begin_step(WorkerStep(finished_sends=[FinishedSend(transfer_id, request_id, held=True)]))
        deadline = time.monotonic() + spec.timeout_s
        while request_id not in worker.get_finished()[0] and time.monotonic() < deadline:
            time.sleep(0.001)  # until decode released it (the lease is longer than the timeout)
        timings.append((baseline[1], first_save, forward_s, forward_end))
    conn.send(timings)
    conn.recv()  # decode is done with us
    worker.shutdown()


def _step(
    worker: Any,
    forward: _Forward,
    names: list[str],
    send: Any,
    views: list[torch.Tensor],
    idx: torch.Tensor,
    contents: list[torch.Tensor],
) -> tuple[float, float, float]:
    """One prefill step; (first save_kv_layer at, forward seconds, forward complete at)."""
    from vllm_pd.connector.step_specs import WorkerStep

    forward.finish()
    started = time.monotonic()
    _host_syncs_fail(idx.device, True)
    worker.begin_step(WorkerStep(sends=[send] if send is not None else []))
    first_save = 0.0
    for i, name in enumerate(names):
        forward.layer(then=lambda v=views[i], c=contents[i]: v.index_copy_(0, idx, c.view(c.shape[0], *v.shape[1:])))
        if send is not None:
            worker.save_kv_layer(name)
            first_save = first_save or time.monotonic()
    worker.wait_for_save()
    _host_syncs_fail(idx.device, False)
    forward.finish()
    ended = time.monotonic()
    return first_save, ended - started, ended


def _decode_main(spec: HarnessSpec, conn: Any, rank: int, base_port: int) -> None:
    from vllm_pd.connector.step_specs import LoadSpec, WorkerStep
    from vllm_pd.protocol.transfer_params import RemotePrefill

    worker, kv, views, device, kv_device = _worker(spec, "decode", rank, base_port)
    forward = _Forward(spec, device, kv_device)
    conn.send(worker.endpoint)
    conn.recv()  # every side has started
    names = list(kv)
    n = spec.blocks("decode")
    results = []
    for r, mode in enumerate(_requests(spec)):
        transfer_id = f"t{r}"
        params = worker.staging.wait_announced(transfer_id, time.monotonic() + spec.timeout_s)
        remote = RemotePrefill.from_params(params)
        assert remote is not None, f"no usable announcement for {transfer_id}: {params}"
        if spec.prefill_tp == spec.decode_tp and not (spec.prefill_block_size or spec.decode_block_size):
            assert remote.kv_format == worker.kv_format, (
                f"prefill's blocks are {remote.kv_format}, ours {worker.kv_format}"
            )
        local_ids = _block_ids(spec, r, side=200 + rank, n=n)
        load = LoadSpec(f"d{r}", transfer_id, remote, 0, tuple(local_ids), layerwise=True)
        _host_syncs_fail(device, True)
        worker.begin_step(WorkerStep(loads=[load]))
        worker.start_loads()
        job = worker.loader.job(f"d{r}")
        assert job is not None
        for name in names:
            worker.wait_for_layer_load(name)
            forward.layer()
        bad = worker.block_ids_with_load_errors()
        _host_syncs_fail(device, False)
        forward.finish()
        idx = torch.tensor(local_ids, device=device)
        exact = True
        for i, v in enumerate(views):
            want, valid = block_contents(spec, i, r, "decode", rank, worker.kv_format, device)
            got = v.index_select(0, idx).reshape(n, -1)
            exact = exact and torch.equal(got[valid], want[valid])
        results.append(
            dict(
                mode=mode,
                exact=exact,
                load_ok=not bad and job.ok,
                from_push=job.blocks_from_push,
                fetched=job.blocks_fetched,
                nbytes=job.bytes_landed,
                landed_at=job.finished_at or time.monotonic(),
            )
        )
        worker.get_finished()
    conn.send(results)
    conn.recv()
    worker.shutdown()


def _requests(spec: HarnessSpec) -> list[str]:
    return [mode for _ in range(spec.rounds) for mode in spec.modes]


def _run_side(main: Any, spec_dict: dict[str, Any], conn: Any, rank: int, base_port: int) -> None:
    spec = HarnessSpec(**{**spec_dict, "modes": tuple(spec_dict["modes"])})
    try:
        main(spec, conn, rank, base_port)
    except BaseException as e:
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it (rank r of an instance listens on base + r)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


def run(spec: HarnessSpec) -> HarnessResult:
    """Run prefill's and decode's TP ranks in fresh processes; their results side by side (per
    request: decode's ranks summed, exact and ok only if every rank's are)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    sides = [("prefill", _prefill_main, spec.prefill_tp), ("decode", _decode_main, spec.decode_tp)]
    conns: dict[str, list[Any]] = {"prefill": [], "decode": []}
    procs = []
    for side, main, tp in sides:
        base = _free_ports(tp) if tp > 1 else 0
        for rank in range(tp):
            parent, child = ctx.Pipe()
            conns[side].append(parent)
            procs.append(ctx.Process(target=_run_side, args=(main, asdict(spec), child, rank, base), daemon=True))
    for p in procs:
        p.start()
    result = HarnessResult(spec)
    try:
        prefill_eps = [_recv(c, spec) for c in conns["prefill"]]
        decode_eps = [_recv(c, spec) for c in conns["decode"]]
        for c in conns["prefill"]:
            c.send((prefill_eps, decode_eps[0]))
        for c in conns["decode"]:
            c.send("go")
        timings = [_recv(c, spec) for c in conns["prefill"]][0]
        loads = [_recv(c, spec) for c in conns["decode"]]
        for c in conns["prefill"] + conns["decode"]:
            c.send("done")
        for k, (baseline_s, first_save, forward_s, forward_end) in enumerate(timings):
            per_rank = [rank_loads[k] for rank_loads in loads]
            result.requests.append(
                RequestResult(
                    baseline_forward_s=baseline_s,
                    first_save_at=first_save,
                    forward_s=forward_s,
                    forward_end_at=forward_end,
                    mode=per_rank[0]["mode"],
                    exact=all(x["exact"] for x in per_rank),
                    load_ok=all(x["load_ok"] for x in per_rank),
                    from_push=sum(x["from_push"] for x in per_rank),
                    fetched=sum(x["fetched"] for x in per_rank),
                    nbytes=sum(x["nbytes"] for x in per_rank),
                    landed_at=max(x["landed_at"] for x in per_rank),
                )
            )
    except _SideFailed as e:
        result.errors.append(str(e))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return result


class _SideFailed(Exception):
    pass


def _recv(conn: Any, spec: HarnessSpec) -> Any:
    if not conn.poll(spec.timeout_s + 120):
        raise _SideFailed("a harness process did not answer in time")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise _SideFailed(msg[1])
    return msg

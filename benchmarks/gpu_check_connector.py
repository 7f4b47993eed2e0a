"""gpu_check's connector steps: the GPU harness over one transport, for two model sizes.

For a Llama-3-8B-sized model (32 layers, 8 KV heads of 128, FLASH_ATTN blocks of 16) and a
DeepSeek-V3-sized one (61 layers, MLA latent 576, FlashMLA pages of 64), a 2K-token request is
pushed and pulled through tests/support/gpu_harness.py (two processes, the connector's worker on each, every
block compared byte for byte) twice: once with a forward that only writes the KV (the KV rate, in
GB/s, beside pinned cudaMemcpy D2H / H2D and a D2D copy of the same bytes measured here), once with
a synthetic forward sized like a real layer at 2K tokens (a [2048, h] @ [h, h] matmul per layer, h
chosen so that 2 * 2048 * h^2 is about the layer's FLOPs; Llama-3-8B: 218 M parameters a layer,
DeepSeek-V3: about 0.6 G active) for the share of the transfer hidden behind it and the forward's
slowdown against the same step without a transfer (benchmarks/gpu_transfer.py's figures). At the
small sizes of ``cpu`` / ``standin`` the run with the forward gives every figure.

Goals (issue 24): host-staged (tcp, shm) >= 0.8 x the slower pinned copy; nixl (VRAM registered,
UCX cuda_ipc on one host) >= 0.8 x D2D; >= 90 % hidden; slowdown <= 3 %; no host sync under
``torch.cuda.set_sync_debug_mode("error")``. The HarnessSpecs are built in :func:`harness_spec` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_transfer import copy_gbps, transfer_figures

from tests.support import gpu_harness
from tests.support.gpu_harness import HarnessResult, HarnessSpec, run

TOKENS = {"full": 2048, "small": 128}
LAYERS_SMALL = 4
HIDDEN_SMALL = 256
ROUNDS = {"full": 3, "small": 1}
RATE_GOAL, HIDDEN_GOAL, SLOWDOWN_GOAL = 0.8, 0.9, 0.03


@dataclass(frozen=True)
class Model:
    name: str  # tests/support/gpu_harness.py's model preset
    backend: str  # vLLM's attention backend on Hopper
    layout: str  # "flash" or "mla": how many bytes a token takes (bytes_per_token)
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    hidden: int  # the synthetic forward's h

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV in one layer, bf16: K and V per head, or MLA's one latent."""
        return 2 * self.head_size * (1 if self.layout == "mla" else 2 * self.kv_heads)


MODELS = (
    Model("llama3-8b", "FLASH_ATTN", "flash", 32, 8, 128, 16, 14848),  # sqrt(218e6) = 14765, to 128s
    Model("deepseek-v3", "FLASHMLA", "mla", 61, 1, 576, 64, 24576),  # sqrt(0.6e9) = 24495
)


def harness_spec(device: str, transport: str, model: Model, size: str, compute: bool) -> HarnessSpec:
    """The one place gpu_check builds the harness's spec (its fields follow tests/support/gpu_harness.py)."""
    blocks = TOKENS[size] // model.block_size
    return HarnessSpec(
        device=device,
        transport=transport,
        backend=model.backend,
        model=model.name,
        layers=0 if size == "full" else LAYERS_SMALL,
        num_blocks=4 * blocks,
        blocks_per_request=blocks,
        modes=("push", "pull"),
        rounds=ROUNDS[size],
        hidden=(model.hidden if size == "full" else HIDDEN_SMALL) if compute else 0,
        host_staging_bytes=1 << 30,
        timeout_s=60.0,
    )


def layers(model: Model, size: str) -> int:
    return model.layers if size == "full" else LAYERS_SMALL


def sync_debug_enforced() -> bool:
    """Whether the harness runs the connector's hooks under torch.cuda.set_sync_debug_mode("error") on CUDA
    (tests/support/gpu_harness.py's ``_host_syncs_fail``; a sync then fails the run)."""
    return hasattr(gpu_harness, "_host_syncs_fail")


def transport_step(device: str, transport: str, size: str) -> dict[str, Any]:
    """One connector step: both models over ``transport``; rows per model and mode."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for model in MODELS:
        bare_spec = harness_spec(device, transport, model, size, compute=False)
        limits = _limits(device, model, size)
        full = run(harness_spec(device, transport, model, size, compute=True))
        # at small sizes (figures meaningless) one run serves both: half the harness start-ups in CI
        bare = run(bare_spec) if size == "full" else full
        if bare.errors or full.errors:
            errors.append(f"{model.name}: {(bare.errors or full.errors)[0]}")
            continue
        for mode in bare_spec.modes:
            count = layers(model, size)
            problem = _counts_problem(bare, mode, count) or _counts_problem(full, mode, count)
            figures = transfer_figures(
                [r for r in bare.requests if r.mode == mode], [r for r in full.requests if r.mode == mode]
            )
            peer = limits["d2d"] if transport == "nixl" else min(limits["d2h"], limits["h2d"])
            rows.append(
                {
                    "model": model.name,
                    "mode": mode,
                    **figures,
                    "blocks_counted": problem is None,
                    "x_peer": float(figures["gbps"]) / peer,
                    **{f"{k}_gbps": v for k, v in limits.items()},
                }
            )
            if problem or not figures["exact"]:
                errors.append(f"{model.name} {mode}: {problem or 'blocks differ from what prefill wrote'}")
    return _verdict(device, transport, rows, errors)


def _limits(device: str, model: Model, size: str) -> dict[str, float]:
    """Pinned D2H / H2D and D2D copies of one request's KV bytes (on the CPU: a memcpy for each)."""
    nbytes = layers(model, size) * TOKENS[size] * model.kv_bytes_per_token
    if device != "cuda":
        rate = copy_gbps("cpu", nbytes, "memcpy")
        return {"d2h": rate, "h2d": rate, "d2d": rate}
    return {kind: copy_gbps("cuda", nbytes, kind) for kind in ("d2h", "h2d", "d2d")}


def _counts_problem(result: HarnessResult, mode: str, layer_count: int) -> str | None:
    """A push lands every block from what was pushed, a pull reads every block: else what was off."""
    n = result.spec.blocks_per_request * layer_count
    want = (n, 0) if mode == "push" else (0, n)
    for r in result.requests:
        if r.mode == mode and (r.from_push, r.fetched) != want:
            return f"(from push, fetched) = {(r.from_push, r.fetched)}, expected {want}"
        if r.mode == mode and not r.load_ok:
            return "decode reported a failed load"
    return None


def _verdict(device: str, transport: str, rows: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    peer = "D2D" if transport == "nixl" else "pinned copy"
    synced = device == "cuda" and sync_debug_enforced()
    if device != "cuda":
        sync_debug = "n/a off a GPU"
    elif synced:
        sync_debug = "enforced: a host sync in the connector's hooks fails the run"
    else:
        sync_debug = "not enforced: tests/support/gpu_harness.py has no sync-debug mode yet"
    result: dict[str, Any] = {
        "status": "failed" if errors or not rows else "ok",
        "rows": rows,
        "detail": "; ".join(errors)[:2000],
        "goal": f"KV >= {RATE_GOAL} x {peer}, hidden >= {HIDDEN_GOAL:.0%}, slowdown <= {SLOWDOWN_GOAL:.0%}, "
        "no host sync",
        "sync_debug": sync_debug,
    }
    if not rows:
        return {**result, "key": "no figure", "goal_met": False}
    worst_rate = min(r["x_peer"] for r in rows)
    worst_hidden = min(r["hidden"] for r in rows)
    worst_slowdown = max(r["slowdown"] for r in rows)
    result["key"] = f"worst KV {worst_rate:.2f} x {peer}, hidden {worst_hidden:.0%}, slowdown {worst_slowdown:+.1%}" + (
        "" if synced else ", sync-debug n/a"
    )
    result["goal_met"] = (
        worst_rate >= RATE_GOAL and worst_hidden >= HIDDEN_GOAL and worst_slowdown <= SLOWDOWN_GOAL and synced
    )
    return result

"""vLLM's CPU rotary embedding on DeepSeek-V2 (MLA) shaped query/key, with vllm_pd's fix.

The MLA model rotates ``q_pe`` [T, H, 64] (a slice of q) and ``k_pe`` [T, 1, 64] (a slice of
the latent projection, token stride 576) in place. The reference is vLLM's own PyTorch
``forward_native`` on the same values.
"""

from __future__ import annotations

import pytest
import torch

from vllm_pd.ops import cpu_rope

KV_LORA, ROPE, NOPE, HEADS = 512, 64, 64, 4


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    cpu_rope.install()
    ropes = {}
    with set_current_vllm_config(VllmConfig()):
        for neox in (False, True):  # DeepSeek-V2 uses the GPT-J (interleaved) style
            ropes[neox] = get_rope(
                ROPE,
                max_position=4096,
                is_neox_style=neox,
                dtype=torch.bfloat16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            )
    return ropes


def mla_inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, q [T, H, nope+rope], latent [T, kv_lora+rope]) as DeepSeek-V2's MLA makes them."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(7, 7 + tokens)  # not from 0: position 0 is the identity rotation
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=g).bfloat16()
    latent = torch.randn(tokens, KV_LORA + ROPE, generator=g).bfloat16()
    return positions, q, latent


def rotate_like_the_model(rope, positions, q, latent) -> torch.Tensor:
    """vllm/model_executor/layers/mla.py: rotate the strided views in place."""
    k_pe = latent.split([KV_LORA, ROPE], dim=-1)[1].unsqueeze(1)
    q[..., NOPE:], k_pe = rope.forward_cpu(positions, q[..., NOPE:], k_pe)
    return k_pe


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
def test_mla_strided_views_are_rotated_like_native(rope, neox: bool, tokens: int) -> None:
    r = rope[neox]
    positions, q, latent = mla_inputs(tokens)
    q_ref, k_ref = r.forward_native(positions, q[..., NOPE:].clone(), latent[:, None, KV_LORA:].clone())
    kv_c_before, q_nope_before = latent[:, :KV_LORA].clone(), q[..., :NOPE].clone()
    k_pe = rotate_like_the_model(r, positions, q, latent)
    torch.testing.assert_close(k_pe.float(), k_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q[..., NOPE:].float(), q_ref.float(), atol=2e-2, rtol=2e-2)
    # and nothing outside the rotated dims was touched
    assert torch.equal(latent[:, :KV_LORA], kv_c_before)
    assert torch.equal(q[..., :NOPE], q_nope_before)


def test_prefill_and_decode_rotate_a_token_alike(rope) -> None:
    """The KV of token t is the same whether it is computed in a prefill batch or alone (a
    decode step, or the last prompt token a PD decode instance recomputes)."""
    r = rope[False]
    positions, q, latent = mla_inputs(16, seed=3)
    batch_k = rotate_like_the_model(r, positions, q.clone(), latent.clone())
    alone_k = rotate_like_the_model(r, positions[-1:], q[-1:].clone(), latent[-1:].clone())
    torch.testing.assert_close(batch_k[-1].float(), alone_k[0].float(), atol=1e-2, rtol=1e-2)


def test_two_dim_calls_reach_the_kernel_unchanged() -> None:
    """Llama-style models pass [T, heads * head_size] rows: same tensors, no copies."""
    seen = []
    wrapped = cpu_rope.stride_safe(lambda *args, **kwargs: seen.append((args, kwargs)))
    qkv = torch.randn(5, 3 * 128)
    q, k = qkv[:, :256], qkv[:, 256:]
    wrapped(torch.arange(5), q, k, 64, torch.zeros(1, 64), True)
    ((args, _),) = seen
    assert args[1] is q and args[2] is k


def test_upstream_kernel_still_needs_the_fix(rope) -> None:
    """vLLM's raw CPU kernel on the MLA views leaves k_pe rows after the first unrotated.
    When this fails, vLLM has fixed its kernel and vllm_pd.ops.cpu_rope can go."""
    positions, q, latent = mla_inputs(4)
    k_pe = latent.split([KV_LORA, ROPE], dim=-1)[1].unsqueeze(1)
    before = k_pe.clone()
    r = rope[False]
    torch.ops._C.rotary_embedding(positions, q[..., NOPE:], k_pe, ROPE, r.cos_sin_cache.to(q.dtype), False)
    assert torch.equal(k_pe[1:], before[1:])

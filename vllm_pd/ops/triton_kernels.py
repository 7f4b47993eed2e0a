"""Triton kernels for the vllm_pd ops: portable across Hopper and ROCm / Hygon DCU.

Written for correctness first (tested on CPU in Triton's interpreter, TRITON_INTERPRET=1):
one program per (batch, 16 query rows) for MLA decode, without split-KV, and block-scaled
GEMM tiles that promote each 128-wide K block with its two scales like DeepGEMM does. They
have not been tuned or even run on a GPU in this project yet.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_kernel(
    Q,
    KC,
    BT,
    LENS,
    OUT,
    LSE,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_btb,
    stride_ob,
    stride_os,
    stride_oh,
    H_Q,
    S_Q,
    ROWS,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    qi = rows // H_Q
    h = rows % H_Q
    dv = tl.arange(0, BLOCK_DV)
    dr = DV + tl.arange(0, BLOCK_DR)  # the rope part: channels DV .. D
    dv_ok = dv < DV
    dr_ok = dr < D
    q_rows = Q + b * stride_qb + qi * stride_qs + h * stride_qh
    q_nope = tl.load(q_rows[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    if DOT_F32:  # the interpreter's dot is only right in fp32; on GPUs bf16/fp16 MMA is used
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    seq_len = tl.load(LENS + b)
    if CAUSAL:
        visible = seq_len - S_Q + qi + 1  # the queries are the last S_Q tokens
    else:
        visible = tl.zeros([BLOCK_H], dtype=tl.int32) + seq_len
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < seq_len
        block = tl.load(BT + b * stride_btb + t // PAGE, mask=t_ok, other=0)
        k_rows = KC + block.to(tl.int64) * stride_kb + (t % PAGE) * stride_kt
        k_nope = tl.load(k_rows[:, None] + dv[None, :], mask=t_ok[:, None] & dv_ok[None, :], other=0.0)
        k_rope = tl.load(k_rows[:, None] + dr[None, :], mask=t_ok[:, None] & dr_ok[None, :], other=0.0)
        if DOT_F32:
            k_nope = k_nope.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(t[None, :] < visible[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new
    seen = l_i > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("inf"))
    o_rows = OUT + b * stride_ob + qi * stride_os + h * stride_oh
    tl.store(o_rows[:, None] + dv[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + (b * H_Q + h) * S_Q + qi, lse, mask=row_ok)


MODE_PLAIN, MODE_CONTIGUOUS, MODE_MASKED = 0, 1, 2


@triton.jit
def fp8_gemm_kernel(
    A,
    SFA,
    B,
    SFB,
    D,
    C,
    LAYOUT,
    MASKED_M,
    M,
    N,
    K,
    stride_ag,
    stride_am,
    stride_bg,
    stride_bn,
    stride_sfag,
    stride_sfam,
    stride_sfak,
    stride_sfbg,
    stride_sfbn,
    stride_sfbk,
    stride_dg,
    stride_dm,
    stride_cm,
    MODE: tl.constexpr,
    HAS_C: tl.constexpr,
    FP8_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)  # group, masked mode only
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    if MODE == 2:
        row_ok = rows < tl.load(MASKED_M + g)
    group = g
    if MODE == 1:
        # DeepGEMM's contiguous layout: a tile holds one group's rows plus -1 padding rows.
        ids = tl.load(LAYOUT + rows, mask=row_ok, other=-1)
        group = tl.max(ids, axis=0)
        row_ok = row_ok & (ids >= 0)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = A + g * stride_ag + rows.to(tl.int64) * stride_am
    b_rows = B + group.to(tl.int64) * stride_bg + cols.to(tl.int64) * stride_bn
    sfa_rows = SFA + g * stride_sfag + rows * stride_sfam
    sfb_row = SFB + group * stride_sfbg + (pid_n * BLOCK_N // 128) * stride_sfbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if group >= 0:
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + ks
            k_ok = k < K
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_rows[:, None] + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if FP8_DOT:
                part = tl.dot(a, tl.trans(b))
            elif DOT_F32:  # the interpreter's dot is only right in fp32
                part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
            else:  # e4m3 values are exact in bf16; used where fp8 MMA is unavailable
                part = tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
            sa = tl.load(sfa_rows + kb * stride_sfak, mask=row_ok, other=0.0)
            sb = tl.load(sfb_row + kb * stride_sfbk)
            acc += part * (sa * sb)[:, None]
    if HAS_C:
        acc += tl.load(C + rows[:, None] * stride_cm + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    d_ptrs = D + g * stride_dg + rows[:, None].to(tl.int64) * stride_dm + cols[None, :]
    out_ok = (rows < M)[:, None] & col_ok[None, :]
    if MODE == 2:
        out_ok = row_ok[:, None] & col_ok[None, :]  # rows past masked_m stay untouched
    tl.store(d_ptrs, acc.to(D.dtype.element_ty), mask=out_ok)

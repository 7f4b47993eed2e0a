// CUDA (SM90) / HIP (Hygon DCU, AMD) kernels for mla_decode and the block-scaled FP8 GEMMs.
//
// Plain SIMT kernels, written for correctness and portability (no CUTLASS, no TMA/WGMMA, no
// vendor FP8 types: FP8 bytes are decoded by bit arithmetic for both e4m3fn and e4m3fnuz).
// They are compiled by tests/test_ops_build.py but have never run here (no GPU in this task).
#include <cfloat>
#include <cmath>

#ifdef VLLM_PD_HIP
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
typedef __hip_bfloat16 vllm_pd_bf16;
#define VLLM_PD_SHFL_XOR(v, m) __shfl_xor((v), (m))
constexpr int kWarp = 64;
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat16 vllm_pd_bf16;
#define VLLM_PD_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
constexpr int kWarp = 32;
#endif

#include "launch.h"

namespace vllm_pd {
namespace gpu {
namespace {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(vllm_pd_bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ vllm_pd_bf16 from_f<vllm_pd_bf16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int m = kWarp / 2; m > 0; m >>= 1) v += VLLM_PD_SHFL_XOR(v, m);
  return v;
}

// ---------------------------------------------------------------------------------------------
// MLA decode: one CTA per (sequence, 16 query rows, split of <= 256 tokens). Pass 1 scores
// the split's tokens into shared memory (a warp per token, a dot product per row), pass 2
// has each thread own output channels and sum p * V over the tokens. Splits are merged by
// mla_combine with their max and sum of exponentials.
// ---------------------------------------------------------------------------------------------
constexpr int kMlaThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kMlaThreads) mla_split(MlaParams p) {
  extern __shared__ float smem[];
  const int b = blockIdx.x, row0 = blockIdx.y * kMlaRowsPerCta, split = blockIdx.z;
  const int rows_total = p.s_q * p.h_q;
  const int rows = min(kMlaRowsPerCta, rows_total - row0);
  const int seq_len = p.seqlens[b];
  const int t_begin = split * p.split_len, t_end = min(seq_len, t_begin + p.split_len);
  float* q_s = smem;                                 // [16][dim]
  float* s_s = q_s + kMlaRowsPerCta * p.dim;         // [16][split_len]
  float* stat = s_s + kMlaRowsPerCta * p.split_len;  // [16] max, [16] sum
  const T* q = static_cast<const T*>(p.q) + ((int64_t)b * rows_total + row0) * p.dim;
  for (int i = threadIdx.x; i < rows * p.dim; i += blockDim.x) q_s[i] = to_f(q[i]);
  __syncthreads();

  const T* cache = static_cast<const T*>(p.k_cache);
  const int32_t* table = p.block_table + (int64_t)b * p.table_stride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int n = max(0, t_end - t_begin);
  for (int t = warp; t < n; t += warps) {
    const int tok = t_begin + t;
    const T* k = cache + table[tok / p.block_size] * p.cache_block_stride + (tok % p.block_size) * p.cache_token_stride;
    float acc[kMlaRowsPerCta];
#pragma unroll
    for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] = 0.f;
    for (int d = lane; d < p.dim; d += kWarp) {
      const float kv = to_f(k[d]);
#pragma unroll
      for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] += q_s[r * p.dim + d] * kv;
    }
#pragma unroll
    for (int r = 0; r < kMlaRowsPerCta; ++r) {
      const float s = warp_sum(acc[r]);
      if (lane == 0 && r < rows) {
        const int visible = p.causal ? seq_len - p.s_q + (row0 + r) / p.h_q + 1 : seq_len;
        s_s[r * p.split_len + t] = tok < visible ? s * p.scale : -INFINITY;
      }
    }
  }
  __syncthreads();
  // Per row: max, then p = exp(s - max) in place and its sum (a warp per row).
  for (int r = warp; r < rows; r += warps) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += kWarp) m = fmaxf(m, s_s[r * p.split_len + t]);
    for (int o = kWarp / 2; o > 0; o >>= 1) m = fmaxf(m, VLLM_PD_SHFL_XOR(m, o));
    float l = 0.f;
    for (int t = lane; t < n; t += kWarp) {
      const float s = s_s[r * p.split_len + t];
      const float e = (m == -INFINITY) ? 0.f : __expf(s - m);
      s_s[r * p.split_len + t] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      stat[r] = m;
      stat[kMlaRowsPerCta + r] = l;
    }
  }
  __syncthreads();
  const int64_t part = ((int64_t)b * p.splits + split) * rows_total + row0;
  for (int d = threadIdx.x; d < p.dim_v; d += blockDim.x) {
    float acc[kMlaRowsPerCta];
#pragma unroll
    for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] = 0.f;
    for (int t = 0; t < n; ++t) {
      const int tok = t_begin + t;
      const float v = to_f(cache[table[tok / p.block_size] * p.cache_block_stride +
                                 (tok % p.block_size) * p.cache_token_stride + d]);
#pragma unroll
      for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] += s_s[r * p.split_len + t] * v;
    }
    for (int r = 0; r < rows; ++r) p.part_out[(part + r) * p.dim_v + d] = acc[r];
  }
  if (threadIdx.x < rows) {
    p.part_max[part + threadIdx.x] = stat[threadIdx.x];
    p.part_sum[part + threadIdx.x] = stat[kMlaRowsPerCta + threadIdx.x];
  }
}

// One CTA per (sequence, row): merges the splits; rows that saw no key get out 0, lse +inf.
template <typename T>
__global__ void mla_combine(MlaParams p) {
  const int b = blockIdx.x, row = blockIdx.y, rows_total = p.s_q * p.h_q;
  const int used = (p.seqlens[b] + p.split_len - 1) / p.split_len;
  float m = -INFINITY;
  for (int s = 0; s < used; ++s) m = fmaxf(m, p.part_max[((int64_t)b * p.splits + s) * rows_total + row]);
  float l = 0.f;
  for (int s = 0; s < used; ++s) {
    const int64_t i = ((int64_t)b * p.splits + s) * rows_total + row;
    if (m != -INFINITY) l += p.part_sum[i] * __expf(p.part_max[i] - m);
  }
  T* out = static_cast<T*>(p.out) + ((int64_t)b * rows_total + row) * p.dim_v;
  for (int d = threadIdx.x; d < p.dim_v; d += blockDim.x) {
    float acc = 0.f;
    if (l > 0.f) {
      for (int s = 0; s < used; ++s) {
        const int64_t i = ((int64_t)b * p.splits + s) * rows_total + row;
        acc += p.part_out[i * p.dim_v + d] * __expf(p.part_max[i] - m);
      }
      acc /= l;
    }
    out[d] = from_f<T>(acc);
  }
  if (threadIdx.x == 0) {
    const int qi = row / p.h_q, h = row % p.h_q;
    p.lse[((int64_t)b * p.h_q + h) * p.s_q + qi] = l > 0.f ? m + logf(l) : INFINITY;
  }
}

template <typename T>
void mla_decode_typed(const MlaParams& p, vllm_pd_stream_t stream) {
  const int rows_total = p.s_q * p.h_q;
  const dim3 grid(p.batch, (rows_total + kMlaRowsPerCta - 1) / kMlaRowsPerCta, p.splits);
  const size_t smem = sizeof(float) * (kMlaRowsPerCta * (p.dim + p.split_len) + 2 * kMlaRowsPerCta);
#ifndef VLLM_PD_HIP
  cudaFuncSetAttribute(mla_split<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
#endif
  mla_split<T><<<grid, kMlaThreads, smem, stream>>>(p);
  mla_combine<T><<<dim3(p.batch, rows_total), 128, 0, stream>>>(p);
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMM: 64x64 output tile per CTA, 256 threads with 4x4 outputs each; each 128-wide K
// block is decoded to fp32 in shared memory (two 64-wide halves, 33 KB), multiplied, then
// promoted with sfa * sfb.
// ---------------------------------------------------------------------------------------------
constexpr int kTile = 64, kBK = 128, kSubK = 64, kGemmThreads = 256;

__device__ __forceinline__ float fp8_to_float(uint8_t v, Fp8 kind) {
  const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 7;
  float x;
  if (kind == Fp8::kE4M3FN) {
    if (exp == 15 && man == 7) return NAN;
    x = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.f + man / 8.f, exp - 7);
  } else {  // fnuz: bias 8, 0x80 is the only NaN, no negative zero
    if (v == 0x80) return NAN;
    x = exp == 0 ? ldexpf((float)man, -10) : ldexpf(1.f + man / 8.f, exp - 8);
  }
  return sign ? -x : x;
}

template <typename T>
__global__ void __launch_bounds__(kGemmThreads) fp8_gemm(GemmParams p) {
  __shared__ float a_s[kSubK][kTile + 1];
  __shared__ float b_s[kSubK][kTile + 1];
  __shared__ float scale_a[kTile];
  const int g = blockIdx.z;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  int m_valid = p.m;
  int group = g;
  if (p.mode == GemmMode::kMasked) m_valid = p.masked_m[g];
  if (row0 >= m_valid) return;
  if (p.mode == GemmMode::kContiguous) {
    // DeepGEMM's layout pads each group to 128 rows, so a 64-row tile holds one group (+ -1 rows).
    group = -1;
    for (int r = 0; r < kTile && row0 + r < p.m; ++r) group = max(group, p.grouped_layout[row0 + r]);
  }
  const uint8_t* a = p.a + g * p.a_group_stride;
  const uint8_t* b = p.b + (group < 0 ? 0 : group) * p.b_group_stride;
  const float* sfa = p.sfa + g * p.sfa_group_stride;
  const float* sfb = p.sfb + (group < 0 ? 0 : group) * p.sfb_group_stride;
  const int tr = (threadIdx.x / 16) * 4, tc = (threadIdx.x % 16) * 4;
  float acc[4][4] = {};
  const int k_blocks = (p.k + kBK - 1) / kBK;
  for (int kb = 0; group >= 0 && kb < k_blocks; ++kb) {
    if (threadIdx.x < kTile) {
      const int r = row0 + threadIdx.x;
      scale_a[threadIdx.x] = r < m_valid ? sfa[r * p.sfa_s0 + kb * p.sfa_s1] : 0.f;
    }
    float part[4][4] = {};
    for (int half = 0; half < kBK / kSubK; ++half) {
      for (int i = threadIdx.x; i < kTile * kSubK; i += blockDim.x) {
        const int r = i / kSubK, x = i % kSubK, kk = kb * kBK + half * kSubK + x;
        const bool row_ok = row0 + r < m_valid, col_ok = col0 + r < p.n, k_ok = kk < p.k;
        a_s[x][r] = row_ok && k_ok ? fp8_to_float(a[(int64_t)(row0 + r) * p.lda + kk], p.fp8) : 0.f;
        b_s[x][r] = col_ok && k_ok ? fp8_to_float(b[(int64_t)(col0 + r) * p.ldb + kk], p.fp8) : 0.f;
      }
      __syncthreads();
      for (int x = 0; x < kSubK; ++x) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] += a_s[x][tr + i] * b_s[x][tc + j];
      }
      __syncthreads();
    }
    const float sb = sfb[(col0 / kBK) * p.sfb_s0 + kb * p.sfb_s1];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j] * scale_a[tr + i] * sb;
    __syncthreads();  // scale_a is rewritten by the next K block
  }
  T* d = static_cast<T*>(p.d) + g * p.d_group_stride;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + tr + i;
    if (r >= m_valid) continue;
    const bool padding = p.mode == GemmMode::kContiguous && p.grouped_layout[r] < 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = col0 + tc + j;
      if (c >= p.n) continue;
      float v = padding ? 0.f : acc[i][j];
      if (p.c != nullptr) v += p.c[(int64_t)r * p.ldc + c];
      d[(int64_t)r * p.ldd + c] = from_f<T>(v);
    }
  }
}

}  // namespace

void launch_mla_decode(const MlaParams& p, vllm_pd_stream_t stream) {
  switch (p.dtype) {
    case DType::kBF16: mla_decode_typed<vllm_pd_bf16>(p, stream); break;
    case DType::kFP16: mla_decode_typed<__half>(p, stream); break;
    case DType::kFP32: mla_decode_typed<float>(p, stream); break;
  }
}

void launch_fp8_gemm(const GemmParams& p, vllm_pd_stream_t stream) {
  const int m_tiles = (p.m + kTile - 1) / kTile, n_tiles = (p.n + kTile - 1) / kTile;
  if (m_tiles == 0 || n_tiles == 0) return;
  const dim3 grid(n_tiles, m_tiles, p.mode == GemmMode::kMasked ? p.groups : 1);
  switch (p.out_dtype) {
    case DType::kBF16: fp8_gemm<vllm_pd_bf16><<<grid, kGemmThreads, 0, stream>>>(p); break;
    case DType::kFP16: fp8_gemm<__half><<<grid, kGemmThreads, 0, stream>>>(p); break;
    case DType::kFP32: fp8_gemm<float><<<grid, kGemmThreads, 0, stream>>>(p); break;
  }
}

}  // namespace gpu
}  // namespace vllm_pd

// CUDA (SM90) / HIP (Hygon DCU, AMD) kernels for mla_decode and the block-scaled FP8 GEMMs.
//
// Plain SIMT kernels, written for correctness and portability (no CUTLASS, no TMA/WGMMA, no
// vendor FP8 types: FP8 bytes are decoded by bit arithmetic for both e4m3fn and e4m3fnuz).
// They are compiled by tests/integration/test_ops_build.py but have never run here (no GPU in this task).
// Every runtime call and launch is checked (VLLM_PD_CHECK / VLLM_PD_CHECK_LAUNCH): the first
// failure is returned to bindings.cu, which raises it as a torch error naming the call.
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

#ifdef VLLM_PD_HIP
#define vllm_pd_last_error hipGetLastError
#else
#define vllm_pd_last_error cudaGetLastError
#endif
#define VLLM_PD_CHECK(expr, what)                                      \
  do {                                                                 \
    const vllm_pd_error_t vllm_pd_error_ = (expr);                     \
    if (vllm_pd_error_ != VLLM_PD_SUCCESS) return {vllm_pd_error_, what}; \
  } while (0)
// After a <<<...>>> launch: a bad configuration (grid, block, shared memory) is reported here.
#define VLLM_PD_CHECK_LAUNCH(what) VLLM_PD_CHECK(vllm_pd_last_error(), what)

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
// MLA decode: one CTA per (sequence, 16 query rows, split). A split takes its mla_split_range
// of the sequence's real length and walks them in chunks of kMlaChunk: pass 1 scores a chunk
// into shared memory (a warp per token, a dot product per row), pass 2 turns scores into
// exp(s - running max) and rescales what earlier chunks summed, pass 3 has each thread own
// output channels and add p * V. Splits are merged by mla_combine with their max and sum.
// ---------------------------------------------------------------------------------------------
constexpr int kMlaThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kMlaThreads) mla_split(MlaParams p) {
  extern __shared__ float smem[];
  const int b = blockIdx.x, row0 = blockIdx.y * kMlaRowsPerCta, split = blockIdx.z;
  const int rows_total = p.s_q * p.h_q;
  const int rows = min(kMlaRowsPerCta, rows_total - row0);
  const int seq_len = p.seqlens[b];
  int64_t begin, end;
  mla_split_range(seq_len, p.splits, split, &begin, &end);
  const int t_begin = static_cast<int>(begin), t_end = static_cast<int>(end);
  float* q_s = smem;                                 // [16][dim]
  float* s_s = q_s + kMlaRowsPerCta * p.dim;         // [16][kMlaChunk]
  float* run_max = s_s + kMlaRowsPerCta * kMlaChunk;  // [16] over the chunks so far
  float* run_sum = run_max + kMlaRowsPerCta;         // [16]
  float* rescale = run_sum + kMlaRowsPerCta;         // [16] factor for the output of earlier chunks
  const T* q = static_cast<const T*>(p.q) + ((int64_t)b * rows_total + row0) * p.dim;
  for (int i = threadIdx.x; i < rows * p.dim; i += blockDim.x) q_s[i] = to_f(q[i]);
  if (threadIdx.x < kMlaRowsPerCta) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.f;
  }
  __syncthreads();

  const T* cache = static_cast<const T*>(p.k_cache);
  const int32_t* table = p.block_table + (int64_t)b * p.table_stride;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int64_t part = ((int64_t)b * p.splits + split) * rows_total + row0;
  for (int c0 = t_begin; c0 < t_end; c0 += kMlaChunk) {
    const int n = min(kMlaChunk, t_end - c0);
    for (int t = warp; t < n; t += warps) {
      const int tok = c0 + t;
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
          s_s[r * kMlaChunk + t] = tok < visible ? s * p.scale : -INFINITY;
        }
      }
    }
    __syncthreads();
    // Per row (a warp each): the new running max, p = exp(s - max) in place, the running sum.
    for (int r = warp; r < rows; r += warps) {
      const float before = run_max[r];
      float m = before;
      for (int t = lane; t < n; t += kWarp) m = fmaxf(m, s_s[r * kMlaChunk + t]);
      for (int o = kWarp / 2; o > 0; o >>= 1) m = fmaxf(m, VLLM_PD_SHFL_XOR(m, o));
      float l = 0.f;
      for (int t = lane; t < n; t += kWarp) {
        const float s = s_s[r * kMlaChunk + t];
        const float e = (m == -INFINITY) ? 0.f : __expf(s - m);
        s_s[r * kMlaChunk + t] = e;
        l += e;
      }
      l = warp_sum(l);
      if (lane == 0) {
        const float a = (before == -INFINITY) ? 0.f : __expf(before - m);
        rescale[r] = a;
        run_sum[r] = run_sum[r] * a + l;
        run_max[r] = m;
      }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < p.dim_v; d += blockDim.x) {
      float acc[kMlaRowsPerCta];
#pragma unroll
      for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] = 0.f;
      for (int t = 0; t < n; ++t) {
        const int tok = c0 + t;
        const float v = to_f(cache[table[tok / p.block_size] * p.cache_block_stride +
                                   (tok % p.block_size) * p.cache_token_stride + d]);
#pragma unroll
        for (int r = 0; r < kMlaRowsPerCta; ++r) acc[r] += s_s[r * kMlaChunk + t] * v;
      }
      // The thread owns these elements in every chunk, so its earlier writes are visible to it.
      for (int r = 0; r < rows; ++r) {
        float* o = p.part_out + (part + r) * p.dim_v + d;
        *o = c0 == t_begin ? acc[r] : *o * rescale[r] + acc[r];
      }
    }
    __syncthreads();  // s_s and rescale are rewritten by the next chunk
  }
  // An empty split (short sequence) reports max -inf: mla_combine skips it unread.
  if (threadIdx.x < rows) {
    p.part_max[part + threadIdx.x] = run_max[threadIdx.x];
    p.part_sum[part + threadIdx.x] = run_sum[threadIdx.x];
  }
}

// One CTA per (sequence, row): merges the splits; rows that saw no key get out 0, lse +inf.
template <typename T>
__global__ void mla_combine(MlaParams p) {
  const int b = blockIdx.x, row = blockIdx.y, rows_total = p.s_q * p.h_q;
  const int64_t first = (int64_t)b * p.splits * rows_total + row;  // split s: first + s * rows_total
  float m = -INFINITY;
  for (int s = 0; s < p.splits; ++s) m = fmaxf(m, p.part_max[first + (int64_t)s * rows_total]);
  float l = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float ms = p.part_max[first + (int64_t)s * rows_total];
    if (ms != -INFINITY) l += p.part_sum[first + (int64_t)s * rows_total] * __expf(ms - m);
  }
  T* out = static_cast<T*>(p.out) + ((int64_t)b * rows_total + row) * p.dim_v;
  for (int d = threadIdx.x; d < p.dim_v; d += blockDim.x) {
    float acc = 0.f;
    if (l > 0.f) {
      for (int s = 0; s < p.splits; ++s) {
        const int64_t i = first + (int64_t)s * rows_total;
        if (p.part_max[i] != -INFINITY) acc += p.part_out[i * p.dim_v + d] * __expf(p.part_max[i] - m);
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
LaunchResult mla_decode_typed(const MlaParams& p, vllm_pd_stream_t stream) {
  const int rows_total = p.s_q * p.h_q;
  const dim3 grid(p.batch, (rows_total + kMlaRowsPerCta - 1) / kMlaRowsPerCta, p.splits);
  const int64_t smem = mla_smem_bytes(p.dim);  // 53 KB for DeepSeek's 576 channels
#ifndef VLLM_PD_HIP
  if (smem > kDefaultSmemBytes) {
    VLLM_PD_CHECK(cudaFuncSetAttribute(mla_split<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                  "cudaFuncSetAttribute(mla_split, cudaFuncAttributeMaxDynamicSharedMemorySize)");
  }
#endif
  mla_split<T><<<grid, kMlaThreads, smem, stream>>>(p);
  VLLM_PD_CHECK_LAUNCH("mla_split<<<>>>");
  mla_combine<T><<<dim3(p.batch, rows_total), 128, 0, stream>>>(p);
  VLLM_PD_CHECK_LAUNCH("mla_combine<<<>>>");
  return {};
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

template <typename T>
LaunchResult fp8_gemm_typed(const GemmParams& p, const dim3& grid, vllm_pd_stream_t stream) {
  fp8_gemm<T><<<grid, kGemmThreads, 0, stream>>>(p);
  VLLM_PD_CHECK_LAUNCH("fp8_gemm<<<>>>");
  return {};
}

}  // namespace

LaunchResult launch_mla_decode(const MlaParams& p, vllm_pd_stream_t stream) {
  switch (p.dtype) {
    case DType::kBF16: return mla_decode_typed<vllm_pd_bf16>(p, stream);
    case DType::kFP16: return mla_decode_typed<__half>(p, stream);
    case DType::kFP32: return mla_decode_typed<float>(p, stream);
  }
  return {};
}

LaunchResult multiprocessor_count(int device, int* count) {
#ifdef VLLM_PD_HIP
  VLLM_PD_CHECK(hipDeviceGetAttribute(count, hipDeviceAttributeMultiprocessorCount, device),
                "hipDeviceGetAttribute(hipDeviceAttributeMultiprocessorCount)");
#else
  VLLM_PD_CHECK(cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device),
                "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
#endif
  return {};
}

LaunchResult launch_fp8_gemm(const GemmParams& p, vllm_pd_stream_t stream) {
  const int m_tiles = (p.m + kTile - 1) / kTile, n_tiles = (p.n + kTile - 1) / kTile;
  if (m_tiles == 0 || n_tiles == 0) return {};
  const dim3 grid(n_tiles, m_tiles, p.mode == GemmMode::kMasked ? p.groups : 1);
  switch (p.out_dtype) {
    case DType::kBF16: return fp8_gemm_typed<vllm_pd_bf16>(p, grid, stream);
    case DType::kFP16: return fp8_gemm_typed<__half>(p, grid, stream);
    case DType::kFP32: return fp8_gemm_typed<float>(p, grid, stream);
  }
  return {};
}

}  // namespace gpu
}  // namespace vllm_pd

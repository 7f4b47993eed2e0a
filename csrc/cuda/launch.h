// Torch-free launch interface of the CUDA/HIP kernels: kernels.cu implements it with plain
// pointers (so nvcc can compile it without torch headers, see tests/integration/test_ops_build.py) and
// bindings.cu calls it from the torch.ops.vllm_pd_C CUDA registrations.
#pragma once

#include <cstdint>

#ifdef VLLM_PD_HIP
#include <hip/hip_runtime.h>
typedef hipStream_t vllm_pd_stream_t;
typedef hipError_t vllm_pd_error_t;
#define VLLM_PD_SUCCESS hipSuccess
#define vllm_pd_error_string hipGetErrorString
#else
#include <cuda_runtime.h>
typedef cudaStream_t vllm_pd_stream_t;
typedef cudaError_t vllm_pd_error_t;
#define VLLM_PD_SUCCESS cudaSuccess
#define vllm_pd_error_string cudaGetErrorString
#endif

#include "mla_plan.h"

namespace vllm_pd {
namespace gpu {

// What a launch function reports: the first runtime call or kernel launch that failed
// (`call` names it), or VLLM_PD_SUCCESS. bindings.cu turns a failure into a torch error.
struct LaunchResult {
  vllm_pd_error_t error = VLLM_PD_SUCCESS;
  const char* call = "";
};

enum class DType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };
enum class Fp8 : int { kE4M3FN = 0, kE4M3FNUZ = 1 };

struct MlaParams {
  const void* q;        // [b, s_q, h_q, dim], contiguous
  const void* k_cache;  // [blocks, block_size, 1, dim], last dim contiguous
  const int32_t* block_table;
  const int32_t* seqlens;
  void* out;            // [b, s_q, h_q, dim_v]
  float* lse;           // [b, h_q, s_q]
  float* part_out;      // workspace [b, splits, rows, dim_v] (splits and size from plan_mla_decode)
  float* part_max;      // workspace [b, splits, rows]
  float* part_sum;      // workspace [b, splits, rows]
  int64_t cache_block_stride, cache_token_stride, table_stride;
  int batch, s_q, h_q, dim, dim_v, block_size, splits;
  float scale;
  bool causal;
  DType dtype;
};

LaunchResult launch_mla_decode(const MlaParams& p, vllm_pd_stream_t stream);

// The SM (CU) count of `device`, which plan_mla_decode sizes the grid for.
LaunchResult multiprocessor_count(int device, int* count);

enum class GemmMode : int { kPlain = 0, kContiguous = 1, kMasked = 2 };

struct GemmParams {
  const uint8_t* a;  // [(G,) m, k] fp8, K-major
  const float* sfa;  // [(G,) m, ceil(k/128)], any strides
  const uint8_t* b;  // [(G,) n, k] fp8, K-major
  const float* sfb;  // [(G,) ceil(n/128), ceil(k/128)]
  void* d;           // [(G,) m, n]
  const float* c;    // optional [m, n] fp32
  const int32_t* grouped_layout;  // contiguous mode: [m] group id or -1
  const int32_t* masked_m;        // masked mode: [G]
  int64_t lda, ldb, ldd, ldc;
  int64_t a_group_stride, b_group_stride, d_group_stride;
  int64_t sfa_s0, sfa_s1, sfa_group_stride, sfb_s0, sfb_s1, sfb_group_stride;
  int m, n, k, groups;
  GemmMode mode;
  Fp8 fp8;
  DType out_dtype;
};

LaunchResult launch_fp8_gemm(const GemmParams& p, vllm_pd_stream_t stream);

}  // namespace gpu
}  // namespace vllm_pd

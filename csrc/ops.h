// Kernel entry points of the vllm_pd_C library. The public ops (torch.ops.vllm_pd.*) live in
// Python (vllm_pd/ops/library.py), validate their input and pick a backend; these are the
// native kernels behind the "native" backend, one schema with CPU (and CUDA/HIP) kernels.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace vllm_pd {

std::tuple<at::Tensor, at::Tensor> mla_decode_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                  const at::Tensor& block_table,
                                                  const at::Tensor& cache_seqlens, int64_t head_dim_v,
                                                  double softmax_scale, bool causal);

void fp8_gemm_nt_cpu(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b,
                     const at::Tensor& sfb, at::Tensor& d, const std::optional<at::Tensor>& c);

void m_grouped_fp8_gemm_nt_contiguous_cpu(const at::Tensor& a, const at::Tensor& sfa,
                                          const at::Tensor& b, const at::Tensor& sfb, at::Tensor& d,
                                          const at::Tensor& grouped_layout);

void m_grouped_fp8_gemm_nt_masked_cpu(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b,
                                      const at::Tensor& sfb, at::Tensor& d, const at::Tensor& masked_m,
                                      int64_t expected_m);

}  // namespace vllm_pd

// torch.ops.vllm_pd_C CUDA registrations (also used for HIP: ROCm tensors use the CUDA key).
// Argument checks beyond the Python-side validation are the ones a GPU kernel cannot make.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "launch.h"

namespace vllm_pd {
namespace {

// Every launch of csrc/cuda/kernels.cu ends here: a failed call becomes a torch error naming it.
void check(const gpu::LaunchResult& result, const char* op) {
  TORCH_CHECK(result.error == VLLM_PD_SUCCESS, "vllm_pd ", op, ": ", result.call, " failed: ",
              vllm_pd_error_string(result.error));
}

gpu::DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return gpu::DType::kBF16;
    case at::kHalf: return gpu::DType::kFP16;
    case at::kFloat: return gpu::DType::kFP32;
    default: TORCH_CHECK(false, name, " must be bf16, fp16 or fp32, got ", t.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> mla_decode_cuda(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                   const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                                                   int64_t head_dim_v, double softmax_scale, bool causal) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  const int64_t b = q.size(0), s_q = q.size(1), h_q = q.size(2), rows = s_q * h_q;
  at::Tensor out = at::empty({b, s_q, h_q, head_dim_v}, q.options());
  at::Tensor lse = at::empty({b, h_q, s_q}, q.options().dtype(at::kFloat));
  if (b == 0) return {out, lse};
  // Splits from shapes and the SM count only (see csrc/cuda/mla_plan.h): no host sync on
  // cache_seqlens, a workspace bounded by the batch, not by the block table's capacity.
  int sms = 0;
  check(gpu::multiprocessor_count(q.get_device(), &sms), "mla_decode");
  const int64_t max_tokens = block_table.size(1) * k_cache.size(1);
  const gpu::MlaPlan plan = gpu::plan_mla_decode(b, rows, q.size(3), head_dim_v, max_tokens, sms);
  int64_t cap = 0;
  const std::string bad_cap = gpu::parse_workspace_cap(std::getenv(gpu::kMlaWorkspaceEnv), &cap);
  TORCH_CHECK(bad_cap.empty(), bad_cap);
  const std::string too_big = gpu::mla_workspace_error(plan, b, rows, head_dim_v, cap);
  TORCH_CHECK(too_big.empty(), too_big);
  const int64_t splits = plan.splits;
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_out = at::empty({b, splits, rows, head_dim_v}, f32);
  at::Tensor part_max = at::empty({b, splits, rows}, f32);
  at::Tensor part_sum = at::empty({b, splits, rows}, f32);
  const at::Tensor table = block_table.contiguous(), lens = cache_seqlens.contiguous();
  gpu::MlaParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.block_table = table.data_ptr<int32_t>();
  p.seqlens = lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.part_out = part_out.data_ptr<float>();
  p.part_max = part_max.data_ptr<float>();
  p.part_sum = part_sum.data_ptr<float>();
  p.cache_block_stride = k_cache.stride(0);
  p.cache_token_stride = k_cache.stride(1);
  p.table_stride = table.stride(0);
  p.batch = b;
  p.s_q = s_q;
  p.h_q = h_q;
  p.dim = q.size(3);
  p.dim_v = head_dim_v;
  p.block_size = k_cache.size(1);
  p.splits = splits;
  p.scale = static_cast<float>(softmax_scale);
  p.causal = causal && s_q > 1;
  p.dtype = dtype_of(q, "q");
  check(gpu::launch_mla_decode(p, c10::cuda::getCurrentCUDAStream()), "mla_decode");
  return {out, lse};
}

gpu::GemmParams gemm_params(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
                            at::Tensor& d) {
  gpu::GemmParams p{};
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.sfa = sfa.data_ptr<float>();
  p.b = reinterpret_cast<const uint8_t*>(b.data_ptr());
  p.sfb = sfb.data_ptr<float>();
  p.d = d.data_ptr();
  p.lda = a.stride(-2);
  p.ldb = b.stride(-2);
  p.ldd = d.stride(-2);
  p.a_group_stride = a.dim() == 3 ? a.stride(0) : 0;
  p.b_group_stride = b.dim() == 3 ? b.stride(0) : 0;
  p.d_group_stride = d.dim() == 3 ? d.stride(0) : 0;
  p.sfa_s0 = sfa.stride(-2);
  p.sfa_s1 = sfa.stride(-1);
  p.sfa_group_stride = sfa.dim() == 3 ? sfa.stride(0) : 0;
  p.sfb_s0 = sfb.stride(-2);
  p.sfb_s1 = sfb.stride(-1);
  p.sfb_group_stride = sfb.dim() == 3 ? sfb.stride(0) : 0;
  p.m = a.size(-2);
  p.n = b.size(-2);
  p.k = a.size(-1);
  p.groups = b.dim() == 3 ? b.size(0) : 1;
  p.fp8 = a.scalar_type() == at::kFloat8_e4m3fn ? gpu::Fp8::kE4M3FN : gpu::Fp8::kE4M3FNUZ;
  p.out_dtype = dtype_of(d, "d");
  return p;
}

void fp8_gemm_nt_cuda(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
                      at::Tensor& d, const std::optional<at::Tensor>& c) {
  const c10::cuda::CUDAGuard guard(a.device());
  gpu::GemmParams p = gemm_params(a, sfa, b, sfb, d);
  at::Tensor cc;
  if (c.has_value()) {
    cc = c->contiguous();
    p.c = cc.data_ptr<float>();
    p.ldc = cc.stride(0);
  }
  p.mode = gpu::GemmMode::kPlain;
  check(gpu::launch_fp8_gemm(p, c10::cuda::getCurrentCUDAStream()), "fp8_gemm_nt");
}

void contiguous_cuda(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
                     at::Tensor& d, const at::Tensor& grouped_layout) {
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor layout = grouped_layout.contiguous();
  gpu::GemmParams p = gemm_params(a, sfa, b, sfb, d);
  p.grouped_layout = layout.data_ptr<int32_t>();
  p.mode = gpu::GemmMode::kContiguous;
  check(gpu::launch_fp8_gemm(p, c10::cuda::getCurrentCUDAStream()), "m_grouped_fp8_gemm_nt_contiguous");
}

void masked_cuda(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
                 at::Tensor& d, const at::Tensor& masked_m, int64_t /*expected_m*/) {
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor mm = masked_m.contiguous();
  gpu::GemmParams p = gemm_params(a, sfa, b, sfb, d);
  p.masked_m = mm.data_ptr<int32_t>();
  p.mode = gpu::GemmMode::kMasked;
  check(gpu::launch_fp8_gemm(p, c10::cuda::getCurrentCUDAStream()), "m_grouped_fp8_gemm_nt_masked");
}

}  // namespace
}  // namespace vllm_pd

TORCH_LIBRARY_IMPL(vllm_pd_C, CUDA, m) {
  m.impl("mla_decode", &vllm_pd::mla_decode_cuda);
  m.impl("fp8_gemm_nt", &vllm_pd::fp8_gemm_nt_cuda);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &vllm_pd::contiguous_cuda);
  m.impl("m_grouped_fp8_gemm_nt_masked", &vllm_pd::masked_cuda);
}

// Schemas of the native kernels and their CPU registrations. The CUDA/HIP kernels register
// under the same schemas from csrc/cuda/bindings.cu when torch is a CUDA or ROCm build.
#include <Python.h>
#include <torch/library.h>

#include "checksum_bindings.h"
#include "ops.h"

extern "C" {
// Importing vllm_pd._C loads this shared object, which runs the TORCH_LIBRARY blocks below; the
// module itself holds the plain Python functions (checksums for the transports).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                          vllm_pd_checksum_methods()};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(vllm_pd_C, m) {
  m.def(
      "mla_decode(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, "
      "int head_dim_v, float softmax_scale, bool causal) -> (Tensor, Tensor)");
  m.def("fp8_gemm_nt(Tensor a, Tensor sfa, Tensor b, Tensor sfb, Tensor(a!) d, Tensor? c) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_contiguous(Tensor a, Tensor sfa, Tensor b, Tensor sfb, "
      "Tensor(a!) d, Tensor grouped_layout) -> ()");
  m.def(
      "m_grouped_fp8_gemm_nt_masked(Tensor a, Tensor sfa, Tensor b, Tensor sfb, Tensor(a!) d, "
      "Tensor masked_m, int expected_m) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_pd_C, CPU, m) {
  m.impl("mla_decode", &vllm_pd::mla_decode_cpu);
  m.impl("fp8_gemm_nt", &vllm_pd::fp8_gemm_nt_cpu);
  m.impl("m_grouped_fp8_gemm_nt_contiguous", &vllm_pd::m_grouped_fp8_gemm_nt_contiguous_cpu);
  m.impl("m_grouped_fp8_gemm_nt_masked", &vllm_pd::m_grouped_fp8_gemm_nt_masked_cpu);
}

// Portable inner loops written so GCC/Clang vectorise them without -ffast-math (independent
// lanes, no reassociation needed), compiled for AVX-512 / AVX2 / baseline and picked at load.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Clones by feature, not by "arch=": GCC resolves an arch= clone with __builtin_cpu_is, i.e. by
// CPU model, so a Sapphire Rapids (or any non-Skylake AVX-512 CPU) silently ran the baseline.
#define VLLM_PD_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VLLM_PD_SIMD_CLONES
#endif

namespace vllm_pd {

constexpr int kLanes = 16;

inline float simd_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline void simd_axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace vllm_pd

// How mla_decode on a GPU cuts each sequence into splits, and the fp32 workspace that costs.
//
// Host C++ only, free of torch and CUDA: bindings.cu plans every call with it, kernels.cu
// uses the split rule on the device, and tests/integration/test_ops_build.py compiles it with g++ and
// runs it on CPU. The split count is chosen from shapes and the GPU's SM count, never from
// cache_seqlens' values, which live on the GPU: reading them would synchronise the host once
// per layer and break CUDA-graph capture. Each CTA then takes its share of the sequence's real
// length on the device, so the workspace no longer grows with the block table's capacity.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VLLM_PD_HOST_DEVICE __host__ __device__
#else
#define VLLM_PD_HOST_DEVICE
#endif

namespace vllm_pd {
namespace gpu {

constexpr int kMlaRowsPerCta = 16;   // query rows (s_q x h_q) per CTA
constexpr int kMlaChunk = 256;       // tokens a CTA scores at once: shared memory holds 16 x 256 scores
constexpr int kMlaCtasPerSm = 2;     // splits are added until the grid fills every SM this often
constexpr int64_t kDefaultSmemBytes = 48 * 1024;  // more needs cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr int64_t kMlaWorkspaceDefaultMiB = 1024;
constexpr const char* kMlaWorkspaceEnv = "VLLM_PD_MLA_WORKSPACE_MB";

struct MlaPlan {
  int64_t splits;           // CTAs per (sequence, 16 rows); see mla_split_range
  int64_t workspace_bytes;  // fp32 partial outputs, maxima and sums of every split
  int64_t smem_bytes;       // dynamic shared memory of one mla_split CTA
};

// The tokens [*begin, *end) split `split` of a `len`-token sequence takes: an equal share, but
// at least one chunk, so a short sequence uses fewer splits (the others get an empty range and
// their CTAs exit at once).
VLLM_PD_HOST_DEVICE inline void mla_split_range(int64_t len, int64_t splits, int64_t split, int64_t* begin,
                                                int64_t* end) {
  const int64_t share = (len + splits - 1) / splits;
  const int64_t split_len = share > kMlaChunk ? share : kMlaChunk;
  const int64_t first = split * split_len;
  *begin = first < len ? first : len;
  *end = *begin + split_len < len ? *begin + split_len : len;
}

inline int64_t mla_smem_bytes(int64_t dim) {
  return static_cast<int64_t>(sizeof(float)) * (kMlaRowsPerCta * (dim + kMlaChunk) + 3 * kMlaRowsPerCta);
}

// `max_tokens`: the most tokens a sequence can have (block table width x block size); it only
// caps the split count, the workspace does not grow with it.
inline MlaPlan plan_mla_decode(int64_t batch, int64_t rows, int64_t dim, int64_t dim_v, int64_t max_tokens,
                               int64_t sm_count) {
  const int64_t row_tiles = (rows + kMlaRowsPerCta - 1) / kMlaRowsPerCta;
  const int64_t ctas = std::max<int64_t>(1, batch * row_tiles);
  const int64_t target = kMlaCtasPerSm * std::max<int64_t>(1, sm_count);
  const int64_t wanted = (target + ctas - 1) / ctas;
  const int64_t useful = std::max<int64_t>(1, (max_tokens + kMlaChunk - 1) / kMlaChunk);
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, useful));
  const int64_t per_split_row = static_cast<int64_t>(sizeof(float)) * (dim_v + 2);  // part_out + max + sum
  return MlaPlan{splits, batch * splits * rows * per_split_row, mla_smem_bytes(dim)};
}

// The workspace cap in bytes from VLLM_PD_MLA_WORKSPACE_MB's value (nullptr: unset), or an
// error naming the key when the value is not a positive whole number of MiB.
inline std::string parse_workspace_cap(const char* env_value, int64_t* cap_bytes) {
  *cap_bytes = kMlaWorkspaceDefaultMiB << 20;
  if (env_value == nullptr || *env_value == '\0') return "";
  char* end = nullptr;
  const long long mib = std::strtoll(env_value, &end, 10);
  if (*end != '\0' || mib <= 0 || mib > (int64_t{1} << 40)) {
    return std::string(kMlaWorkspaceEnv) + "='" + env_value + "' is not a positive number of MiB";
  }
  *cap_bytes = static_cast<int64_t>(mib) << 20;
  return "";
}

// Empty when the plan's workspace fits the cap, otherwise the error mla_decode raises.
inline std::string mla_workspace_error(const MlaPlan& plan, int64_t batch, int64_t rows, int64_t dim_v,
                                       int64_t cap_bytes) {
  if (plan.workspace_bytes <= cap_bytes) return "";
  const int64_t need_mib = (plan.workspace_bytes + (1 << 20) - 1) >> 20;
  return "mla_decode needs a " + std::to_string(need_mib) + " MiB split-KV workspace (batch " +
         std::to_string(batch) + " x " + std::to_string(rows) + " query rows x " + std::to_string(plan.splits) +
         " splits x " + std::to_string(dim_v + 2) + " fp32) but " + kMlaWorkspaceEnv + " caps it at " +
         std::to_string(cap_bytes >> 20) + " MiB: set " + kMlaWorkspaceEnv + "=" + std::to_string(need_mib) +
         " or more, or decode fewer sequences per step";
}

}  // namespace gpu
}  // namespace vllm_pd

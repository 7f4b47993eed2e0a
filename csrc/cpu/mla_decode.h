// Shared between the MLA decode driver (mla_decode.cpp: checks, splits, LSE merge) and its
// per-split kernels: the portable fp32 one and the AMX one (mla_decode_amx.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace vllm_pd {
namespace mla {

struct Problem {
  int64_t rows;   // s_q * h_q query rows per sequence
  int64_t h_q;
  int64_t s_q;
  int64_t dim;    // 576
  int64_t dim_v;  // 512
  int64_t block_size;
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  int64_t max_blocks;
  float scale;
  bool causal;
};

// True when this CPU has AMX-BF16 and AVX512-BF16 and the kernel let this process use the
// tile registers (Linux arch_prctl(ARCH_REQ_XCOMP_PERM)); asked once, then cached.
bool amx_usable();

// The shapes the AMX kernel handles: bf16, head dims in whole 32-element tile rows.
bool amx_fits(const Problem& p);

// One thread's AMX state for a bf16 problem: its tile configuration, the query of the sequence
// it is working on (pre-packed as tile operands) and its accumulators. Build it on the thread
// that uses it: tile registers are per thread.
class AmxAttention {
 public:
  explicit AmxAttention(const Problem& p);
  ~AmxAttention();
  AmxAttention(const AmxAttention&) = delete;
  AmxAttention& operator=(const AmxAttention&) = delete;

  // q: the rows x dim query of one sequence.
  void load_query(const c10::BFloat16* q);

  // Attends the loaded query to tokens [begin, end) of a sequence of seq_len tokens; writes the
  // unnormalised output (rows x dim_v), the running max (natural log units, -inf when a row saw
  // no key) and the sum of exponentials, as the portable kernel does.
  void attend(const c10::BFloat16* cache, const int32_t* blocks, int64_t seq_len, int64_t begin,
              int64_t end, float* acc, float* row_max, float* row_sum);

 private:
  struct TokenTile {
    const uint16_t* rows;  // first of 16 token rows of dim bf16
    int64_t stride;        // bytes between rows
  };
  void scores_tiles(int64_t group, const TokenTile* kv, int tiles);
  void softmax_chunk(int64_t group, int64_t t0, int64_t end, int tiles, float scale_log2);
  void accumulate_values(int64_t group, const TokenTile* kv, int tiles);

  const Problem p_;
  int64_t groups_;   // row groups of 16 (tile height)
  int64_t kq_;       // dim / 32: QK^T tile steps
  int64_t kv_;       // dim_v / 32: output column tiles (each split in even and odd columns)
  void* memory_;
  uint32_t* q_tiles_;  // [groups][kq][16][16]: q^T in the VNNI pairs layout of a B tile
  float* out_tiles_;   // [groups][kv][2][16][16]: even / odd output columns per row
  float* max_;         // [groups * 16], log2 units
  float* sum_;         // [groups * 16]
  int32_t* visible_;   // [groups * 16]: keys < visible are seen by the row (0 for padding)
  float* scores_;           // [64][16]: one chunk's scores, token-major
  uint32_t* token_probs_;   // [64][16]: its probabilities as (hi, lo) bf16 pairs, token-major
  uint32_t* probs_;         // [4 tiles][4][16][16]: the same as A tiles (see softmax_chunk)
  uint16_t* stage_;         // [4][16][dim]: KV rows that are not 16 contiguous cache rows
};

}  // namespace mla
}  // namespace vllm_pd

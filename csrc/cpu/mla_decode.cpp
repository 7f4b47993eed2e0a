// Paged MLA (MQA, one latent KV head) decode on CPU: FlashMLA's flash_mla_with_kvcache semantics.
//
// This file checks the input, cuts sequences into splits so both cores stay busy at small batch
// (flash-decoding) and merges the splits with their log-sum-exp. Each split reads every KV token
// once for all s_q * h_q query rows, with one of two kernels: AMX bf16 tiles (mla_decode_amx.cpp,
// bf16 on CPUs that have AMX) or the portable fp32 one below (any x86-64, any dtype).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../ops.h"
#include "mla_decode.h"
#include "simd.h"

namespace vllm_pd {
namespace {

constexpr int kTile = 16;  // KV tokens converted to fp32 and scored together

struct Split {
  int64_t batch;
  int64_t begin;
  int64_t end;
};

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

using mla::Problem;


// Scores one fp32 tile of KV tokens [t0, t0 + nt) against all rows and folds it into the
// running (unnormalised) output, max and sum of exponentials of every row.
VLLM_PD_SIMD_CLONES void accumulate_tile(const Problem& p, const float* qf, const float* kbuf,
                                         int64_t t0, int64_t nt, int64_t seq_len, float* acc,
                                         float* row_max, float* row_sum, float* scores) {
  const int64_t D = p.dim, DV = p.dim_v;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < p.rows; ++r) {
    // Causal: the s_q queries are the last s_q tokens, query j sees keys < L - s_q + j + 1.
    const int64_t visible = p.causal ? seq_len - p.s_q + r / p.h_q + 1 : seq_len;
    const float* qr = qf + r * D;
    float* sr = scores + r * kTile;
    float tile_max = kNegInf;
    for (int64_t t = 0; t < nt; ++t) {
      if (t0 + t >= visible) {
        sr[t] = kNegInf;
        continue;
      }
      sr[t] = simd_dot(qr, kbuf + t * D, D) * p.scale;
      tile_max = std::max(tile_max, sr[t]);
    }
    if (tile_max == kNegInf) continue;
    const float new_max = std::max(row_max[r], tile_max);
    const float correction = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first tile
    float* ar = acc + r * DV;
    if (correction != 1.f) {
      for (int64_t d = 0; d < DV; ++d) ar[d] *= correction;
    }
    float sum = row_sum[r] * correction;
    for (int64_t t = 0; t < nt; ++t) {
      if (sr[t] == kNegInf) continue;
      const float w = std::exp(sr[t] - new_max);
      sum += w;
      simd_axpy(w, kbuf + t * D, ar, DV);
    }
    row_sum[r] = sum;
    row_max[r] = new_max;
  }
}

// Attends the rows of one sequence to tokens [begin, end).
template <typename scalar_t>
void attend_split(const Problem& p, const float* qf, const scalar_t* cache, const int32_t* blocks,
                  int64_t seq_len, int64_t begin, int64_t end, float* acc, float* row_max,
                  float* row_sum, float* kbuf, float* scores) {
  for (int64_t r = 0; r < p.rows; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
  }
  std::fill(acc, acc + p.rows * p.dim_v, 0.f);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t nt = std::min<int64_t>(kTile, end - t0);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t tok = t0 + t;
      const int64_t blk = blocks[tok / p.block_size];
      to_float(cache + blk * p.cache_block_stride + (tok % p.block_size) * p.cache_token_stride,
               kbuf + t * p.dim, p.dim);
    }
    accumulate_tile(p, qf, kbuf, t0, nt, seq_len, acc, row_max, row_sum, scores);
  }
}

// out = x * scale in the output dtype. The bf16 one rounds to nearest-even with integer ops
// (as c10::BFloat16 does, NaN kept) so it vectorises: c10's scalar conversion was a visible
// share of short-sequence decode time.
VLLM_PD_SIMD_CLONES void store_scaled(const float* x, float scale, c10::BFloat16* out, int64_t n) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * scale;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    o[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}

void store_scaled(const float* x, float scale, c10::Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::Half>(x[i] * scale);
}

void store_scaled(const float* x, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale;
}

// VLLM_PD_MLA_CPU_KERNEL picks the per-split kernel: "auto" (default: AMX for bf16 when the CPU
// and OS allow it, else portable), "amx" (an error where AMX cannot run) or "portable".
enum class Kernel { kPortable, kAmx };

Kernel pick_kernel(const Problem& p, at::ScalarType dtype) {
  const char* env = std::getenv("VLLM_PD_MLA_CPU_KERNEL");
  const std::string want = env == nullptr || *env == '\0' ? "auto" : env;
  TORCH_CHECK(want == "auto" || want == "amx" || want == "portable",
              "mla_decode: VLLM_PD_MLA_CPU_KERNEL must be auto, amx or portable, got '", want, "'");
  if (want == "portable") return Kernel::kPortable;
  const bool fits = dtype == at::kBFloat16 && mla::amx_fits(p);
  if (want == "amx") {
    TORCH_CHECK(mla::amx_usable(), "mla_decode: VLLM_PD_MLA_CPU_KERNEL=amx but this CPU or kernel offers no AMX-BF16");
    TORCH_CHECK(fits, "mla_decode: VLLM_PD_MLA_CPU_KERNEL=amx needs bf16 and head dims in multiples of 32");
    return Kernel::kAmx;
  }
  return fits && mla::amx_usable() ? Kernel::kAmx : Kernel::kPortable;
}

template <typename scalar_t>
void run(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const int32_t* table,
         const int32_t* lens, int64_t batch, at::Tensor& out, at::Tensor& lse) {
  const Kernel kernel = pick_kernel(p, q.scalar_type());
  const int64_t R = p.rows, D = p.dim, DV = p.dim_v;
  // Split sizes: enough pieces for every thread, never pieces so small the overhead shows.
  int64_t total = 0;
  for (int64_t i = 0; i < batch; ++i) total += lens[i];
  const int64_t threads = at::get_num_threads();
  // Whole multiples of 64 tokens keep the AMX kernel's 16-token tiles inside cache blocks.
  int64_t chunk = std::max<int64_t>(256, (total + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + 63) / 64 * 64;
  std::vector<Split> splits;
  std::vector<int64_t> first_split(batch + 1);
  for (int64_t i = 0; i < batch; ++i) {
    first_split[i] = static_cast<int64_t>(splits.size());
    for (int64_t s = 0; s < lens[i]; s += chunk) splits.push_back({i, s, std::min(s + chunk, (int64_t)lens[i])});
  }
  first_split[batch] = static_cast<int64_t>(splits.size());
  const int64_t n_splits = static_cast<int64_t>(splits.size());
  std::vector<float> part_acc(n_splits * R * DV), part_max(n_splits * R), part_sum(n_splits * R);

  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* cache = k_cache.data_ptr<scalar_t>();
  // One task per thread; each takes the next split as it finishes one, so a thread whose core
  // is shared with another process takes fewer splits instead of holding the others back.
  std::atomic<int64_t> next_split{0};
  const int64_t workers = std::min<int64_t>(threads, n_splits);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (kernel == Kernel::kAmx) {
        mla::AmxAttention amx(p);  // tile registers belong to this thread
        int64_t loaded = -1;
        for (int64_t s; (s = next_split.fetch_add(1)) < n_splits;) {
          const Split& sp = splits[s];
          if (sp.batch != loaded) {
            amx.load_query(qp + sp.batch * R * D);
            loaded = sp.batch;
          }
          amx.attend(cache, table + sp.batch * p.max_blocks, lens[sp.batch], sp.begin, sp.end,
                     part_acc.data() + s * R * DV, part_max.data() + s * R, part_sum.data() + s * R);
        }
        return;
      }
    }
    std::vector<float> qf(R * D), kbuf(kTile * D), scores(R * kTile);
    int64_t loaded = -1;
    for (int64_t s; (s = next_split.fetch_add(1)) < n_splits;) {
      const Split& sp = splits[s];
      if (sp.batch != loaded) {
        to_float(qp + sp.batch * R * D, qf.data(), R * D);
        loaded = sp.batch;
      }
      attend_split<scalar_t>(p, qf.data(), cache, table + sp.batch * p.max_blocks, lens[sp.batch],
                             sp.begin, sp.end, part_acc.data() + s * R * DV,
                             part_max.data() + s * R, part_sum.data() + s * R, kbuf.data(),
                             scores.data());
    }
  });

  scalar_t* op = out.data_ptr<scalar_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, batch * R, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(DV);
    for (int64_t br = lo; br < hi; ++br) {
      const int64_t i = br / R, r = br % R;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = first_split[i]; s < first_split[i + 1]; ++s) m = std::max(m, part_max[s * R + r]);
      std::fill(row.begin(), row.end(), 0.f);
      float l = 0.f;
      if (m != -std::numeric_limits<float>::infinity()) {
        for (int64_t s = first_split[i]; s < first_split[i + 1]; ++s) {
          const float w = std::exp(part_max[s * R + r] - m);  // 0 for a split that saw no key
          if (w == 0.f) continue;
          l += part_sum[s * R + r] * w;
          simd_axpy(w, part_acc.data() + (s * R + r) * DV, row.data(), DV);
        }
      }
      scalar_t* o = op + br * DV;
      const int64_t qi = r / p.h_q, h = r % p.h_q;
      if (l > 0.f) {
        const float inv = 1.f / l;
        store_scaled(row.data(), inv, o, DV);
        lp[(i * p.h_q + h) * p.s_q + qi] = m + std::log(l);
      } else {  // nothing visible: FlashMLA's convention is out = 0, lse = +inf
        for (int64_t d = 0; d < DV; ++d) o[d] = static_cast<scalar_t>(0.f);
        lp[(i * p.h_q + h) * p.s_q + qi] = std::numeric_limits<float>::infinity();
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mla_decode_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                  const at::Tensor& block_table,
                                                  const at::Tensor& cache_seqlens, int64_t head_dim_v,
                                                  double softmax_scale, bool causal) {
  TORCH_CHECK(q_in.dim() == 4, "mla_decode: q must be [batch, s_q, h_q, head_dim], got ", q_in.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == 1,
              "mla_decode: k_cache must be [num_blocks, block_size, 1, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q_in.scalar_type(), "mla_decode: k_cache dtype ",
              k_cache.scalar_type(), " differs from q dtype ", q_in.scalar_type());
  TORCH_CHECK(k_cache.size(3) == q_in.size(3), "mla_decode: k_cache head_dim ", k_cache.size(3),
              " differs from q head_dim ", q_in.size(3));
  TORCH_CHECK(k_cache.stride(3) == 1, "mla_decode: k_cache's last dimension must be contiguous");
  TORCH_CHECK(head_dim_v > 0 && head_dim_v <= q_in.size(3), "mla_decode: head_dim_v ", head_dim_v,
              " out of range");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2,
              "mla_decode: block_table must be int32 [batch, max_blocks]");
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && cache_seqlens.dim() == 1,
              "mla_decode: cache_seqlens must be int32 [batch]");
  const int64_t batch = q_in.size(0);
  TORCH_CHECK(block_table.size(0) == batch && cache_seqlens.size(0) == batch,
              "mla_decode: block_table / cache_seqlens batch differs from q's ", batch);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens_t = cache_seqlens.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = table.size(1);
  for (int64_t i = 0; i < batch; ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= max_blocks * block_size, "mla_decode: cache_seqlens[", i,
                "] = ", lens[i], " does not fit block_table's ", max_blocks, " blocks of ", block_size);
    for (int64_t j = 0; j < (lens[i] + block_size - 1) / block_size; ++j) {
      TORCH_CHECK(tab[i * max_blocks + j] >= 0 && tab[i * max_blocks + j] < k_cache.size(0),
                  "mla_decode: block_table[", i, ", ", j, "] = ", tab[i * max_blocks + j],
                  " is not a block of k_cache");
    }
  }
  Problem p{q.size(1) * q.size(2), q.size(2), q.size(1), q.size(3), head_dim_v, block_size,
            k_cache.stride(0), k_cache.stride(1), max_blocks, static_cast<float>(softmax_scale), causal};
  at::Tensor out = at::empty({batch, q.size(1), q.size(2), head_dim_v}, q.options());
  at::Tensor lse = at::empty({batch, q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kBFloat16: run<c10::BFloat16>(p, q, k_cache, tab, lens, batch, out, lse); break;
    case at::kHalf: run<c10::Half>(p, q, k_cache, tab, lens, batch, out, lse); break;
    case at::kFloat: run<float>(p, q, k_cache, tab, lens, batch, out, lse); break;
    default: TORCH_CHECK(false, "mla_decode: q dtype ", q.scalar_type(), " is not bf16/fp16/fp32");
  }
  return {out, lse};
}

}  // namespace vllm_pd

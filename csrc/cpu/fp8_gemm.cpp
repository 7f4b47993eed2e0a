// DeepGEMM-style block-scaled FP8 GEMM on CPU: D = C + A @ B.T with 1x128 activation scales
// (sfa [m, ceil(k/128)]) and 128x128 weight scales (sfb [ceil(n/128), ceil(k/128)]), for
// e4m3fn (NVIDIA) and e4m3fnuz (AMD / Hygon DCU). Like DeepGEMM, each 128-wide K block is
// accumulated in fp32 and then promoted with its two scales.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <vector>

#include "../ops.h"
#include "simd.h"

namespace vllm_pd {
namespace {

constexpr int64_t kBlockK = 128;  // scale granularity along K (and N for the weights)
constexpr int64_t kTileN = 64;    // output columns per work item (divides 128: one sfb row)
constexpr int64_t kTileM = 4;     // rows of A sharing each converted B row

using Lut = std::array<float, 256>;

template <typename fp8_t>
Lut make_lut() {
  Lut lut{};
  for (int i = 0; i < 256; ++i) lut[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
  return lut;
}

const Lut& lut_for(at::ScalarType t) {
  static const Lut fn = make_lut<c10::Float8_e4m3fn>();
  static const Lut fnuz = make_lut<c10::Float8_e4m3fnuz>();
  return t == at::kFloat8_e4m3fn ? fn : fnuz;
}

struct Operand {  // an fp8 matrix with its scales, by pointer and strides
  const uint8_t* data;
  int64_t ld;
  const float* sf;
  int64_t sf_s0;
  int64_t sf_s1;
};

// acc[kTileM][kTileN] += scale_i * (A rows . B^T tile) for one K block; bt is B's tile
// transposed to [kBlockK][kTileN] so the inner loop runs along contiguous output columns.
VLLM_PD_SIMD_CLONES void block_product(const float* af, int64_t mrows, int64_t kk, const float* bt,
                                       const float* row_scale, float* acc) {
  for (int64_t i = 0; i < mrows; ++i) {
    float part[kTileN] = {};
    const float* a = af + i * kBlockK;
    for (int64_t x = 0; x < kk; ++x) {
      const float av = a[x];
      const float* b = bt + x * kTileN;
      for (int64_t j = 0; j < kTileN; ++j) part[j] += av * b[j];
    }
    float* ar = acc + i * kTileN;
    const float s = row_scale[i];
    for (int64_t j = 0; j < kTileN; ++j) ar[j] += s * part[j];
  }
}

template <typename out_t>
void gemm(const Operand& A, const Operand& B, out_t* d, int64_t ldd, const float* c, int64_t ldc,
          int64_t m, int64_t n, int64_t k, const Lut& lut) {
  if (m == 0 || n == 0) return;
  const int64_t k_blocks = (k + kBlockK - 1) / kBlockK;
  const int64_t n_tiles = (n + kTileN - 1) / kTileN;
  const int64_t m_tiles = (m + kTileM - 1) / kTileM;
  // One item = kTileN columns x a run of rows; each K block of the B tile is converted once
  // and reused by every row of the run.
  const int64_t rows_per_item = std::max<int64_t>(kTileM, std::min<int64_t>(m_tiles, 16) * kTileM);
  const int64_t m_runs = (m + rows_per_item - 1) / rows_per_item;
  at::parallel_for(0, n_tiles * m_runs, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> bt(kBlockK * kTileN), af(kTileM * kBlockK), acc(rows_per_item * kTileN);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t nt = item % n_tiles, run = item / n_tiles;
      const int64_t j0 = nt * kTileN, jn = std::min(kTileN, n - j0);
      const int64_t r0 = run * rows_per_item, rn = std::min(rows_per_item, m - r0);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t sfb_row = j0 / kBlockK;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t kk = std::min(kBlockK, k - kb * kBlockK);
        const float sb = B.sf[sfb_row * B.sf_s0 + kb * B.sf_s1];
        if (jn < kTileN) std::fill(bt.begin(), bt.end(), 0.f);
        for (int64_t j = 0; j < jn; ++j) {
          const uint8_t* brow = B.data + (j0 + j) * B.ld + kb * kBlockK;
          for (int64_t x = 0; x < kk; ++x) bt[x * kTileN + j] = lut[brow[x]];
        }
        const float* btk = bt.data();
        for (int64_t i0 = 0; i0 < rn; i0 += kTileM) {
          const int64_t mi = std::min(kTileM, rn - i0);
          float row_scale[kTileM];
          for (int64_t i = 0; i < mi; ++i) {
            const int64_t row = r0 + i0 + i;
            const uint8_t* arow = A.data + row * A.ld + kb * kBlockK;
            for (int64_t x = 0; x < kk; ++x) af[i * kBlockK + x] = lut[arow[x]];
            row_scale[i] = A.sf[row * A.sf_s0 + kb * A.sf_s1] * sb;
          }
          block_product(af.data(), mi, kk, btk, row_scale, acc.data() + i0 * kTileN);
        }
      }
      for (int64_t i = 0; i < rn; ++i) {
        const int64_t row = r0 + i;
        out_t* drow = d + row * ldd + j0;
        const float* crow = c ? c + row * ldc + j0 : nullptr;
        for (int64_t j = 0; j < jn; ++j) {
          const float v = acc[i * kTileN + j] + (crow ? crow[j] : 0.f);
          drow[j] = static_cast<out_t>(v);
        }
      }
    }
  });
}

void check_fp8(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e4m3fnuz,
              "fp8 gemm: ", name, " must be float8_e4m3fn or float8_e4m3fnuz, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, "fp8 gemm: ", name, " must be K-major (last stride 1)");
}

void check_scale(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "fp8 gemm: ", name, " must be float32, got ", t.scalar_type());
}

Operand operand(const at::Tensor& x, const at::Tensor& sf) {
  return {reinterpret_cast<const uint8_t*>(x.data_ptr()), x.stride(-2), sf.data_ptr<float>(),
          sf.stride(-2), sf.stride(-1)};
}

// Runs one [m, k] x [n, k]^T product on views; group offsets are applied by the callers.
void gemm_view(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb,
               at::Tensor& d, const float* c, int64_t ldc) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fp8 gemm: a (", a.scalar_type(), ") and b (",
              b.scalar_type(), ") must have the same fp8 dtype");
  TORCH_CHECK(d.stride(-1) == 1, "fp8 gemm: d must have a contiguous last dimension");
  const Lut& lut = lut_for(a.scalar_type());
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  const Operand A = operand(a, sfa), B = operand(b, sfb);
  switch (d.scalar_type()) {
    case at::kBFloat16: gemm(A, B, d.data_ptr<c10::BFloat16>(), d.stride(0), c, ldc, m, n, k, lut); break;
    case at::kHalf: gemm(A, B, d.data_ptr<c10::Half>(), d.stride(0), c, ldc, m, n, k, lut); break;
    case at::kFloat: gemm(A, B, d.data_ptr<float>(), d.stride(0), c, ldc, m, n, k, lut); break;
    default: TORCH_CHECK(false, "fp8 gemm: d must be bf16, fp16 or fp32, got ", d.scalar_type());
  }
}

void check_common(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b, const at::Tensor& sfb) {
  check_fp8(a, "a");
  check_fp8(b, "b");
  check_scale(sfa, "sfa");
  check_scale(sfb, "sfb");
}

}  // namespace

void fp8_gemm_nt_cpu(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b,
                     const at::Tensor& sfb, at::Tensor& d, const std::optional<at::Tensor>& c) {
  check_common(a, sfa, b, sfb);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && d.dim() == 2, "fp8_gemm_nt: a, b, d must be 2-D");
  TORCH_CHECK(a.size(1) == b.size(1), "fp8_gemm_nt: a and b K differ (", a.size(1), " vs ", b.size(1), ")");
  TORCH_CHECK(d.size(0) == a.size(0) && d.size(1) == b.size(0), "fp8_gemm_nt: d must be [m, n]");
  const float* cp = nullptr;
  int64_t ldc = 0;
  at::Tensor cc;
  if (c.has_value()) {
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->sizes() == d.sizes(), "fp8_gemm_nt: c must be fp32 [m, n]");
    cc = c->stride(-1) == 1 ? *c : c->contiguous();
    cp = cc.data_ptr<float>();
    ldc = cc.stride(0);
  }
  gemm_view(a, sfa, b, sfb, d, cp, ldc);
}

void m_grouped_fp8_gemm_nt_contiguous_cpu(const at::Tensor& a, const at::Tensor& sfa,
                                          const at::Tensor& b, const at::Tensor& sfb, at::Tensor& d,
                                          const at::Tensor& grouped_layout) {
  check_common(a, sfa, b, sfb);
  TORCH_CHECK(grouped_layout.scalar_type() == at::kInt && grouped_layout.dim() == 1 &&
                  grouped_layout.size(0) == a.size(0),
              "m_grouped_fp8_gemm_nt_contiguous: grouped_layout must be int32 [m_sum]");
  const at::Tensor layout = grouped_layout.contiguous();
  const int32_t* g = layout.data_ptr<int32_t>();
  const int64_t m = a.size(0), groups = b.size(0);
  // Consecutive rows of one group form a segment; DeepGEMM pads each group to 128 rows, so
  // segments are long and each runs as one ordinary GEMM.
  int64_t start = 0;
  while (start < m) {
    int64_t end = start + 1;
    while (end < m && g[end] == g[start]) ++end;
    at::Tensor dv = d.narrow(0, start, end - start);
    if (g[start] < 0) {
      dv.zero_();
    } else {
      TORCH_CHECK(g[start] < groups, "m_grouped_fp8_gemm_nt_contiguous: grouped_layout[", start, "] = ",
                  g[start], " but b has ", groups, " groups");
      gemm_view(a.narrow(0, start, end - start), sfa.narrow(0, start, end - start), b[g[start]],
                sfb[g[start]], dv, nullptr, 0);
    }
    start = end;
  }
}

void m_grouped_fp8_gemm_nt_masked_cpu(const at::Tensor& a, const at::Tensor& sfa, const at::Tensor& b,
                                      const at::Tensor& sfb, at::Tensor& d, const at::Tensor& masked_m,
                                      int64_t /*expected_m: a scheduling hint for GPUs*/) {
  check_common(a, sfa, b, sfb);
  TORCH_CHECK(masked_m.scalar_type() == at::kInt && masked_m.dim() == 1 && masked_m.size(0) == a.size(0),
              "m_grouped_fp8_gemm_nt_masked: masked_m must be int32 [num_groups]");
  const at::Tensor mm = masked_m.contiguous();
  const int32_t* rows = mm.data_ptr<int32_t>();
  for (int64_t g = 0; g < a.size(0); ++g) {
    TORCH_CHECK(rows[g] >= 0 && rows[g] <= a.size(1), "m_grouped_fp8_gemm_nt_masked: masked_m[", g,
                "] = ", rows[g], " outside [0, ", a.size(1), "]");
    if (rows[g] == 0) continue;
    at::Tensor dv = d[g].narrow(0, 0, rows[g]);
    gemm_view(a[g].narrow(0, 0, rows[g]), sfa[g].narrow(0, 0, rows[g]), b[g], sfb[g], dv, nullptr, 0);
  }
}

}  // namespace vllm_pd

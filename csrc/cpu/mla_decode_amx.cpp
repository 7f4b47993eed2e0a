// MLA decode on Intel AMX (bf16 tiles), for one (sequence, split) at a time.
//
// Why AMX: at h_q = 16 every 1152-byte KV token costs ~35 kFLOP, so keeping up with memory on
// two cores needs several hundred GFLOP/s; fp32 FMAs gave ~15. Each chunk of 64 tokens (four
// 16-row tiles) is read from the cache once for all query rows (16 rows = one tile height):
//   S^T [tokens x rows] = K [tokens x 576] . Q^T   A = 16 cache rows, loaded in place (stride =
//                                                   token stride); B = q^T packed once per sequence
//   online softmax on S^T: one zmm holds one token's 16 rows, so max / sum are lane-wise
//   O [rows x 512] += P . V                          B = the same 16 cache rows, in place; P as
//                                                   A tiles of bf16 pairs: (p, 0) pairs give the
//                                                   even output columns, (0, p) pairs the odd ones
// Doubling the P.V tile work that way costs less than re-packing V into pairs of tokens. P is
// split into bf16 hi + lo parts (twice again) so P.V is close to fp32: FlashMLA rounds P to bf16,
// but here that alone was enough to flip vLLM's greedy output on a small model.
//
// Everything that uses AVX-512 or tiles carries a target attribute (no file-wide flags), so the
// rest of the library still runs on any x86-64; mla_decode.cpp only calls in after amx_usable().
#include "mla_decode.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define VLLM_PD_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#else
#define VLLM_PD_HAVE_AMX 0
#endif

namespace vllm_pd {
namespace mla {

bool amx_fits(const Problem& p) { return p.dim % 32 == 0 && p.dim_v % 32 == 0 && p.dim_v <= p.dim; }

#if VLLM_PD_HAVE_AMX

namespace {

constexpr int kRows = 16;        // tile height: query rows per group, tokens per KV tile
constexpr int kTiles = 4;              // token tiles per chunk: 4 accumulators hide the tile latency
constexpr int kChunk = kTiles * kRows;  // tokens scored per softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512 = (b >> 16 & 1) && (b >> 30 & 1) && (b >> 17 & 1) && (b >> 31 & 1);  // f bw dq vl
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);                                    // bf16, tile
  if (!avx512 || !amx || a < 1) return false;
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  return a >> 5 & 1;  // avx512_bf16
}

bool request_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles are 16 rows x 64 bytes; scores_tiles and accumulate_values say what each holds.
AMX_FN void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kRows;
  }
  // Not _tile_loadconfig: GCC 12 declares its operand as 8 bytes, so the stores to the rest of
  // cfg may be dropped as dead and the tiles left unconfigured (SIGILL on first use).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

AMX_FN void release_tiles() { _tile_release(); }

// 2^x for x <= 0 (scores minus their max): Taylor to degree 6 on the rounded remainder
// (|f| <= 0.5, error ~1e-7), scaled by 2^n; -inf gives 0 and NaN stays NaN.
AMX_FN inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.f), x);  // NaN in the second operand is kept
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// dst[j] (row j, 16 dwords) = column j of the 16 x 16 dword matrix src (rows `stride` apart).
AMX_FN inline void transpose16(const uint32_t* src, uint32_t* dst, int64_t stride = 16) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + stride * i);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j]: column j of each 128-bit lane, rows 4i..4i+3
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_si512(dst + 16 * j, _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_storeu_si512(dst + 16 * (8 + j), _mm512_shuffle_i32x4(v0, v1, 0xdd));
    _mm512_storeu_si512(dst + 16 * (4 + j), _mm512_shuffle_i32x4(w0, w1, 0x88));
    _mm512_storeu_si512(dst + 16 * (12 + j), _mm512_shuffle_i32x4(w0, w1, 0xdd));
  }
}


}  // namespace

bool amx_usable() {
  static const bool usable = cpu_has_amx_bf16() && request_tile_permission();
  return usable;
}

AmxAttention::AmxAttention(const Problem& p)
    : p_(p), groups_((p.rows + kRows - 1) / kRows), kq_(p.dim / 32), kv_(p.dim_v / 32) {
  TORCH_CHECK(amx_fits(p), "mla_decode: AMX kernel needs head dims in multiples of 32");
  const size_t q_tiles = groups_ * kq_ * 256 * 4, out_tiles = groups_ * kv_ * 512 * 4;
  const size_t per_row = groups_ * kRows * 4, scores = kChunk * kRows * 4, probs = kTiles * 1024 * 4;
  const size_t stage = kTiles * kRows * p.dim * 2;
  const size_t total = q_tiles + out_tiles + 3 * per_row + 2 * scores + probs + stage;
  memory_ = std::aligned_alloc(64, (total + 63) / 64 * 64 + 64 * 8);
  TORCH_CHECK(memory_ != nullptr, "mla_decode: out of memory for the AMX workspace");
  char* m = static_cast<char*>(memory_);
  auto take = [&m](size_t bytes) {
    char* r = m;
    m += (bytes + 63) / 64 * 64;
    return r;
  };
  q_tiles_ = reinterpret_cast<uint32_t*>(take(q_tiles));
  out_tiles_ = reinterpret_cast<float*>(take(out_tiles));
  max_ = reinterpret_cast<float*>(take(per_row));
  sum_ = reinterpret_cast<float*>(take(per_row));
  visible_ = reinterpret_cast<int32_t*>(take(per_row));
  scores_ = reinterpret_cast<float*>(take(scores));
  token_probs_ = reinterpret_cast<uint32_t*>(take(scores));
  probs_ = reinterpret_cast<uint32_t*>(take(probs));
  stage_ = reinterpret_cast<uint16_t*>(take(stage));
  configure_tiles();
}

AmxAttention::~AmxAttention() {
  release_tiles();
  std::free(memory_);
}

AMX_FN void AmxAttention::load_query(const c10::BFloat16* q) {
  // B tile of step k for group g: row i, column h = the (2i, 2i+1) bf16 pair of dims 32k.. of
  // row h, i.e. the transpose of rows g*16.. as dwords. Missing rows of the last group are 0.
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  const int64_t half = p_.dim / 2;
  alignas(64) uint32_t padded[kRows * kRows];
  for (int64_t g = 0; g < groups_; ++g) {
    const int64_t present = std::min<int64_t>(kRows, p_.rows - g * kRows);
    const uint32_t* rows = pairs + g * kRows * half;
    for (int64_t k = 0; k < kq_; ++k) {
      uint32_t* dst = q_tiles_ + (g * kq_ + k) * 256;
      if (present == kRows) {
        transpose16(rows + 16 * k, dst, half);
        continue;
      }
      std::memset(padded, 0, sizeof(padded));
      for (int64_t h = 0; h < present; ++h) std::memcpy(padded + 16 * h, rows + h * half + 16 * k, 64);
      transpose16(padded, dst);
    }
  }
}

AMX_FN void AmxAttention::attend(const c10::BFloat16* cache_bf16, const int32_t* blocks,
                                 int64_t seq_len, int64_t begin, int64_t end, float* acc,
                                 float* row_max, float* row_sum) {
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(cache_bf16);
  const int64_t D = p_.dim, R = p_.rows;
  const float scale_log2 = p_.scale * static_cast<float>(M_LOG2E);
  for (int64_t r = 0; r < groups_ * kRows; ++r) {
    max_[r] = kNegInf;
    sum_[r] = 0.f;
    // Causal: the s_q queries are the last s_q tokens, query j sees keys < L - s_q + j + 1.
    visible_[r] = r >= R ? 0 : p_.causal ? seq_len - p_.s_q + r / p_.h_q + 1 : seq_len;
  }
  std::memset(out_tiles_, 0, groups_ * kv_ * 512 * sizeof(float));

  // 16 tokens from t as one tile: in place when they are 16 rows of one block, else copied
  // (zeros past `end`: unused cache slots may hold NaN, and 0 * NaN would leak into P.V).
  auto token_tile = [&](int slot, int64_t t) -> TokenTile {
    const int64_t n = std::min<int64_t>(kRows, end - t);
    const int64_t offset = t % p_.block_size;
    if (n == kRows && offset + kRows <= p_.block_size) {
      const uint16_t* first = cache + blocks[t / p_.block_size] * p_.cache_block_stride + offset * p_.cache_token_stride;
      return {first, p_.cache_token_stride * 2};
    }
    uint16_t* dst = stage_ + slot * kRows * D;
    for (int64_t i = 0; i < kRows; ++i) {
      if (i < n) {
        const int64_t tok = t + i;
        std::memcpy(dst + i * D,
                    cache + blocks[tok / p_.block_size] * p_.cache_block_stride + (tok % p_.block_size) * p_.cache_token_stride,
                    D * 2);
      } else {
        std::memset(dst + i * D, 0, D * 2);
      }
    }
    return {dst, D * 2};
  };

  for (int64_t t0 = begin; t0 < end; t0 += kChunk) {
    const int tiles = static_cast<int>(std::min<int64_t>(kTiles, (end - t0 + kRows - 1) / kRows));
    TokenTile kv[kTiles];
    for (int i = 0; i < kTiles; ++i) kv[i] = i < tiles ? token_tile(i, t0 + i * kRows) : kv[0];
    for (int64_t g = 0; g < groups_; ++g) {
      const __m512i visible = _mm512_loadu_si512(visible_ + g * kRows);
      if (_mm512_reduce_max_epi32(visible) <= t0) continue;  // causal: no row sees these keys
      scores_tiles(g, kv, tiles);
      softmax_chunk(g, t0, end, tiles, scale_log2);
      accumulate_values(g, kv, tiles);
    }
  }

  const float ln2 = static_cast<float>(M_LN2);
  const __m512i interleave_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i interleave_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / kRows, h = r % kRows;
    row_max[r] = max_[r] == kNegInf ? kNegInf : max_[r] * ln2;
    row_sum[r] = sum_[r];
    const float* out = out_tiles_ + g * kv_ * 512 + h * 16;
    float* a = acc + r * p_.dim_v;
    for (int64_t c = 0; c < kv_; ++c) {  // interleave the even and odd columns back
      const __m512 even = _mm512_loadu_ps(out + c * 512), odd = _mm512_loadu_ps(out + c * 512 + 256);
      _mm512_storeu_ps(a + 32 * c, _mm512_permutex2var_ps(even, interleave_lo, odd));
      _mm512_storeu_ps(a + 32 * c + 16, _mm512_permutex2var_ps(even, interleave_hi, odd));
    }
  }
}

// S^T [token, row] of each token tile: tiles 0-3 accumulate, 4 holds q^T, 5-7 take turns at K.
AMX_FN void AmxAttention::scores_tiles(int64_t g, const TokenTile* kv, int tiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint32_t* qt = q_tiles_ + g * kq_ * 256;
  for (int64_t k = 0; k < kq_; ++k) {
    _tile_loadd(4, qt + k * 256, 64);
    _tile_loadd(5, kv[0].rows + 32 * k, kv[0].stride);
    _tile_dpbf16ps(0, 5, 4);
    if (tiles > 1) {
      _tile_loadd(6, kv[1].rows + 32 * k, kv[1].stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (tiles > 2) {
      _tile_loadd(7, kv[2].rows + 32 * k, kv[2].stride);
      _tile_dpbf16ps(2, 7, 4);
    }
    if (tiles > 3) {
      _tile_loadd(5, kv[3].rows + 32 * k, kv[3].stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, scores_, 64);
  if (tiles > 1) _tile_stored(1, scores_ + 256, 64);
  if (tiles > 2) _tile_stored(2, scores_ + 512, 64);
  if (tiles > 3) _tile_stored(3, scores_ + 768, 64);
}

// Online softmax of one chunk for row group g, lane = query row, in log2 units; leaves the bf16
// probabilities as A tiles in probs_ (row = query row, dword = token).
AMX_FN void AmxAttention::softmax_chunk(int64_t g, int64_t t0, int64_t end, int tiles, float scale_log2) {
  const __m512i visible = _mm512_loadu_si512(visible_ + g * kRows);
  const int n_tok = tiles * kRows;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(scale_log2);
  __m512 chunk_max = neg_inf;
  for (int t = 0; t < n_tok; ++t) {
    const __m512i token = _mm512_set1_epi32(static_cast<int32_t>(t0 + t));
    const __mmask16 hidden = t0 + t >= end ? __mmask16(0xffff) : _mm512_cmpge_epi32_mask(token, visible);
    const __m512 x = _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_loadu_ps(scores_ + 16 * t), scale), hidden, neg_inf);
    _mm512_storeu_ps(scores_ + 16 * t, x);
    chunk_max = _mm512_max_ps(chunk_max, x);
  }
  const __m512 old_max = _mm512_loadu_ps(max_ + g * kRows);
  const __m512 new_max = _mm512_max_ps(old_max, chunk_max);
  // A row that has seen nothing yet keeps max -inf; subtracting 0 then keeps its p at 0.
  const __m512 base = _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
  const __m512 correction = exp2_nonpositive(_mm512_sub_ps(old_max, base));
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(sum_ + g * kRows), correction);
  for (int t = 0; t < n_tok; ++t) {
    const __m512 prob = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores_ + 16 * t), base));
    sum = _mm512_add_ps(sum, prob);
    // p = hi + lo, both bf16 (16 significant bits together): P.V close to fp32, not bf16.
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(prob));
    const __m512 rest = _mm512_sub_ps(prob, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(rest));
    _mm512_storeu_si512(token_probs_ + 16 * t, _mm512_or_si512(hi, _mm512_slli_epi32(lo, 16)));
  }
  _mm512_storeu_ps(max_ + g * kRows, new_max);
  _mm512_storeu_ps(sum_ + g * kRows, sum);
  // Rows whose max grew rescale what they have accumulated (rows that saw nothing hold 0).
  const __mmask16 grown = _mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) &
                          _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_UQ);
  if (grown) {
    alignas(64) float c[kRows];
    _mm512_store_ps(c, correction);
    float* out = out_tiles_ + g * kv_ * 512;
    for (int h = 0; h < kRows; ++h) {
      if (!(grown >> h & 1)) continue;
      const __m512 ch = _mm512_set1_ps(c[h]);
      for (int64_t j = 0; j < 2 * kv_; ++j)
        _mm512_storeu_ps(out + j * 256 + h * 16, _mm512_mul_ps(_mm512_loadu_ps(out + j * 256 + h * 16), ch));
    }
  }
  // One transpose of the (hi, lo) dwords, then the four A tiles: (hi, 0), (0, hi), (lo, 0), (0, lo).
  const __m512i low_half = _mm512_set1_epi32(0xffff), high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int i = 0; i < tiles; ++i) {
    uint32_t* a = probs_ + i * 1024;
    alignas(64) uint32_t packed[256];
    transpose16(token_probs_ + i * 256, packed);
    for (int h = 0; h < kRows; ++h) {
      const __m512i v = _mm512_load_si512(packed + 16 * h);
      _mm512_storeu_si512(a + 16 * h, _mm512_and_si512(v, low_half));
      _mm512_storeu_si512(a + 256 + 16 * h, _mm512_slli_epi32(v, 16));
      _mm512_storeu_si512(a + 512 + 16 * h, _mm512_srli_epi32(v, 16));
      _mm512_storeu_si512(a + 768 + 16 * h, _mm512_and_si512(v, high_half));
    }
  }
}

// O += P . V, one 32-column slice at a time: tiles 0/1 accumulate its even / odd columns, 2/3
// hold (hi, 0)/(0, hi) and 5/6 (lo, 0)/(0, lo) of a token tile's probabilities, 4 its V rows.
AMX_FN void AmxAttention::accumulate_values(int64_t g, const TokenTile* kv, int tiles) {
  float* out = out_tiles_ + g * kv_ * 512;
  for (int64_t c = 0; c < kv_; ++c) {
    float* o = out + c * 512;
    _tile_loadd(0, o, 64);
    _tile_loadd(1, o + 256, 64);
    for (int i = 0; i < tiles; ++i) {
      const uint32_t* a = probs_ + i * 1024;
      _tile_loadd(2, a, 64);
      _tile_loadd(3, a + 256, 64);
      _tile_loadd(5, a + 512, 64);
      _tile_loadd(6, a + 768, 64);
      _tile_loadd(4, kv[i].rows + 32 * c, kv[i].stride);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 6, 4);
    }
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
  }
}

#else  // no AMX in this build (not x86-64 GCC >= 11): the portable kernel runs

bool amx_usable() { return false; }
AmxAttention::AmxAttention(const Problem& p) : p_(p) { TORCH_CHECK(false, "mla_decode: built without AMX"); }
AmxAttention::~AmxAttention() = default;
void AmxAttention::load_query(const c10::BFloat16*) {}
void AmxAttention::attend(const c10::BFloat16*, const int32_t*, int64_t, int64_t, int64_t, float*, float*, float*) {}
void AmxAttention::scores_tiles(int64_t, const TokenTile*, int) {}
void AmxAttention::softmax_chunk(int64_t, int64_t, int64_t, int, float) {}
void AmxAttention::accumulate_values(int64_t, const TokenTile*, int) {}

#endif

}  // namespace mla
}  // namespace vllm_pd

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78; iSCSI/ext4/SCTP), optionally fused
// with a copy: the transports' per-block checksum. The bytes are read once, folded into the CRC
// and written to the destination from the same registers, so copy+checksum costs about one
// memcpy instead of a memcpy plus a hash pass.
//
// x86-64 with SSE4.2: the crc32 instruction has a 3-cycle latency but issues once per cycle,
// so the buffer is cut into three equal streams hashed in an interleaved loop and the three
// CRCs are combined at the end with "shift by n zero bytes" tables (Mark Adler's crc32c.c
// scheme). Elsewhere: a byte-table loop (correct, slow; only non-x86 builds take it).
#include "crc32c.h"

#include <cstring>
#include <mutex>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VLLM_PD_CRC32C_HW 1
#endif

namespace vllm_pd {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
constexpr size_t kLong = 8192;           // bytes per stream, long rounds
constexpr size_t kShort = 256;           // bytes per stream, short rounds

struct Tables {
  uint32_t byte[256];          // one byte step of the register
  uint32_t shift_long[4][256]; // register -> register after kLong zero bytes
  uint32_t shift_short[4][256];
};

uint32_t sw_bytes(const Tables& t, uint32_t crc, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) crc = t.byte[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

// The register after feeding `nzeros` zero bytes, by repeated squaring of the one-zero-bit
// operator would be faster; a plain loop over the byte table is fast enough for the 2 x 1024
// entries computed once per process (~20 M table steps).
uint32_t sw_zeros(const Tables& t, uint32_t crc, size_t nzeros) {
  for (size_t i = 0; i < nzeros; ++i) crc = t.byte[crc & 0xff] ^ (crc >> 8);
  return crc;
}

const Tables& tables() {
  static Tables t;
  static std::once_flag once;
  std::call_once(once, [] {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t.byte[b] = c;
    }
    // The zero-byte operator is linear, so a table per register byte covers every register.
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) {
        t.shift_long[k][b] = sw_zeros(t, b << (8 * k), kLong);
        t.shift_short[k][b] = sw_zeros(t, b << (8 * k), kShort);
      }
  });
  return t;
}

inline uint32_t shift(const uint32_t (&tab)[4][256], uint32_t crc) {
  return tab[0][crc & 0xff] ^ tab[1][(crc >> 8) & 0xff] ^ tab[2][(crc >> 16) & 0xff] ^ tab[3][crc >> 24];
}

#ifdef VLLM_PD_CRC32C_HW

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// kStream: a non-temporal store (movnti) - the line goes to memory without first being read
// into the cache (no read-for-ownership), a third less memory traffic for a large destination
// that this core will not read again (the receiver's KV blocks).
template <bool kStream>
__attribute__((target("sse4.2"))) inline void store64(uint8_t* p, uint64_t v) {
  if (kStream)
    _mm_stream_si64(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  else
    std::memcpy(p, &v, 8);
}

// Three streams of `len` bytes each at src, src+len, src+2len; returns the combined register.
// kCopy: also write the bytes to dst (same offsets).
template <bool kCopy, bool kStream>
__attribute__((target("sse4.2"))) inline uint32_t three_streams(uint32_t crc0, const uint8_t* src,
                                                                  uint8_t* dst, size_t len,
                                                                  const uint32_t (&tab)[4][256]) {
  uint64_t c0 = crc0, c1 = 0, c2 = 0;
  const uint8_t* end = src + len;
  for (; src < end; src += 8, dst += kCopy ? 8 : 0) {
    const uint64_t a = load64(src), b = load64(src + len), c = load64(src + 2 * len);
    c0 = _mm_crc32_u64(c0, a);
    c1 = _mm_crc32_u64(c1, b);
    c2 = _mm_crc32_u64(c2, c);
    if (kCopy) {
      store64<kStream>(dst, a);
      store64<kStream>(dst + len, b);
      store64<kStream>(dst + 2 * len, c);
    }
  }
  uint32_t crc = shift(tab, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
  return shift(tab, crc) ^ static_cast<uint32_t>(c2);
}

template <bool kCopy, bool kStream>
__attribute__((target("sse4.2"))) uint32_t hw_run(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n) {
  const Tables& t = tables();
  // Byte steps up to an 8-byte aligned source, so the word loads never split a cache line.
  while (n && (reinterpret_cast<uintptr_t>(src) & 7)) {
    if (kCopy) *dst++ = *src;
    crc = _mm_crc32_u8(crc, *src++);
    --n;
  }
  while (n >= 3 * kLong) {
    crc = three_streams<kCopy, kStream>(crc, src, dst, kLong, t.shift_long);
    src += 3 * kLong;
    if (kCopy) dst += 3 * kLong;
    n -= 3 * kLong;
  }
  while (n >= 3 * kShort) {
    crc = three_streams<kCopy, kStream>(crc, src, dst, kShort, t.shift_short);
    src += 3 * kShort;
    if (kCopy) dst += 3 * kShort;
    n -= 3 * kShort;
  }
  uint64_t c = crc;
  for (; n >= 8; n -= 8, src += 8) {
    const uint64_t v = load64(src);
    c = _mm_crc32_u64(c, v);
    if (kCopy) {
      store64<kStream>(dst, v);
      dst += 8;
    }
  }
  crc = static_cast<uint32_t>(c);
  for (; n; --n) {
    if (kCopy) *dst++ = *src;
    crc = _mm_crc32_u8(crc, *src++);
  }
  if (kStream) _mm_sfence();  // the streamed stores are visible before the caller signals
  return crc;
}

bool have_sse42() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}

#endif  // VLLM_PD_CRC32C_HW

}  // namespace

uint32_t crc32c_copy(void* dst, const void* src, size_t n, uint32_t crc, bool stream) {
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  uint32_t reg = ~crc;  // the public value is the final (inverted) register, as in zlib.crc32
#ifdef VLLM_PD_CRC32C_HW
  if (have_sse42()) {
    if (!d)
      reg = hw_run<false, false>(reg, s, nullptr, n);
    else
      reg = stream ? hw_run<true, true>(reg, s, d, n) : hw_run<true, false>(reg, s, d, n);
    return ~reg;
  }
#endif
  if (d) std::memmove(d, s, n);
  return ~sw_bytes(tables(), reg, s, n);
}

bool crc32c_hardware() {
#ifdef VLLM_PD_CRC32C_HW
  return have_sse42();
#else
  return false;
#endif
}

}  // namespace vllm_pd

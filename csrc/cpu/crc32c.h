// CRC32C of a byte range, optionally fused with copying it (see crc32c.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vllm_pd {

// CRC32C of src[0, n) continuing from `crc` (0 to start; chaining works like zlib.crc32's
// `value`). When dst is not null the bytes are also copied to dst (ranges must not overlap);
// `stream` writes dst with non-temporal stores (for a large destination not read again soon).
uint32_t crc32c_copy(void* dst, const void* src, size_t n, uint32_t crc, bool stream = false);

// True when the SSE4.2 crc32 instruction path is used (else a byte-table loop).
bool crc32c_hardware();

}  // namespace vllm_pd

// Python functions of vllm_pd._C for the transports' checksum (vllm_pd/connector/transport/
// checksum.py): plain CPython methods taking buffers, not torch ops, because they are called
// once per block (or ring slot) on memoryviews and the dispatcher's per-call cost would show.
// Both release the GIL, so the transport's sender and receiver threads hash in parallel.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "checksum_bindings.h"
#include "cpu/crc32c.h"

namespace {

// Below this, dropping and retaking the GIL costs more than the work.
constexpr Py_ssize_t kReleaseGilNbytes = 16 * 1024;

uint32_t run(void* dst, const Py_buffer& src, uint32_t value) {
  if (src.len < kReleaseGilNbytes) return vllm_pd::crc32c_copy(dst, src.buf, src.len, value);
  PyThreadState* saved = PyEval_SaveThread();
  const uint32_t out = vllm_pd::crc32c_copy(dst, src.buf, src.len, value);
  PyEval_RestoreThread(saved);
  return out;
}

PyObject* py_crc32c(PyObject*, PyObject* args) {
  Py_buffer src;
  unsigned int value = 0;
  if (!PyArg_ParseTuple(args, "y*|I:crc32c", &src, &value)) return nullptr;
  const uint32_t out = run(nullptr, src, value);
  PyBuffer_Release(&src);
  return PyLong_FromUnsignedLong(out);
}

PyObject* py_copy_crc32c(PyObject*, PyObject* args) {
  Py_buffer dst, src;
  unsigned int value = 0;
  if (!PyArg_ParseTuple(args, "w*y*|I:copy_crc32c", &dst, &src, &value)) return nullptr;
  if (dst.len != src.len) {
    PyErr_Format(PyExc_ValueError, "copy_crc32c: destination is %zd bytes, source %zd", dst.len, src.len);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return nullptr;
  }
  const uint32_t out = run(dst.buf, src, value);
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return PyLong_FromUnsignedLong(out);
}

// copy_blocks_crc32c(span, blocks, index, offset, value, to_span)
//     -> (moved, index, offset, value, digests)
// Moves bytes between one contiguous span (a ring slot) and a sequence of blocks, in order,
// starting at blocks[index][offset:], until the span or the blocks run out: into the span when
// to_span, out of it otherwise. `value` is the CRC32C of blocks[index][:offset] so far;
// `digests` holds, per block completed by this call, its CRC32C as 8 little-endian bytes (the
// transports' digest slot), ready to join into the trailer. The transports call it once per ring
// slot instead of once per block, so Python's per-block cost (~5 us, a quarter of a 128 KiB
// copy) is gone; the GIL is released for all the copies of the call.
struct Piece {
  uint8_t* block;
  size_t block_off;
  size_t span_off;
  size_t n;
  bool ends_block;
};

PyObject* py_copy_blocks_crc32c(PyObject*, PyObject* args) {
  PyObject *span_obj, *blocks_obj;
  Py_ssize_t index, offset;
  unsigned int value;
  int to_span;
  if (!PyArg_ParseTuple(args, "OOnnIp:copy_blocks_crc32c", &span_obj, &blocks_obj, &index, &offset,
                        &value, &to_span))
    return nullptr;
  PyObject* blocks = PySequence_Fast(blocks_obj, "copy_blocks_crc32c: blocks must be a sequence");
  if (blocks == nullptr) return nullptr;
  const Py_ssize_t nblocks = PySequence_Fast_GET_SIZE(blocks);
  Py_buffer span;
  std::vector<Py_buffer> held;
  std::vector<Piece> pieces;
  PyObject* result = nullptr;
  // The span is read when filling blocks, written when filling the span; blocks the reverse.
  if (PyObject_GetBuffer(span_obj, &span, to_span ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
    Py_DECREF(blocks);
    return nullptr;
  }
  if (index < 0 || offset < 0 || index > nblocks) {
    PyErr_SetString(PyExc_ValueError, "copy_blocks_crc32c: index/offset out of range");
    goto done;
  }
  {
    size_t span_off = 0;
    const size_t span_len = static_cast<size_t>(span.len);
    Py_ssize_t i = index;
    size_t off = static_cast<size_t>(offset);
    for (; i < nblocks; ++i, off = 0) {
      held.emplace_back();
      if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(blocks, i), &held.back(),
                             to_span ? PyBUF_SIMPLE : PyBUF_WRITABLE) != 0) {
        held.pop_back();
        goto done;
      }
      const size_t len = static_cast<size_t>(held.back().len);
      if (off > len) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks_crc32c: offset beyond the block");
        goto done;
      }
      const size_t take = std::min(len - off, span_len - span_off);
      if (take == 0 && off < len) break;  // span full
      pieces.push_back({static_cast<uint8_t*>(held.back().buf), off, span_off, take, off + take == len});
      span_off += take;
      if (off + take < len) break;  // span full mid-block
    }
    std::vector<uint32_t> crcs;
    crcs.reserve(pieces.size());
    uint32_t crc = value;
    auto* span_bytes = static_cast<uint8_t*>(span.buf);
    PyThreadState* saved = PyEval_SaveThread();
    for (const Piece& p : pieces) {
      uint8_t* blk = p.block + p.block_off;
      uint8_t* spn = span_bytes + p.span_off;
      // Into the span (a ring slot the peer reads next): cached stores. Into the blocks (KV
      // pages nobody on this core reads soon): streamed stores, no read-for-ownership.
      crc = to_span ? vllm_pd::crc32c_copy(spn, blk, p.n, crc, false)
                    : vllm_pd::crc32c_copy(blk, spn, p.n, crc, true);
      if (p.ends_block) {
        crcs.push_back(crc);
        crc = 0;
      }
    }
    PyEval_RestoreThread(saved);
    // Where the next call starts: after the last block completed, or inside the unfinished one.
    Py_ssize_t next_index = index + static_cast<Py_ssize_t>(crcs.size());
    size_t next_offset = 0;
    if (!pieces.empty() && !pieces.back().ends_block) next_offset = pieces.back().block_off + pieces.back().n;
    else if (pieces.empty()) next_offset = static_cast<size_t>(offset);
    PyObject* digests = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(8 * crcs.size()));
    if (digests == nullptr) goto done;
    {
      char* out = PyBytes_AS_STRING(digests);
      std::memset(out, 0, 8 * crcs.size());
      for (size_t k = 0; k < crcs.size(); ++k)
        for (int byte = 0; byte < 4; ++byte) out[8 * k + byte] = static_cast<char>(crcs[k] >> (8 * byte));
    }
    size_t moved = 0;
    for (const Piece& p : pieces) moved += p.n;
    result = Py_BuildValue("(nnnIN)", static_cast<Py_ssize_t>(moved), next_index,
                           static_cast<Py_ssize_t>(next_offset), crc, digests);
  }
done:
  for (Py_buffer& b : held) PyBuffer_Release(&b);
  PyBuffer_Release(&span);
  Py_DECREF(blocks);
  return result;
}

PyObject* py_crc32c_hardware(PyObject*, PyObject*) { return PyBool_FromLong(vllm_pd::crc32c_hardware()); }

PyMethodDef kMethods[] = {
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, value=0) -> int: CRC32C of a bytes-like object, continuing from value."},
    {"copy_crc32c", py_copy_crc32c, METH_VARARGS,
     "copy_crc32c(dst, src, value=0) -> int: copy src into dst (same length) and return the "
     "CRC32C of the bytes, continuing from value; one read of src."},
    {"copy_blocks_crc32c", py_copy_blocks_crc32c, METH_VARARGS,
     "copy_blocks_crc32c(span, blocks, index, offset, value, to_span) -> (moved, index, offset, "
     "value, digests): move bytes between a span and blocks[index][offset:]... with per-block "
     "CRC32C (digests: 8 little-endian bytes per completed block)."},
    {"crc32c_hardware", py_crc32c_hardware, METH_NOARGS,
     "crc32c_hardware() -> bool: True when the SSE4.2 instruction path is used."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* vllm_pd_checksum_methods() { return kMethods; }

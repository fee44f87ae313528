// Reads a GGUF weight matrix and does nothing with it: the time the GGUF kernel's access
// pattern costs alone, for scripts/weight_read_ceiling.py.
//
// ``rows`` > 1: groups of ``rows`` weight rows side by side, one block of each per step,
// with the group ``kAheadGroups`` ahead prefetched, tiles of 16 rows over the threads:
// what engine/quant/csrc/gguf_dot_avx2.h does for the 32-value formats in the file's
// layout. ``rows`` == 1: each row from start to end, 1 KB prefetched ahead (the K
// formats' pattern, and near enough regrouped Q5_0's one stream per group). Every
// byte is loaded into a vector register and xor-ed into a sum the caller gets back, so
// the compiler cannot drop the loads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef uint64_t v4u __attribute__((vector_size(32)));

constexpr int64_t kTileRows = 16;
constexpr int64_t kAheadGroups = 4;
constexpr int64_t kAheadBytes = 1024;

inline v4u load32(const uint8_t* p) {
  v4u v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The bytes [p, p + n) xor-ed in 32-byte loads (the last one may reach into the next
// block, as the kernel's loads do; the matrix's own padding keeps it inside the buffer).
inline v4u touch_block(const uint8_t* p, int64_t n) {
  v4u acc = {0, 0, 0, 0};
  for (int64_t o = 0; o < n; o += 32) acc ^= load32(p + o);
  return acc;
}

v4u group(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t block, int64_t nb) {
  v4u acc = {0, 0, 0, 0};
  const uint8_t* ahead = w + kAheadGroups * rows * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t o = 0; o < rows * block; o += 64) __builtin_prefetch(ahead + b * rows * block + o);
    for (int64_t r = 0; r < rows; ++r) acc ^= touch_block(w + r * row_bytes + b * block, block);
  }
  return acc;
}

v4u one_row(const uint8_t* w, int64_t row_bytes, int64_t block) {
  v4u acc = {0, 0, 0, 0};
  for (int64_t o = 0; o < row_bytes; o += block) {
    for (int64_t p = 0; p < block; p += 64) __builtin_prefetch(w + o + kAheadBytes + p);
    acc ^= touch_block(w + o, block);
  }
  return acc;
}

// w [N, row bytes] uint8; block: bytes per block; rows: side by side (1: row by row).
int64_t touch(const at::Tensor& w, int64_t block, int64_t rows) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "touch: w [N, bytes] uint8");
  TORCH_CHECK(block > 0 && w.size(1) % block == 0 && rows >= 1 && rows <= kTileRows,
              "touch: bad block or rows");
  const int64_t n = w.size(0), row_bytes = w.size(1), nb = row_bytes / block;
  // The last 32-byte load of a row may pass its end by up to 31 bytes: stop a group short
  // of the matrix's last row so that no load leaves the buffer.
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  std::vector<v4u> sums(std::max(1, at::get_num_threads()), v4u{0, 0, 0, 0});
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    v4u acc = {0, 0, 0, 0};
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r1 = std::min(n, (t + 1) * kTileRows);
      int64_t r = t * kTileRows;
      if (rows > 1)
        for (; r + rows <= r1 && (r + rows < n || block % 32 == 0); r += rows)
          acc ^= group(base + r * row_bytes, row_bytes, rows, block, nb);
      for (; r < r1; ++r) {
        if (r + 1 == n && block % 32 != 0) {  // the very last row: whole 32-byte loads only
          for (int64_t o = 0; o + 32 <= row_bytes; o += 32) acc ^= load32(base + r * row_bytes + o);
          continue;
        }
        acc ^= one_row(base + r * row_bytes, row_bytes, block);
      }
    }
    sums[at::get_thread_num()] ^= acc;
  });
  v4u total = {0, 0, 0, 0};
  for (const v4u& s : sums) total ^= s;
  return static_cast<int64_t>(total[0] ^ total[1] ^ total[2] ^ total[3]);
}

}  // namespace

TORCH_LIBRARY(declattn_read, m) {
  m.def("touch(Tensor w, int block, int rows) -> int");
  m.impl("touch", c10::DispatchKey::CPU, &touch);
}

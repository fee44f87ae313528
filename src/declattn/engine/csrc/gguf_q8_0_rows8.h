// Q8_0 with its rows regrouped by eight at load (``gguf_repack``): the same bytes as the
// GGUF file holds, laid out so that a decode row costs about half the instructions and
// every code load is aligned.
//
// Why: qwen2.5-0.5b's output head (Q8_0, 151936 x 896, 37% of a decode step's weight
// bytes) ran at ~18 GB/s hot in cache on one core of a 2-core Zen 3: arithmetic, not
// bytes, bounded it there. In the file's layout (34-byte blocks) the kernel reads four
// rows side by side with unaligned loads, takes each row's codes' sign twice (``|w|``, and
// ``x`` signed by ``w``), puts four fp16 scales in lane by lane and reduces the rows with
// half its inputs zeros: ~13 instructions per row and block of 32. Regrouped, ``|x|`` is
// taken once for eight rows (each row then ``maddubs(|x|, w signed by x)``), the eight
// scales are one 16-byte load and one multiply-add serves the eight rows: ~7.
// Measured, file layout against regrouped alternated in one process: a 2048-row slice of
// the head hot in cache 1.4-1.5x faster on one thread (best of 20; medians 1.25-1.45x);
// all of the head from memory the same within +-5% on one or two threads (both near what
// the cores can read); one decode row through all of the model's matrices 0.5-3% faster
// (medians; scripts/gguf_layout_ab.py, its "Q8_0 in file layout" arm).
//
// A group of eight rows is ``8 * row_bytes`` contiguous bytes (where the eight rows were):
//   d[nb][8]       fp16 scales, per block the eight rows' in order (16 bytes a block);
//   qs[nb][8][32]  per block the eight rows' 32 codes, row after row (256 bytes a block).
// With ``nb`` even (any K that is a multiple of 64) and the tensor 32-byte aligned, every
// code load is 32-byte aligned. Rows past the last whole group stay in the GGUF layout.
//
// The sign trick needs |w| <= 127: a code of -128 signed by a negative x stays -128 in
// int8. ggml never writes one (codes are round(x / (amax / 127))), but a matrix that holds
// one is kept in the file's layout (``q8_0_codes_fit``), whose kernel takes |w| as u8.
// Per row the float work is the file layout kernel's, in the same order (a fused
// multiply-add of scale * x's scale and the block's integer sum, block after block), so the
// results are the same bit for bit.

#pragma once

#include "gguf_blocks.h"

#if defined(__AVX2__)
#include "gguf_dot_avx2.h"
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace gguf {

// Our id for the regrouped layout (not a GGUF type: the file holds plain Q8_0).
constexpr int64_t kQ8_0_R8 = 1008;

// True where no code of these Q8_0 blocks is -128 (the regrouped kernel's condition).
inline bool q8_0_codes_fit(const uint8_t* w, int64_t blocks) {
  uint8_t bad = 0;
  for (int64_t b = 0; b < blocks; ++b, w += 34)
    for (int i = 2; i < 34; ++i) bad |= w[i] == 0x80;
  return !bad;
}

// Eight GGUF rows at ``src`` (``row_bytes`` apart, ``nb`` blocks each) -> one group at dst.
inline void regroup_q8_0(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = src + r * row_bytes + b * 34;
      std::memcpy(dst + 16 * b + 2 * r, blk, 2);
      std::memcpy(dst + 16 * nb + 256 * b + 32 * r, blk + 2, 32);
    }
}

// The inverse: one group -> eight GGUF rows, ``row_bytes`` apart.
inline void ungroup_q8_0(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < 8; ++r) {
      uint8_t* blk = dst + r * row_bytes + b * 34;
      std::memcpy(blk, src + 16 * b + 2 * r, 2);
      std::memcpy(blk + 2, src + 16 * nb + 256 * b + 32 * r, 32);
    }
}

#if defined(__AVX2__)
// Eight rows' block sums (eight i32 lanes each) -> lane r = row r's sum: interleaved and
// added in pairs of rows (unpack, four lanes a row), in fours (two lanes a row in each
// 128-bit half), then the halves added across. Single-uop shuffles: on Zen 3 ``hadd``'s
// tree (as in ``hsum8``) was ~15% slower for the whole group with the matrix in L2.
inline __m256i sum8_rows(const __m256i* p) {
  __m256i t[4];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                            _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  __m256i h[2];  // rows 0-3 (4-7): per half, lane j = row j's (4 + j's) partial sum
  for (int i = 0; i < 2; ++i)
    h[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h[0], h[1], 0x21),
                          _mm256_blend_epi32(h[0], h[1], 0xF0));
}

// One group . one activation row -> out[8].
inline void group_q8_0(const uint8_t* w, const Q8Row& x, int64_t nb, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* qs = w + 16 * nb;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, qs += 256) {
    for (int64_t o = 0; o < 8 * 34; o += 64)  // the group's bytes, 272 a block, as one run
      _mm_prefetch(reinterpret_cast<const char*>(w + kGroupAhead + 8 * 34 * b + o), _MM_HINT_T0);
    const __m256i qx = load32(x.q + 32 * b);
    const __m256i ax = _mm256_sign_epi8(qx, qx);
    __m256i p[8];
    for (int r = 0; r < 8; ++r) {  // i16 lanes: two products of at most 127 * 127
      const __m256i q = load32(qs + 32 * r);
      p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q, qx)), ones);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * b)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])),
                          _mm256_cvtepi32_ps(sum8_rows(p)), acc);
  }
  _mm256_storeu_ps(out, acc);
}

constexpr auto dot_q8_0_r8 = dot_groups<group_q8_0, 8, dot32<BQ8_0>>;
#endif

}  // namespace gguf

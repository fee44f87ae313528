// Q5_0 with its rows regrouped by eight at load (``gguf_repack``): the same bytes as the
// GGUF file holds, laid out so that a decode row costs about half the instructions.
//
// Why: on one AVX2 core the GGUF layout's Q5_0 (70% of qwen2.5-0.5b's layer bytes) was
// compute-bound, at 8-9 GB/s with the matrix in cache and 6-7 from memory. Per row and
// block of 32 it spent ~18 instructions: the 32 high bits spread by a shuffle, an OR
// pattern and a compare; two nibble halves put together; an fp16 scale inserted lane by
// lane from eight rows 22 bytes apart; a widening ``madd`` per row. Regrouped, a pair of
// rows is one 32-byte load of nibbles and one 8-byte word of high bits that two variable
// shifts spread; the eight scales are one 16-byte load; ~9.5 instructions per row-block.
// A standalone A/B (one thread, 24 matrices 4864 x 896 from memory, 2-core Zen 3):
// 0.70-0.75x the time of the GGUF layout.
//
// A group of eight rows is ``8 * row_bytes`` contiguous bytes (where the eight rows were),
// per block of 32 columns 176 bytes:
//   d[8]   fp16 scales, rows in the order 0 2 4 6 1 3 5 7 (the order ``hadd`` leaves);
//   hb[4]  per pair p of rows (2p, 2p + 1) a 64-bit word of their 64 high bits;
//   qs[4]  per pair, 32 bytes: row 2p's 16 nibble bytes, then row 2p + 1's.
// A pair's nibbles load as one vector: ``lo`` (low nibbles: values 0-15 of row 2p, then of
// row 2p + 1) and ``hi`` (values 16-31). Byte ``8q + j`` of ``lo`` takes its high bit from
// bit ``8j + q`` of the word (a left shift by 4 - q brings it to bit 4 of byte j in 64-bit
// lane q), byte ``8q + j`` of ``hi`` from bit ``8j + 4 + q`` (a right shift by q).
// Rows past the last whole group stay in the GGUF layout.

#pragma once

#include "gguf_blocks.h"

#if defined(__AVX2__)
#include "gguf_dot_avx2.h"
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace gguf {

// Our id for the regrouped layout (not a GGUF type: the file holds plain Q5_0).
constexpr int64_t kQ5_0_R8 = 1006;
constexpr int64_t kGroupBlock = 8 * 22;
constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// The word's bit for byte ``pos`` (0-31) of vector ``hi`` (0: lo, 1: hi).
inline int word_bit(int hi, int pos) { return 8 * (pos % 8) + 4 * hi + pos / 8; }

// Eight GGUF rows at ``src`` (``row_bytes`` apart, ``nb`` blocks each) -> one group at dst.
inline void regroup_q5_0(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b, dst += kGroupBlock) {
    const uint8_t* blk[8];
    uint32_t qh[8];
    for (int r = 0; r < 8; ++r) {
      blk[r] = src + r * row_bytes + b * 22;
      std::memcpy(&qh[r], blk[r] + 2, 4);
    }
    for (int l = 0; l < 8; ++l) std::memcpy(dst + 2 * l, blk[kOrder[l]], 2);
    for (int p = 0; p < 4; ++p) {
      uint64_t word = 0;
      for (int hi = 0; hi < 2; ++hi)
        for (int pos = 0; pos < 32; ++pos)
          word |= uint64_t((qh[2 * p + pos / 16] >> (16 * hi + pos % 16)) & 1) << word_bit(hi, pos);
      std::memcpy(dst + 16 + 8 * p, &word, 8);
      for (int r = 0; r < 2; ++r) std::memcpy(dst + 48 + 32 * p + 16 * r, blk[2 * p + r] + 6, 16);
    }
  }
}

// The inverse: one group -> eight GGUF rows, ``row_bytes`` apart.
inline void ungroup_q5_0(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b, src += kGroupBlock) {
    uint8_t* blk[8];
    for (int r = 0; r < 8; ++r) blk[r] = dst + r * row_bytes + b * 22;
    for (int l = 0; l < 8; ++l) std::memcpy(blk[kOrder[l]], src + 2 * l, 2);
    for (int p = 0; p < 4; ++p) {
      uint64_t word;
      std::memcpy(&word, src + 16 + 8 * p, 8);
      uint32_t qh[2] = {0, 0};
      for (int hi = 0; hi < 2; ++hi)
        for (int pos = 0; pos < 32; ++pos)
          qh[pos / 16] |= uint32_t((word >> word_bit(hi, pos)) & 1) << (16 * hi + pos % 16);
      for (int r = 0; r < 2; ++r) {
        std::memcpy(blk[2 * p + r] + 2, &qh[r], 4);
        std::memcpy(blk[2 * p + r] + 6, src + 48 + 32 * p + 16 * r, 16);
      }
    }
  }
}

#if defined(__AVX2__)
// One group . one activation row -> out[8] (rows in their own order).
inline void group_q5_0(const uint8_t* w, const Q8Row& x, int64_t nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i left = _mm256_setr_epi64x(4, 3, 2, 1), right = _mm256_setr_epi64x(0, 1, 2, 3);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kGroupBlock) {
    for (int64_t o = 0; o < kGroupBlock; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kGroupAhead + o), _MM_HINT_T0);
    const __m128i* xb = reinterpret_cast<const __m128i*>(x.q + 32 * b);
    const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(xb));
    const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(xb + 1));
    __m256i p[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i v = load32(w + 48 + 32 * q);
      int64_t word;
      std::memcpy(&word, w + 16 + 8 * q, 8);
      const __m256i h = _mm256_set1_epi64x(word);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4),
                                         _mm256_and_si256(_mm256_sllv_epi64(h, left), m10));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                         _mm256_and_si256(_mm256_srlv_epi64(h, right), m10));
      // each i16 lane: four products of at most 31 * 127, no overflow
      p[q] = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
    }
    // lanes: rows 0 2 4 6 | 1 3 5 7, as the scales are stored
    const __m256i s = _mm256_sub_epi32(
        _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])),
        _mm256_set1_epi32(16 * x.isum[b]));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(s), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int l = 0; l < 8; ++l) out[kOrder[l]] = o[l];
}

constexpr auto dot_q5_0_r8 = dot_groups<group_q5_0, 8, dot32<BQ5_0>>;
#endif

}  // namespace gguf

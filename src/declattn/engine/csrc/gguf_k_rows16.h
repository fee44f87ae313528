// Q4_K and Q6_K with their rows regrouped by sixteen at load (``gguf_repack``), for CPUs
// with AVX-512 VNNI: one 32-bit lane of a 512-bit register is one weight row, as in
// gguf_rows16_vnni.h.
//
// Why: the AVX2 kernels read a K-format row alone and spend most of their work summing
// each group's products across lanes (``hadd`` trees) and unpacking its scales before
// they can scale them. qwen2.5-0.5b's down matrices are these formats (twelve Q4_K, twelve
// Q6_K), and on an AVX-512 core the AVX2 kernels are bound by that arithmetic with the
// matrix in cache; regrouped, sixteen rows share each lane-wise step and no sum crosses
// lanes.
//
// The prefetch goes with the loads, a line ahead for each line read. Prefetching a whole
// super-block's lines at its start (``prefetch_block`` of 2-3 KB, as the 32-value layouts
// do per 320-512 bytes) made the same kernels slower in the step than the AVX2 ones: a
// burst of 36-53 prefetches at once, where the stream wants them spread.
//
// The float work per row is the file layout's kernel's, in its order (dot_q4_k's and
// dot_q6_k's eight accumulator lanes, fed and summed as they are there), so the results
// are the same bit for bit (tests/engine/test_quant_kernel.py). Rows past the last whole
// group stay in the file's layout. Every byte of the file's rows is kept, only moved.

#pragma once

#include "gguf_rows16_vnni.h"

namespace gguf {
// Our ids for the layouts (not GGUF types: the file holds plain Q4_K and Q6_K).
constexpr int64_t kQ4_K_R16 = 2012;
constexpr int64_t kQ6_K_R16 = 2014;
}  // namespace gguf

#if defined(GGUF_ROWS16)

namespace gguf {

// The eight accumulator lanes of sixteen rows summed as dot_q4_k's and dot_q6_k's hsum
// does, ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), so the results match bit for bit.
inline void store_lanes8(const __m512* acc, float* out) {
  const __m512 even = _mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6]));
  const __m512 odd = _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7]));
  _mm512_storeu_ps(out, _mm512_add_ps(even, odd));
}

// --- Q6_K ----------------------------------------------------------------------------------
//
// Per super-block of 256 columns (3,360 bytes, as many as the file's sixteen rows):
//   d[16]          fp16 scale of each row (32 bytes);
//   sc[16][16]     per group of 16 columns, the sixteen rows' int8 scales (256 bytes);
//   qh[2][8][64]   half h, chunk s: bytes 4r .. 4r + 3 are row r's high-bit bytes
//                  32h + 4s .. 32h + 4s + 3 (1,024 bytes);
//   ql[2][2][8][64] half h, part p, chunk s: bytes 4r .. 4r + 3 are row r's low-bit bytes
//                  64h + 32p + 4s .. + 3 (2,048 bytes).
// Every byte keeps its meaning in the file (low nibble, high nibble, two high bits per
// value): a chunk of low bits and its high bits give four columns of sixteen rows, the
// unsigned side of ``vpdpbusd``, codes plus 32 as stored. Each group's exact integer sum,
// less 32 times the activations' sum, is times its scale.

namespace q6k16 {
constexpr int64_t kBlock = 210, kGroup = 16 * kBlock;
constexpr int64_t kScales = 32, kHigh = 288, kLow = 1312;  // offsets in a super-block
}  // namespace q6k16

// The file's sixteen rows <-> the regrouped super-blocks, one layout description for both
// directions (``move_rows16``).
template <bool ToGroups>
inline void move_q6_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  using namespace q6k16;
  move_rows16<ToGroups>(src, row_bytes, nb, dst, kBlock, kGroup, [](auto& mv, int64_t, int r) {
    mv(2 * r, 208, 2);
    for (int j = 0; j < 16; ++j) mv(kScales + 16 * j + r, 192 + j, 1);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 8; ++s) {
        mv(kHigh + 64 * (8 * h + s) + 4 * r, 128 + 32 * h + 4 * s, 4);
        for (int p = 0; p < 2; ++p)
          mv(kLow + 64 * (16 * h + 8 * p + s) + 4 * r, 64 * h + 32 * p + 4 * s, 4);
      }
  });
}

inline void regroup_q6_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q6_k_r16<true>(src, row_bytes, nb, dst);
}

inline void ungroup_q6_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q6_k_r16<false>(src, row_bytes, nb, dst);
}

// One group of sixteen Q6_K rows . ``R`` activation rows -> out[R][16]. Each chunk of
// codes is unpacked once for the R rows; a pair of groups' integer sums (columns c .. c +
// 15 and c + 64 ..) is finished and scaled before the next pair starts, so each row keeps
// two sums live, not sixteen. A sum starts at minus 32 times its activations' sum (the
// codes' offset, taken off for free) and is scaled in fp32: sum * scale is an integer of
// at most 2^23 in magnitude, so the float product is exact, as ``vpmulld`` was, in fewer
// instructions. Per row, each accumulator lane takes the same terms in the same order as
// dot_q6_k's (half 0 before half 1, block after block).
struct Q6_KR16 {
  template <int R>
  static void rows(const uint8_t* w, const Q8Row* x, int64_t nb, float* out) {
    using namespace q6k16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    __m512 acc[R][8];  // acc[r][a]: lane a of dot_q6_k's accumulator, for each of sixteen rows
    for (auto& row : acc)
      for (__m512& a : row) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* g = w + kGroup * b;
      const uint8_t* ahead = g + kRows16Ahead;
      prefetch_block<kHigh>(g);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 2; ++p)
          for (int q = 0; q < 2; ++q) {  // groups 8h + 2p + q (low nibbles) and 4 on (high)
            const int j0 = 8 * h + 2 * p + q;
            __m512i sums[R][2];  // each starts at minus 32 times its activations' sum
            for (int r = 0; r < R; ++r)
              for (int i = 0; i < 2; ++i)
                sums[r][i] = _mm512_set1_epi32(-32 * x[r].bsum[16 * b + j0 + 4 * i]);
            for (int s = 4 * q; s < 4 * q + 4; ++s) {
              if (p == 0)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + kHigh + 64 * (8 * h + s)),
                             _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + kLow + 64 * (16 * h + 8 * p + s)),
                           _MM_HINT_T0);
              const __m512i hb = _mm512_loadu_si512(g + kHigh + 64 * (8 * h + s));
              const __m512i l = _mm512_loadu_si512(g + kLow + 64 * (16 * h + 8 * p + s));
              const __m512i top_lo =
                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * p), m2), 4);
              const __m512i top_hi =
                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 + 2 * p), m2), 4);
              const __m512i lo = _mm512_ternarylogic_epi32(l, m4, top_lo, 0xEA);  // (l & m4) | top
              const __m512i hi =
                  _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), m4, top_hi, 0xEA);
              const int col = 128 * h + 32 * p + 4 * s;  // lo's first column; hi's is 64 on
              for (int r = 0; r < R; ++r) {
                const int8_t* xq = x[r].q + 256 * b + col;
                sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], lo, x4(xq));
                sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], hi, x4(xq + 64));
              }
            }
            for (int i = 0; i < 2; ++i) {
              const int j = j0 + 4 * i, a = (j % 8) / 2 + 4 * (j % 2);
              const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + kScales + 16 * j))));
              for (int r = 0; r < R; ++r) {
                const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][i]), sc);  // exact
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(x[r].d[8 * b + j / 2]));
                acc[r][a] = _mm512_fmadd_ps(dx, v, acc[r][a]);
              }
            }
          }
    }
    for (int r = 0; r < R; ++r) store_lanes8(acc[r], out + 16 * r);
  }
};

constexpr auto dot_q6_k_r16 = dot_groups<group16_one<Q6_KR16>, 16, each_row<dot_q6_k>>;

// --- Q4_K ----------------------------------------------------------------------------------
//
// Per super-block of 256 columns (2,304 bytes, as many as the file's sixteen rows):
//   d[16], dmin[16]   fp16, each row's (64 bytes);
//   u[3][16]          the file's twelve scale bytes of each row as three 32-bit words,
//                     word k of the sixteen rows together (192 bytes);
//   qs[4][8][64]      chunk c, slice s: bytes 4r .. 4r + 3 are row r's nibble bytes
//                     32c + 4s .. + 3 (low nibbles: group 2c's columns 4s .. 4s + 3, high
//                     ones group 2c + 1's) (2,048 bytes).

namespace q4k16 {
constexpr int64_t kBlock = 144, kGroup = 16 * kBlock;
constexpr int64_t kWords = 64, kCodes = 256;  // offsets in a super-block
}  // namespace q4k16

template <bool ToGroups>
inline void move_q4_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  using namespace q4k16;
  move_rows16<ToGroups>(src, row_bytes, nb, dst, kBlock, kGroup, [](auto& mv, int64_t, int r) {
    mv(2 * r, 0, 2);
    mv(32 + 2 * r, 2, 2);
    for (int k = 0; k < 3; ++k) mv(kWords + 64 * k + 4 * r, 4 + 4 * k, 4);
    for (int c = 0; c < 4; ++c)
      for (int s = 0; s < 8; ++s) mv(kCodes + 64 * (8 * c + s) + 4 * r, 16 + 32 * c + 4 * s, 4);
  });
}

inline void regroup_q4_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q4_k_r16<true>(src, row_bytes, nb, dst);
}

inline void ungroup_q4_k_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q4_k_r16<false>(src, row_bytes, nb, dst);
}

// Byte ``j`` (0-7) of the eight 6-bit scales (``mins``: of the mins) of sixteen rows, as
// q4_k_scales unpacks them from the words u0, u1, u2.
inline __m512i q4_k_scale16(const __m512i* u, int j, bool mins) {
  const __m512i m6 = _mm512_set1_epi32(0x3F), m4 = _mm512_set1_epi32(0x0F),
                m2 = _mm512_set1_epi32(0x03);
  const __m512i lo = u[mins ? 1 : 0];
  if (j < 4) return _mm512_and_si512(_mm512_srli_epi32(lo, 8 * j), m6);
  const int k = 8 * (j - 4);
  const __m512i low4 = _mm512_and_si512(_mm512_srli_epi32(u[2], k + (mins ? 4 : 0)), m4);
  const __m512i top2 = _mm512_and_si512(_mm512_srli_epi32(lo, k + 6), m2);
  return _mm512_or_si512(low4, _mm512_slli_epi32(top2, 4));
}

// One group of sixteen Q4_K rows . ``R`` activation rows -> out[R][16]: each code vector
// is loaded and split into nibbles once for the R rows, and each 64 columns' two sums are
// scaled before the next 64 start, in fp32 (sum * scale and the activations' sum * min
// are integers below 2^24, so exact, as ``vpmulld`` was). Per row, each accumulator lane
// takes dot_q4_k's terms in its order.
struct Q4_KR16 {
  template <int R>
  static void rows(const uint8_t* w, const Q8Row* x, int64_t nb, float* out) {
    using namespace q4k16;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[R][8];  // acc[r][j]: lane j of dot_q4_k's accumulator (group j), sixteen rows
    for (auto& row : acc)
      for (__m512& a : row) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* g = w + kGroup * b;
      prefetch_block<kCodes>(g);
      const __m512i u[3] = {_mm512_loadu_si512(g + kWords), _mm512_loadu_si512(g + kWords + 64),
                            _mm512_loadu_si512(g + kWords + 128)};
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
      const __m512 dmin =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32)));
      for (int c = 0; c < 4; ++c) {
        __m512i sums[R][2];
        for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {
          _mm_prefetch(reinterpret_cast<const char*>(g + kCodes + 64 * (8 * c + s) + kRows16Ahead),
                       _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(g + kCodes + 64 * (8 * c + s));
          const __m512i lo = _mm512_and_si512(v, m4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x[r].q + 256 * b + 64 * c + 4 * s;
            sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], lo, x4(xq));
            sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], hi, x4(xq + 32));
          }
        }
        for (int i = 0; i < 2; ++i) {
          const int j = 2 * c + i;
          const __m512 sc = _mm512_cvtepi32_ps(q4_k_scale16(u, j, false)),
                       mn = _mm512_cvtepi32_ps(q4_k_scale16(u, j, true));
          for (int r = 0; r < R; ++r) {
            const __m512 dx = _mm512_set1_ps(x[r].d[8 * b + j]);
            const __m512 main = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][i]), sc);  // exact
            acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), main, acc[r][j]);
            const __m512 off =
                _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(x[r].isum[8 * b + j])), mn);
            acc[r][j] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), off, acc[r][j]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) store_lanes8(acc[r], out + 16 * r);
  }
};

constexpr auto dot_q4_k_r16 = dot_groups<group16_one<Q4_KR16>, 16, each_row<dot_q4_k>>;

constexpr auto batch_q6_k_r16 = group16_batch<Q6_KR16, 8>;
constexpr auto batch_q4_k_r16 = group16_batch<Q4_KR16, 8>;

}  // namespace gguf
#endif

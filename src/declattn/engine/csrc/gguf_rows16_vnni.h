// Q8_0 and Q5_0 with their rows regrouped by sixteen at load (``gguf_repack``), for CPUs
// with AVX-512 VNNI: one 32-bit lane of a 512-bit register is one weight row, so a
// block's integer dot for sixteen rows is ``vpdpbusd`` alone, with no sum across lanes.
//
// Why: on an AVX-512 core the AVX2 kernels of the layouts regrouped by eight
// (gguf_q8_0_rows8.h, gguf_q5_0_rows8.h) are compute-bound: a decode row through the
// matrices takes longer than loading the same bytes in the same order, and these two
// formats hold most of a model like qwen2.5-0.5b's bytes. Per row and block of 32 the
// AVX2 kernels spend ~6.4 (Q8_0) and ~9.5 (Q5_0) instructions; here ~1.3 and ~2.8.
//
// A group of sixteen rows is ``16 * row_bytes`` contiguous bytes (where the rows were):
//   d[nb][16]   fp16 scales, per block the sixteen rows' in order (32 bytes a block);
// then per block of 32 columns, for Q8_0 (512 bytes):
//   qs[8][64]   chunk j holds columns 4j .. 4j + 3: bytes 4r .. 4r + 3 are row r's codes,
//               each stored plus 128 (xor 0x80) as an unsigned byte;
// for Q5_0 (320 bytes):
//   hb[4][2]    per chunk c two 64-bit words: bit 4r + i of the first is the high bit of
//               row r's column 8c + i, of the second that of column 8c + 4 + i;
//   qs[4][64]   chunk c: byte 4r + i holds row r's column 8c + i in its low nibble and
//               column 8c + 4 + i in its high one.
// ``vpdpbusd`` takes unsigned bytes times signed ones, four products a lane: the codes
// are the unsigned side (Q8_0's plus 128, Q5_0's 5-bit values as stored, 16 too many)
// and four activations broadcast to every lane the signed side; the offset times the
// activation block's sum comes off once per block, as the value a block's sum starts at.
// With ``nb`` even (any K a multiple of 64) and the tensor 64-byte aligned, every code
// load is 64-byte aligned. Rows past the last whole group stay in the GGUF layout.
//
// Not AMX int8, on the CPUs that have it: with eight activation rows, one tile multiply
// per two blocks gives the same sums (bit for bit), but unpacking the codes into tiles,
// the tiles' loads and stores, and the scaling took as long as the ``vpdpbusd``s, one
// after another (``git log -- scripts/amx_int8_q5_0.cpp`` holds the experiment).
//
// Per row the float work is the other layouts' in the same order (the block's exact
// integer sum, then a multiply-add of scale * x's scale, block after block), so the
// results are theirs bit for bit (tests/engine/test_quant_kernel.py). Q8_0's -128, which
// the eight-row kernel's sign trick cannot take, is an ordinary code here.

#pragma once

#include "gguf_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "gguf_dot_avx2.h"
#define GGUF_ROWS16 1
#endif

#include <cstdint>
#include <cstring>

namespace gguf {

// Our ids for the layouts (not GGUF types: the file holds plain Q5_0 and Q8_0).
constexpr int64_t kQ5_0_R16 = 2006;
constexpr int64_t kQ8_0_R16 = 2008;

// The file's sixteen rows (``row_bytes`` apart, ``nb`` blocks of ``block`` bytes each) <->
// one group, one layout description for both directions (``ToGroups``: rows -> group).
// For every block b and row r, ``layout(mv, b, r)`` names where each piece of row r's
// block lies in the group: mv(at_g, at_blk, n, flip) moves n bytes between the group's
// offset ``group * b + at_g`` and the block's offset at_blk, each xor ``flip`` (its own
// inverse). Used by the layouts that move whole bytes (Q8_0 here, Q4_K and Q6_K in
// gguf_k_rows16.h).
template <bool ToGroups, typename Layout>
inline void move_rows16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst,
                        int64_t block, int64_t group, Layout&& layout) {
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < 16; ++r) {
      const int64_t g = group * b, blk = r * row_bytes + block * b;
      auto mv = [&](int64_t at_g, int64_t at_blk, size_t n, uint8_t flip = 0) {
        const uint8_t* from = ToGroups ? src + blk + at_blk : src + g + at_g;
        uint8_t* to = ToGroups ? dst + g + at_g : dst + blk + at_blk;
        if (flip == 0) std::memcpy(to, from, n);
        else for (size_t i = 0; i < n; ++i) to[i] = from[i] ^ flip;
      };
      layout(mv, b, r);
    }
}

// Q8_0: the scales of every block first (2 bytes a row), then each block's codes plus 128.
template <bool ToGroups>
inline void move_q8_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_rows16<ToGroups>(src, row_bytes, nb, dst, 34, 0, [nb](auto& mv, int64_t b, int r) {
    mv(32 * b + 2 * r, 0, 2);
    const int64_t qs = 32 * nb + 512 * b + 4 * r;
    for (int c = 0; c < 32; ++c) mv(qs + 64 * (c / 4) + c % 4, 2 + c, 1, 0x80);
  });
}

// Q5_0's 5-bit value of column c (0..31) in a file block (d, qh, qs: 22 bytes) and in a
// group's block (hb, qs: 320 bytes; row r, column c = 8 * chunk + 4 * half + i), read and
// or-ed in bit by bit.
namespace q5_0_16 {
inline int file(const uint8_t* blk, int c) {
  const int nibble = c < 16 ? blk[6 + c] & 0xF : blk[6 + c - 16] >> 4;
  return nibble | (((blk[2 + c / 8] >> (c % 8)) & 1) << 4);
}
inline void set_file(uint8_t* blk, int c, int v) {
  blk[6 + c % 16] |= (v & 0xF) << (c < 16 ? 0 : 4);
  blk[2 + c / 8] |= ((v >> 4) & 1) << (c % 8);
}
inline int group(const uint8_t* grp, int r, int c) {
  const int chunk = c / 8, half = (c / 4) % 2, k = 4 * r + c % 4;
  const int lo = (grp[64 + 64 * chunk + k] >> (4 * half)) & 0xF;
  return lo | (((grp[16 * chunk + 8 * half + k / 8] >> (k % 8)) & 1) << 4);
}
inline void set_group(uint8_t* grp, int r, int c, int v) {
  const int chunk = c / 8, half = (c / 4) % 2, k = 4 * r + c % 4;
  grp[64 + 64 * chunk + k] |= (v & 0xF) << (4 * half);
  grp[16 * chunk + 8 * half + k / 8] |= ((v >> 4) & 1) << (k % 8);
}
}  // namespace q5_0_16

template <bool ToGroups>
inline void move_q5_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  using namespace q5_0_16;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t grp = 32 * nb + 320 * b;
    if (ToGroups) std::memset(dst + grp, 0, 320);
    for (int r = 0; r < 16; ++r) {
      const int64_t blk = r * row_bytes + b * 22, d = 32 * b + 2 * r;
      if (ToGroups) {
        std::memcpy(dst + d, src + blk, 2);
        for (int c = 0; c < 32; ++c) set_group(dst + grp, r, c, file(src + blk, c));
      } else {
        std::memcpy(dst + blk, src + d, 2);
        std::memset(dst + blk + 2, 0, 20);
        for (int c = 0; c < 32; ++c) set_file(dst + blk, c, group(src + grp, r, c));
      }
    }
  }
}

inline void regroup_q8_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q8_0_r16<true>(src, row_bytes, nb, dst);
}

inline void ungroup_q8_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q8_0_r16<false>(src, row_bytes, nb, dst);
}

inline void regroup_q5_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q5_0_r16<true>(src, row_bytes, nb, dst);
}

inline void ungroup_q5_0_r16(const uint8_t* src, int64_t row_bytes, int64_t nb, uint8_t* dst) {
  move_q5_0_r16<false>(src, row_bytes, nb, dst);
}

#if defined(GGUF_ROWS16)
// A group's blocks are one run of memory, prefetched this far ahead along it: 2-4 KB
// ahead read fastest (gate/up and output head, caches flushed, one and two threads);
// 8 KB (the eight-row layouts' distance) was slower, 16-32 KB and none slower still.
constexpr int64_t kRows16Ahead = 3072;

template <int64_t Bytes>
inline void prefetch_block(const uint8_t* p) {
  for (int64_t o = 0; o < Bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kRows16Ahead + o), _MM_HINT_T0);
}

inline __m512i x4(const int8_t* p) {  // four activations in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc (row r in lane r) += (d * x's d) * the block's integer sum s, as the other layouts do.
inline __m512 scale_add(const uint8_t* d, float xd, __m512i s, __m512 acc) {
  const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  return _mm512_fmadd_ps(_mm512_mul_ps(dd, _mm512_set1_ps(xd)), _mm512_cvtepi32_ps(s), acc);
}

// A format's group kernel is ``Kernel::rows<R>``: one group of sixteen rows . R activation
// rows -> out[R][16]. The one-row form the layouts' ``dot_groups`` takes:
template <typename Kernel>
inline void group16_one(const uint8_t* w, const Q8Row& x, int64_t nb, float* out) {
  Kernel::template rows<1>(w, &x, nb, out);
}

// One group of sixteen rows . ``n`` activation rows -> out[n][16]: ``R`` rows at a time,
// then the rest by halves. ``Kernel::rows<R>`` is a format's group kernel for R rows; 8
// rows for every format, each measured against 4 (Q8_0's one chain of sums per row at 8
// leaves room in the 32 vector registers; the K formats' float accumulators, eight a row,
// wait in memory between their updates, once per group of columns).
template <typename Kernel, int R>
inline void group16_batch(const uint8_t* w, const Q8Row* x, int64_t n, int64_t nb, float* out) {
  for (; n >= R; n -= R, x += R, out += 16 * R) Kernel::template rows<R>(w, x, nb, out);
  if constexpr (R > 1) group16_batch<Kernel, R / 2>(w, x, n, nb, out);
}

// One group of sixteen Q8_0 rows . ``R`` activation rows -> out[R][16]. Each code vector
// is loaded once for the R rows, so a batch of decode rows reads a group's codes once from
// cache instead of R times, and each row's work is the one-row kernel's in its order.
// ``Chains`` integer sums per row keep enough ``vpdpbusd`` in flight (two for up to four
// rows, one for eight: eight rows are eight chains, and their registers still fit); the
// sums are exact, so the split does not change a bit.
struct Q8_0R16 {
  template <int R>
  static void rows(const uint8_t* w, const Q8Row* x, int64_t nb, float* out) {
    constexpr int Chains = R >= 8 ? 1 : 2;
    const uint8_t* qs = w + 32 * nb;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, qs += 512) {
      prefetch_block<512>(qs);
      __m512i s[R][Chains];  // the first chain starts at minus the codes' offset times x's sum
      for (int r = 0; r < R; ++r) {
        s[r][0] = _mm512_set1_epi32(-128 * x[r].isum[b]);
        for (int c = 1; c < Chains; ++c) s[r][c] = _mm512_setzero_si512();
      }
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * j);
        for (int r = 0; r < R; ++r)
          s[r][j % Chains] =
              _mm512_dpbusd_epi32(s[r][j % Chains], v, x4(x[r].q + 32 * b + 4 * j));
      }
      for (int r = 0; r < R; ++r) {
        __m512i sum = s[r][0];
        if constexpr (Chains == 2) sum = _mm512_add_epi32(sum, s[r][1]);
        acc[r] = scale_add(w + 32 * b, x[r].d[b], sum, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  }
};

// One group of sixteen Q5_0 rows . ``R`` activation rows -> out[R][16]: each chunk's codes
// are unpacked once for the R rows (the unpacking, not the loads, bounds this format).
struct Q5_0R16 {
  template <int R>
  static void rows(const uint8_t* w, const Q8Row* x, int64_t nb, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const uint8_t* hb = w + 32 * nb;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, hb += 320) {
      prefetch_block<320>(hb);
      __m512i s[R][2];  // the first chain starts at minus the codes' offset times x's sum
      for (int r = 0; r < R; ++r) {
        s[r][0] = _mm512_set1_epi32(-16 * x[r].isum[b]);
        s[r][1] = _mm512_setzero_si512();
      }
      for (int c = 0; c < 4; ++c) {
        uint64_t bits[2];
        std::memcpy(bits, hb + 16 * c, 16);
        const __m512i v = _mm512_loadu_si512(hb + 64 + 64 * c);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, m10);
        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, m10);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = x[r].q + 32 * b + 8 * c;
          s[r][0] = _mm512_dpbusd_epi32(s[r][0], lo, x4(xb));
          s[r][1] = _mm512_dpbusd_epi32(s[r][1], hi, x4(xb + 4));
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r] = scale_add(w + 32 * b, x[r].d[b], _mm512_add_epi32(s[r][0], s[r][1]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  }
};

constexpr auto dot_q8_0_r16 = dot_groups<group16_one<Q8_0R16>, 16, dot32<BQ8_0>>;
constexpr auto dot_q5_0_r16 = dot_groups<group16_one<Q5_0R16>, 16, dot32<BQ5_0>>;

// A whole group of sixteen Q8_0 or Q5_0 rows dequantised straight from the group's layout
// (no copy back to the file's layout first: moving Q5_0's codes back bit by bit cost
// several times the dequantising itself): row r into out + r * k, k = 32 nb, each value
// the file layout's ``d * code`` (dequant_row), bit for bit. ``Codes`` gives one block's
// sixteen rows of 32 codes, offsets taken off.
template <void (*Codes)(const uint8_t*, int8_t (*)[32]), int64_t BlockBytes>
inline void dequant_group16(const uint8_t* w, int64_t nb, float* out, int64_t k) {
  alignas(64) int8_t codes[16][32];
  for (int64_t b = 0; b < nb; ++b) {
    Codes(w + 32 * nb + BlockBytes * b, codes);
    for (int r = 0; r < 16; ++r) {
      const __m512 d = _mm512_set1_ps(fp16(w + 32 * b + 2 * r));
      for (int h = 0; h < 2; ++h) {
        const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(codes[r] + 16 * h));
        _mm512_storeu_ps(out + r * k + 32 * b + 16 * h,
                         _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
      }
    }
  }
}

inline void codes16_q8_0(const uint8_t* qs, int8_t (*codes)[32]) {
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < 16; ++r) {
      uint32_t u;
      std::memcpy(&u, qs + 64 * j + 4 * r, 4);
      u ^= 0x80808080u;
      std::memcpy(codes[r] + 4 * j, &u, 4);
    }
}

// Q5_0: each chunk unpacked as the kernel unpacks it, then per 128-bit lane the low and
// high halves' 32-bit pieces paired, so that each 64-bit piece is one row's eight columns.
inline void codes16_q5_0(const uint8_t* hb, int8_t (*codes)[32]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
  for (int c = 0; c < 4; ++c) {
    uint64_t bits[2];
    std::memcpy(bits, hb + 16 * c, 16);
    const __m512i v = _mm512_loadu_si512(hb + 64 + 64 * c);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    lo = _mm512_sub_epi8(_mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, m10), m10);
    hi = _mm512_sub_epi8(_mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, m10), m10);
    alignas(64) uint64_t pairs[2][8];  // [0]: rows 4L, 4L + 1 of lane L; [1]: 4L + 2, 4L + 3
    _mm512_store_si512(pairs[0], _mm512_unpacklo_epi32(lo, hi));
    _mm512_store_si512(pairs[1], _mm512_unpackhi_epi32(lo, hi));
    for (int lane = 0; lane < 4; ++lane)
      for (int e = 0; e < 4; ++e)
        std::memcpy(codes[4 * lane + e] + 8 * c, &pairs[e / 2][2 * lane + e % 2], 8);
  }
}

constexpr auto dequant_q8_0_r16 = dequant_group16<codes16_q8_0, 512>;
constexpr auto dequant_q5_0_r16 = dequant_group16<codes16_q5_0, 320>;

constexpr auto batch_q8_0_r16 = group16_batch<Q8_0R16, 8>;
constexpr auto batch_q5_0_r16 = group16_batch<Q5_0R16, 8>;
#endif

}  // namespace gguf

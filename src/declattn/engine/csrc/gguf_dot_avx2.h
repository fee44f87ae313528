// One weight row (or a group of rows) . one activation row with AVX2.

#pragma once

#include "gguf_blocks.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf {

// A kernel over ``rows`` rows ``row_bytes`` apart, as Format::dot takes them.
using RowsDot = void (*)(const uint8_t*, int64_t, int64_t, const Q8Row&, int64_t, float*);

// ``Row`` (one row's dot) over each of ``rows`` rows: a RowsDot.
template <float (*Row)(const uint8_t*, const Q8Row&, int64_t)>
void each_row(const uint8_t* w, int64_t row_bytes, int64_t rows, const Q8Row& x, int64_t nb,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = Row(w + r * row_bytes, x, nb);
}

// --- the same with AVX2 ----------------------------------------------------------------------
//
// Each block's dot product is integer work (u8 x s8 pairs, ``maddubs``). Codes stored with
// an offset (Q4_0's 8, Q5_0's 16, Q6_K's 32) are used as unsigned bytes and the offset
// times the activation block's sum is taken off once per block. The K formats reduce a
// super-block's eight per-32 sums together (``hsum8``) and scale them in one vector
// multiply-add (rather than a multiply and a dependent add per 32), one row at a time
// with software prefetch ``kAhead`` bytes on; the 32-value formats go eight rows at a time
// (Q8_0 four), reduce the rows' integer sums together the same way, and prefetch the
// group of rows ahead (``rows32``).

#if defined(__AVX2__)
// 4 KB: once the Q4_K scales stopped stalling (``q4_k_scales``) a super-block is quick
// enough that 1 KB ahead is less than the memory's latency; 4 KB covers it, and 8 KB
// gains nothing more.
constexpr int64_t kAhead = 4096;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + o), _MM_HINT_T0);
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// lane j = the sum of p[j]'s eight lanes
inline __m256i hsum8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 32 u8 x s8 -> 8 x i32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> low nibbles, then high ones
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

inline __m256i bits_to_bytes(const uint8_t* qh) {  // bit i of 32 -> byte i is 0xFF
  uint32_t x32;
  std::memcpy(&x32, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// The 32-value formats, ``rows`` rows at a time: each activation block is loaded once for
// the rows, each row's block dot stays integer (eight i32 lanes), and the rows are reduced
// together (``hsum8``: lane r = row r) so that the scales, the code offset and the
// conversion to float are one vector operation per group rather than one per row (a gain
// where arithmetic bounds the time; where memory bounds it, as on two threads, the two
// run alike). Q8_0, whose codes need no unpacking, reads four rows (eight were slower
// from memory).
struct BQ8_0 {
  static constexpr int64_t bytes = 34;
  static constexpr int rows = 4;
  static constexpr int offset = 0;
  static constexpr bool has_min = false;
  static __m256i dot(const uint8_t* w, __m256i qx) {  // signed x signed, by the sign trick
    const __m256i q = load32(w + 2);
    return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(qx, q));
  }
};

struct BQ4_0 {
  static constexpr int rows = 8;
  static constexpr int64_t bytes = 18;
  static constexpr int offset = 8;
  static constexpr bool has_min = false;
  static __m256i dot(const uint8_t* w, __m256i qx) { return dot_u8s8(nibbles32(w + 2), qx); }
};

struct BQ4_1 {
  static constexpr int rows = 8;
  static constexpr int64_t bytes = 20;
  static constexpr int offset = 0;
  static constexpr bool has_min = true;  // fp16 min after the scale
  static __m256i dot(const uint8_t* w, __m256i qx) { return dot_u8s8(nibbles32(w + 4), qx); }
};

struct BQ5_0 {
  static constexpr int rows = 8;
  static constexpr int64_t bytes = 22;
  static constexpr int offset = 16;
  static constexpr bool has_min = false;
  static __m256i dot(const uint8_t* w, __m256i qx) {
    const __m256i hi = _mm256_and_si256(bits_to_bytes(w + 2), _mm256_set1_epi8(0x10));
    return dot_u8s8(_mm256_or_si256(nibbles32(w + 6), hi), qx);
  }
};

// Eight fp16 values, ``stride`` bytes apart, as fp32 lanes (lanes from R on are 0).
template <int R>
inline __m256 fp16_lanes(const uint8_t* p, int64_t stride) {
  __m128i h = _mm_setzero_si128();
  for (int r = 0; r < R; ++r) {
    uint16_t v;
    std::memcpy(&v, p + r * stride, 2);
    h = _mm_insert_epi16(h, v, r);
  }
  return _mm256_cvtph_ps(h);
}

// The group of rows ``kAheadGroups`` after this one is prefetched as this one is read
// (rows side by side are as many streams, which the hardware prefetcher alone leaves far
// below the memory's bandwidth).
constexpr int64_t kAheadGroups = 4;

// The layouts regrouped by eight rows (gguf_q5_0_rows8.h, gguf_q8_0_rows8.h) prefetch this
// far ahead along a group's bytes (the rows of a thread's tiles are one run of memory
// there): for Q5_0 5-11 KB read alike, 0.7 KB and 28 KB slower; for Q8_0 2-16 KB alike.
constexpr int64_t kGroupAhead = 8192;

template <class B, int R>
void rows32(const uint8_t* w, int64_t row_bytes, const Q8Row& x, int64_t nb, float* out) {
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  const uint8_t* ahead = w + kAheadGroups * R * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pf = ahead + b * R * B::bytes;
    for (int64_t o = 0; o < R * B::bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + o), _MM_HINT_T0);
    const __m256i qx = load32(x.q + 32 * b);
    __m256i p[8];
    for (int r = 0; r < 8; ++r)
      p[r] = r < R ? B::dot(w + r * row_bytes + b * B::bytes, qx) : _mm256_setzero_si256();
    __m256i s = hsum8(p);
    if (B::offset) s = _mm256_sub_epi32(s, _mm256_set1_epi32(B::offset * x.isum[b]));
    const __m256 d = fp16_lanes<R>(w + b * B::bytes, row_bytes);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(s), acc);
    if (B::has_min)
      mins = _mm256_fmadd_ps(fp16_lanes<R>(w + b * B::bytes + 2, row_bytes),
                             _mm256_set1_ps(x.sum[b]), mins);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, _mm256_add_ps(acc, mins));
  for (int r = 0; r < R; ++r) out[r] = o[r];
}

template <class B>
void dot32(const uint8_t* w, int64_t row_bytes, int64_t rows, const Q8Row& x, int64_t nb,
           float* out) {
  int64_t r = 0;
  for (; r + B::rows <= rows; r += B::rows)
    rows32<B, B::rows>(w + r * row_bytes, row_bytes, x, nb, out + r);
  for (; r < rows; ++r) rows32<B, 1>(w + r * row_bytes, row_bytes, x, nb, out + r);
}

// ``rows`` rows from a tile start (a multiple of R rows into the matrix) of a layout
// regrouped by R rows (gguf_q5_0_rows8.h, gguf_q8_0_rows8.h, gguf_rows16_vnni.h,
// gguf_k_rows16.h): whole groups by ``Group``, the rest (only ever the matrix's last rows)
// in the GGUF layout by ``Rest``.
template <void (*Group)(const uint8_t*, const Q8Row&, int64_t, float*), int R, RowsDot Rest>
void dot_groups(const uint8_t* w, int64_t row_bytes, int64_t rows, const Q8Row& x, int64_t nb,
                float* out) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) Group(w + r * row_bytes, x, nb, out + r);
  Rest(w + r * row_bytes, row_bytes, rows - r, x, nb, out + r);
}

// The 12 scale bytes of a Q4_K super-block -> 8 scales (bytes 0-7 of the first) and 8 mins
// (of the second), unpacked in general registers and moved to vectors whole. Why not an
// array of four words loaded as one vector: that is four narrow stores and one wide load,
// which the CPU cannot forward, so each super-block waited for its stores to reach the
// cache, a stall as long as the rest of dot_q4_k's work (results bit for bit the same).
inline void q4_k_scales(const uint8_t* s, __m256i* sc, __m256i* mn) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, s, 4);
  std::memcpy(&u1, s + 4, 4);
  std::memcpy(&u2, s + 8, 4);
  const uint64_t scales = (uint64_t{(u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)} << 32) |
                          (u0 & 0x3F3F3F3F);
  const uint64_t mins = (uint64_t{((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)} << 32) |
                        (u1 & 0x3F3F3F3F);
  *sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales)));
  *mn = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mins)));
}

// Q4_K: per super-block an fp16 scale and min, eight 6-bit scales and mins (one per 32),
// 128 bytes of nibbles (32 bytes: block 2c in the low nibbles, 2c + 1 in the high ones).
float dot_q4_k(const uint8_t* w, const Q8Row& x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w += 144) {
    prefetch(w, 144);
    __m256i sc, mn;
    q4_k_scales(w + 4, &sc, &mn);
    const int8_t* q8 = x.q + b * 256;
    __m256i p[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i q4 = load32(w + 16 + 32 * c);
      p[2 * c] = dot_u8s8(_mm256_and_si256(q4, m4), load32(q8 + 64 * c));
      p[2 * c + 1] = dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4),
                              load32(q8 + 64 * c + 32));
    }
    const __m256 dx = _mm256_loadu_ps(x.d + 8 * b);
    const __m256 main = _mm256_cvtepi32_ps(_mm256_mullo_epi32(hsum8(p), sc));
    const __m256 off = _mm256_cvtepi32_ps(_mm256_mullo_epi32(load32(x.isum + 8 * b), mn));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16(w)), dx), main, acc);
    acc = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fp16(w + 2)), dx), off, acc);
  }
  return hsum(acc);
}

// Q6_K: 6-bit codes stored + 32 (low 4 bits in ql, high 2 in qh), an int8 scale per 16,
// an fp16 scale per super-block. A 32-byte chunk covers two groups of 16: ``madd`` of its
// pair sums by ones leaves group g in lanes 0-3 and g + 1 in lanes 4-7, so two ``hadd``
// levels give the sixteen group sums as [0 2 4 6 | 1 3 5 7] and [8 10 12 14 | 9 11 13 15].
float dot_q6_k(const uint8_t* w, const Q8Row& x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    prefetch(w, 210);
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t* q8 = x.q + b * 256;
    __m256i p[8];
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32);
      const __m256i hb = load32(qh + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
      };
      for (int s = 0; s < 4; ++s) p[4 * h + s] = dot_u8s8(q[s], load32(q8 + 128 * h + 32 * s));
    }
    const __m128i sc8 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)),
                                         evens_odds);
    const float d = fp16(w + 208);
    for (int half = 0; half < 2; ++half) {  // chunks 4 * half .. + 3: groups 8 * half .. + 7
      const __m256i* ph = p + 4 * half;
      const __m256i g = _mm256_hadd_epi32(_mm256_hadd_epi32(ph[0], ph[1]),
                                          _mm256_hadd_epi32(ph[2], ph[3]));
      const __m256i bs = _mm256_permutevar8x32_epi32(load32(x.bsum + 16 * b + 8 * half), order);
      const __m256i sc = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc8, 8) : sc8);
      const __m256i v = _mm256_mullo_epi32(_mm256_sub_epi32(g, _mm256_slli_epi32(bs, 5)), sc);
      const __m256 dx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.d + 8 * b + 4 * half));
      acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d), dx), _mm256_cvtepi32_ps(v), acc);
    }
  }
  return hsum(acc);
}
#endif

}  // namespace gguf

// y = x W^T with W kept in llama.cpp's own block bytes (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
//
// Why a kernel: a decode step is one row times every weight matrix, so its time is the
// bytes of the weights; reading a GGUF's blocks as they are reads what llama.cpp reads,
// and keeps its numbers exactly (no second rounding of 5-, 6- or 8-bit codes). As in
// llama.cpp, the activations are rounded to int8 per block of 32 so that each block's dot
// product is integer work (AVX2 maddubs); each row then sums its blocks' dots times both
// scales in fp32. Activations get one scale per 32 values for every format (llama.cpp
// uses 256 for the K formats; see dot_q4_k).
//
// What made it fast (qwen2.5-0.5b's matrices, one decode row, 2-core Zen 3: 86-102 ms ->
// 40 ms on one thread, 28 ms on two; scripts/gguf_matrix_profile.py): software prefetch
// ahead of the rows being read; the K formats' per-32 sums reduced eight at a time and
// scaled in one vector multiply-add per super-block (was eight dependent ones), and the
// 32-value formats' rows reduced eight at a time the same way (was per row); codes
// stored with an offset used as unsigned bytes, the offset taken off once per block; and
// OpenMP in the build (native.py), without which at::parallel_for ran on one thread.
//
// Compiled with -march=native on the machine that runs it: AVX2 where the CPU has it, a
// plain C++ loop otherwise (same results, to float rounding).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

// ggml type ids, as in the GGUF file
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { m <<= 1; ++e; } while (!(m & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// --- activations rounded to int8 -----------------------------------------------------------

// One row of x rounded to int8 in blocks of 32, one scale each. The K formats read the
// per-block arrays eight blocks (one super-block) at a time.
struct Q8Row {
  const int8_t* q;
  const float* d;       // scale, per 32
  const float* sum;     // d * sum(q), per 32 (for formats with a min)
  const int32_t* isum;  // sum(q), per 32 (for formats whose codes are stored with an offset)
  const int32_t* bsum;  // sum(q), per 16 (Q6_K: a scale per 16)
};

inline int8_t round8(float v) {
  return static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(v))));
}

// ``T``: float or bf16, read as it is (a bf16 decode row is never copied to fp32 first).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* sum, int32_t* isum,
                  int32_t* bsum) {
  constexpr int64_t block = 32;
  float xb[block];
  for (int64_t b = 0; b < k / block; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < block; ++i) {
      xb[i] = static_cast<float>(x[b * block + i]);
      amax = std::max(amax, std::fabs(xb[i]));
    }
    const float db = amax / 127.0f;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    int s[2] = {0, 0};
    for (int64_t i = 0; i < block; ++i) {
      q[b * block + i] = round8(xb[i] * id);
      s[i / 16] += q[b * block + i];
    }
    d[b] = db;
    isum[b] = s[0] + s[1];
    sum[b] = db * static_cast<float>(isum[b]);
    bsum[2 * b] = s[0];
    bsum[2 * b + 1] = s[1];
  }
}

// --- one weight row . one activation row, plain C++ (CPUs without AVX2) ----------------------

inline void k4_scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if !defined(__AVX2__)
float dot_q8_0(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 34) {
    int s = 0;
    for (int i = 0; i < 32; ++i) s += static_cast<int8_t>(w[2 + i]) * x.q[b * 32 + i];
    acc += fp16(w) * x.d[b] * s;
  }
  return acc;
}

float dot_q4_0(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 18) {
    int s = 0;
    for (int i = 0; i < 16; ++i) {
      s += ((w[2 + i] & 0xF) - 8) * x.q[b * 32 + i];
      s += ((w[2 + i] >> 4) - 8) * x.q[b * 32 + 16 + i];
    }
    acc += fp16(w) * x.d[b] * s;
  }
  return acc;
}

float dot_q4_1(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float offsets = 0;  // sum over blocks of m * sum(x)
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 20) {
    int s = 0;
    for (int i = 0; i < 16; ++i) {
      s += (w[4 + i] & 0xF) * x.q[b * 32 + i];
      s += (w[4 + i] >> 4) * x.q[b * 32 + 16 + i];
    }
    acc += fp16(w) * x.d[b] * s;
    offsets += fp16(w + 2) * x.sum[b];
  }
  return acc + offsets;
}

float dot_q5_0(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 22) {
    uint32_t qh;
    std::memcpy(&qh, w + 2, 4);
    int s = 0;
    for (int i = 0; i < 16; ++i) {
      const int lo = (w[6 + i] & 0xF) | (((qh >> i) & 1) << 4);
      const int hi = (w[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      s += (lo - 16) * x.q[b * 32 + i] + (hi - 16) * x.q[b * 32 + 16 + i];
    }
    acc += fp16(w) * x.d[b] * s;
  }
  return acc;
}

// K formats: a super-block of 256 weights spans eight activation blocks of 32 (x.d[8b + j]).
// llama.cpp rounds these activations with one scale per 256; one per 32 keeps an outlier
// from coarsening 255 neighbours (Gemma 3 270M, mean |logit error| against fp32: 0.227 ->
// 0.167), for one float multiply per 32.
float dot_q4_k(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 144) {
    const float d = fp16(w), dmin = fp16(w + 2);
    const uint8_t* qs = w + 16;
    const int8_t* q8 = x.q + b * 256;
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1, sl = 0, sh = 0;
      k4_scale_min(2 * c, w + 4, &sc0, &m0);
      k4_scale_min(2 * c + 1, w + 4, &sc1, &m1);
      for (int i = 0; i < 32; ++i) {
        sl += (qs[32 * c + i] & 0xF) * q8[64 * c + i];
        sh += (qs[32 * c + i] >> 4) * q8[64 * c + 32 + i];
      }
      const float* dx = x.d + 8 * b + 2 * c;
      const int32_t* is = x.isum + 8 * b + 2 * c;
      acc += dx[0] * (d * sc0 * sl - dmin * m0 * is[0]) + dx[1] * (d * sc1 * sh - dmin * m1 * is[1]);
    }
  }
  return acc;
}

float dot_q6_k(const uint8_t* w, const Q8Row& x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b, w += 210) {
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = fp16(w + 208);
    const int8_t* q8 = x.q + b * 256;
    for (int h = 0; h < 2; ++h) {
      int sumi[4] = {0, 0, 0, 0};
      for (int c = 0; c < 32; ++c) {
        const uint8_t l0 = ql[64 * h + c], l1 = ql[64 * h + 32 + c], hb = qh[32 * h + c];
        const int u[4] = {(l0 & 0xF) | ((hb & 3) << 4), (l1 & 0xF) | (((hb >> 2) & 3) << 4),
                          (l0 >> 4) | (((hb >> 4) & 3) << 4), (l1 >> 4) | (((hb >> 6) & 3) << 4)};
        for (int s = 0; s < 4; ++s) {
          const int e = 128 * h + 32 * s + c;
          sumi[s] += sc[e / 16] * (u[s] - 32) * q8[e];
        }
      }
      for (int s = 0; s < 4; ++s) acc += d * x.d[8 * b + 4 * h + s] * sumi[s];
    }
  }
  return acc;
}
#endif

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
constexpr int64_t kAhead = 1024;

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
// conversion to float are one vector operation per group rather than one per row. Against
// four rows with per-row float work, on qwen2.5-0.5b's blocks alternated in one process
// (2-core Zen 3): one decode row 1.08x faster on one thread, the same on two (memory
// bounds it there: scripts/weight_read_ceiling.py); eight rows 1.16x / 1.08x. Q8_0, whose
// codes need no unpacking, reads four rows (eight were slower from memory).
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
// (rows side by side are as many streams, which the hardware prefetcher alone left at
// 3.8 of 15 GB/s on this 2-core Zen 3).
constexpr int64_t kAheadGroups = 4;

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

// Q4_K: per super-block an fp16 scale and min, eight 6-bit scales and mins (one per 32),
// 128 bytes of nibbles (32 bytes: block 2c in the low nibbles, 2c + 1 in the high ones).
float dot_q4_k(const uint8_t* w, const Q8Row& x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w += 144) {
    prefetch(w, 144);
    uint32_t u[4];  // the 12 scale bytes -> 8 scales (bytes 0-7), 8 mins (bytes 8-15)
    std::memcpy(u, w + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3F3F3F3F;
    u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3F3F3F3F;
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m256i sc = _mm256_cvtepu8_epi32(sm), mn = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));
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

// --- one weight row to fp32 (prefill multiplies many rows: there a float GEMM is faster) -----

void dequant_row(int64_t type, const uint8_t* w, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    switch (type) {
      case kQ4_0: case kQ4_1: {
        const bool offset = type == kQ4_1;
        const float d = fp16(w), m = offset ? fp16(w + 2) : 0.0f;
        const uint8_t* qs = w + (offset ? 4 : 2);
        const int zero = offset ? 0 : 8;
        for (int i = 0; i < 16; ++i) {
          y[i] = d * ((qs[i] & 0xF) - zero) + m;
          y[i + 16] = d * ((qs[i] >> 4) - zero) + m;
        }
        w += offset ? 20 : 18, y += 32;
        break;
      }
      case kQ5_0: {
        const float d = fp16(w);
        uint32_t qh;
        std::memcpy(&qh, w + 2, 4);
        for (int i = 0; i < 16; ++i) {
          const int lo = (w[6 + i] & 0xF) | (((qh >> i) & 1) << 4);
          const int hi = (w[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
          y[i] = d * (lo - 16);
          y[i + 16] = d * (hi - 16);
        }
        w += 22, y += 32;
        break;
      }
      case kQ8_0: {
        const float d = fp16(w);
        for (int i = 0; i < 32; ++i) y[i] = d * static_cast<int8_t>(w[2 + i]);
        w += 34, y += 32;
        break;
      }
      case kQ4_K: {
        const float d = fp16(w), dmin = fp16(w + 2);
        for (int c = 0; c < 4; ++c) {
          int sc0, m0, sc1, m1;
          k4_scale_min(2 * c, w + 4, &sc0, &m0);
          k4_scale_min(2 * c + 1, w + 4, &sc1, &m1);
          const uint8_t* qs = w + 16 + 32 * c;
          for (int i = 0; i < 32; ++i) {
            y[64 * c + i] = d * sc0 * (qs[i] & 0xF) - dmin * m0;
            y[64 * c + 32 + i] = d * sc1 * (qs[i] >> 4) - dmin * m1;
          }
        }
        w += 144, y += 256;
        break;
      }
      case kQ6_K: {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        const float d = fp16(w + 208);
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 32; ++c) {
            const uint8_t l0 = ql[64 * h + c], l1 = ql[64 * h + 32 + c], hb = qh[32 * h + c];
            const int u[4] = {(l0 & 0xF) | ((hb & 3) << 4), (l1 & 0xF) | (((hb >> 2) & 3) << 4),
                              (l0 >> 4) | (((hb >> 4) & 3) << 4),
                              (l1 >> 4) | (((hb >> 6) & 3) << 4)};
            for (int s = 0; s < 4; ++s) {
              const int e = 128 * h + 32 * s + c;
              y[e] = d * sc[e / 16] * (u[s] - 32);
            }
          }
        w += 210, y += 256;
        break;
      }
      default: TORCH_CHECK(false, "gguf_dequantize: unsupported ggml type ", type);
    }
  }
}

// ``rows`` consecutive weight rows . one activation row -> out[rows].
using RowsDot = void (*)(const uint8_t*, int64_t, int64_t, const Q8Row&, int64_t, float*);

template <float (*F)(const uint8_t*, const Q8Row&, int64_t)>
void each_row(const uint8_t* w, int64_t row_bytes, int64_t rows, const Q8Row& x, int64_t nb,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = F(w + r * row_bytes, x, nb);
}

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  RowsDot dot;
};

Format format_of(int64_t type) {
  switch (type) {
#if defined(__AVX2__)
    case kQ4_0: return {32, 18, dot32<BQ4_0>};
    case kQ4_1: return {32, 20, dot32<BQ4_1>};
    case kQ5_0: return {32, 22, dot32<BQ5_0>};
    case kQ8_0: return {32, 34, dot32<BQ8_0>};
#else
    case kQ4_0: return {32, 18, each_row<dot_q4_0>};
    case kQ4_1: return {32, 20, each_row<dot_q4_1>};
    case kQ5_0: return {32, 22, each_row<dot_q5_0>};
    case kQ8_0: return {32, 34, each_row<dot_q8_0>};
#endif
    case kQ4_K: return {256, 144, each_row<dot_q4_k>};
    case kQ6_K: return {256, 210, each_row<dot_q6_k>};
    default: TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", type);
  }
}

// Weight rows per tile: a tile stays in cache while every activation row passes over it,
// and each activation row is read once per tile (a batch of decode rows).
constexpr int64_t kRows = 16;

// x [M, K] (fp32 or bf16), w [N, row bytes] uint8 -> [M, N] in x's dtype; T: x's type.
template <typename T>
at::Tensor gguf_linear_t(const at::Tensor& x, const at::Tensor& w, const Format& f) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t nab = k / 32;
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * nab), sums(m * nab);
  std::vector<int32_t> isum(m * nab), bsum(m * 2 * nab);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * k, k, q.data() + r * k, d.data() + r * nab, sums.data() + r * nab,
                   isum.data() + r * nab, bsum.data() + r * 2 * nab);
  });
  at::Tensor out = at::empty({m, n}, x.options());
  T* op = out.data_ptr<T>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), nb = k / f.block;
  const int64_t tiles = (n + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j1 = std::min(n, (t + 1) * kRows);
      float tile[kRows];
      for (int64_t r = 0; r < m; ++r) {
        const Q8Row xr{q.data() + r * k, d.data() + r * nab, sums.data() + r * nab,
                       isum.data() + r * nab, bsum.data() + r * 2 * nab};
        f.dot(wp + t * kRows * row_bytes, row_bytes, j1 - t * kRows, xr, nb, tile);
        for (int64_t j = t * kRows; j < j1; ++j) op[r * n + j] = static_cast<T>(tile[j - t * kRows]);
      }
    }
  });
  return out;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gguf_linear: x [M, K] and w [N, bytes]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "gguf_linear: w uint8");
  const Format f = format_of(type);
  const int64_t k = x.size(1);
  TORCH_CHECK(k % f.block == 0 && w.size(1) == k / f.block * f.bytes,
              "gguf_linear: ", k, " columns do not match ", w.size(1), " bytes per row");
  if (x.scalar_type() == at::kBFloat16) return gguf_linear_t<at::BFloat16>(x.contiguous(), w, f);
  return gguf_linear_t<float>(x.to(at::kFloat).contiguous(), w, f).to(x.scalar_type());
}

// w [N, row bytes] uint8 -> fp32 [N, k], the weight as gguf-py's dequantize gives it.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_dequantize: w [N, bytes] uint8");
  const Format f = format_of(type);
  TORCH_CHECK(k % f.block == 0 && w.size(1) == k / f.block * f.bytes,
              "gguf_dequantize: ", k, " columns do not match ", w.size(1), " bytes per row");
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(type, wp + r * row_bytes, op + r * k, k / f.block);
  });
  return out;
}

// How many threads ``at::parallel_for`` ran ``n`` items on: more than one only where this
// file was compiled with OpenMP (a test checks the build flags through it).
int64_t threads_used(int64_t n) {
  std::vector<int> seen(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::accumulate(seen.begin(), seen.end(), int64_t{0});
}

}  // namespace

TORCH_LIBRARY(declattn_gguf, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int type, int k) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
  m.def("threads_used", &threads_used);
}

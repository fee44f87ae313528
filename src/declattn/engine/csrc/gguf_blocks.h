// The GGUF block formats this kernel reads: their ids, fp16 scales, the activations
// rounded to int8 per block of 32, and one weight row decoded to fp32 (the reference
// the kernels are tested against, and prefill's dequantised weight).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace gguf {

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
// The plain loop; ``quantize_row`` takes the vector one where the CPU has AVX2.
template <typename T>
void quantize_row_plain(const T* x, int64_t k, int8_t* q, float* d, float* sum, int32_t* isum,
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

#if defined(__AVX2__)
// Eight values of x from ``p`` as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return _mm_cvtsi128_si32(r);
}

// The same numbers as ``quantize_row_plain``, bit for bit (the same fp32 maximum,
// division, product and round-half-even; tests/engine/test_quant_kernel.py checks both
// against torch). Why a vector path: the plain loop's running maximum and per-value sums
// are chains of dependent instructions, ~20 us for a 4,864-wide row on the Xeon guest,
// paid once per matmul call on one thread (a decode step makes ~100 such calls).
template <typename T>
void quantize_row_avx2(const T* x, int64_t k, int8_t* q, float* d, float* sum, int32_t* isum,
                       int32_t* bsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / 32; ++b) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + 32 * b + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    const float db = _mm_cvtss_f32(r) / 127.0f;
    const __m256 id = _mm256_set1_ps(db > 0.0f ? 1.0f / db : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t s0 = hsum_i32(_mm256_add_epi32(c[0], c[1]));
    const int32_t s1 = hsum_i32(_mm256_add_epi32(c[2], c[3]));
    d[b] = db;
    isum[b] = s0 + s1;
    sum[b] = db * static_cast<float>(isum[b]);
    bsum[2 * b] = s0;
    bsum[2 * b + 1] = s1;
  }
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* sum, int32_t* isum,
                  int32_t* bsum) {
#if defined(__AVX2__)
  quantize_row_avx2(x, k, q, d, sum, isum, bsum);
#else
  quantize_row_plain(x, k, q, d, sum, isum, bsum);
#endif
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

}  // namespace gguf

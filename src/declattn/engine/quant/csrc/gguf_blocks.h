// The GGUF block formats this kernel reads: their ids, fp16 scales, the activations
// rounded to int8 per block of 32, and one weight row decoded to fp32 (the reference
// the kernels are tested against, and prefill's dequantised weight).

#pragma once

#include <c10/util/Exception.h>

#if defined(__F16C__)
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

// One weight row . one activation row in plain C++, for CPUs without AVX2.

#pragma once

#include "gguf_blocks.h"

namespace gguf {

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

}  // namespace gguf

// An experiment, measured and then deleted (git keeps it): Q5_0 regrouped by sixteen rows
// times eight activation rows by AMX int8 tiles (tdpbssd) against the VNNI kernel
// (gguf_rows16_vnni.h's batch_q5_0_r16), one thread, the matrix hot in L2.
//
// The AMX form: codes unpacked signed (minus 16) into B tiles of two blocks (16 rows of 64
// bytes), the activations laid out once per call as A tiles of two blocks (rows 0-7 the
// first block's 32 bytes then zeros, rows 8-15 zeros then the second's), one tdpbssd per
// two blocks, the 16 x 16 sums stored and scaled as the VNNI kernel scales them (the
// outputs equal the VNNI kernel's bit for bit: ``same=1``). "phased": 16 blocks unpacked,
// multiplied, then scaled; "unpack/tiles/finish only": one of the three alone;
// "pipeN": unpack N pairs ahead, multiply one ahead, scale the current pair; "+cfg": the
// tile configuration loaded and released per group call.
//
// Build from the repository root:
//   T=$(.venv/bin/python -c "import torch,os;print(os.path.dirname(torch.__file__))")
//   g++ -O3 -ffp-contract=fast -std=c++17 -march=x86-64-v4 -mavx512vnni -mavx512bf16 \
//     -mamx-tile -mamx-bf16 -mamx-int8 -Isrc/declattn/engine/csrc -I$T/include \
//     scripts/amx_int8_q5_0.cpp -L$T/lib -lc10 -Wl,-rpath,$T/lib -o /tmp/amx_int8_q5_0
//   /tmp/amx_int8_q5_0 64 896    # 64 groups of 16 rows (616 KB), K = 896 (gate/up)
//   /tmp/amx_int8_q5_0 64 4864
#include <sys/syscall.h>
#include <unistd.h>

#include "gguf_formats.h"
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
using namespace gguf;
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
bool amx_usable() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
inline void cfg16() { TileConfig c; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; } _tile_loadconfig(&c); }
void pair8(const int8_t* q, int64_t k, int8_t* out) {
  const int64_t np = (k / 32 + 1) / 2;
  std::memset(out, 0, np * 1024);
  for (int64_t p = 0; p < np; ++p)
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 1024 * p + 64 * r, q + r * k + 64 * p, 32);
      if (64 * p + 32 < k) std::memcpy(out + 1024 * p + 64 * (8 + r) + 32, q + r * k + 64 * p + 32, 32);
    }
}
template <int Mode, int Parts = 7>  // Mode 0: phased; Parts: 1 unpack, 2 tiles, 4 finish
struct Exp {
  static void rows8(const uint8_t* w, const Q8Row* x, const int8_t* ap, int64_t nb, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const uint8_t* hb = w + 32 * nb;
    constexpr int64_t kSpan = 16;
    alignas(64) uint8_t bt[kSpan][8][64];
    alignas(64) int32_t ct[kSpan / 2][16][16];
    __m512 acc[8];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    auto unpack = [&](int64_t b, uint8_t (*dst)[64]) {
      const uint8_t* h = hb + 320 * b;
      prefetch_block<320>(h);
      for (int c = 0; c < 4; ++c) {
        uint64_t bits[2];
        std::memcpy(bits, h + 16 * c, 16);
        const __m512i v = _mm512_loadu_si512(h + 64 + 64 * c);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        _mm512_store_si512(dst[2 * c], _mm512_mask_sub_epi8(lo, _cvtu64_mask64(~bits[0]), lo, m10));
        _mm512_store_si512(dst[2 * c + 1], _mm512_mask_sub_epi8(hi, _cvtu64_mask64(~bits[1]), hi, m10));
      }
    };
    auto finish = [&](int64_t b, const int32_t (*sums)[16]) {
      const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * b)));
      for (int r = 0; r < 8; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dd, _mm512_set1_ps(x[r].d[b])), _mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), acc[r]);
    };
    for (int64_t b0 = 0; b0 < nb; b0 += kSpan) {
      const int64_t n = std::min(kSpan, nb - b0), np = (n + 1) / 2;
      if (Parts & 1) for (int64_t i = 0; i < n; ++i) unpack(b0 + i, bt[i]);
      const int8_t* a = ap + 1024 * (b0 / 2);
      if (Mode == 0) {
        int64_t p = 0;
        if (Parts & 2) for (; p + 2 <= np; p += 2) {
          _tile_loadd(0, a + 1024 * p, 64); _tile_loadd(1, bt[2 * p], 64); _tile_zero(2); _tile_dpbssd(2, 0, 1);
          _tile_loadd(3, a + 1024 * (p + 1), 64); _tile_loadd(4, bt[2 * p + 2], 64); _tile_zero(5); _tile_dpbssd(5, 3, 4);
          _tile_stored(2, ct[p], 64); _tile_stored(5, ct[p + 1], 64);
        }
        if (p < np) { _tile_loadd(0, a + 1024 * p, 64); _tile_loadd(1, bt[2 * p], 64); _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, ct[p], 64); }
        if (Parts & 4) for (int64_t i = 0; i < n; ++i) finish(b0 + i, reinterpret_cast<const int32_t(*)[16]>(ct[i / 2][8 * (i % 2)]));
      } else {
        for (int64_t p = 0; p < np; ++p) {
          if (p % 2 == 0) { _tile_loadd(0, a + 1024 * p, 64); _tile_loadd(1, bt[2 * p], 64); _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, ct[p], 64); }
          else { _tile_loadd(3, a + 1024 * p, 64); _tile_loadd(4, bt[2 * p], 64); _tile_zero(5); _tile_dpbssd(5, 3, 4); _tile_stored(5, ct[p], 64); }
          if (p > 0) { finish(b0 + 2 * p - 2, reinterpret_cast<const int32_t(*)[16]>(ct[p - 1][0])); finish(b0 + 2 * p - 1, reinterpret_cast<const int32_t(*)[16]>(ct[p - 1][8])); }
        }
        const int64_t p = np - 1;
        finish(b0 + 2 * p, reinterpret_cast<const int32_t(*)[16]>(ct[p][0]));
        if (2 * p + 1 < n) finish(b0 + 2 * p + 1, reinterpret_cast<const int32_t(*)[16]>(ct[p][8]));
      }
    }
    for (int r = 0; r < 8; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  }
};
template <int Set>
inline void tile_pair(const int8_t* a, const void* b, void* c) {
  if constexpr (Set == 0) { _tile_loadd(0, a, 64); _tile_loadd(1, b, 64); _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, c, 64); }
  else { _tile_loadd(3, a, 64); _tile_loadd(4, b, 64); _tile_zero(5); _tile_dpbssd(5, 3, 4); _tile_stored(5, c, 64); }
}
template <int Dist>
struct Pipe {
  static void rows8(const uint8_t* w, const Q8Row* x, const int8_t* ap, int64_t nb, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const uint8_t* hb = w + 32 * nb;
    constexpr int R = 8;  // ring
    alignas(64) uint8_t bt[R][16][64];
    alignas(64) int32_t ct[R][16][16];
    __m512 acc[8];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    const int64_t np = (nb + 1) / 2;
    auto unpack_pair = [&](int64_t p) {
      for (int64_t b = 2 * p; b < std::min(nb, 2 * p + 2); ++b) {
        const uint8_t* h = hb + 320 * b;
        prefetch_block<320>(h);
        uint8_t (*dst)[64] = bt[p % R] + 8 * (b % 2);
        for (int c = 0; c < 4; ++c) {
          uint64_t bits[2];
          std::memcpy(bits, h + 16 * c, 16);
          const __m512i v = _mm512_loadu_si512(h + 64 + 64 * c);
          __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          _mm512_store_si512(dst[2 * c], _mm512_mask_sub_epi8(lo, _cvtu64_mask64(~bits[0]), lo, m10));
          _mm512_store_si512(dst[2 * c + 1], _mm512_mask_sub_epi8(hi, _cvtu64_mask64(~bits[1]), hi, m10));
        }
      }
    };
    auto tiles = [&](int64_t p) {
      if (p % 2 == 0) tile_pair<0>(ap + 1024 * p, bt[p % R], ct[p % R]);
      else tile_pair<1>(ap + 1024 * p, bt[p % R], ct[p % R]);
    };
    auto finish_pair = [&](int64_t p) {
      for (int64_t b = 2 * p; b < std::min(nb, 2 * p + 2); ++b) {
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * b)));
        const int32_t (*s)[16] = ct[p % R] + 8 * (b % 2);
        for (int r = 0; r < 8; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dd, _mm512_set1_ps(x[r].d[b])), _mm512_cvtepi32_ps(_mm512_load_si512(s[r])), acc[r]);
      }
    };
    for (int64_t p = 0; p < std::min(np, int64_t(2 * Dist)); ++p) unpack_pair(p);
    for (int64_t p = 0; p < std::min(np, int64_t(Dist)); ++p) tiles(p);
    for (int64_t p = 0; p < np; ++p) {
      if (p + 2 * Dist < np) unpack_pair(p + 2 * Dist);
      if (p + Dist < np) tiles(p + Dist);
      finish_pair(p);
    }
    for (int r = 0; r < 8; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
  }
};
int main(int argc, char** argv) {
  amx_usable();
  const int64_t K = argc > 2 ? atoi(argv[2]) : 896, nb = K / 32, groups = argc > 1 ? atoi(argv[1]) : 64, M = 8;
  const int64_t gbytes = 16 * 22 * nb;
  std::vector<uint8_t> w(groups * gbytes);
  std::mt19937 rng(1);
  for (auto& b : w) b = rng();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < 16 * nb; ++i) { w[g * gbytes + 2 * i] = rng() & 0xff; w[g * gbytes + 2 * i + 1] = 0x20; }
  std::vector<int8_t> q(M * K); std::vector<float> d(M * nb), sums(M * nb);
  for (auto& v : d) v = 0.001f * (rng() % 100 + 1);
  std::vector<int32_t> isum(M * nb), bsum(M * 2 * nb);
  for (auto& v : q) v = (int8_t)(rng() % 255 - 127);
  for (int r = 0; r < M; ++r) for (int b = 0; b < nb; ++b) { int s = 0; for (int i = 0; i < 32; ++i) s += q[r*K+32*b+i]; isum[r*nb+b] = s; }
  std::vector<Q8Row> xs(M);
  for (int r = 0; r < M; ++r) xs[r] = {q.data() + r * K, d.data() + r * nb, sums.data() + r * nb, isum.data() + r * nb, bsum.data() + r * 2 * nb};
  std::vector<int8_t> ap(((nb + 1) / 2) * 1024); pair8(q.data(), K, ap.data());
  std::vector<float> o0(groups * 128), o(groups * 128);
  auto run = [&](const char* name, auto f, std::vector<float>& out) {
    double best = 1e9;
    for (int it = 0; it < 50; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t g = 0; g < groups; ++g) f(w.data() + g * gbytes, out.data() + g * 128);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("%-22s %6.0f ns/group %5.1f GB/s same=%d\n", name, best / groups * 1e9, gbytes / (best / groups) / 1e9, out == o0);
  };
  run("vnni", [&](const uint8_t* w, float* o) { batch_q5_0_r16(w, xs.data(), M, nb, o); }, o0);
  run("pipe1 +cfg", [&](const uint8_t* w, float* o) { cfg16(); Pipe<1>::rows8(w, xs.data(), ap.data(), nb, o); _tile_release(); }, o);
  cfg16();
  run("phased", [&](const uint8_t* w, float* o) { Exp<0>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run(" unpack only", [&](const uint8_t* w, float* o) { Exp<0, 1>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run(" tiles only", [&](const uint8_t* w, float* o) { Exp<0, 2>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run(" finish only", [&](const uint8_t* w, float* o) { Exp<0, 4>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run("pipe1", [&](const uint8_t* w, float* o) { Pipe<1>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run("pipe2", [&](const uint8_t* w, float* o) { Pipe<2>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run("pipe3", [&](const uint8_t* w, float* o) { Pipe<3>::rows8(w, xs.data(), ap.data(), nb, o); }, o);
  run("vnni", [&](const uint8_t* w, float* o) { batch_q5_0_r16(w, xs.data(), M, nb, o); }, o0);
}

// How many of each vector instruction the decode kernels lean on one core issues a
// second, when nothing waits on memory or on a result: twelve independent chains each.
// A CPU's peak is what a kernel's time per kept row or per weight is held against
// (docs/benchmarks.md, "Throughput"); guests of one family differ in FMA units.
//
//   cc -O2 -march=native scripts/issue_rate.c -o /tmp/issue_rate && /tmp/issue_rate
//
// Needs AVX-512 with BF16 and VNNI (Zen 4 and 5, Intel since Cooper Lake).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define KEEP(a) __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), \
    "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]), "+v"(a[8]), "+v"(a[9]), "+v"(a[10]), \
    "+v"(a[11]))
#define CHAINS 12
#define ROUNDS 100000000L

// One line: instructions a second, and the products (multiply-adds) they carry.
#define RATE(name, T, init, step, per)                                                  \
  static void name(void) {                                                              \
    T a[CHAINS];                                                                        \
    for (int i = 0; i < CHAINS; ++i) a[i] = init;                                       \
    const double t = now();                                                             \
    for (long n = 0; n < ROUNDS; ++n) {                                                 \
      _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; ++i) a[i] = step;            \
      KEEP(a);                                                                          \
    }                                                                                   \
    const double g = ROUNDS * CHAINS / (now() - t) / 1e9;                               \
    printf("%-14s %5.2f G a second  %6.1f G products a second\n", #name, g, g * (per)); \
  }

RATE(fma_zmm, __m512, _mm512_set1_ps(0.001f),
     _mm512_fmadd_ps(a[i], _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-4f)), 16)
RATE(fma_ymm, __m256, _mm256_set1_ps(0.001f),
     _mm256_fmadd_ps(a[i], _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-4f)), 8)
RATE(dpbf16_zmm, __m512, _mm512_set1_ps(0.001f),
     _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(0x3f803f80),
                      (__m512bh)_mm512_set1_epi32(0x3f803f80)), 32)
RATE(vpdpbusd_zmm, __m512i, _mm512_set1_epi32(1),
     _mm512_dpbusd_epi32(a[i], _mm512_set1_epi8(3), _mm512_set1_epi8(-2)), 64)
RATE(vpdpbusd_ymm, __m256i, _mm256_set1_epi32(1),
     _mm256_dpbusd_epi32(a[i], _mm256_set1_epi8(3), _mm256_set1_epi8(-2)), 32)

int main(void) {
  fma_zmm();
  fma_ymm();
  dpbf16_zmm();
  vpdpbusd_zmm();
  vpdpbusd_ymm();
  return 0;
}

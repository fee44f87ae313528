// How fast this core issues the 512-bit instructions decode attention's BF16 path chooses
// between: fp32 FMA against vdpbf16ps (throughput over 8 independent chains, latency over
// one chain), and a 32-bit shuffle. csrc/decode_attn_avx512.h scores keys by two FMAs per
// pair of dims on Intel because a vdpbf16ps issued only once in the time of ~3.6 FMAs on
// a Sapphire Rapids-class Xeon (docs/benchmarks.md). Build and run on a CPU with AVX-512
// BF16, nothing else busy:
//   g++ -O2 -march=native scripts/avx512_issue_rates.cpp -o /tmp/rates && /tmp/rates
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Keeps the chains in registers and every update done (written out: an array of
// accumulators measured 3x slower, spilled).
#define KEEP(...) asm volatile("" : __VA_ARGS__)
#define EIGHT(OP) \
  a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5); a6 = OP(a6); a7 = OP(a7); \
  KEEP("+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7))

const __m512 kX = _mm512_set1_ps(1.0f), kY = _mm512_set1_ps(1e-9f);
const __m512i kP = _mm512_set1_epi32(0x3f803f80), kQ = _mm512_set1_epi32(0x30003000);
inline __m512 fma(__m512 a) { return _mm512_fmadd_ps(kX, kY, a); }
inline __m512 dot(__m512 a) { return _mm512_dpbf16_ps(a, (__m512bh)kP, (__m512bh)kQ); }
inline __m512i shuffle(__m512i a) { return _mm512_unpacklo_epi32(a, kP); }

// ns per instruction over 8 chains of ``OP`` (throughput), or over one (latency).
#define RATE(NAME, T, INIT, OP)                                            \
  __attribute__((noinline)) double NAME##_rate(long n) {                   \
    T a0 = INIT, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
    const double t0 = now();                                               \
    for (long i = 0; i < n; ++i) { EIGHT(OP); }                            \
    const double t = now() - t0;                                           \
    volatile T sink = a0; sink = a7; (void)sink;                           \
    return t / n / 8 * 1e9;                                                \
  }                                                                        \
  __attribute__((noinline)) double NAME##_latency(long n) {                \
    T a0 = INIT;                                                           \
    const double t0 = now();                                               \
    for (long i = 0; i < n; ++i) { a0 = OP(a0); KEEP("+v"(a0)); }          \
    const double t = now() - t0;                                           \
    volatile T sink = a0; (void)sink;                                      \
    return t / n * 1e9;                                                    \
  }

RATE(fma, __m512, kX, fma)
RATE(dot, __m512, kX, dot)
RATE(shuffle, __m512i, kP, shuffle)

}  // namespace

int main() {
  const long n = 100'000'000;
  for (int round = 0; round < 2; ++round) {
    const double f = fma_rate(n), d = dot_rate(n);
    std::printf(
        "ns per 512-bit instruction: fma %.3f (latency %.3f), vdpbf16ps %.3f (latency %.3f), "
        "unpacklo_epi32 %.3f; one vdpbf16ps issues in the time of %.1f FMAs\n",
        f, fma_latency(n), d, dot_latency(n), shuffle_rate(n), d / f);
  }
}

// Decode attention for bf16 queries over a bf16 pool on a CPU with AVX-512 BF16 (Zen 4
// and 5, Intel since Cooper Lake): included by decode_attn.cpp, inside its namespace,
// after the helpers it uses (kTile, Int, head_blocks).
//
// Why its own path: the portable path scores with fp32 FMAs over rows in lanes' order
// (dims across lanes), so every score ends in a sum across lanes, and a bf16 key is
// widened per use. Here a tile's keys are transposed once, so that a vector's 16 lanes
// are 16 rows and each 32-bit lane holds a pair of dims, shared by every query head of
// its KV head; then no score needs a sum across lanes. Two ways to score them (``Dot``):
// - ``vdpbf16ps``: one instruction per pair of dims and head against the query's pair,
//   half the multiplies of fp32 FMAs. The fast way on Zen 5 (measured; Zen 4 not).
// - fp32 FMAs: each pair split into its two dims as fp32 by a shift and a mask (exact),
//   then two FMAs. On Sapphire Rapids-class Xeons a 512-bit ``vdpbf16ps`` issues once
//   in the time of ~4 FMAs, so two FMAs are the cheaper way there.
// ``dot_scores()`` picks by vendor. The values are fp32 FMAs either way (the softmax
// weights are not rounded to bf16), straight from the bf16 rows split the same way.
//
// Exactness: bf16 x bf16 products are exact in fp32; the sums are fp32, in another
// order than the portable path's, and ``vdpbf16ps`` treats denormal inputs as zero.
// So the output is the fp32 softmax of the same scores up to fp32 rounding, as on the
// portable path.

#include <immintrin.h>

constexpr int kLanes = 16;

// exp for x <= 0, the polynomial of exp8 on 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic),
                           magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The two bf16 of each 32-bit lane as fp32: the even dims (low halves), the odd dims.
inline __m512 even_dims(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_dims(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The keys of R = 16 / C rows, C = dim / 32 vectors of 32 dims each, read in memory order
// (vector i * C + c is row i's dims [32 c, 32 c + 32)) and transposed as 32-bit pairs of
// dims: lane i * C + c of kt[j] holds pair 16 c + j of row i. Reading whole rows in order
// keeps the hardware prefetcher on one stream (reading every row's first half, then
// every row's second half, splits it into two streams and reads slower from memory).
template <int C>
inline void transpose_rows(const at::BFloat16* const* rows, __m512i* kt) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16 / C; ++i)
    for (int c = 0; c < C; ++c) r[i * C + c] = _mm512_loadu_si512(rows[i] + 32 * c);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int a = 0; a < 16; a += 4) {  // r[a + j]: column j of vectors a..a+3, per lane
    r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // lane L of r[4a + j] is column 4L + j of vectors 4a..4a+3
    const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    kt[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    kt[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    kt[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    kt[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// The queries in the transposed keys' lane order: qv[g * 16 + j] lane i * C + c holds
// pair 16 c + j of head g (``qb``: ``dim / 2`` bf16 pairs per head).
template <int C>
inline void lay_queries(const uint32_t* qb, int group, __m512i* qv) {
  alignas(64) uint32_t lanes[16];
  for (int g = 0; g < group; ++g)
    for (int j = 0; j < 16; ++j) {
      for (int v = 0; v < 16; ++v) lanes[v] = qb[g * 16 * C + 16 * (v % C) + j];
      qv[g * 16 + j] = _mm512_load_si512(lanes);
    }
}

// The queries for fp32 scoring: qs[((g * 16 + j) * 2 + h) * C + c] is the even (h = 0)
// or odd (h = 1) dim of pair 16 c + j of head g, exact in fp32.
template <int C>
inline void lay_queries_f32(const uint32_t* qb, int group, float* qs) {
  for (int g = 0; g < group; ++g)
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < C; ++c) {
        const uint32_t pair = qb[g * 16 * C + 16 * c + j];
        const uint32_t dims[2] = {pair << 16, pair & 0xFFFF0000u};
        for (int h = 0; h < 2; ++h) std::memcpy(qs + ((g * 16 + j) * 2 + h) * C + c, dims + h, 4);
      }
}

// C floats repeated across the 16 lanes (lane i * C + c gets p[c]): one broadcast load.
template <int C>
inline __m512 repeat(const float* p) {
  if constexpr (C == 1) return _mm512_set1_ps(*p);
  if constexpr (C == 2) {
    double d;
    std::memcpy(&d, p, sizeof d);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
  }
  if constexpr (C == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
  if constexpr (C == 8) return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
}

// The R scores of one head from its 16 lanes of partial sums: the C lanes of each row
// summed, packed to the front, scaled, stored at s.
template <int C>
inline void store_scores(__m512 acc, float scale, float* s) {
  constexpr int R = 16 / C;
  alignas(64) static constexpr int kPack[16] = {0 * C % 16, 1 * C % 16, 2 * C % 16,
      3 * C % 16, 4 * C % 16, 5 * C % 16, 6 * C % 16, 7 * C % 16, 8 * C % 16, 9 * C % 16,
      10 * C % 16, 11 * C % 16, 12 * C % 16, 13 * C % 16, 14 * C % 16, 15 * C % 16};
  if constexpr (C >= 2) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
  if constexpr (C >= 4) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));
  if constexpr (C >= 8) acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1));
  if constexpr (C >= 2) acc = _mm512_permutexvar_ps(_mm512_load_si512(kPack), acc);
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << R) - 1),
                        _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
}

// s[g * kTile + i] = scale * q[g] . k[i] for the R rows of ``kt`` and GB heads, by 16
// ``vdpbf16ps`` per head against the query pairs ``qv``.
template <int C, int GB>
inline void score_rows_dot(const __m512i* kt, const __m512i* qv, float scale, float* s) {
  for (int g = 0; g < GB; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) acc = _mm512_dpbf16_ps(acc, (__m512bh)kt[j], (__m512bh)qv[g * 16 + j]);
    store_scores<C>(acc, scale, s + g * kTile);
  }
}

// The same scores by fp32 FMAs against the query dims ``qs``: each pair split once for
// every head, half of them at a time (16 vectors), two chains per head (the even dims'
// and the odd dims': one chain of 32 dependent FMAs waits on each FMA's latency).
template <int C, int GB>
inline void score_rows_fma(const __m512i* kt, const float* qs, float scale, float* s) {
  __m512 even[GB], odd[GB];
  for (int g = 0; g < GB; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int half = 0; half < 16; half += 8) {
    __m512 ke[8], ko[8];
    for (int j = 0; j < 8; ++j) {
      ke[j] = even_dims(kt[half + j]);
      ko[j] = odd_dims(kt[half + j]);
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 8; ++j) {
        const float* q = qs + (g * 16 + half + j) * 2 * C;
        even[g] = _mm512_fmadd_ps(ke[j], repeat<C>(q), even[g]);
        odd[g] = _mm512_fmadd_ps(ko[j], repeat<C>(q + C), odd[g]);
      }
  }
  for (int g = 0; g < GB; ++g) store_scores<C>(_mm512_add_ps(even[g], odd[g]), scale, s + g * kTile);
}

// The C cache lines of one bf16 row of dim 32 C (pool rows start on a line).
template <int C>
inline void prefetch_lines(const at::BFloat16* row) {
  for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(row + 32 * c), _MM_HINT_T0);
}

// acc[g][d0 : d0 + 32] += sum_t p[g][t] v[t][d0 : d0 + 32] for GB heads over n bf16 rows,
// each 32-bit pair split into its dims (a shift and a mask, no shuffle): acc's 32 floats
// at d0 hold the 16 even dims, then the 16 odd ones (``interleave`` puts them in order).
// Row t also prefetches the ``C`` lines of row t of ``next`` (the next tile's V rows, the
// first ``n_next`` of them; none when null).
template <int GB, int C>
inline void values_rows(const float* s, int n, const at::BFloat16* const* vrows, int d0,
                        int dim, float* acc, const at::BFloat16* const* next, int n_next) {
  __m512 a[GB][2];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 2; ++j) a[g][j] = _mm512_loadu_ps(acc + g * dim + d0 + 16 * j);
  for (int t = 0; t < n; ++t) {
    if (next != nullptr && t < n_next) prefetch_lines<C>(next[t]);
    const __m512i pairs = _mm512_loadu_si512(vrows[t] + d0);
    const __m512 ve = even_dims(pairs), vo = odd_dims(pairs);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * kTile + t]);
      a[g][0] = _mm512_fmadd_ps(w, ve, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(w, vo, a[g][1]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc + g * dim + d0 + 16 * j, a[g][j]);
}

// Every 32 floats of ``acc`` (n of them) from even dims then odd dims back to dim order.
inline void interleave(float* acc, int n) {
  alignas(64) static constexpr int kLo[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static constexpr int kHi[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int i = 0; i < n; i += 32) {
    const __m512 e = _mm512_loadu_ps(acc + i), o = _mm512_loadu_ps(acc + i + 16);
    _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(e, lo, o));
    _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(e, hi, o));
  }
}

// The online softmax of one tile's scores for every head (n of kTile rows kept; the
// rest are padding): updates m, l, rescales acc, leaves exp(s - m) in s (0 past n).
inline void softmax16(float* s, int group, int n, int dim, float* acc, float* m, float* l) {
  const __mmask16 k0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 k1 = n <= 16 ? 0 : n >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16)) - 1);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < group; ++g) {
    float* sg = s + g * kTile;
    const __m512 x0 = _mm512_mask_loadu_ps(ninf, k0, sg);
    const __m512 x1 = _mm512_mask_loadu_ps(ninf, k1, sg + 16);
    const float mx = std::max(m[g], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
    if (mx > m[g]) {
      const float c = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first tile
      l[g] *= c;
      float* ag = acc + g * dim;
      const __m512 cv = _mm512_set1_ps(c);
      for (int d = 0; d < dim; d += 16) _mm512_storeu_ps(ag + d, _mm512_mul_ps(_mm512_loadu_ps(ag + d), cv));
      m[g] = mx;
    }
    const __m512 mv = _mm512_set1_ps(mx);
    const __m512 e0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(x0, mv)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(x1, mv)));
    _mm512_storeu_ps(sg, e0);
    _mm512_storeu_ps(sg + 16, e1);
    l[g] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
  }
}

// attend_rows for bf16 q (``qb``, unscaled, as bf16 pairs) over bf16 pools, dim 32 C,
// scored by ``vdpbf16ps`` (Dot) or fp32 FMAs: the same work item, the same outputs
// (acc, m, l).
template <int C, bool Dot>
void attend_rows_bf16(const uint32_t* qb, float scale, int group, const at::BFloat16* kbase,
                      const at::BFloat16* vbase, const int64_t* runs, const int64_t* ends,
                      int64_t n_runs, int64_t lo, int64_t hi, float* acc, float* m, float* l) {
  static_assert(kTile == 2 * kLanes, "a tile is two vectors of rows");
  constexpr int dim = 32 * C, R = 16 / C;
  std::fill(acc, acc + group * dim, 0.0f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);
  alignas(64) float s[16 * kTile];
  alignas(64) __m512i kt[16];
  std::vector<__m512i> qv(Dot ? static_cast<size_t>(group) * 16 : 0);
  std::vector<float> qs(Dot ? 0 : static_cast<size_t>(group) * 32 * C);
  if constexpr (Dot) lay_queries<C>(qb, group, qv.data());
  else lay_queries_f32<C>(qb, group, qs.data());
  // Two tiles of row pointers: the one being walked and the next, whose rows are
  // prefetched while this one is worked, a few lines at a time (its keys with each block of
  // R rows scored, its values with each row weighed). Once scoring is this cheap the rows
  // stall on memory unless read ahead; spread so, the prefetches keep memory busy through
  // the tile's arithmetic, where the same prefetches issued in one burst at each tile's
  // start (half a tile ahead) made a batched decode step slower on an Intel Xeon.
  const at::BFloat16* krows[2][kTile];
  const at::BFloat16* vrows[2][kTile];
  RowWalk<at::BFloat16> walk(runs, ends, n_runs, lo);
  int n = static_cast<int>(std::min<int64_t>(kTile, hi - lo)), cur = 0;
  walk.tile(n, dim, kbase, vbase, krows[0], vrows[0]);
  for (int64_t at = lo + n;; cur = 1 - cur) {
    const int n_next = static_cast<int>(std::min<int64_t>(kTile, hi - at));
    if (n_next > 0) walk.tile(n_next, dim, kbase, vbase, krows[1 - cur], vrows[1 - cur]);
    for (int t0 = 0; t0 < n; t0 += R) {
      for (int t = t0; t < std::min(t0 + R, n_next); ++t) prefetch_lines<C>(krows[1 - cur][t]);
      transpose_rows<C>(krows[cur] + t0, kt);
      head_blocks(group, [&](auto gb, int g0) {
        constexpr int GB = decltype(gb)::value;
        if constexpr (Dot) score_rows_dot<C, GB>(kt, qv.data() + g0 * 16, scale, s + g0 * kTile + t0);
        else score_rows_fma<C, GB>(kt, qs.data() + g0 * 32 * C, scale, s + g0 * kTile + t0);
      });
    }
    softmax16(s, group, n, dim, acc, m, l);
    head_blocks(group, [&](auto gb, int g0) {
      constexpr int GB = decltype(gb)::value;
      for (int d0 = 0; d0 < dim; d0 += 32)
        values_rows<GB, C>(s + g0 * kTile, n, vrows[cur], d0, dim, acc + g0 * dim,
                           g0 == 0 && d0 == 0 ? vrows[1 - cur] : nullptr, n_next);
    });
    if (n_next <= 0) break;
    at += n_next;
    n = n_next;
  }
  interleave(acc, group * dim);
}

// Whether this CPU scores by ``vdpbf16ps`` rather than by fp32 FMAs: on AMD, where the
// dot path is the measured fast one (Zen 5); not on Intel, where a 512-bit
// ``vdpbf16ps`` issues once in the time of ~4 FMAs (Sapphire Rapids-class Xeons).
inline bool dot_scores() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

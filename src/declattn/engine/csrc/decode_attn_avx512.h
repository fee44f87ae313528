// Decode attention for bf16 queries over a bf16 pool on a CPU with AVX-512 BF16 (Zen 4
// and 5, Intel since Cooper Lake): included by decode_attn.cpp, inside its namespace,
// after the helpers it uses (kTile, Int, head_blocks).
//
// Why its own path: the portable path scores with fp32 FMAs over rows in lanes' order
// (dims across lanes), so every score ends in a sum across lanes, and a bf16 key is
// widened per use. Here a tile's keys are transposed once, so that a vector's 16 lanes
// are 16 rows and each 32-bit lane holds a pair of dims; then ``vdpbf16ps`` scores 16
// rows for one head and one pair of dims per instruction against the query's pair
// broadcast: no sums across lanes, half the multiply instructions of fp32 FMAs, and the
// tile's transpose is shared by every query head of its KV head. The values stay fp32
// FMAs (the softmax weights are not rounded to bf16), 16 dims a vector.
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

// Sixteen bf16 -> fp32.
inline __m512 widen16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The keys of R = 16 / C rows, C = dim / 32 vectors of 32 dims each, read in memory order
// (vector i * C + c is row i's dims [32 c, 32 c + 32)) and transposed as 32-bit pairs of
// dims: lane i * C + c of kt[j] holds pair 16 c + j of row i. Reading whole rows in order
// keeps the hardware prefetcher on one stream (reading every row's first half, then
// every row's second half, measured 2x slower from memory).
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

// s[g * kTile + i] = scale * q[g] . k[i] for the R rows of ``kt`` and GB heads: 16
// ``vdpbf16ps`` per head, then the C lanes of each row summed and packed to the front.
template <int C, int GB>
inline void score_rows(const __m512i* kt, const __m512i* qv, float scale, float* s) {
  constexpr int R = 16 / C;
  alignas(64) static constexpr int kPack[16] = {0 * C % 16, 1 * C % 16, 2 * C % 16,
      3 * C % 16, 4 * C % 16, 5 * C % 16, 6 * C % 16, 7 * C % 16, 8 * C % 16, 9 * C % 16,
      10 * C % 16, 11 * C % 16, 12 * C % 16, 13 * C % 16, 14 * C % 16, 15 * C % 16};
  const __m512i pack = _mm512_load_si512(kPack);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < GB; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) acc = _mm512_dpbf16_ps(acc, (__m512bh)kt[j], (__m512bh)qv[g * 16 + j]);
    if constexpr (C >= 2) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
    if constexpr (C >= 4) acc = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));
    if constexpr (C >= 8) acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1));
    if constexpr (C >= 2) acc = _mm512_permutexvar_ps(pack, acc);
    _mm512_mask_storeu_ps(s + g * kTile, static_cast<__mmask16>((1u << R) - 1),
                          _mm512_mul_ps(acc, sc));
  }
}

// acc[g][d0 : d0 + 32] += sum_t p[g][t] v[t][d0 : d0 + 32] for GB heads over n rows of
// fp32 values ``vt`` (``dim`` apart).
template <int GB>
inline void values16(const float* s, int n, const float* vt, int d0, int dim, float* acc) {
  __m512 a[GB][2];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 2; ++j) a[g][j] = _mm512_loadu_ps(acc + g * dim + d0 + 16 * j);
  for (int t = 0; t < n; ++t) {
    const __m512 v0 = _mm512_loadu_ps(vt + t * dim + d0);
    const __m512 v1 = _mm512_loadu_ps(vt + t * dim + d0 + 16);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * kTile + t]);
      a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc + g * dim + d0 + 16 * j, a[g][j]);
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

// Rows read ahead of the one being walked, within its run. Once scoring is this cheap a
// tile's keys and values stall on memory: software prefetch of the rows half a tile
// ahead took a 16K-row layer from 940 to 545 us (8 to 32 rows ahead measured alike; on
// the portable path, bound by its arithmetic, it changed nothing).
constexpr int kAhead = 16;

// attend_rows for bf16 q (``qb``, unscaled, as bf16 pairs) over bf16 pools, dim 32 C:
// the same work item, the same outputs (acc, m, l).
template <int C>
void attend_rows_bf16(const uint32_t* qb, float scale, int group, const at::BFloat16* kbase,
                      const at::BFloat16* vbase, const int64_t* runs, const int64_t* ends,
                      int64_t n_runs, int64_t lo, int64_t hi, float* acc, float* m, float* l) {
  static_assert(kTile == 2 * kLanes, "a tile is two vectors of rows");
  constexpr int dim = 32 * C, R = 16 / C;
  std::fill(acc, acc + group * dim, 0.0f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);
  alignas(64) float s[16 * kTile];
  alignas(64) float vt[kTile * dim];
  alignas(64) __m512i kt[16];
  std::vector<__m512i> qv(static_cast<size_t>(group) * 16);
  lay_queries<C>(qb, group, qv.data());
  const at::BFloat16* krows[kTile];
  const at::BFloat16* vrows[kTile];
  RowWalk<at::BFloat16> walk(runs, ends, n_runs, lo);
  for (int64_t at = lo; at < hi;) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, hi - at));
    walk.tile(n, dim, kbase, vbase, krows, vrows, kAhead);
    at += n;
    for (int t0 = 0; t0 < n; t0 += R) {
      transpose_rows<C>(krows + t0, kt);
      head_blocks(group, [&](auto gb, int g0) {
        constexpr int GB = decltype(gb)::value;
        score_rows<C, GB>(kt, qv.data() + g0 * 16, scale, s + g0 * kTile + t0);
      });
    }
    softmax16(s, group, n, dim, acc, m, l);
    // The tile's values, widened to fp32 once, in row order: every head reads them from L1.
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < dim; d += 16) _mm512_store_ps(vt + t * dim + d, widen16(vrows[t] + d));
    head_blocks(group, [&](auto gb, int g0) {
      constexpr int GB = decltype(gb)::value;
      for (int d0 = 0; d0 < dim; d0 += 32) values16<GB>(s + g0 * kTile, n, vt, d0, dim, acc + g0 * dim);
    });
  }
}

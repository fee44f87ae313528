// The portable decode-attention path: GCC/Clang vector extensions of 8 x fp32, so the
// same source becomes AVX2+FMA, AVX-512 or NEON code. Included by decode_attn.cpp, inside
// its namespace, after kTile, Int and head_blocks.
//
// Scores are fp32 FMAs of the scaled fp32 query against keys widened in registers, dims
// across lanes (a sum across lanes per score); the values are fp32 FMAs over a tile
// widened to fp32 once. Any head_dim that is a multiple of 8, any pool dtype.

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// Eight bf16 values -> fp32: bf16 is the top half of an fp32.
inline v8f load8(const at::BFloat16* p) {
#if defined(__AVX2__)
  // One widening load and a shift (the generic form below compiles to two halves).
  __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(u));
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

inline v8f load8(const at::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<v8f>(
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(p[i]);
  return load8(tmp);
#endif
}

// Sums of eight vectors, as one vector: out[i] = sum(a[i]).
inline v8f reduce8(const v8f* a) {
  v8f x = __builtin_shufflevector(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) +
          __builtin_shufflevector(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f y = __builtin_shufflevector(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) +
          __builtin_shufflevector(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f z = __builtin_shufflevector(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14) +
          __builtin_shufflevector(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f w = __builtin_shufflevector(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14) +
          __builtin_shufflevector(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f u = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  v8f t = __builtin_shufflevector(z, w, 0, 1, 8, 9, 4, 5, 12, 13) +
          __builtin_shufflevector(z, w, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u, t, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u, t, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp for x <= 0 (softmax arguments), Cephes' expf polynomial: ~1 ulp; below -87 it
// returns ~1e-38 rather than 0, which no softmax over a row holding exp(0) can see.
inline v8f exp8(v8f x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8f n = (x * splat(1.44269504088896341f) + magic) - magic;
  v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// Rows per score block for GB query heads: GB * rows accumulators, at most 16 with the
// key vectors in registers (2 rows for 5-7 heads: each key load then serves two rows).
template <int GB>
constexpr int rows_per_block() { return GB <= 4 ? 8 / GB : GB < 8 ? 2 : 1; }

// s[g * kTile + t] = q[g] . k[t] for GB query heads and rows_per_block rows at a time.
// Each key vector is converted once and used by every head of the block.
template <int GB, typename T>
inline void score_block(const float* q, int dim, const T* const* rows, float* s) {
  constexpr int TB = rows_per_block<GB>();
  constexpr int NA = (GB * TB + 7) / 8 * 8;  // accumulators, reduced eight at a time
  v8f acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = splat(0.0f);
  for (int d = 0; d < dim; d += 8) {
    v8f k[TB];
    for (int t = 0; t < TB; ++t) k[t] = load8(rows[t] + d);
    for (int g = 0; g < GB; ++g) {
      const v8f qv = load8(q + g * dim + d);
      for (int t = 0; t < TB; ++t) acc[g * TB + t] += qv * k[t];
    }
  }
  float out[NA];
  for (int i = 0; i < NA; i += 8) store8(out + i, reduce8(acc + i));
  for (int g = 0; g < GB; ++g)
    for (int t = 0; t < TB; ++t) s[g * kTile + t] = out[g * TB + t];
}

// acc[0 : 8 * DB] += sum_t p[t] * v[t][0 : 8 * DB] for one query head: DB accumulators
// over fp32 rows (``v`` points at column d0 of row 0, ``stride`` floats apart), one
// broadcast per row.
template <int DB>
inline void value_block(const float* p, int n, const float* v, int stride, float* acc) {
  v8f a[DB];
  for (int j = 0; j < DB; ++j) a[j] = load8(acc + 8 * j);
  for (int t = 0; t < n; ++t) {
    const v8f w = splat(p[t]);
    for (int j = 0; j < DB; ++j) a[j] += w * load8(v + t * stride + 8 * j);
  }
  for (int j = 0; j < DB; ++j) store8(acc + 8 * j, a[j]);
}

// acc[g] += sum_t p[g][t] * v[t] for every query head, v a tile of fp32 rows.
inline void values(const float* s, int group, int n, const float* v, int dim, float* acc) {
  for (int g = 0; g < group; ++g) {
    const float* p = s + g * kTile;
    float* ag = acc + g * dim;
    int d0 = 0;
    for (; d0 + 64 <= dim; d0 += 64) value_block<8>(p, n, v + d0, dim, ag + d0);
    switch ((dim - d0) / 8) {
      case 7: value_block<7>(p, n, v + d0, dim, ag + d0); break;
      case 6: value_block<6>(p, n, v + d0, dim, ag + d0); break;
      case 5: value_block<5>(p, n, v + d0, dim, ag + d0); break;
      case 4: value_block<4>(p, n, v + d0, dim, ag + d0); break;
      case 3: value_block<3>(p, n, v + d0, dim, ag + d0); break;
      case 2: value_block<2>(p, n, v + d0, dim, ag + d0); break;
      case 1: value_block<1>(p, n, v + d0, dim, ag + d0); break;
      default: break;
    }
  }
}

// One work item: the query group of one KV head over kept rows [lo, hi) of its runs
// (counted across runs: ends[i] is the number of rows in runs 0..i). Writes the
// unnormalised output acc[G, D], the running max m[G] and the sum of weights l[G].
template <typename T>
void attend_rows(const float* q, int group, int dim, const T* kbase, const T* vbase,
                 const int64_t* runs, const int64_t* ends, int64_t n_runs, int64_t lo,
                 int64_t hi, float* acc, float* m, float* l) {
  std::fill(acc, acc + group * dim, 0.0f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);
  alignas(64) float s[16 * kTile];
  std::vector<float> vbuf(static_cast<size_t>(kTile) * dim);
  float* vt = vbuf.data();
  const T* krows[kTile];
  const T* vrows[kTile];
  RowWalk<T> walk(runs, ends, n_runs, lo);
  for (int64_t at = lo; at < hi;) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, hi - at));
    walk.tile(n, dim, kbase, vbase, krows, vrows);  // no prefetch: no gain on this path
    at += n;
    head_blocks(group, [&](auto gb, int g0) {
      constexpr int GB = decltype(gb)::value;
      for (int t = 0; t < n; t += rows_per_block<GB>())
        score_block<GB>(q + g0 * dim, dim, krows + t, s + g0 * kTile + t);
    });
    for (int g = 0; g < group; ++g) {
      float* sg = s + g * kTile;
      float mx = m[g];
      int t0 = 0;
      if (n >= 8) {
        v8f vm = load8(sg);
        for (t0 = 8; t0 + 8 <= n; t0 += 8) {
          const v8f x = load8(sg + t0);
          vm = vm > x ? vm : x;
        }
        for (int i = 0; i < 8; ++i) mx = std::max(mx, vm[i]);
      }
      for (; t0 < n; ++t0) mx = std::max(mx, sg[t0]);
      if (mx > m[g]) {
        const float c = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first tile
        l[g] *= c;
        float* ag = acc + g * dim;
        for (int d = 0; d < dim; d += 8) store8(ag + d, load8(ag + d) * splat(c));
        m[g] = mx;
      }
      v8f vsum = splat(0.0f);
      int t = 0;
      for (; t + 8 <= n; t += 8) {
        const v8f e = exp8(load8(sg + t) - splat(mx));
        store8(sg + t, e);
        vsum += e;
      }
      float sum = 0.0f;
      for (int i = 0; i < 8; ++i) sum += vsum[i];
      for (; t < n; ++t) {
        sg[t] = std::exp(sg[t] - mx);
        sum += sg[t];
      }
      l[g] += sum;
    }
    // The tile's values, widened to fp32 once: every query head reads them from L1.
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < dim; d += 8) store8(vt + t * dim + d, load8(vrows[t] + d));
    values(s, group, n, vt, dim, acc);
  }
}

// Unrolled loops measured 12-25% faster on the 2-core EPYC (AVX2) in interleaved A/B runs:
// the head-dimension and row loops have runtime bounds the compiler does not unroll.
#pragma GCC optimize("unroll-loops")

// Fused decode attention over paged KV: one pass over the kept rows, per KV head for all
// of its query heads (GQA), online softmax, fp32 accumulation.
//
// Why a kernel: on a CPU without native bf16 arithmetic, torch's bf16 matmul of a few
// query rows against a long key run is far below memory bandwidth, and a torch call per
// run makes a view of many short runs pay a fixed cost per run. Here a run costs a few
// pointers: the kernel walks the kept rows in tiles of row pointers, whatever runs they
// come from, and reads each K and V row once.
//
// Written with GCC/Clang vector extensions (8 x fp32), compiled with -march=native on the
// machine that runs it, so the same source becomes AVX2+FMA, AVX-512 or NEON code.

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
#include <limits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

constexpr int kTile = 32;  // rows scored, softmaxed and accumulated together

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
// key vectors in registers (2 rows for 5-7 heads measured 12% faster than 1 at 7).
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

template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Int<GB>, g0) over the query heads [0, group) in blocks of up to eight: one
// block per KV head for the usual group sizes, so each K and V vector is converted once.
template <typename F>
inline void head_blocks(int group, F&& f) {
  int g = 0;
  for (; g + 8 <= group; g += 8) f(Int<8>{}, g);
  switch (group - g) {
    case 7: f(Int<7>{}, g); break;
    case 6: f(Int<6>{}, g); break;
    case 5: f(Int<5>{}, g); break;
    case 4: f(Int<4>{}, g); break;
    case 3: f(Int<3>{}, g); break;
    case 2: f(Int<2>{}, g); break;
    case 1: f(Int<1>{}, g); break;
    default: break;
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
  int64_t r = std::upper_bound(ends, ends + n_runs, lo) - ends;  // the run holding row lo
  int64_t row = runs[2 * r] + (lo - (r ? ends[r - 1] : 0));
  for (int64_t at = lo; at < hi;) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, hi - at));
    for (int t = 0; t < n; ++t) {
      while (row == runs[2 * r + 1]) {  // the next non-empty run
        ++r;
        row = runs[2 * r];
      }
      krows[t] = kbase + row * dim;
      vrows[t] = vbase + row * dim;
      ++row;
    }
    for (int t = n; t < kTile; ++t) krows[t] = krows[0];  // padding: scored, then dropped
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

// qp: the scaled queries, fp32 [B, Hkv, G, D]; outp: fp32 [B, Hkv, G, D].
template <typename T>
void run_kernel(const float* qp, int64_t batch, int group, const at::Tensor& kp,
                const at::Tensor& vp, const at::Tensor& runs, const at::Tensor& offsets,
                float* outp, int64_t min_split_rows) {
  const int64_t n_kv = kp.size(0);
  const int dim = static_cast<int>(kp.size(2));
  const int64_t pool_rows = kp.size(1);
  const T* kb = reinterpret_cast<const T*>(kp.data_ptr());
  const T* vb = reinterpret_cast<const T*>(vp.data_ptr());
  const int64_t* rp = runs.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();

  // Rows per batch row, counted across its runs; then the work items: (row, head) pairs,
  // split along the rows when there are fewer pairs than threads to keep busy.
  std::vector<int64_t> ends(runs.size(0));
  std::vector<int64_t> totals(batch);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t c = 0;
    for (int64_t i = op[b]; i < op[b + 1]; ++i) {
      TORCH_CHECK(rp[2 * i] <= rp[2 * i + 1] && rp[2 * i] >= 0 && rp[2 * i + 1] <= pool_rows,
                  "run outside the pool");
      c += rp[2 * i + 1] - rp[2 * i];
      ends[i] = c;
    }
    totals[b] = c;
  }
  struct Item {
    int64_t b, h, lo, hi;
  };
  const int64_t pairs = batch * n_kv;
  const int64_t want = (2 * at::get_num_threads() + pairs - 1) / pairs;
  std::vector<Item> items;
  std::vector<int64_t> first(pairs + 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t most = totals[b] / std::max<int64_t>(1, min_split_rows);
    const int64_t split = std::max<int64_t>(1, std::min<int64_t>(want, most));
    for (int64_t h = 0; h < n_kv; ++h) {
      first[b * n_kv + h] = items.size();
      for (int64_t s = 0; s < split; ++s)
        items.push_back({b, h, totals[b] * s / split, totals[b] * (s + 1) / split});
    }
  }
  first[pairs] = items.size();
  const int64_t n_items = items.size();
  const int64_t gd = static_cast<int64_t>(group) * dim;
  std::vector<float> acc(n_items * gd), mm(n_items * group), ll(n_items * group);
  at::parallel_for(0, n_items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      float* a = acc.data() + i * gd;
      float* m = mm.data() + i * group;
      float* l = ll.data() + i * group;
      if (it.lo >= it.hi) {
        std::fill(a, a + gd, 0.0f);
        std::fill(m, m + group, -std::numeric_limits<float>::infinity());
        std::fill(l, l + group, 0.0f);
        continue;
      }
      const int64_t r0 = op[it.b];
      const int64_t head = it.h * pool_rows * dim;
      attend_rows<T>(qp + (it.b * n_kv + it.h) * gd, group, dim, kb + head, vb + head,
                     rp + 2 * r0, ends.data() + r0, op[it.b + 1] - r0, it.lo, it.hi, a, m, l);
    }
  });
  // Merge the partials of each (row, head) by their maxima: exact, as one softmax.
  for (int64_t p = 0; p < pairs; ++p) {
    float* o = outp + p * gd;
    for (int g = 0; g < group; ++g) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = first[p]; i < first[p + 1]; ++i) mx = std::max(mx, mm[i * group + g]);
      float total = 0.0f;
      float* og = o + g * dim;
      std::fill(og, og + dim, 0.0f);
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // nothing kept
      for (int64_t i = first[p]; i < first[p + 1]; ++i) {
        const float c = std::exp(mm[i * group + g] - mx);
        total += c * ll[i * group + g];
        const float* ai = acc.data() + i * gd + g * dim;
        for (int d = 0; d < dim; ++d) og[d] += c * ai[d];
      }
      const float inv = 1.0f / total;
      for (int d = 0; d < dim; ++d) og[d] *= inv;
    }
  }
}

// Elements of a float tensor (bf16, fp16 or fp32) as fp32, times ``scale``; and back.
void to_float(const at::Tensor& t, float scale, float* dst) {
  const int64_t n = t.numel();
  switch (t.scalar_type()) {
    case at::kFloat: {
      const float* p = t.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) dst[i] = p[i] * scale;
      break;
    }
    case at::kBFloat16: {
      const at::BFloat16* p = t.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]) * scale;
      break;
    }
    case at::kHalf: {
      const at::Half* p = t.data_ptr<at::Half>();
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]) * scale;
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported query dtype ", t.scalar_type());
  }
}

void from_float(const float* src, at::Tensor& t) {
  const int64_t n = t.numel();
  switch (t.scalar_type()) {
    case at::kFloat:
      std::copy(src, src + n, t.data_ptr<float>());
      break;
    case at::kBFloat16: {
      at::BFloat16* p = t.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<at::BFloat16>(src[i]);
      break;
    }
    case at::kHalf: {
      at::Half* p = t.data_ptr<at::Half>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<at::Half>(src[i]);
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported query dtype ", t.scalar_type());
  }
}

}  // namespace

// q [B, H, D] in the model's dtype; kp, vp [Hkv, rows, D]; runs [N, 2] int64 pool row
// ranges, row b reading runs[offsets[b] : offsets[b + 1]]. Returns softmax(scale * q k) v
// as [B, H, D] in q's dtype, accumulated in fp32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                            const at::Tensor& runs, const at::Tensor& offsets, double scale,
                            int64_t min_split_rows) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D]");
  TORCH_CHECK(kp.dim() == 3 && kp.is_contiguous() && vp.is_contiguous(),
              "pools must be contiguous [Hkv, rows, D]");
  TORCH_CHECK(kp.sizes() == vp.sizes() && kp.scalar_type() == vp.scalar_type(),
              "K and V pools differ in shape or dtype");
  TORCH_CHECK(q.size(2) == kp.size(2) && q.size(1) % kp.size(0) == 0,
              "q does not match the pools (head_dim, or heads not a multiple of KV heads)");
  TORCH_CHECK(q.size(2) % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t group = q.size(1) / kp.size(0);
  TORCH_CHECK(group <= 16, "at most 16 query heads per KV head");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 &&
                  runs.size(1) == 2,
              "runs must be contiguous int64 [N, 2]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == q.size(0) + 1,
              "offsets must be int64 [B + 1]");
  const int64_t n = q.numel();
  std::vector<float> qf(n), of(n);
  to_float(q, static_cast<float>(scale), qf.data());
  const int64_t batch = q.size(0);
  const int g = static_cast<int>(group);
  switch (kp.scalar_type()) {
    case at::kBFloat16:
      run_kernel<at::BFloat16>(qf.data(), batch, g, kp, vp, runs, offsets, of.data(),
                               min_split_rows);
      break;
    case at::kFloat:
      run_kernel<float>(qf.data(), batch, g, kp, vp, runs, offsets, of.data(), min_split_rows);
      break;
    case at::kHalf:
      run_kernel<at::Half>(qf.data(), batch, g, kp, vp, runs, offsets, of.data(),
                           min_split_rows);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", kp.scalar_type());
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  from_float(of.data(), out);
  return out;
}

#ifndef DECLATTN_OP_NAMESPACE
#define DECLATTN_OP_NAMESPACE declattn
#endif

TORCH_LIBRARY(DECLATTN_OP_NAMESPACE, m) {
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor runs, Tensor offsets, "
        "float scale, int min_split_rows) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}

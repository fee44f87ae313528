// Unrolled loops: the head-dimension and row loops have runtime bounds the compiler does
// not unroll on its own, and unrolled they keep more loads and FMAs in flight.
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
// Built once per CPU variant (engine/native/variants.py), the one loaded picked by the CPU's
// features. Two paths share the work split, the tiles of row pointers and the merge here:
// - decode_attn_portable.h: GCC/Clang vector extensions (8 x fp32), any pool dtype and
//   head_dim a multiple of 8; AVX2+FMA, AVX-512 or NEON code by the variant;
// - decode_attn_avx512.h: bf16 queries over a bf16 pool (the engine's default on a CPU),
//   head_dim 32/64/128/256, where the CPU has AVX-512 BF16: keys transposed per tile and
//   scored with vdpbf16ps (AMD) or fp32 FMAs (Intel), the next tile's rows prefetched;
// - decode_attn_amx.h: the same work by AMX tile multiplies, where the CPU has AMX-BF16
//   and the OS grants it (Intel since Sapphire Rapids).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "declattn_ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 32;  // rows scored, softmaxed and accumulated together

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

// The kept rows of one work item (rows [lo, hi) counted across its runs: ends[i] is the
// number of rows in runs 0..i), walked in order a tile at a time.
template <typename T>
class RowWalk {
 public:
  RowWalk(const int64_t* runs, const int64_t* ends, int64_t n_runs, int64_t lo)
      : runs_(runs), r_(std::upper_bound(ends, ends + n_runs, lo) - ends),  // run of row lo
        row_(runs[2 * r_] + (lo - (r_ ? ends[r_ - 1] : 0))) {}

  // The next n rows' K and V rows into krows/vrows (K padded to kTile with the first
  // row: scored, then dropped).
  void tile(int n, int dim, const T* kbase, const T* vbase, const T** krows, const T** vrows) {
    for (int t = 0; t < n; ++t) {
      while (row_ == runs_[2 * r_ + 1]) {  // the next non-empty run
        ++r_;
        row_ = runs_[2 * r_];
      }
      krows[t] = kbase + row_ * dim;
      vrows[t] = vbase + row_ * dim;
      ++row_;
    }
    for (int t = n; t < kTile; ++t) krows[t] = krows[0];
  }

 private:
  const int64_t* runs_;
  int64_t r_, row_;
};

#include "decode_attn_portable.h"

#if defined(__AVX512BF16__)
#include "decode_attn_avx512.h"
constexpr bool kBf16Path = true;
#else
constexpr bool kBf16Path = false;
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "decode_attn_amx.h"
#define DECLATTN_AMX 1
#endif

// How the bf16 path scores: the CPU's choice, or one forced, so that a test runs each on
// any CPU that has it.
enum Scoring : int64_t { kMachine = 0, kDot = 1, kFma = 2, kAmx = 3 };

// qp: the scaled queries, fp32 [B, Hkv, G, D]; outp: fp32 [B, Hkv, G, D]. ``qb``: the
// same queries unscaled as bf16 pairs where the bf16 path takes them (else null).
// ``way``: how the bf16 path works (kDot, kFma or kAmx).
template <typename T>
void run_kernel(const float* qp, const uint32_t* qb, int64_t way, float scale, int64_t batch,
                int group, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& runs,
                const at::Tensor& offsets, float* outp, int64_t min_split_rows) {
  const int64_t n_kv = kp.size(0);
  const int dim = static_cast<int>(kp.size(2));
  const int64_t pool_rows = kp.size(1);
  const T* kb = reinterpret_cast<const T*>(kp.data_ptr());
  const T* vb = reinterpret_cast<const T*>(vp.data_ptr());
  const int64_t* rp = runs.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();

  // Rows per batch row, counted across its runs; then the work items: (row, head) pairs,
  // split along the rows when there are fewer pairs than threads to keep busy, into no
  // more items than threads: at::parallel_for gives each thread one equal share of items,
  // so further items only add their set-up and merge (two per thread made a focus step
  // slower, not faster).
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
  const int64_t want = (at::get_num_threads() + pairs - 1) / pairs;
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
      const int64_t q0 = (it.b * n_kv + it.h) * gd;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (qb != nullptr) {
          auto call = [&](auto c) {
            constexpr int kC = decltype(c)::value;
            auto attend = way == kDot ? attend_rows_bf16<kC, true> : attend_rows_bf16<kC, false>;
#if defined(DECLATTN_AMX)
            if (way == kAmx) attend = attend_rows_amx<kC>;
#endif
            attend(qb + q0 / 2, scale, group, kb + head, vb + head, rp + 2 * r0,
                   ends.data() + r0, op[it.b + 1] - r0, it.lo, it.hi, a, m, l);
          };
          switch (dim) {
            case 32: call(Int<1>{}); continue;
            case 64: call(Int<2>{}); continue;
            case 128: call(Int<4>{}); continue;
            case 256: call(Int<8>{}); continue;
            default: break;
          }
        }
      }
#endif
      attend_rows<T>(qp + q0, group, dim, kb + head, vb + head, rp + 2 * r0,
                     ends.data() + r0, op[it.b + 1] - r0, it.lo, it.hi, a, m, l);
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

// Whether the bf16 path can work by AMX here: built with it, and granted by the OS.
bool amx_way() {
#if defined(DECLATTN_AMX)
  return amx_usable();
#else
  return false;
#endif
}

// The bf16 path's way on this CPU: AMX where it can, else vdpbf16ps on AMD and fp32 FMAs
// on Intel (``dot_scores``).
int64_t machine_way() {
  if (amx_way()) return kAmx;
#if defined(__AVX512BF16__)
  if (dot_scores()) return kDot;
#endif
  return kFma;
}

// q [B, H, D] in the model's dtype; kp, vp [Hkv, rows, D]; runs [N, 2] int64 pool row
// ranges, row b reading runs[offsets[b] : offsets[b + 1]]. Returns softmax(scale * q k) v
// as [B, H, D] in q's dtype, accumulated in fp32. ``scoring``: see Scoring.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                            const at::Tensor& runs, const at::Tensor& offsets, double scale,
                            int64_t min_split_rows, int64_t scoring) {
  TORCH_CHECK(scoring >= kMachine && scoring <= kAmx, "scoring must be 0, 1, 2 or 3");
  TORCH_CHECK(scoring != kAmx || amx_way(), "scoring 3 (AMX): this CPU, build or OS has no AMX");
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
  const float sc = static_cast<float>(scale);
  // bf16 queries over a bf16 pool take the AVX-512 BF16 path where it is built.
  const bool bf16 = kBf16Path && q.scalar_type() == at::kBFloat16 &&
                    kp.scalar_type() == at::kBFloat16;
  const uint32_t* qb = bf16 ? reinterpret_cast<const uint32_t*>(q.data_ptr()) : nullptr;
  const int64_t way = scoring == kMachine ? machine_way() : scoring;
  switch (kp.scalar_type()) {
    case at::kBFloat16:
      run_kernel<at::BFloat16>(qf.data(), qb, way, sc, batch, g, kp, vp, runs, offsets, of.data(),
                               min_split_rows);
      break;
    case at::kFloat:
      run_kernel<float>(qf.data(), nullptr, kFma, sc, batch, g, kp, vp, runs, offsets, of.data(),
                        min_split_rows);
      break;
    case at::kHalf:
      run_kernel<at::Half>(qf.data(), nullptr, kFma, sc, batch, g, kp, vp, runs, offsets, of.data(),
                           min_split_rows);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", kp.scalar_type());
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  from_float(of.data(), out);
  return out;
}

// Whether this build scores bf16 queries over bf16 pools with AVX-512 BF16: a test holds
// a CPU that has it to a build that uses it.
bool decode_bf16_path() { return kBf16Path; }

// How the bf16 path scores on this CPU: "amx", "vdpbf16ps", "fma", or "" where there is
// no such path (benchmarks record it).
std::string decode_scoring() {
  if (!kBf16Path) return "";
  switch (machine_way()) {
    case kAmx: return "amx";
    case kDot: return "vdpbf16ps";
    default: return "fma";
  }
}

DECLATTN_FRAGMENT(m) {
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor runs, Tensor offsets, "
        "float scale, int min_split_rows, int scoring=0) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def("decode_bf16_path() -> bool", &decode_bf16_path);
  m.def("decode_scoring() -> str", &decode_scoring);
}

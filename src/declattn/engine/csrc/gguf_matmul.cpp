// y = x W^T with W kept in llama.cpp's own block bytes (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
//
// Why a kernel: a decode step is one row times every weight matrix, so its time is the
// bytes of the weights; reading a GGUF's blocks as they are reads what llama.cpp reads,
// and keeps its numbers exactly (no second rounding of 5-, 6- or 8-bit codes). As in
// llama.cpp, the activations are rounded to int8 per block of 32 so that each block's dot
// product is integer work (AVX2 maddubs); each row then sums its blocks' dots times both
// scales in fp32. Activations get one scale per 32 values for every format (llama.cpp
// uses 256 for the K formats; see dot_q4_k).
//
// What makes it fast (each step below cut a decode row's time through the matrices):
// software prefetch
// ahead of the rows being read; the K formats' per-32 sums reduced eight at a time and
// scaled in one vector multiply-add per super-block (was eight dependent ones), and the
// 32-value formats' rows reduced eight at a time the same way (was per row); codes
// stored with an offset used as unsigned bytes, the offset taken off once per block; and
// OpenMP in the build (native/build.py), without which at::parallel_for ran on one thread.
//
// Built once per CPU variant (engine/native/variants.py): AVX2 where the variant has it, a
// plain C++ loop otherwise (same results, to float rounding).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "declattn_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_dot_avx2.h"
#include "gguf_dot_portable.h"
#include "gguf_k_rows16.h"
#include "gguf_q5_0_rows8.h"
#include "gguf_q8_0_rows8.h"
#include "gguf_rows16_vnni.h"

namespace {

using namespace gguf;

// ``rows`` consecutive weight rows . one activation row -> out[rows].
using RowsDot = void (*)(const uint8_t*, int64_t, int64_t, const Q8Row&, int64_t, float*);

template <float (*F)(const uint8_t*, const Q8Row&, int64_t)>
void each_row(const uint8_t* w, int64_t row_bytes, int64_t rows, const Q8Row& x, int64_t nb,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = F(w + r * row_bytes, x, nb);
}

// One whole group of ``kRows`` weight rows . n activation rows -> out[n][kRows].
using GroupBatch = void (*)(const uint8_t*, const Q8Row*, int64_t, int64_t, float*);

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  RowsDot dot;
  GroupBatch batch = nullptr;  // several activation rows per pass over a tile, where written
};

Format format_of(int64_t type) {
  switch (type) {
#if defined(GGUF_ROWS16)
    case kQ5_0_R16: return {32, 22, dot_q5_0_r16, batch_q5_0_r16};
    case kQ8_0_R16: return {32, 34, dot_q8_0_r16, batch_q8_0_r16};
    case kQ4_K_R16: return {256, 144, dot_q4_k_r16, batch_q4_k_r16};
    case kQ6_K_R16: return {256, 210, dot_q6_k_r16, batch_q6_k_r16};
#else
    case kQ5_0_R16: case kQ8_0_R16:
    case kQ4_K_R16: case kQ6_K_R16:
      TORCH_CHECK(false, "gguf: the layouts regrouped by sixteen rows (", type,
                  ") are made and read by AVX-512 VNNI builds only");
#endif
#if defined(__AVX2__)
    case kQ4_0: return {32, 18, dot32<BQ4_0>};
    case kQ4_1: return {32, 20, dot32<BQ4_1>};
    case kQ5_0: return {32, 22, dot32<BQ5_0>};
    case kQ8_0: return {32, 34, dot32<BQ8_0>};
    case kQ5_0_R8: return {32, 22, dot_q5_0_r8};
    case kQ8_0_R8: return {32, 34, dot_q8_0_r8};
#else
    case kQ5_0_R8: TORCH_CHECK(false, "gguf: the regrouped Q5_0 layout (", kQ5_0_R8,
                               ") is made and read by AVX2 builds only");
    case kQ8_0_R8: TORCH_CHECK(false, "gguf: the regrouped Q8_0 layout (", kQ8_0_R8,
                               ") is made and read by AVX2 builds only");
    case kQ4_0: return {32, 18, each_row<dot_q4_0>};
    case kQ4_1: return {32, 20, each_row<dot_q4_1>};
    case kQ5_0: return {32, 22, each_row<dot_q5_0>};
    case kQ8_0: return {32, 34, each_row<dot_q8_0>};
#endif
    case kQ4_K: return {256, 144, each_row<dot_q4_k>};
    case kQ6_K: return {256, 210, each_row<dot_q6_k>};
    default: TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", type);
  }
}

// A layout regrouped by eight rows (gguf_q5_0_rows8.h, gguf_q8_0_rows8.h) or sixteen
// (gguf_rows16_vnni.h): the file's type it holds (whose block bytes ``format_of`` gives),
// the rows of a group, and one group to and from that many of the file's rows.
using GroupFn = void (*)(const uint8_t*, int64_t, int64_t, uint8_t*);
// A whole group dequantised as it lies (row r at out + r * k), where written.
using GroupDequant = void (*)(const uint8_t*, int64_t, float*, int64_t);
struct Regrouped {
  int64_t type, file_type, rows;
  GroupFn regroup, ungroup;
  GroupDequant dequant = nullptr;
};
// Best first: ``gguf_repack`` takes the first one this build reads.
constexpr Regrouped kRegrouped[] = {
#if defined(GGUF_ROWS16)
    {kQ5_0_R16, kQ5_0, 16, regroup_q5_0_r16, ungroup_q5_0_r16, dequant_q5_0_r16},
    {kQ8_0_R16, kQ8_0, 16, regroup_q8_0_r16, ungroup_q8_0_r16, dequant_q8_0_r16},
#else
    {kQ5_0_R16, kQ5_0, 16, regroup_q5_0_r16, ungroup_q5_0_r16},
    {kQ8_0_R16, kQ8_0, 16, regroup_q8_0_r16, ungroup_q8_0_r16},
#endif
#if defined(GGUF_ROWS16)
    {kQ4_K_R16, kQ4_K, 16, regroup_q4_k_r16, ungroup_q4_k_r16},
    {kQ6_K_R16, kQ6_K, 16, regroup_q6_k_r16, ungroup_q6_k_r16},
#endif
    {kQ5_0_R8, kQ5_0, 8, regroup_q5_0, ungroup_q5_0},
    {kQ8_0_R8, kQ8_0, 8, regroup_q8_0, ungroup_q8_0}};

// Whether this build's kernel reads layout ``g`` (rows by sixteen: AVX-512 VNNI; by
// eight: AVX2).
bool readable(const Regrouped& g) {
#if defined(GGUF_ROWS16)
  if (g.rows == 16) return true;
#endif
#if defined(__AVX2__)
  if (g.rows == 8) return true;
#endif
  return false;
}

const Regrouped* regrouped(int64_t type) {  // by the regrouped id; nullptr: not one
  for (const Regrouped& g : kRegrouped)
    if (g.type == type) return &g;
  return nullptr;
}

// Weight rows per tile: a tile stays in cache while every activation row passes over it,
// and each activation row is read once per tile (a batch of decode rows). Where a format
// has a batch kernel (the layouts regrouped by sixteen), a whole tile takes several
// activation rows per pass: its codes are loaded and unpacked once for all of them, the
// work that bounds a batched step once the weights are read once per step.
constexpr int64_t kRows = 16;

// One weight matrix of a call: its blocks, rows, and where its outputs start.
struct Part {
  const uint8_t* w;
  int64_t rows, row_bytes, col0, tile0;  // first output column, first tile of the call
  Format f;
};

// x [M, K] (fp32 or bf16) times each part -> [M, sum of rows] in x's dtype, the parts'
// outputs side by side; T: x's type. x is rounded to int8 once for all parts, and the
// parts' tiles are one range over the threads, so a small matrix (a 128-row k_proj) is
// not a call of its own with its own start-up.
template <typename T>
at::Tensor gguf_linear_t(const at::Tensor& x, const std::vector<Part>& parts, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t nab = k / 32;
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * nab), sums(m * nab);
  std::vector<int32_t> isum(m * nab), bsum(m * 2 * nab);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * k, k, q.data() + r * k, d.data() + r * nab, sums.data() + r * nab,
                   isum.data() + r * nab, bsum.data() + r * 2 * nab);
  });
  std::vector<Q8Row> xs(m);
  for (int64_t r = 0; r < m; ++r)
    xs[r] = {q.data() + r * k, d.data() + r * nab, sums.data() + r * nab,
             isum.data() + r * nab, bsum.data() + r * 2 * nab};
  at::Tensor out = at::empty({m, n}, x.options());
  T* op = out.data_ptr<T>();
  const Part& last = parts.back();
  const int64_t tiles = last.tile0 + (last.rows + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    size_t i = 0;
    std::vector<float> tile(m * kRows);
    for (int64_t t = t0; t < t1; ++t) {
      while (i + 1 < parts.size() && parts[i + 1].tile0 <= t) ++i;
      const Part& p = parts[i];
      const int64_t j0 = (t - p.tile0) * kRows, rows = std::min(kRows, p.rows - j0);
      const uint8_t* w = p.w + j0 * p.row_bytes;
      if (p.f.batch && rows == kRows)
        p.f.batch(w, xs.data(), m, k / p.f.block, tile.data());
      else
        for (int64_t r = 0; r < m; ++r)
          p.f.dot(w, p.row_bytes, rows, xs[r], k / p.f.block, tile.data() + r * kRows);
      for (int64_t r = 0; r < m; ++r) {
        T* o = op + r * n + p.col0 + j0;
        for (int64_t j = 0; j < rows; ++j) o[j] = static_cast<T>(tile[r * kRows + j]);
      }
    }
  });
  return out;
}

// x [M, K] times every w_i [N_i, row bytes] (of ggml type types[i]) -> [M, sum N_i].
at::Tensor gguf_linear_cat(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x [M, K]");
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(),
              "gguf_linear: one type per weight, and at least one weight");
  const int64_t k = x.size(1);
  std::vector<Part> parts;
  int64_t n = 0, tiles = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const at::Tensor& w = ws[i];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                "gguf_linear: w [N, bytes] uint8");
    const Format f = format_of(types[i]);
    TORCH_CHECK(k % f.block == 0 && w.size(1) == k / f.block * f.bytes,
                "gguf_linear: ", k, " columns do not match ", w.size(1), " bytes per row");
    parts.push_back({w.data_ptr<uint8_t>(), w.size(0), w.size(1), n, tiles, f});
    n += w.size(0);
    tiles += (w.size(0) + kRows - 1) / kRows;
  }
  if (x.scalar_type() == at::kBFloat16) return gguf_linear_t<at::BFloat16>(x.contiguous(), parts, n);
  return gguf_linear_t<float>(x.to(at::kFloat).contiguous(), parts, n).to(x.scalar_type());
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gguf_linear: x [M, K] and w [N, bytes]");
  return gguf_linear_cat(x, {w}, {type});
}

// Rows of x (type T) rounded to int8 as a matmul call rounds them: codes q, scales d.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool plain, int8_t* q, float* d) {
  const int64_t nab = k / 32;
  std::vector<float> sums(nab);
  std::vector<int32_t> isum(nab), bsum(2 * nab);
  const auto row = plain ? quantize_row_plain<T> : quantize_row<T>;
  for (int64_t r = 0; r < m; ++r)
    row(x + r * k, k, q + r * k, d + r * nab, sums.data(), isum.data(), bsum.data());
}

// x [M, K] (fp32 or bf16) -> (codes int8 [M, K], scales fp32 [M, K / 32]): the rounding
// every matmul call applies to its activations, for tests. ``plain``: the scalar loop
// rather than the vector one (the same numbers, or a test fails).
std::tuple<at::Tensor, at::Tensor> gguf_quantize(const at::Tensor& x_, bool plain) {
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) % 32 == 0, "gguf_quantize: x [M, K], K a multiple of 32");
  const bool bf16 = x_.scalar_type() == at::kBFloat16;
  const at::Tensor x = bf16 ? x_.contiguous() : x_.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / 32}, x.options().dtype(at::kFloat));
  if (bf16)
    quantize_rows(x.data_ptr<at::BFloat16>(), m, k, plain, q.data_ptr<int8_t>(), d.data_ptr<float>());
  else
    quantize_rows(x.data_ptr<float>(), m, k, plain, q.data_ptr<int8_t>(), d.data_ptr<float>());
  return {q, d};
}

// fp32 -> bf16 rounded to nearest even, NaN to c10's quiet NaN: c10::BFloat16's own
// rounding, in a loop the compiler vectorizes (the conversion one value at a time took
// longer than dequantising).
inline void to_bf16(const float* x, int64_t n, at::BFloat16* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    o[i] = x[i] != x[i] ? uint16_t{0x7FC0} : rounded;
  }
}

// Rows [r0, r0 + n) of a dequantised weight as T, made in fp32 at ``rows()``: straight in
// the output for fp32, else in a scratch of n rows that ``done`` rounds to bf16 (``to_bf16``).
template <typename T>
struct RowsOut {
  T* out;
  int64_t k;
  std::vector<float> scratch;
  RowsOut(T* o, int64_t k_, int64_t n) : out(o), k(k_), scratch(std::is_same_v<T, float> ? 0 : n * k_) {}
  float* rows(int64_t r0) {
    if constexpr (std::is_same_v<T, float>) return out + r0 * k;
    else return scratch.data();
  }
  void done(int64_t r0, int64_t n) {
    if constexpr (!std::is_same_v<T, float>) to_bf16(scratch.data(), n * k, out + r0 * k);
  }
};

// Rows of a regrouped layout: whole groups dequantised as they lie where the layout has a
// way to, else copied back to the file's rows first; rows past the last group are the file's.
template <typename T>
void dequantize_groups(const Regrouped& g, const uint8_t* wp, int64_t n, int64_t row_bytes,
                       int64_t k, T* op) {
  const int64_t nb = k / format_of(g.file_type).block, gr = g.rows;
  at::parallel_for(0, n / gr, 8, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(g.dequant ? 0 : gr * row_bytes);
    RowsOut<T> o(op, k, gr);
    for (int64_t i = g0; i < g1; ++i) {
      const uint8_t* grp = wp + gr * i * row_bytes;
      float* y = o.rows(gr * i);
      if (g.dequant) {
        g.dequant(grp, nb, y, k);
      } else {
        g.ungroup(grp, row_bytes, nb, rows.data());
        for (int64_t r = 0; r < gr; ++r) dequant_row(g.file_type, rows.data() + r * row_bytes, y + r * k, nb);
      }
      o.done(gr * i, gr);
    }
  });
  RowsOut<T> o(op, k, 1);
  for (int64_t r = n / gr * gr; r < n; ++r) {
    dequant_row(g.file_type, wp + r * row_bytes, o.rows(r), nb);
    o.done(r, 1);
  }
}

template <typename T>
void dequantize_into(const uint8_t* wp, int64_t type, int64_t n, int64_t row_bytes, int64_t k,
                     T* op) {
  if (const Regrouped* g = regrouped(type)) return dequantize_groups(*g, wp, n, row_bytes, k, op);
  const int64_t nb = k / format_of(type).block;
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    RowsOut<T> o(op, k, 1);
    for (int64_t r = r0; r < r1; ++r) {
      dequant_row(type, wp + r * row_bytes, o.rows(r), nb);
      o.done(r, 1);
    }
  });
}

// w [N, row bytes] uint8 -> [N, k], the weight as gguf-py's dequantize gives it: fp32, or
// (``bf16``) that rounded to bf16 without an fp32 copy of the whole matrix first, the
// weight a bf16 prefill GEMM multiplies by.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t k, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_dequantize: w [N, bytes] uint8");
  const Format f = format_of(type);
  TORCH_CHECK(k % f.block == 0 && w.size(1) == k / f.block * f.bytes,
              "gguf_dequantize: ", k, " columns do not match ", w.size(1), " bytes per row");
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, k}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (bf16)
    dequantize_into(w.data_ptr<uint8_t>(), type, n, w.size(1), k, out.data_ptr<at::BFloat16>());
  else
    dequantize_into(w.data_ptr<uint8_t>(), type, n, w.size(1), k, out.data_ptr<float>());
  return out;
}

// A copy of blocks ``w`` of the file's type with each whole group of ``g``'s rows passed
// through ``convert`` (``g``'s regroup or ungroup); rows past the last group stay as they
// are.
at::Tensor convert_groups(const at::Tensor& w, const char* op, const Regrouped& g,
                          GroupFn convert) {
  const int64_t bytes = format_of(g.file_type).bytes;
  TORCH_CHECK(w.size(1) % bytes == 0, op, ": ", w.size(1), " bytes is not rows of ", bytes,
              "-byte blocks");
  const int64_t n = w.size(0), row_bytes = w.size(1), nb = row_bytes / bytes, gr = g.rows;
  at::Tensor out = w.clone();
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / gr, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t i = g0; i < g1; ++i)
      convert(src + gr * i * row_bytes, row_bytes, nb, dst + gr * i * row_bytes);
  });
  return out;
}

// The layout the kernel reads fastest for a GGUF matrix: Q5_0, Q8_0, Q4_K and Q6_K
// regrouped by sixteen rows with AVX-512 VNNI (gguf_rows16_vnni.h, gguf_k_rows16.h), Q5_0
// and Q8_0 by eight on AVX2 (gguf_q5_0_rows8.h, gguf_q8_0_rows8.h; not Q8_0 with a code
// of -128, which that kernel cannot take), the blocks as they are otherwise. ``rows`` asks
// for the layout by that many rows (8 or 16; an error where this build cannot read it), 0
// for the best one, -1 for the file's. Returns the blocks to keep and the type to pass with them.
std::tuple<at::Tensor, int64_t> gguf_repack(const at::Tensor& w, int64_t type, int64_t rows) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_repack: w [N, bytes] uint8");
  TORCH_CHECK(rows == 0 || rows == -1 || rows == 8 || rows == 16,
              "gguf_repack: rows 0 (best), -1 (the file's layout), 8 or 16, not ", rows);
  if (rows == -1) return {w, type};
  for (const Regrouped& g : kRegrouped) {
    if (g.file_type != type || (rows && g.rows != rows)) continue;
    TORCH_CHECK(readable(g) || !rows, "gguf_repack: this build cannot read rows regrouped by ",
                rows, " (AVX-512 VNNI reads 16, AVX2 8)");
    if (!readable(g) || w.size(0) < g.rows) continue;
    if (g.rows == 8 && type == kQ8_0 && !q8_0_codes_fit(w.data_ptr<uint8_t>(), w.numel() / 34))
      continue;
    return {convert_groups(w, "gguf_repack", g, g.regroup), g.type};
  }
  return {w, type};
}

// The blocks as the GGUF file holds them, from ``gguf_repack``'s layout.
at::Tensor gguf_unpack(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_unpack: w [N, bytes] uint8");
  const Regrouped* g = regrouped(type);
  return g ? convert_groups(w, "gguf_unpack", *g, g->ungroup) : w;
}

// How many threads ``at::parallel_for`` ran ``n`` items on: more than one only where this
// file was compiled with OpenMP (a test checks the build flags through it).
int64_t threads_used(int64_t n) {
  std::vector<int> seen(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::accumulate(seen.begin(), seen.end(), int64_t{0});
}

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.def("gguf_linear(Tensor x, Tensor w, int type) -> Tensor");
  m.def("gguf_linear_cat(Tensor x, Tensor[] ws, int[] types) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int type, int k, bool bf16=False) -> Tensor");
  m.def("gguf_quantize(Tensor x, bool plain) -> (Tensor, Tensor)");
  m.def("gguf_repack(Tensor w, int type, int rows=0) -> (Tensor, int)");
  m.def("gguf_unpack(Tensor w, int type) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.impl("gguf_linear_cat", c10::DispatchKey::CPU, &gguf_linear_cat);
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
  m.impl("gguf_quantize", c10::DispatchKey::CPU, &gguf_quantize);
  m.impl("gguf_repack", c10::DispatchKey::CPU, &gguf_repack);
  m.impl("gguf_unpack", c10::DispatchKey::CPU, &gguf_unpack);
  m.def("threads_used", &threads_used);
}

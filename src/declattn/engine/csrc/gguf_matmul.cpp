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

#include "gguf_formats.h"

namespace {

using namespace gguf;

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

#include "gguf_dequant.h"

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

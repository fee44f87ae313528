// Dequantising GGUF blocks (the weight a prefill's GEMM multiplies by, and tests'
// reference) and the int8 rounding of activations every matmul call applies (for tests),
// in any layout gguf_formats.h names: included by gguf_matmul.cpp, inside its namespace,
// which registers the ops (the format headers define their functions once, for one
// translation unit; the headers it needs are included there, above the namespace).

#pragma once

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
// rounding (so the result is ``Tensor.to(torch.bfloat16)``'s), written as integer
// arithmetic that the compiler vectorizes.
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
  RowsOut(T* o, int64_t k_, int64_t n)
      : out(o), k(k_), scratch(std::is_same_v<T, float> ? 0 : n * k_) {}
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
        for (int64_t r = 0; r < gr; ++r)
          dequant_row(g.file_type, rows.data() + r * row_bytes, y + r * k, nb);
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

// RMSNorm and RoPE as one native call each, with the arithmetic of the torch code they
// replace (models/layers.py): fp32 inside, rounded to the activation dtype where it is.
//
// Why: a decode step of a 24-layer model makes 49 norm calls and 48 rotary calls, each
// 6-8 small torch ops (casts, pow, mean, rsqrt, slices, cat) whose fixed cost per op,
// whatever the size, outweighs their arithmetic on one decode row; here each is one call.
//
// Same numbers as torch: every product and sum is rounded as torch rounds it (no fused
// multiply-adds, so this file turns contraction off), except the mean of squares, summed
// here in double: torch's fp32 sum goes in vector lanes in an order not worth copying, so
// the norm's scale can differ from torch's in its last bit (either is within one fp32
// rounding of the exact value; one bf16 output in ~10,000 moves by one unit).

#pragma GCC optimize("fp-contract=off")
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "declattn_ops.h"

#include <cmath>
#include <algorithm>
#include <cstdint>

namespace {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// One row: y = x * rsqrt(mean(x^2) + eps), then weight * y in the activation dtype, or
// y * (1 + weight) in fp32 (Gemma's unit offset) — as RMSNorm.forward.
template <typename T>
void norm_row(const T* x, const T* w, int64_t d, float eps, bool unit_offset, T* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < d; ++i) {
    const double v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float mean = static_cast<float>(ss / static_cast<double>(d));
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) {
    const float y = static_cast<float>(x[i]) * r;
    if (unit_offset) {
      out[i] = round_to<T>(y * (1.0f + static_cast<float>(w[i])));
    } else {
      out[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(y)));
    }
  }
}

template <typename T>
at::Tensor rms_norm_t(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset) {
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(1, d);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row<T>(xp + r * d, wp, d, static_cast<float>(eps), unit_offset, op + r * d);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: contiguous x [..., D] and weight [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight differ in dtype");
  switch (x.scalar_type()) {
    case at::kBFloat16: return rms_norm_t<at::BFloat16>(x, w, eps, unit_offset);
    case at::kFloat: return rms_norm_t<float>(x, w, eps, unit_offset);
    default: TORCH_CHECK(false, "rms_norm: bf16 or fp32, not ", x.scalar_type());
  }
}

// x [T, H, D] rotated in the half-split layout by cos/sin [T, D / 2] (fp32), as
// apply_rotary: (x1 c - x2 s, x2 c + x1 s) in fp32, rounded to x's dtype. x's rows may be
// strided (the q or k heads of the merged q/k/v output, read in place); out is contiguous.
template <typename T>
at::Tensor rotary_t(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2, row = x.stride(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, t * h, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* c = cp + (i / h) * half;
      const float* s = sp + (i / h) * half;
      const T* xi = xp + (i / h) * row + (i % h) * d;
      T* oi = op + i * d;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = static_cast<float>(xi[j]), x2 = static_cast<float>(xi[j + half]);
        const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
        oi[j] = round_to<T>(a - b);
        oi[j + half] = round_to<T>(e + f);
      }
    }
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                  (x.size(1) == 1 || x.stride(1) == x.size(2)),
              "rotary: x [T, H, D] with each row's heads contiguous, D even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) / 2,
              "rotary: cos and sin fp32 [T, D / 2]");
  switch (x.scalar_type()) {
    case at::kBFloat16: return rotary_t<at::BFloat16>(x, cos, sin);
    case at::kFloat: return rotary_t<float>(x, cos, sin);
    default: TORCH_CHECK(false, "rotary: bf16 or fp32, not ", x.scalar_type());
  }
}

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool unit_offset) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}

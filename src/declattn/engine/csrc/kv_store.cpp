// A step's new keys and values into a layer's pools, in one native call.
//
// Why: the torch way (slice the pool, transpose the rows, copy; for K and for V) is eight
// op calls per layer, ~50 us on a Xeon KVM guest for the 512 bytes a decode row stores
// there, ~1.2 ms of a 24-layer qwen2.5-0.5b decode step (a scratch timing of
// KVCache.write, 2026-12-03). Here it is one call and a few memcpy. The bytes stored are
// the same (same dtype: no rounding), so every read of the pool is unchanged.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "declattn_ops.h"

#include <cstdint>
#include <cstring>

namespace {

// x [T, H, D] (rows of D contiguous, any strides above) -> pool [H, rows, D] rows [row, row + T).
void store(at::Tensor& pool, const at::Tensor& x, int64_t row) {
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), rows = pool.size(1);
  const int64_t es = pool.element_size();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + ((h * rows) + row + i) * d * es,
                  src + (i * x.stride(0) + h * x.stride(1)) * es, d * es);
}

void check(const at::Tensor& pool, const at::Tensor& x, int64_t row, const char* name) {
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous() && pool.device().is_cpu(),
              "store_rows: the ", name, " pool must be a contiguous CPU [Hkv, rows, D]");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == pool.size(0) && x.size(2) == pool.size(2) &&
                  x.stride(2) == 1,
              "store_rows: ", name, " must be [T, Hkv, D] with contiguous rows, as the pool");
  TORCH_CHECK(x.scalar_type() == pool.scalar_type(), "store_rows: ", name,
              " differs from its pool in dtype");
  TORCH_CHECK(row >= 0 && row + x.size(0) <= pool.size(1), "store_rows: rows [", row, ", ",
              row + x.size(0), ") outside the pool's ", pool.size(1));
}

void store_rows(at::Tensor kp, at::Tensor vp, const at::Tensor& k, const at::Tensor& v,
                int64_t row) {
  check(kp, k, row, "k");
  check(vp, v, row, "v");
  store(kp, k, row);
  store(vp, v, row);
}

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.def("store_rows(Tensor(a!) kp, Tensor(b!) vp, Tensor k, Tensor v, int row) -> ()");
  m.impl("store_rows", c10::DispatchKey::CPU, &store_rows);
}

// A step's new keys and values into a layer's pools, in one native call.
//
// Why: the torch way (slice or index the pool, transpose the rows, copy; for K and for V)
// is several op calls per layer, ~50 us on a Xeon KVM guest for the 512 bytes a decode row
// stores there. Here it is one call and a few memcpy. The bytes stored are the same (same
// dtype: no rounding), so every read of the pool is unchanged. The rows are any pool rows
// (one per new token): a batch of sequences stores each one's token in its own block.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "declattn_ops.h"

#include <cstdint>
#include <cstring>

namespace {

// x [T, H, D] (rows of D contiguous, any strides above) -> pool [H, rows, D] at rows[i].
void store(at::Tensor& pool, const at::Tensor& x, const int64_t* rows) {
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), n = pool.size(1);
  const int64_t es = pool.element_size();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + ((h * n) + rows[i]) * d * es,
                  src + (i * x.stride(0) + h * x.stride(1)) * es, d * es);
}

void check(const at::Tensor& pool, const at::Tensor& x, const char* name) {
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous() && pool.device().is_cpu(),
              "store_rows: the ", name, " pool must be a contiguous CPU [Hkv, rows, D]");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == pool.size(0) && x.size(2) == pool.size(2) &&
                  x.stride(2) == 1,
              "store_rows: ", name, " must be [T, Hkv, D] with contiguous rows, as the pool");
  TORCH_CHECK(x.scalar_type() == pool.scalar_type(), "store_rows: ", name,
              " differs from its pool in dtype");
}

void store_rows(at::Tensor kp, at::Tensor vp, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& rows) {
  check(kp, k, "k");
  check(vp, v, "v");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.device().is_cpu() && rows.size(0) == k.size(0) &&
                  v.size(0) == k.size(0),
              "store_rows: rows must be a contiguous int64 CPU [T], one per new token");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < kp.size(1) && r[i] < vp.size(1), "store_rows: row ", r[i],
                " outside the pool's ", kp.size(1));
  store(kp, k, r);
  store(vp, v, r);
}

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.def("store_rows(Tensor(a!) kp, Tensor(b!) vp, Tensor k, Tensor v, Tensor rows) -> ()");
  m.impl("store_rows", c10::DispatchKey::CPU, &store_rows);
}

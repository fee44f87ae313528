// Greedy sampling's argmax over one row of logits, read where the head wrote them (bf16 or
// fp32): the first index of the largest value, a NaN counting as the largest (the first NaN
// wins), as torch.argmax and numpy's argmax pick.
//
// Why a kernel: torch's CPU argmax is a scalar loop, and the numpy one it replaces needs
// the row converted to fp32 first (numpy has no bf16): over a vocabulary of ~150K logits,
// the conversion and the scan cost a batched decode step a visible part of its time for
// every greedy row. Here one pass over the row in its own dtype, 16 lanes at a time (GCC
// vector extensions: AVX-512, AVX2 or NEON code by the variant).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "declattn_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kMinSplit = 1 << 15;  // shorter rows are read by one thread
constexpr int64_t kMaxParts = 64;
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
typedef uint16_t VH __attribute__((vector_size(2 * kLanes)));

inline VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline VF load(const at::BFloat16* p) {  // a bf16 is the top half of its fp32
  VH h;
  std::memcpy(&h, p, sizeof h);
  const VI w = __builtin_convertvector(h, VI) << 16;
  VF v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

template <typename T>
int64_t first_nan(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(static_cast<float>(p[i]))) return i;
  return -1;
}

// Per lane: the largest value and the first index it was seen at (a later equal value
// does not replace it); then the lanes' maximum and the least index holding it; then the
// tail. A lane that never rose above -inf keeps index 0, right only where every value is
// -inf, the one case its index can win. (Two compare chains at once measured no faster:
// a row of the batch's logits is read from the last-level cache at about this pace.)
template <typename T>
int64_t argmax_row(const T* p, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  VF best = {};
  VI at = {}, idx = {}, nan = {};
  for (int j = 0; j < kLanes; ++j) {
    best[j] = ninf;
    idx[j] = j;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {  // indices fit int32: checked by the caller
    const VF x = load(p + i);
    const VI gt = x > best;
    best = gt ? x : best;
    at = gt ? idx : at;
    nan |= x != x;
    idx += kLanes;
  }
  float m = ninf;
  int64_t arg = 0;
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    m = std::max(m, best[j]);
    any_nan |= nan[j] != 0;
  }
  if (i > 0) {
    arg = std::numeric_limits<int64_t>::max();
    for (int j = 0; j < kLanes; ++j)
      if (best[j] == m) arg = std::min<int64_t>(arg, at[j]);
  }
  for (; i < n; ++i) {
    const float x = static_cast<float>(p[i]);
    any_nan |= std::isnan(x);
    if (x > m) {
      m = x;
      arg = i;
    }
  }
  return any_nan ? first_nan(p, n) : arg;
}

// The row in one part per thread, merged: the first part holding a NaN, else the part
// with the largest value, the earlier on a tie. (A row the head has just written is read
// at a few GB/s by one core: two read it in about half the time.)
template <typename T>
int64_t argmax_parts(const T* p, int64_t n) {
  const int64_t parts = n < kMinSplit ? 1 : std::min<int64_t>(at::get_num_threads(), kMaxParts);
  int64_t found[kMaxParts];
  at::parallel_for(0, parts, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t lo = n * k / parts, hi = n * (k + 1) / parts;
      found[k] = lo + argmax_row(p + lo, hi - lo);
    }
  });
  int64_t arg = found[0];
  for (int64_t k = 1; k < parts; ++k) {
    const float best = static_cast<float>(p[arg]), x = static_cast<float>(p[found[k]]);
    if (!std::isnan(best) && (std::isnan(x) || x > best)) arg = found[k];
  }
  return arg;
}

int64_t argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.numel() > 0, "argmax takes one non-empty row of logits");
  TORCH_CHECK(x.numel() < (int64_t{1} << 31) - kLanes, "argmax: row too long for int32 lanes");
  const at::Tensor c = x.contiguous();
  switch (c.scalar_type()) {
    case at::kFloat: return argmax_parts(c.data_ptr<float>(), c.numel());
    case at::kBFloat16: return argmax_parts(c.data_ptr<at::BFloat16>(), c.numel());
    default: TORCH_CHECK(false, "argmax takes bf16 or fp32 logits, not ", c.scalar_type());
  }
}

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.def("argmax(Tensor x) -> int");
  m.impl("argmax", c10::DispatchKey::CPU, &argmax);
}

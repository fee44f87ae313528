// A GGUF model's decode step in one native call, ``DecodeStack.run`` (decode_layers.py):
// per layer ``before_attention`` (norm, merged q/k/v matmul, bias, q/k norms, RoPE), the
// paged attention's own two kernels (store the new keys and values, decode attention over
// the runs the step planned), and ``after_attention`` (o matmul, residual, norm, merged
// gate/up matmul, activation, down matmul, residual; Gemma's sandwich norms). A decode
// step whose reads cannot be planned up front (query-aware selection) calls the two ops
// per layer around the attention function instead.
//
// Why: made from Python, that work was ~20 op calls per layer, ~500 a step of a 24-layer
// model, and a Python op call costs a few microseconds of its own whatever the tensor
// (argument parsing, a tensor object made for each result), so for a small model's
// decode step the calls cost more than their arithmetic. Called from here, an op costs
// the dispatcher's fraction of a microsecond.
//
// Same numbers as the Python it replaces: every step is the very op that code called (the
// GGUF matmul, rms_norm and rotary through the dispatcher; ATen's silu and gelu), in the
// same order and dtypes, or, for the adds and the gate's multiply (and bf16 silu with it,
// ``silu_times_rows``), a loop that computes each element as ATen does (``in_place``
// below), so the result equals the modules' bit for bit
// (tests/engine/test_quant_decode_layers.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "declattn_ops.h"

#if defined(__AVX512F__)
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <immintrin.h>
#include <sleef.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using LinearSig = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef);
using NormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using RotarySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// A set of ops (a struct of handles), found at its first use and kept.
template <typename Set>
const Set& found() {
  static const Set handles;
  return handles;
}

// The layer ops' own (gguf_matmul.cpp, norm_rope.cpp: the same library).
struct Ops {
  c10::TypedOperatorHandle<LinearSig> linear =
      find<LinearSig>(DECLATTN_OP("gguf_linear_cat"));
  c10::TypedOperatorHandle<NormSig> norm = find<NormSig>(DECLATTN_OP("rms_norm"));
  c10::TypedOperatorHandle<RotarySig> rotary = find<RotarySig>(DECLATTN_OP("rotary"));
};

const Ops& ops() { return found<Ops>(); }

// One layer's norms share one eps and one form (every family builds them from its config).
struct NormForm {
  double eps;
  bool unit_offset;
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& w) const {
    return ops().norm.call(x.contiguous(), w, eps, unit_offset);
  }
};

// -- elementwise work in place --------------------------------------------------------------
//
// Why: between two weight matmuls the caches below the last level hold weights, so an
// ATen op called there (dispatch, TensorIterator, a fresh tensor) runs cold. These loops
// work on a tensor the layer has just made, still in cache, with no dispatch and no
// allocation. Each element is computed as ATen computes it for these dtypes
// (widened to fp32, one fp32 operation, rounded to nearest even once), so the results
// are ATen's bit for bit (tests/engine/test_quant_decode_layers.py).

// a[i] = op(a[i], b[i % row]) for n elements (``row`` == n: b as long as a), in fp32 and
// rounded back by c10's own conversion, as ATen's kernels round.
template <typename T, typename Op>
void combine(T* a, const T* b, int64_t n, int64_t row, Op op) {
  for (int64_t r = 0; r < n; r += row)
    for (int64_t i = 0; i < row; ++i)
      a[r + i] = static_cast<T>(op(static_cast<float>(a[r + i]), static_cast<float>(b[i])));
}

enum class Elementwise { kAdd, kMul };

// ``a`` (made by this layer, so free to overwrite) op ``b``, where b is as large as a or
// one row of it: in place when both are contiguous fp32 or bf16 of one dtype, else ATen's
// op (the same result, allocated afresh).
at::Tensor in_place(at::Tensor a, const at::Tensor& b, Elementwise op) {
  const bool add = op == Elementwise::kAdd;
  const auto dtype = a.scalar_type();
  const bool same = b.scalar_type() == dtype && a.is_contiguous() && b.is_contiguous() &&
                    (dtype == at::kFloat || dtype == at::kBFloat16) && a.dim() >= 1;
  const bool whole = same && b.sizes() == a.sizes();
  const bool row = same && b.dim() == 1 && b.numel() == a.size(-1);
  if (!whole && !row) return add ? at::add(a, b) : at::mul(a, b);
  const int64_t n = a.numel(), width = whole ? n : b.numel();
  if (n == 0) return a;
  auto run = [&](auto* ap, const auto* bp) {
    if (add) combine(ap, bp, n, width, [](float x, float y) { return x + y; });
    else combine(ap, bp, n, width, [](float x, float y) { return x * y; });
  };
  if (dtype == at::kFloat) run(a.data_ptr<float>(), b.data_ptr<float>());
  else run(a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>());
  return a;
}

at::Tensor matmul(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types,
                  const std::optional<at::Tensor>& bias) {
  at::Tensor y = ops().linear.call(x.contiguous(), ws, types);
  return bias ? in_place(y, *bias, Elementwise::kAdd) : y;
}

// silu(gate) * up for every row of ``both`` (the gate/up matmul's output [T, 2n]: a row's n
// gate values, then its n up values; read by pointer, not as two views, which cost several
// op calls a layer) into a new [T, n], the rows shared among the threads, where that is
// ATen's result bit for bit: bf16, ATen dispatching to its AVX-512 kernels, and ATen's
// silu over the gate's [T, n] view taking its vector path for every element
// (``aten_silu_vectorises``). An undefined tensor (nothing computed) otherwise, and ATen's
// ops run.
//
// Why: ATen's silu and multiply were the costliest of a layer's small ops in a decode step
// (cold TensorIterator ops making two tensors between two matmuls, behind a chunk of the
// output into views). Same numbers: per element ATen's vector silu for bf16 (widened to
// fp32, ``x / (1 + exp(-x))`` with Sleef's expf u10 as ``Vectorized<float>::exp`` calls
// it, rounded to bf16), then the multiply as ``in_place`` does it; the layer test holds
// the result to the modules' bit for bit.
#if defined(__AVX512F__)
bool aten_silu_vectorises(int64_t t, int64_t n) {
  // ATen's loop takes each piece of a row it is handed two vectors of 32 at a time, the
  // rest by a scalar loop with another exp; the pieces are the rows cut at its parallel
  // loop's chunk boundaries (ParallelOpenMP.h's split of T x n elements into equal chunks
  // of whole grains' worth among at most the threads). Every piece a multiple of 64 long:
  // n one, and the chunks one where there are several.
  if (n % 64 != 0) return false;
  const int64_t numel = t * n, grain = at::internal::GRAIN_SIZE;
  const int64_t threads = at::get_num_threads();
  if (numel <= grain || threads == 1) return true;
  const int64_t chunks = std::min<int64_t>(threads, (numel + grain - 1) / grain);
  return ((numel + chunks - 1) / chunks) % 64 == 0;
}

at::Tensor silu_times_rows(const at::Tensor& both) {
  const int64_t t = both.size(0), n = both.size(1) / 2;
  if (both.scalar_type() != at::kBFloat16 || !both.is_contiguous() || !aten_silu_vectorises(t, n))
    return {};
  static const bool aten_avx512 = at::get_cpu_capability() == "AVX512";
  if (!aten_avx512) return {};
  at::Tensor out = at::empty({t, n}, both.options());
  const at::BFloat16* in = both.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float s[16];
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* g = in + r * 2 * n;
      const at::BFloat16* u = g + n;
      at::BFloat16* y = o + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        const __m512 minus_x = _mm512_castsi512_ps(  // -x, as ATen's neg(): the sign flipped
            _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
        const __m512 e = Sleef_expf16_u10(minus_x);
        _mm512_store_ps(s, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        for (int j = 0; j < 16; ++j)
          y[i + j] = static_cast<at::BFloat16>(
              static_cast<float>(static_cast<at::BFloat16>(s[j])) * static_cast<float>(u[i + j]));
      }
    }
  });
  return out;
}
#else
at::Tensor silu_times_rows(const at::Tensor&) { return {}; }
#endif

at::Tensor activate(const at::Tensor& x, const std::string& activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "gelu_tanh") return at::gelu(x, "tanh");
  TORCH_CHECK(activation == "gelu", "after_attention: activation silu, gelu_tanh or gelu, not ",
              activation);
  return at::gelu(x);
}

// act(gate) * up, from the gate/up matmul's output [T, 2 x inter] (the two side by side),
// by ATen's ops.
at::Tensor gate_times_up(const at::Tensor& both, const std::string& activation) {
  const auto gu = both.chunk(2, -1);
  return in_place(activate(gu[0], activation), gu[1], Elementwise::kMul);
}

// h [T, hidden] -> q [T, H, D] and k [T, KV, D] rotated, v [T, KV, D] (a view).
std::tuple<at::Tensor, at::Tensor, at::Tensor> before_attention(
    const at::Tensor& h, const at::Tensor& attn_norm, double eps, bool unit_offset,
    at::TensorList qkv, at::IntArrayRef qkv_types, const std::optional<at::Tensor>& qkv_bias,
    int64_t heads, int64_t kv_heads, int64_t dim, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(h.dim() == 2, "before_attention: h [T, hidden]");
  const NormForm norm{eps, unit_offset};
  const int64_t t = h.size(0);
  const at::Tensor y = matmul(norm(h, attn_norm), qkv, qkv_types, qkv_bias);
  TORCH_CHECK(y.is_contiguous() && y.size(1) == (heads + 2 * kv_heads) * dim,
              "before_attention: q/k/v give ", y.size(1), " columns, not (", heads, " + 2 x ",
              kv_heads, ") x ", dim);
  // q, k and v side by side in each row of y, taken as [T, heads, D] views in one op each
  // (a split and its views made several op calls for each, as did the gate/up's chunk in
  // after_attention).
  auto heads_of = [&](int64_t n, int64_t first) {
    return y.as_strided({t, n, dim}, {y.stride(0), dim, 1}, y.storage_offset() + first * dim);
  };
  at::Tensor q = heads_of(heads, 0), k = heads_of(kv_heads, heads);
  if (q_norm && k_norm) {
    q = norm(q, *q_norm);
    k = norm(k, *k_norm);
  }
  q = ops().rotary.call(q, cos, sin);  // a row's heads are contiguous in y: read in place
  k = ops().rotary.call(k, cos, sin);
  return {q, k, heads_of(kv_heads, heads + kv_heads)};
}

// h [T, hidden] and the attention's out [T, H, D] -> the layer's output [T, hidden].
at::Tensor after_attention(
    const at::Tensor& h, const at::Tensor& out, double eps, bool unit_offset, at::TensorList o,
    at::IntArrayRef o_types, const std::optional<at::Tensor>& o_bias,
    const std::optional<at::Tensor>& post_attn_norm, const at::Tensor& mlp_norm,
    at::TensorList gate_up, at::IntArrayRef gate_up_types,
    const std::optional<at::Tensor>& gate_up_bias, const std::string& activation,
    at::TensorList down, at::IntArrayRef down_types, const std::optional<at::Tensor>& down_bias,
    const std::optional<at::Tensor>& post_mlp_norm) {
  TORCH_CHECK(h.dim() == 2 && out.dim() == 3 && out.size(0) == h.size(0),
              "after_attention: h [T, hidden] and out [T, H, D]");
  const NormForm norm{eps, unit_offset};
  at::Tensor a = matmul(out.reshape({out.size(0), -1}), o, o_types, o_bias);
  if (post_attn_norm) a = norm(a, *post_attn_norm);
  at::Tensor x = in_place(a, h, Elementwise::kAdd);
  const at::Tensor both = matmul(norm(x, mlp_norm), gate_up, gate_up_types, gate_up_bias);
  at::Tensor gated = activation == "silu" ? silu_times_rows(both) : at::Tensor();
  if (!gated.defined()) gated = gate_times_up(both, activation);
  at::Tensor m = matmul(gated, down, down_types, down_bias);
  if (post_mlp_norm) m = norm(m, *post_mlp_norm);
  return in_place(m, x, Elementwise::kAdd);
}

// -- a whole decode step ------------------------------------------------------------------
//
// Why: per layer, the Python around these ops (the attention function's checks, the cache
// write, the run batch, the read record, four op calls parsing their lists of blocks) ran
// on one thread while the others waited, every layer of every step. Here a layer costs
// C++ calls only. The
// ops are the very ones the Python path calls, in the same order, so the result and what
// the pools hold are the same bit for bit (tests/engine/test_quant_decode_layers.py).

using StoreSig = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&);
using AttendSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t, int64_t);

// The paged attention's kernels (kv_store.cpp, decode_attn.cpp), found at the first step:
// only the stack needs them.
struct AttentionOps {
  c10::TypedOperatorHandle<StoreSig> store = find<StoreSig>(DECLATTN_OP("store_rows"));
  c10::TypedOperatorHandle<AttendSig> attend =
      find<AttendSig>(DECLATTN_OP("decode_attention"));
};

// One layer's weights and shapes: the arguments of its two calls above.
struct StackLayer {
  at::Tensor attn_norm, mlp_norm;
  std::vector<at::Tensor> qkv, o, gate_up, down;
  std::vector<int64_t> qkv_types, o_types, gate_up_types, down_types;
  std::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  std::optional<at::Tensor> q_norm, k_norm, post_attn_norm, post_mlp_norm;
  int64_t heads, kv_heads, dim;
  double eps, scale;
  bool unit_offset, local;  // local: a sliding-window layer (rotated by the local RoPE)
  std::string activation;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<StackLayer> layers;

  // The layer's arguments, in decode_layers.py's order; the stack keeps the tensors.
  void add(at::Tensor attn_norm, double eps, bool unit_offset, std::vector<at::Tensor> qkv,
           std::vector<int64_t> qkv_types, std::optional<at::Tensor> qkv_bias, int64_t heads,
           int64_t kv_heads, int64_t dim, std::optional<at::Tensor> q_norm,
           std::optional<at::Tensor> k_norm, double scale, bool local, std::vector<at::Tensor> o,
           std::vector<int64_t> o_types, std::optional<at::Tensor> o_bias,
           std::optional<at::Tensor> post_attn_norm, at::Tensor mlp_norm,
           std::vector<at::Tensor> gate_up, std::vector<int64_t> gate_up_types,
           std::optional<at::Tensor> gate_up_bias, std::string activation,
           std::vector<at::Tensor> down, std::vector<int64_t> down_types,
           std::optional<at::Tensor> down_bias, std::optional<at::Tensor> post_mlp_norm) {
    layers.push_back({std::move(attn_norm), std::move(mlp_norm), std::move(qkv), std::move(o),
                      std::move(gate_up), std::move(down), std::move(qkv_types),
                      std::move(o_types), std::move(gate_up_types), std::move(down_types),
                      std::move(qkv_bias), std::move(o_bias), std::move(gate_up_bias),
                      std::move(down_bias), std::move(q_norm), std::move(k_norm),
                      std::move(post_attn_norm), std::move(post_mlp_norm), heads, kv_heads, dim,
                      eps, scale, unit_offset, local, std::move(activation)});
  }

  // h [T, hidden] through every layer: layer i stores its new keys and values at pool rows
  // rows[0..T) of k_pools[i] and v_pools[i], then attends over runs[i] (rows per
  // decode row by offsets[i], as decode.py's RunBatch) -> [T, hidden].
  at::Tensor run(at::Tensor h, at::Tensor cos_g, at::Tensor sin_g, at::Tensor cos_l,
                 at::Tensor sin_l, std::vector<at::Tensor> k_pools,
                 std::vector<at::Tensor> v_pools, at::Tensor rows, std::vector<at::Tensor> runs,
                 std::vector<at::Tensor> offsets, int64_t min_split_rows) {
    const size_t n = layers.size();
    TORCH_CHECK(k_pools.size() == n && v_pools.size() == n && runs.size() == n &&
                    offsets.size() == n,
                "DecodeStack.run: one pool pair and one run batch per layer (", n, ")");
    const AttentionOps& attn = found<AttentionOps>();
    for (size_t i = 0; i < n; ++i) {
      const StackLayer& x = layers[i];
      const at::Tensor& cos = x.local ? cos_l : cos_g;
      const at::Tensor& sin = x.local ? sin_l : sin_g;
      auto [q, k, v] = before_attention(h, x.attn_norm, x.eps, x.unit_offset, x.qkv, x.qkv_types,
                                        x.qkv_bias, x.heads, x.kv_heads, x.dim, x.q_norm,
                                        x.k_norm, cos, sin);
      attn.store.call(k_pools[i], v_pools[i], k, v, rows);
      const at::Tensor out = attn.attend.call(q.contiguous(), k_pools[i], v_pools[i], runs[i],
                                              offsets[i], x.scale, min_split_rows, 0);
      h = after_attention(h, out, x.eps, x.unit_offset, x.o, x.o_types, x.o_bias,
                          x.post_attn_norm, x.mlp_norm, x.gate_up, x.gate_up_types,
                          x.gate_up_bias, x.activation, x.down, x.down_types, x.down_bias,
                          x.post_mlp_norm);
    }
    return h;
  }
};

}  // namespace

DECLATTN_FRAGMENT(m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add", &DecodeStack::add)
      .def("run", &DecodeStack::run);
  m.def(
      "before_attention(Tensor h, Tensor attn_norm, float eps, bool unit_offset, Tensor[] qkv, "
      "int[] qkv_types, Tensor? qkv_bias, int heads, int kv_heads, int dim, Tensor? q_norm, "
      "Tensor? k_norm, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)");
  m.def(
      "after_attention(Tensor h, Tensor out, float eps, bool unit_offset, Tensor[] o, "
      "int[] o_types, Tensor? o_bias, Tensor? post_attn_norm, Tensor mlp_norm, "
      "Tensor[] gate_up, int[] gate_up_types, Tensor? gate_up_bias, str activation, "
      "Tensor[] down, int[] down_types, Tensor? down_bias, Tensor? post_mlp_norm) -> Tensor");
  m.impl("before_attention", c10::DispatchKey::CPU, &before_attention);
  m.impl("after_attention", c10::DispatchKey::CPU, &after_attention);
}

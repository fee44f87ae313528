// A decoder layer's work around its attention, for a short step of a GGUF model, in two
// native calls: ``before_attention`` (norm, merged q/k/v matmul, bias, q/k norms, RoPE) and
// ``after_attention`` (o matmul, residual, norm, merged gate/up matmul, activation, down
// matmul, residual; Gemma's sandwich norms). decode_layers.py calls them per layer.
//
// Why: made from Python, that work was ~20 op calls per layer, ~500 a step of a 24-layer
// model, and a Python op call costs a few microseconds of its own whatever the tensor
// (argument parsing, a tensor object made for each result), so the calls cost more than
// their arithmetic: a qwen2.5-0.5b decode step spent 2.5-5 ms in them on 1 or 2 threads
// of a Xeon KVM guest, 10-15% of the step. Called from here, an op costs the dispatcher's
// fraction of a microsecond.
//
// Same numbers as the Python it replaces: every step is the very op that code called (the
// GGUF matmul, rms_norm and rotary through the dispatcher; ATen's add, mul, silu, gelu),
// in the same order and dtypes, so the result equals it, and the modules, bit for bit
// (tests/engine/test_quant_decode_layers.py). Nothing here computes on its own.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace {

using LinearSig = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef);
using NormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using RotarySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The ops this file calls, found once (their libraries are loaded before this one).
struct Ops {
  c10::TypedOperatorHandle<LinearSig> linear = find<LinearSig>("declattn_gguf::gguf_linear_cat");
  c10::TypedOperatorHandle<NormSig> norm = find<NormSig>("declattn_layers::rms_norm");
  c10::TypedOperatorHandle<RotarySig> rotary = find<RotarySig>("declattn_layers::rotary");
};

const Ops& ops() {
  static const Ops found;
  return found;
}

// One layer's norms share one eps and one form (every family builds them from its config).
struct NormForm {
  double eps;
  bool unit_offset;
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& w) const {
    return ops().norm.call(x.contiguous(), w, eps, unit_offset);
  }
};

at::Tensor matmul(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types,
                  const std::optional<at::Tensor>& bias) {
  at::Tensor y = ops().linear.call(x.contiguous(), ws, types);
  return bias ? at::add(y, *bias) : y;
}

at::Tensor activate(const at::Tensor& x, const std::string& activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "gelu_tanh") return at::gelu(x, "tanh");
  TORCH_CHECK(activation == "gelu", "after_attention: activation silu, gelu_tanh or gelu, not ",
              activation);
  return at::gelu(x);
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
  at::Tensor y = matmul(norm(h, attn_norm), qkv, qkv_types, qkv_bias);
  const auto parts = y.split_with_sizes({heads * dim, kv_heads * dim, kv_heads * dim}, -1);
  at::Tensor q = parts[0].view({t, heads, dim}), k = parts[1].view({t, kv_heads, dim});
  if (q_norm && k_norm) {
    q = norm(q, *q_norm);
    k = norm(k, *k_norm);
  }
  q = ops().rotary.call(q.contiguous(), cos, sin);
  k = ops().rotary.call(k.contiguous(), cos, sin);
  return {q, k, parts[2].view({t, kv_heads, dim})};
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
  at::Tensor x = at::add(h, a);
  const auto gu = matmul(norm(x, mlp_norm), gate_up, gate_up_types, gate_up_bias).chunk(2, -1);
  at::Tensor m = matmul(at::mul(activate(gu[0], activation), gu[1]), down, down_types, down_bias);
  if (post_mlp_norm) m = norm(m, *post_mlp_norm);
  return at::add(x, m);
}

}  // namespace

TORCH_LIBRARY(declattn_decode_layer, m) {
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

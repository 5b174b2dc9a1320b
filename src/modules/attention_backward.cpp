// Backward passes of the chapter's attention modules: the forward in reverse, one saved
// context per forward (attention.cpp). scaled_dot_product_attention_backward differentiates the
// attention itself; the projections' Linear submodules differentiate themselves.
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "modules/backward_util.hpp"

namespace attn::nn {

namespace {

// dQ, dK, dV of the saved attention for dL/d(attention output) `grad_context` (views allowed).
SdpaGrads attention_grads(const detail::AttentionContext& ctx, const TensorView& grad_context,
                          const TensorView& q, const TensorView& k, const TensorView& v) {
  return scaled_dot_product_attention_backward(grad_context, q, k, v, ctx.result, ctx.options);
}

// dL/dx through the three projections: each Linear's backward also adds its parameter grads.
Tensor qkv_backward(Linear& W_query, Linear& W_key, Linear& W_value, const TensorView& dq,
                    const TensorView& dk, const TensorView& dv) {
  Tensor dx = W_query.backward(dq);
  detail::accumulate_grad(dx, W_key.backward(dk));
  detail::accumulate_grad(dx, W_value.backward(dv));
  return dx;
}

// x @ W's backward for SelfAttentionV1: adds x^T dY into grad_W and returns dY W^T.
Tensor matmul_weight_backward(const TensorView& dy, const TensorView& x, const Tensor& W, Tensor& grad_W) {
  // x @ W == linear(x, W^T): its weight gradient is dW^T.
  LinearGrads g = linear_backward(dy, x, W.t(), false);
  detail::accumulate_grad(grad_W, g.grad_weight.t());
  return std::move(g.grad_input);
}

NamedTensors qkv_grads(Linear& W_query, Linear& W_key, Linear& W_value) {
  NamedTensors p;
  append_prefixed(p, "W_query", W_query.named_grads());
  append_prefixed(p, "W_key", W_key.named_grads());
  append_prefixed(p, "W_value", W_value.named_grads());
  return p;
}

}  // namespace

// ---- SelfAttentionV1 ----------------------------------------------------------------------------

Tensor SelfAttentionV1::backward(const TensorView& grad_output) {
  // grad_output (..., T, d_out) -> dx (..., T, d_in); grad_W_* += x^T dQ/dK/dV
  if (!saved_) detail::throw_no_saved_forward("SelfAttentionV1");
  detail::check_grad_output(grad_output, saved_->output_shape, "SelfAttentionV1");
  const detail::AttentionContext ctx = std::move(*saved_);
  saved_.reset();
  const SdpaGrads g = attention_grads(ctx, grad_output, ctx.queries, ctx.keys, ctx.values);
  Tensor dx = matmul_weight_backward(g.grad_query, ctx.input, W_query, grad_W_query);
  detail::accumulate_grad(dx, matmul_weight_backward(g.grad_key, ctx.input, W_key, grad_W_key));
  detail::accumulate_grad(dx, matmul_weight_backward(g.grad_value, ctx.input, W_value, grad_W_value));
  return dx;
}

NamedTensors SelfAttentionV1::named_grads() {
  return {{"W_query", &grad_W_query}, {"W_key", &grad_W_key}, {"W_value", &grad_W_value}};
}

// ---- SelfAttentionV2 ----------------------------------------------------------------------------

Tensor SelfAttentionV2::backward(const TensorView& grad_output) {
  // grad_output (..., T, d_out) -> dx (..., T, d_in)
  if (!saved_) detail::throw_no_saved_forward("SelfAttentionV2");
  detail::check_grad_output(grad_output, saved_->output_shape, "SelfAttentionV2");
  const detail::AttentionContext ctx = std::move(*saved_);
  saved_.reset();
  const SdpaGrads g = attention_grads(ctx, grad_output, ctx.queries, ctx.keys, ctx.values);
  return qkv_backward(W_query, W_key, W_value, g.grad_query, g.grad_key, g.grad_value);
}

NamedTensors SelfAttentionV2::named_grads() { return qkv_grads(W_query, W_key, W_value); }

// ---- CausalAttention ----------------------------------------------------------------------------

Tensor CausalAttention::backward(const TensorView& grad_output) {
  // grad_output (b, T, d_out) -> dx (b, T, d_in); dropout replays the saved weights
  if (!saved_) detail::throw_no_saved_forward("CausalAttention");
  detail::check_grad_output(grad_output, saved_->output_shape, "CausalAttention");
  const detail::AttentionContext ctx = std::move(*saved_);
  saved_.reset();
  const SdpaGrads g = attention_grads(ctx, grad_output, ctx.queries, ctx.keys, ctx.values);
  return qkv_backward(W_query, W_key, W_value, g.grad_query, g.grad_key, g.grad_value);
}

NamedTensors CausalAttention::named_grads() { return qkv_grads(W_query, W_key, W_value); }

// ---- MultiHeadAttentionWrapper ------------------------------------------------------------------

Tensor MultiHeadAttentionWrapper::backward(const TensorView& grad_output) {
  // grad_output (b, T, H * d_out) -> dx (b, T, d_in): head h gets columns [h d_out, (h+1) d_out)
  if (!saved_output_shape_) detail::throw_no_saved_forward("MultiHeadAttentionWrapper");
  detail::check_grad_output(grad_output, *saved_output_shape_, "MultiHeadAttentionWrapper");
  saved_output_shape_.reset();
  Tensor dx;
  int64_t col = 0;
  for (CausalAttention& head : heads) {
    const Tensor dh = head.backward(grad_output.slice(2, col, col + head.d_out).contiguous());
    col += head.d_out;
    if (dx.defined()) {
      detail::accumulate_grad(dx, dh);
    } else {
      dx = dh;
    }
  }
  return dx;
}

NamedTensors MultiHeadAttentionWrapper::named_grads() {
  NamedTensors p;
  for (size_t h = 0; h < heads.size(); ++h) {
    append_prefixed(p, "heads." + std::to_string(h), heads[h].named_grads());
  }
  return p;
}

// ---- MultiHeadAttention -----------------------------------------------------------------------

Tensor MultiHeadAttention::backward(const TensorView& grad_output) {
  // grad_output (b, T, d_out) -> dx (b, T, d_in): out_proj, merge heads, attention, split
  // heads, projections, each reversed.
  if (!saved_) detail::throw_no_saved_forward("MultiHeadAttention");
  const int64_t b = saved_->queries.size(0), T = saved_->queries.size(1);
  detail::check_grad_output(grad_output, {b, T, d_out}, "MultiHeadAttention");
  const detail::AttentionContext ctx = std::move(*saved_);
  saved_.reset();
  const Tensor d_merged = out_proj.backward(grad_output);  // (b, T, d_out)
  auto split = [&](const TensorView& t) { return t.view({b, T, num_heads, head_dim}).transpose(1, 2); };
  const Tensor d_context = split(d_merged).contiguous();  // (b, H, T, hd)
  const SdpaGrads g = attention_grads(ctx, d_context, split(ctx.queries), split(ctx.keys), split(ctx.values));
  // (b, H, T, hd) -> (b, T, H, hd) -> (b, T, d_out)
  auto merge = [&](const Tensor& t) { return t.transpose(1, 2).contiguous(); };
  const Tensor dq = merge(g.grad_query), dk = merge(g.grad_key), dv = merge(g.grad_value);
  return qkv_backward(W_query, W_key, W_value, dq.view({b, T, d_out}), dk.view({b, T, d_out}),
                      dv.view({b, T, d_out}));
}

NamedTensors MultiHeadAttention::named_grads() {
  NamedTensors p = qkv_grads(W_query, W_key, W_value);
  append_prefixed(p, "out_proj", out_proj.named_grads());
  return p;
}

}  // namespace attn::nn

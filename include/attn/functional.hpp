// The functional core: plain functions with PyTorch's names and semantics
// (torch.*, torch.nn.functional.*). Every module in modules.hpp is a thin layer over these.
//
// All functions take views (any strides) and return new contiguous tensors unless their name
// ends in `_` (in place, as in PyTorch). Shapes broadcast with NumPy/PyTorch rules. Bad
// arguments throw attn::ShapeError / ValueError / IndexError naming the argument and the
// expected and actual shapes or values.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "attn/random.hpp"
#include "attn/tensor.hpp"

namespace attn {

// ---- elementwise and reductions (src/ops/elementwise.cpp) -------------------------------------
Tensor add(const TensorView& a, const TensorView& b);
Tensor sub(const TensorView& a, const TensorView& b);
Tensor mul(const TensorView& a, const TensorView& b);
Tensor div(const TensorView& a, const TensorView& b);
Tensor add(const TensorView& a, float b);
Tensor mul(const TensorView& a, float b);
Tensor div(const TensorView& a, float b);
Tensor exp(const TensorView& x);
Tensor sum(const TensorView& x);                                      // all elements, 0-D
Tensor sum(const TensorView& x, int dim, bool keepdim = false);
Tensor mean(const TensorView& x);
// Variance of all elements; unbiased=false divides by N (torch.var(unbiased=False)).
// Accumulates in float64 as PyTorch's CPU kernel does.
Tensor var(const TensorView& x, bool unbiased = true);
Tensor cat(std::span<const TensorView> tensors, int dim);
Tensor stack(std::span<const TensorView> tensors, int dim);

// ---- matrix products (src/ops/matmul.cpp; CBLAS sgemm) --------------------------------------
// torch.matmul: 1-D·1-D (dot, 0-D result), 2-D @ 2-D, 1-D/2-D mixes, and batched N-D with
// broadcast batch dims. Transposed views are passed to BLAS without copying.
Tensor matmul(const TensorView& a, const TensorView& b);
Tensor dot(const TensorView& a, const TensorView& b);

// ---- softmax (src/ops/softmax.cpp) -----------------------------------------------------------
// Stable softmax: exp(x - max) / sum. A row that is entirely -inf gives NaN, as in PyTorch's
// torch.softmax; scaled_dot_product_attention instead defines fully masked rows as 0.
Tensor softmax(const TensorView& x, int dim);
// The chapter's softmax_naive: exp(x) / exp(x).sum(dim). Overflows for large inputs (that is
// the lesson); kept for teaching, never used by attention.
Tensor softmax_naive(const TensorView& x, int dim);

// ---- masks, layers (src/ops/nn_ops.cpp) ------------------------------------------------------
// x.masked_fill(mask, value): where mask != 0 (PyTorch: True) the result is `value`. The mask
// broadcasts to x's shape.
Tensor masked_fill(const TensorView& x, const TensorView& mask, float value);
void masked_fill_(const TensorView& x, const TensorView& mask, float value);
// torch.triu / torch.tril of the last two dims; `diagonal` as in PyTorch.
Tensor triu(const TensorView& x, int64_t diagonal = 0);
Tensor tril(const TensorView& x, int64_t diagonal = 0);
// F.linear: x @ weight^T + bias. x: (..., in), weight: (out, in), bias: (out) or undefined.
Tensor linear(const TensorView& x, const TensorView& weight, const TensorView& bias = {});
// F.dropout with PyTorch's CPU semantics: in training, each element is kept with probability
// 1 - p (bernoulli_ draws in memory order) and scaled by 1 / (1 - p); p == 0 draws nothing;
// p == 1 gives zeros; not training returns a copy of x.
Tensor dropout(const TensorView& x, float p, bool training = true,
               Generator& gen = default_generator());
// F.embedding: rows of weight (num, dim) picked by ids; result shape is ids_shape + [dim].
Tensor embedding(std::span<const int64_t> ids, const Shape& ids_shape, const TensorView& weight);
// F.dropout that also returns what its backward needs. keep_mask has x's shape: 1 where the
// element was kept, 0 where dropped (all ones when nothing was dropped); p is the probability
// actually applied (0 when not training), so dropout_backward(g, r.keep_mask, r.p) is right in
// every mode. Draws exactly as dropout().
struct DropoutResult {
  Tensor output;
  Tensor keep_mask;
  float p = 0.0f;
};
DropoutResult dropout_with_mask(const TensorView& x, float p, bool training = true,
                                Generator& gen = default_generator());

// ---- norms, activations, losses (src/ops/norm_act_loss.cpp) ---------------------------------
// F.layer_norm over the last dim: normalized_shape must be [C] with C = x.size(-1).
// weight, bias: (C) or undefined (no affine). Mean and variance (biased) in float64.
Tensor layer_norm(const TensorView& x, const Shape& normalized_shape, const TensorView& weight = {},
                  const TensorView& bias = {}, float eps = 1e-5f);
// F.gelu. approximate = "none": x * Phi(x) with the erf (nn.GELU's default); "tanh":
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Anything else: ValueError.
Tensor gelu(const TensorView& x, std::string_view approximate = "none");
// F.cross_entropy(logits, targets) with reduction="mean": logits (N, C), targets N class ids in
// [0, C) (IndexError otherwise); returns a 0-D tensor. log-softmax in float64 per row.
Tensor cross_entropy(const TensorView& logits, std::span<const int64_t> targets);

// ---- backward functions ----------------------------------------------------------------------
// Each takes the gradient of the loss with respect to its forward's output (grad_out, the
// forward output's shape) plus what the forward saw, and returns the gradients of the inputs.
// A grad_out, mask or saved tensor of the wrong shape throws ShapeError naming the argument.
// Nothing is accumulated: the caller (a module) adds parameter gradients where it keeps them.

// (src/ops/backward.cpp)
// linear: grad_out (..., out), x (..., in), weight (out, in).
struct LinearGrads {
  Tensor grad_input;   // x's shape: grad_out @ weight
  Tensor grad_weight;  // (out, in): sum over rows of grad_out^T x
  Tensor grad_bias;    // (out): sum over rows of grad_out; undefined unless has_bias
};
LinearGrads linear_backward(const TensorView& grad_out, const TensorView& x,
                            const TensorView& weight, bool has_bias);
// softmax: grad_out and softmax_out (the forward's result) of one shape.
// dx = y * (g - sum(g * y, dim)).
Tensor softmax_backward(const TensorView& grad_out, const TensorView& softmax_out, int dim);
// Softmax of x with the positions where mask != 0 excluded (masked_fill's convention, as the
// chapter's masked_fill(mask.bool(), -inf) then softmax); mask broadcasts to x. A row with
// every position masked gives 0 (torch._masked_softmax; attn's SDPA policy), never NaN.
Tensor masked_softmax(const TensorView& x, const TensorView& mask, int dim);
// masked_softmax's backward: softmax_backward with masked positions' gradient exactly 0.
Tensor masked_softmax_backward(const TensorView& grad_out, const TensorView& softmax_out,
                               const TensorView& mask, int dim);
// masked_fill's backward with respect to x: grad_out with the filled positions zeroed.
Tensor masked_fill_backward(const TensorView& grad_out, const TensorView& mask);
// dropout: keep_mask and p from dropout_with_mask; grad_out * keep_mask / (1 - p) (the
// forward's float32 scale), zeros when p == 1.
Tensor dropout_backward(const TensorView& grad_out, const TensorView& keep_mask, float p);
// embedding: grad_out (ids_shape + [dim]) -> (num_embeddings, dim); rows of repeated ids add
// up, rows of unused ids are 0. Ids out of range throw IndexError as the forward does.
Tensor embedding_backward(const TensorView& grad_out, std::span<const int64_t> ids,
                          const Shape& ids_shape, int64_t num_embeddings);

// (src/ops/norm_act_loss.cpp)
// layer_norm: grad_out and x (..., C); mean and rstd are recomputed from x exactly as the
// forward computed them.
struct LayerNormGrads {
  Tensor grad_input;   // x's shape
  Tensor grad_weight;  // (C), undefined when weight is undefined
  Tensor grad_bias;    // (C), undefined when bias is undefined
};
LayerNormGrads layer_norm_backward(const TensorView& grad_out, const TensorView& x,
                                   const Shape& normalized_shape, const TensorView& weight = {},
                                   const TensorView& bias = {}, float eps = 1e-5f);
// gelu: grad_out and x of one shape.
Tensor gelu_backward(const TensorView& grad_out, const TensorView& x,
                     std::string_view approximate = "none");
// cross_entropy: grad_out 0-D (the loss's gradient, 1 for loss.backward()) -> (N, C):
// (softmax(logits) - onehot(targets)) * grad_out / N.
Tensor cross_entropy_backward(const TensorView& grad_out, const TensorView& logits,
                              std::span<const int64_t> targets);

}  // namespace attn

#include "attn/sdpa.hpp"

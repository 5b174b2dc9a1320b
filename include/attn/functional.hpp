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
#include <vector>

#include "attn/random.hpp"
#include "attn/tensor.hpp"

namespace attn {

// ---- elementwise and reductions (src/reference/elementwise.cpp) -------------------------------
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

// ---- matrix products (src/reference/matmul.cpp; CBLAS sgemm) --------------------------------
// torch.matmul: 1-D·1-D (dot, 0-D result), 2-D @ 2-D, 1-D/2-D mixes, and batched N-D with
// broadcast batch dims. Transposed views are passed to BLAS without copying.
Tensor matmul(const TensorView& a, const TensorView& b);
Tensor dot(const TensorView& a, const TensorView& b);

// ---- softmax (src/reference/softmax.cpp) -----------------------------------------------------
// Stable softmax: exp(x - max) / sum. A row that is entirely -inf gives NaN, as in PyTorch's
// torch.softmax; scaled_dot_product_attention instead defines fully masked rows as 0.
Tensor softmax(const TensorView& x, int dim);
// The chapter's softmax_naive: exp(x) / exp(x).sum(dim). Overflows for large inputs (that is
// the lesson); kept for teaching, never used by attention.
Tensor softmax_naive(const TensorView& x, int dim);

// ---- masks, layers (src/reference/nn_ops.cpp) ------------------------------------------------
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

}  // namespace attn

#include "attn/sdpa.hpp"

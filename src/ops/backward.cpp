// Backward functions of the layers in nn_ops.cpp and softmax.cpp: linear, softmax, masked
// softmax, masked_fill, dropout and embedding. Each mirrors its forward and returns the
// gradients of the forward's inputs; modules accumulate parameter gradients themselves.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>

#include "attn/error.hpp"
#include "attn/functional.hpp"

namespace attn {
namespace {

void require_shape(const TensorView& t, const Shape& expected, const char* fn, const char* arg) {
  if (!t.defined() || !(t.shape() == expected)) {
    throw ShapeError(fmt::format("{}: {} must have shape {}, got {}", fn, arg, expected.str(),
                                 t.defined() ? t.shape().str() : "undefined"));
  }
}

int wrap_dim(int dim, int ndim, const char* fn) {
  const int nd = std::max(ndim, 1);
  if (dim < -nd || dim >= nd) {
    throw IndexError(fmt::format("{}: dim {} out of range for a {}-D tensor (expected [{}, {}])",
                                 fn, dim, ndim, -nd, nd - 1));
  }
  return dim < 0 ? dim + nd : dim;
}

}  // namespace

LinearGrads linear_backward(const TensorView& grad_out, const TensorView& x,
                            const TensorView& weight, bool has_bias) {
  // grad_out (..., out), x (..., in), weight (out, in) -> dx (..., in), dW (out, in), db (out)
  if (!weight.defined() || weight.dim() != 2) {
    throw ShapeError(fmt::format("linear_backward: weight must be 2-D (out_features, in_features), got {}",
                                 weight.defined() ? weight.shape().str() : "undefined"));
  }
  const int64_t out_f = weight.size(0), in_f = weight.size(1);
  if (!x.defined() || x.dim() == 0 || x.size(-1) != in_f) {
    throw ShapeError(fmt::format("linear_backward: x's last dim must equal in_features = {}, got {}",
                                 in_f, x.defined() ? x.shape().str() : "undefined"));
  }
  Shape out_shape = x.shape();
  out_shape[x.dim() - 1] = out_f;
  require_shape(grad_out, out_shape, "linear_backward", "grad_out");

  const int64_t rows = x.numel() / std::max<int64_t>(in_f, 1);
  LinearGrads g;
  if (rows == 0 || in_f == 0 || out_f == 0) {
    g.grad_input = Tensor::zeros(x.shape());
    g.grad_weight = Tensor::zeros(weight.shape());
    if (has_bias) g.grad_bias = Tensor::zeros({out_f});
    return g;
  }
  const Tensor gc = grad_out.contiguous(), xc = x.contiguous();
  const TensorView g2 = gc.view({rows, out_f}), x2 = xc.view({rows, in_f});
  const Tensor dx = matmul(g2, weight);  // (rows, in)
  g.grad_input = Tensor::empty(x.shape());
  std::copy_n(dx.data(), dx.numel(), g.grad_input.data());
  g.grad_weight = matmul(g2.t(), x2);  // (out, in)
  if (has_bias) g.grad_bias = sum(g2, 0);
  return g;
}

Tensor softmax_backward(const TensorView& grad_out, const TensorView& softmax_out, int dim) {
  // grad_out, softmax_out (any shape, equal) -> dx: y * (g - sum(g * y, dim))
  require_shape(grad_out, softmax_out.shape(), "softmax_backward", "grad_out");
  const int d = wrap_dim(dim, softmax_out.dim(), "softmax_backward");
  if (softmax_out.dim() == 0) return Tensor::zeros({});  // a 1-element softmax is constant
  // Work on rows along the last dim: move `dim` there (transpose is its own inverse).
  const int last = softmax_out.dim() - 1;
  const Tensor g = grad_out.transpose(d, last).contiguous();
  const Tensor y = softmax_out.transpose(d, last).contiguous();
  Tensor dx = Tensor::empty(y.shape());
  const int64_t n = y.size(-1), rows = n == 0 ? 0 : y.numel() / n;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g.data() + r * n;
    const float* yr = y.data() + r * n;
    float* out = dx.data() + r * n;
    double dot = 0.0;  // float64 so long rows lose nothing to the subtraction below
    for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(gr[j]) * yr[j];
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(yr[j] * (gr[j] - dot));
  }
  return dx.transpose(d, last).contiguous();
}

Tensor masked_softmax(const TensorView& x, const TensorView& mask, int dim) {
  // x (any), mask broadcast to x (nonzero = excluded) -> y (x's shape)
  Tensor y = softmax(masked_fill(x, mask, -std::numeric_limits<float>::infinity()), dim);
  // Fully masked rows came out NaN (0/0); every masked position is 0 by definition.
  masked_fill_(y, mask, 0.0f);
  return y;
}

Tensor masked_softmax_backward(const TensorView& grad_out, const TensorView& softmax_out,
                               const TensorView& mask, int dim) {
  // grad_out, softmax_out (x's shape), mask broadcast to x -> dx (x's shape)
  Tensor dx = softmax_backward(grad_out, softmax_out, dim);
  masked_fill_(dx, mask, 0.0f);  // a NaN or inf in grad_out must not reach excluded inputs
  return dx;
}

Tensor masked_fill_backward(const TensorView& grad_out, const TensorView& mask) {
  // grad_out (x's shape), mask broadcast to x -> dx (x's shape)
  return masked_fill(grad_out, mask, 0.0f);
}

Tensor dropout_backward(const TensorView& grad_out, const TensorView& keep_mask, float p) {
  // grad_out, keep_mask (x's shape) -> dx = grad_out * (keep_mask / (1 - p))
  if (!(p >= 0.0f && p <= 1.0f)) {
    throw ValueError(fmt::format("dropout_backward: probability p must be in [0, 1], got {}", p));
  }
  if (!grad_out.defined()) throw ShapeError("dropout_backward: grad_out is undefined");
  require_shape(keep_mask, grad_out.shape(), "dropout_backward", "keep_mask");
  if (p == 1.0f) return Tensor::zeros(grad_out.shape());
  // The forward's float32 factor noise / (1 - p), so the backward scales exactly as it did.
  const float keep = 1.0f - p;
  const Tensor m = keep_mask.contiguous();
  Tensor dx = grad_out.contiguous();
  for (int64_t i = 0; i < dx.numel(); ++i) dx.data()[i] *= m.data()[i] / keep;
  return dx;
}

Tensor embedding_backward(const TensorView& grad_out, std::span<const int64_t> ids,
                          const Shape& ids_shape, int64_t num_embeddings) {
  // grad_out (ids_shape + [dim]), ids (ids_shape.numel()) -> dW (num_embeddings, dim)
  if (num_embeddings <= 0) {
    throw ValueError(fmt::format("embedding_backward: num_embeddings must be positive, got {}",
                                 num_embeddings));
  }
  if (static_cast<int64_t>(ids.size()) != ids_shape.numel()) {
    throw ShapeError(fmt::format("embedding_backward: {} ids given for ids shape {}", ids.size(),
                                 ids_shape.str()));
  }
  if (!grad_out.defined() || grad_out.dim() != ids_shape.ndim() + 1) {
    throw ShapeError(fmt::format("embedding_backward: grad_out must have shape {} + [embedding_dim], got {}",
                                 ids_shape.str(), grad_out.defined() ? grad_out.shape().str() : "undefined"));
  }
  const int64_t dim = grad_out.size(-1);
  Shape expected = ids_shape;
  expected.push_back(dim);
  require_shape(grad_out, expected, "embedding_backward", "grad_out");
  Tensor dw = Tensor::zeros({num_embeddings, dim});
  const Tensor g = grad_out.contiguous();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= num_embeddings) {
      throw IndexError(fmt::format("embedding_backward: id {} at position {} is out of range [0, {})",
                                   ids[i], i, num_embeddings));
    }
    float* row = dw.data() + ids[i] * dim;
    const float* src = g.data() + static_cast<int64_t>(i) * dim;
    for (int64_t j = 0; j < dim; ++j) row[j] += src[j];
  }
  return dw;
}

}  // namespace attn

// masked_fill, triu/tril, linear, dropout and embedding: the small layers the chapter builds
// attention from.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/functional.hpp"

namespace attn {

void masked_fill_(const TensorView& x, const TensorView& mask, float value) {
  const Shape b = broadcast_shapes(x.shape(), mask.shape(), "masked_fill (mask vs. self)");
  if (!(b == x.shape())) {
    throw ShapeError(fmt::format("masked_fill: mask of shape {} does not broadcast to self's shape {}",
                                 mask.shape().str(), x.shape().str()));
  }
  const TensorView m = mask.expand(x.shape());
  std::vector<int64_t> moffs;
  moffs.reserve(static_cast<size_t>(x.numel()));
  for_each_offset(m, [&](int64_t o) { moffs.push_back(o); });
  size_t i = 0;
  for_each_offset(x, [&](int64_t o) {
    if (m.data()[moffs[i++]] != 0.0f) x.data()[o] = value;
  });
}

Tensor masked_fill(const TensorView& x, const TensorView& mask, float value) {
  Tensor out = x.contiguous();
  masked_fill_(out, mask, value);
  return out;
}

namespace {
Tensor triangle(const TensorView& x, int64_t diagonal, bool upper, const char* name) {
  if (x.dim() < 2) {
    throw ShapeError(fmt::format("{}: expected a tensor with at least 2 dimensions, got shape {}",
                                 name, x.shape().str()));
  }
  Tensor out = x.contiguous();
  const int64_t rows = x.size(-2), cols = x.size(-1);
  const int64_t mats = rows * cols == 0 ? 0 : out.numel() / (rows * cols);
  for (int64_t b = 0; b < mats; ++b) {
    float* m = out.data() + b * rows * cols;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const bool keep = upper ? (j - i >= diagonal) : (j - i <= diagonal);
        if (!keep) m[i * cols + j] = 0.0f;
      }
    }
  }
  return out;
}
}  // namespace

Tensor triu(const TensorView& x, int64_t diagonal) { return triangle(x, diagonal, true, "triu"); }
Tensor tril(const TensorView& x, int64_t diagonal) { return triangle(x, diagonal, false, "tril"); }

Tensor linear(const TensorView& x, const TensorView& weight, const TensorView& bias) {
  if (weight.dim() != 2) {
    throw ShapeError(fmt::format("linear: weight must be 2-D (out_features, in_features), got shape {}",
                                 weight.shape().str()));
  }
  if (x.dim() == 0 || x.size(-1) != weight.size(1)) {
    throw ShapeError(fmt::format(
        "linear: input's last dim must equal in_features = {} (weight shape {}), got input shape {}",
        weight.size(1), weight.shape().str(), x.shape().str()));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    throw ShapeError(fmt::format("linear: bias must have shape [{}], got {}", weight.size(0),
                                 bias.shape().str()));
  }
  // Fold leading dims into rows when x is contiguous, as torch does for N-D input.
  Tensor out;
  if (x.dim() > 2 && x.is_contiguous()) {
    Shape out_shape = x.shape();
    out_shape[x.dim() - 1] = weight.size(0);
    const Tensor flat = matmul(x.view({-1, x.size(-1)}), weight.t());
    out = Tensor::empty(out_shape);
    std::copy_n(flat.data(), flat.numel(), out.data());
  } else {
    out = matmul(x, weight.t());
  }
  if (bias.defined()) {
    const int64_t n = weight.size(0);
    float* d = out.data();
    for (int64_t i = 0; i < out.numel(); ++i) d[i] += bias.data()[(i % n) * bias.stride(0)];
  }
  return out;
}

DropoutResult dropout_with_mask(const TensorView& x, float p, bool training, Generator& gen) {
  if (!(p >= 0.0f && p <= 1.0f)) {
    throw ValueError(fmt::format("dropout: probability p must be in [0, 1], got {}", p));
  }
  if (!training || p == 0.0f) return {x.contiguous(), Tensor::ones(x.shape()), 0.0f};
  if (p == 1.0f) return {Tensor::zeros(x.shape()), Tensor::zeros(x.shape()), 1.0f};
  Tensor noise = Tensor::empty(x.shape());
  bernoulli_(noise, 1.0 - static_cast<double>(p), gen);
  // PyTorch: noise.div_(1 - p) in float32, then x * noise.
  const float keep = 1.0f - p;
  Tensor out = x.contiguous();
  for (int64_t i = 0; i < out.numel(); ++i) out.data()[i] *= noise.data()[i] / keep;
  return {std::move(out), std::move(noise), p};
}

Tensor dropout(const TensorView& x, float p, bool training, Generator& gen) {
  return dropout_with_mask(x, p, training, gen).output;
}

Tensor embedding(std::span<const int64_t> ids, const Shape& ids_shape, const TensorView& weight) {
  if (weight.dim() != 2) {
    throw ShapeError(fmt::format("embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {}",
                                 weight.shape().str()));
  }
  if (static_cast<int64_t>(ids.size()) != ids_shape.numel()) {
    throw ShapeError(fmt::format("embedding: {} ids given for ids shape {}", ids.size(),
                                 ids_shape.str()));
  }
  const int64_t num = weight.size(0), dim = weight.size(1);
  Shape out_shape = ids_shape;
  out_shape.push_back(dim);
  Tensor out = Tensor::empty(out_shape);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= num) {
      throw IndexError(fmt::format("embedding: id {} at position {} is out of range [0, {})", ids[i],
                                   i, num));
    }
    const TensorView row = weight.select(0, ids[i]);
    for (int64_t j = 0; j < dim; ++j) out.data()[static_cast<int64_t>(i) * dim + j] = row.data()[j * row.stride(0)];
  }
  return out;
}

}  // namespace attn

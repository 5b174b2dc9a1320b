// Layer norm, GELU and cross-entropy (what a GPT block and its training loop add to the
// chapter's attention), each with its backward beside it. Row statistics are taken in float64:
// these ops are not on the attention hot path, and float64 keeps their gradients well inside
// the tolerances the tests justify.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

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

// Validates layer_norm's arguments; returns C, the normalised (last) dim.
int64_t check_layer_norm(const TensorView& x, const Shape& normalized_shape, const TensorView& weight,
                         const TensorView& bias, float eps, const char* fn) {
  if (!x.defined() || x.dim() == 0) {
    throw ShapeError(fmt::format("{}: x must have at least 1 dimension, got {}", fn,
                                 x.defined() ? x.shape().str() : "undefined"));
  }
  const int64_t c = x.size(-1);
  if (!(normalized_shape == Shape{c})) {
    throw ShapeError(fmt::format("{}: normalized_shape must be [{}] (x's last dim; only the last dim "
                                 "is supported), got {} for x of shape {}",
                                 fn, c, normalized_shape.str(), x.shape().str()));
  }
  if (weight.defined()) require_shape(weight, {c}, fn, "weight");
  if (bias.defined()) require_shape(bias, {c}, fn, "bias");
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    throw ValueError(fmt::format("{}: eps must be finite and >= 0, got {}", fn, eps));
  }
  return c;
}

struct RowStats {
  double mean, rstd;
};

RowStats row_stats(const float* row, int64_t c, float eps) {
  double mean = 0.0;
  for (int64_t j = 0; j < c; ++j) mean += row[j];
  mean /= static_cast<double>(c);
  double var = 0.0;  // biased, as F.layer_norm
  for (int64_t j = 0; j < c; ++j) var += (row[j] - mean) * (row[j] - mean);
  var /= static_cast<double>(c);
  return {mean, 1.0 / std::sqrt(var + static_cast<double>(eps))};
}

bool gelu_is_tanh(std::string_view approximate, const char* fn) {
  if (approximate == "none") return false;
  if (approximate == "tanh") return true;
  throw ValueError(fmt::format("{}: approximate must be 'none' or 'tanh', got '{}'", fn,
                               std::string(approximate)));
}

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;

void check_cross_entropy(const TensorView& logits, std::span<const int64_t> targets, const char* fn) {
  if (!logits.defined() || logits.dim() != 2 || logits.size(1) == 0) {
    throw ShapeError(fmt::format("{}: logits must have shape (N, C) with C > 0, got {}", fn,
                                 logits.defined() ? logits.shape().str() : "undefined"));
  }
  if (static_cast<int64_t>(targets.size()) != logits.size(0)) {
    throw ShapeError(fmt::format("{}: targets must have N = {} entries (logits shape {}), got {}", fn,
                                 logits.size(0), logits.shape().str(), targets.size()));
  }
  const int64_t c = logits.size(1);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0 || targets[i] >= c) {
      throw IndexError(fmt::format("{}: target {} at position {} is out of range [0, {})", fn,
                                   targets[i], i, c));
    }
  }
}

// log(sum_j exp(row_j)) in float64, stable.
double log_sum_exp(const float* row, int64_t c) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < c; ++j) mx = std::max(mx, static_cast<double>(row[j]));
  if (std::isinf(mx)) return mx;
  double s = 0.0;
  for (int64_t j = 0; j < c; ++j) s += std::exp(row[j] - mx);
  return mx + std::log(s);
}

}  // namespace

// ---- layer norm -------------------------------------------------------------------------------

Tensor layer_norm(const TensorView& x, const Shape& normalized_shape, const TensorView& weight,
                  const TensorView& bias, float eps) {
  // x (..., C), weight (C), bias (C) -> y (..., C) = (x - mean) * rstd * weight + bias
  const int64_t c = check_layer_norm(x, normalized_shape, weight, bias, eps, "layer_norm");
  Tensor y = x.contiguous();
  const Tensor w = weight.defined() ? weight.contiguous() : Tensor();
  const Tensor b = bias.defined() ? bias.contiguous() : Tensor();
  const int64_t rows = c == 0 ? 0 : y.numel() / c;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y.data() + r * c;
    const RowStats s = row_stats(row, c, eps);
    for (int64_t j = 0; j < c; ++j) {
      double v = (row[j] - s.mean) * s.rstd;
      if (w.defined()) v *= w.data()[j];
      if (b.defined()) v += b.data()[j];
      row[j] = static_cast<float>(v);
    }
  }
  return y;
}

LayerNormGrads layer_norm_backward(const TensorView& grad_out, const TensorView& x,
                                   const Shape& normalized_shape, const TensorView& weight,
                                   const TensorView& bias, float eps) {
  // grad_out, x (..., C), weight (C) -> dx (..., C), dweight (C), dbias (C)
  //   xhat = (x - mean) * rstd,  dxhat = g * weight,
  //   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
  const int64_t c = check_layer_norm(x, normalized_shape, weight, bias, eps, "layer_norm_backward");
  require_shape(grad_out, x.shape(), "layer_norm_backward", "grad_out");
  const Tensor xc = x.contiguous(), g = grad_out.contiguous();
  const Tensor w = weight.defined() ? weight.contiguous() : Tensor();
  LayerNormGrads out;
  out.grad_input = Tensor::empty(x.shape());
  std::vector<double> dw(static_cast<size_t>(c), 0.0), db(static_cast<size_t>(c), 0.0);
  std::vector<double> xhat(static_cast<size_t>(c)), dxhat(static_cast<size_t>(c));
  const int64_t rows = c == 0 ? 0 : xc.numel() / c;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xc.data() + r * c;
    const float* gr = g.data() + r * c;
    const RowStats s = row_stats(xr, c, eps);
    double mean_d = 0.0, mean_dx = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      xhat[j] = (xr[j] - s.mean) * s.rstd;
      dxhat[j] = w.defined() ? gr[j] * static_cast<double>(w.data()[j]) : gr[j];
      mean_d += dxhat[j];
      mean_dx += dxhat[j] * xhat[j];
      dw[j] += gr[j] * xhat[j];
      db[j] += gr[j];
    }
    mean_d /= static_cast<double>(c);
    mean_dx /= static_cast<double>(c);
    float* dxr = out.grad_input.data() + r * c;
    for (int64_t j = 0; j < c; ++j) {
      dxr[j] = static_cast<float>(s.rstd * (dxhat[j] - mean_d - xhat[j] * mean_dx));
    }
  }
  auto to_tensor = [c](const std::vector<double>& v) {
    Tensor t = Tensor::empty({c});
    for (int64_t j = 0; j < c; ++j) t.data()[j] = static_cast<float>(v[j]);
    return t;
  };
  if (weight.defined()) out.grad_weight = to_tensor(dw);
  if (bias.defined()) out.grad_bias = to_tensor(db);
  return out;
}

// ---- GELU -----------------------------------------------------------------------------------------

Tensor gelu(const TensorView& x, std::string_view approximate) {
  // x (any) -> y (x's shape)
  const bool tanh_form = gelu_is_tanh(approximate, "gelu");
  Tensor y = x.contiguous();
  for (int64_t i = 0; i < y.numel(); ++i) {
    const double v = y.data()[i];
    const double r = tanh_form ? 0.5 * v * (1.0 + std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v)))
                               : 0.5 * v * (1.0 + std::erf(v * std::numbers::sqrt2 / 2.0));
    y.data()[i] = static_cast<float>(r);
  }
  return y;
}

Tensor gelu_backward(const TensorView& grad_out, const TensorView& x, std::string_view approximate) {
  // grad_out, x (one shape) -> dx = grad_out * gelu'(x)
  const bool tanh_form = gelu_is_tanh(approximate, "gelu_backward");
  if (!x.defined()) throw ShapeError("gelu_backward: x is undefined");
  require_shape(grad_out, x.shape(), "gelu_backward", "grad_out");
  const Tensor xc = x.contiguous();
  Tensor dx = grad_out.contiguous();
  for (int64_t i = 0; i < dx.numel(); ++i) {
    const double v = xc.data()[i];
    double d;
    if (tanh_form) {
      const double t = std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
      d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * v * v);
    } else {
      // Phi(x) + x * phi(x)
      d = 0.5 * (1.0 + std::erf(v * std::numbers::sqrt2 / 2.0)) +
          v * std::exp(-0.5 * v * v) * std::numbers::inv_sqrtpi / std::numbers::sqrt2;
    }
    dx.data()[i] = static_cast<float>(dx.data()[i] * d);
  }
  return dx;
}

// ---- cross-entropy ----------------------------------------------------------------------------

Tensor cross_entropy(const TensorView& logits, std::span<const int64_t> targets) {
  // logits (N, C), targets (N) -> 0-D mean over rows of logsumexp(row) - row[target]
  check_cross_entropy(logits, targets, "cross_entropy");
  const Tensor l = logits.contiguous();
  const int64_t n = l.size(0), c = l.size(1);
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = l.data() + r * c;
    total += log_sum_exp(row, c) - row[targets[r]];
  }
  // N == 0 gives 0/0 = NaN, as torch's mean over nothing.
  return Tensor::scalar(static_cast<float>(total / static_cast<double>(n)));
}

Tensor cross_entropy_backward(const TensorView& grad_out, const TensorView& logits,
                              std::span<const int64_t> targets) {
  // grad_out 0-D, logits (N, C), targets (N) -> dlogits (N, C) = (softmax - onehot) * g / N
  check_cross_entropy(logits, targets, "cross_entropy_backward");
  require_shape(grad_out, Shape{}, "cross_entropy_backward", "grad_out");
  const Tensor l = logits.contiguous();
  const int64_t n = l.size(0), c = l.size(1);
  Tensor dl = Tensor::empty(l.shape());
  const double scale = static_cast<double>(grad_out.item()) / static_cast<double>(n);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = l.data() + r * c;
    float* out = dl.data() + r * c;
    const double lse = log_sum_exp(row, c);
    for (int64_t j = 0; j < c; ++j) {
      const double p = std::exp(row[j] - lse) - (j == targets[r] ? 1.0 : 0.0);
      out[j] = static_cast<float>(p * scale);
    }
  }
  return dl;
}

}  // namespace attn

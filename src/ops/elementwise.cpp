// Elementwise arithmetic, reductions and concatenation over strided views.
//
// Straightforward loops: these serve the chapter's small steps (normalising scores, row sums,
// the variance experiment) and the modules' glue, never the attention hot loop.
#include <cmath>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "ops/cascade_sum.hpp"

namespace attn {
namespace {

template <typename Op>
Tensor binary(const TensorView& a, const TensorView& b, const char* name, Op op) {
  if (!a.defined() || !b.defined()) throw ValueError(fmt::format("{}: an operand is undefined", name));
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const TensorView ea = a.expand(shape), eb = b.expand(shape);
  Tensor out = Tensor::empty(shape);
  // Walk both inputs with the same odometer by traversing a stacked offset pair.
  std::vector<int64_t> offa, offb;
  offa.reserve(static_cast<size_t>(out.numel()));
  offb.reserve(static_cast<size_t>(out.numel()));
  for_each_offset(ea, [&](int64_t o) { offa.push_back(o); });
  for_each_offset(eb, [&](int64_t o) { offb.push_back(o); });
  float* dst = out.data();
  for (size_t i = 0; i < offa.size(); ++i) dst[i] = op(ea.data()[offa[i]], eb.data()[offb[i]]);
  return out;
}

template <typename Op>
Tensor unary(const TensorView& x, Op op) {
  Tensor out = Tensor::empty(x.shape());
  float* dst = out.data();
  for_each_offset(x, [&](int64_t o) { *dst++ = op(x.data()[o]); });
  return out;
}

int wrap(int dim, int ndim, const char* name) {
  if (dim < -ndim || dim >= ndim) {
    throw IndexError(fmt::format("{}: dim {} out of range for a {}-D tensor (expected [{}, {}])",
                                 name, dim, ndim, -ndim, ndim - 1));
  }
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace

Tensor add(const TensorView& a, const TensorView& b) {
  return binary(a, b, "add", [](float x, float y) { return x + y; });
}
Tensor sub(const TensorView& a, const TensorView& b) {
  return binary(a, b, "sub", [](float x, float y) { return x - y; });
}
Tensor mul(const TensorView& a, const TensorView& b) {
  return binary(a, b, "mul", [](float x, float y) { return x * y; });
}
Tensor div(const TensorView& a, const TensorView& b) {
  return binary(a, b, "div", [](float x, float y) { return x / y; });
}
Tensor add(const TensorView& a, float b) { return unary(a, [b](float x) { return x + b; }); }
Tensor mul(const TensorView& a, float b) { return unary(a, [b](float x) { return x * b; }); }
Tensor div(const TensorView& a, float b) { return unary(a, [b](float x) { return x / b; }); }
Tensor exp(const TensorView& x) { return unary(x, [](float v) { return std::exp(v); }); }

Tensor sum(const TensorView& x) {
  // PyTorch's summation order: a float64 sum would print "tensor(1.)" where PyTorch prints
  // "tensor(1.0000)".
  if (x.is_contiguous()) return Tensor::scalar(detail::cascade_sum(x.data(), x.numel(), 1));
  const Tensor c = x.contiguous();
  return Tensor::scalar(detail::cascade_sum(c.data(), c.numel(), 1));
}

Tensor sum(const TensorView& x, int dim, bool keepdim) {
  const int d = wrap(dim, x.dim(), "sum");
  Shape out_shape;
  for (int i = 0; i < x.dim(); ++i) {
    if (i != d) out_shape.push_back(x.size(i));
    else if (keepdim) out_shape.push_back(1);
  }
  Tensor out = Tensor::empty(out_shape);
  const int64_t n = x.size(d), stride = x.stride(d);
  // The remaining dims in their original order (the output's order), each with x's stride.
  Shape outer_shape, outer_strides;
  for (int i = 0; i < x.dim(); ++i) {
    if (i == d) continue;
    outer_shape.push_back(x.size(i));
    outer_strides.push_back(x.stride(i));
  }
  const TensorView outer(x.data(), outer_shape, outer_strides);
  float* dst = out.data();
  for_each_offset(outer, [&](int64_t o) {
    *dst++ = detail::cascade_sum(x.data() + o, n, stride);
  });
  return out;
}

Tensor mean(const TensorView& x) {
  if (x.numel() == 0) throw ValueError("mean: empty tensor");
  double acc = 0.0;
  for_each_offset(x, [&](int64_t o) { acc += x.data()[o]; });
  return Tensor::scalar(static_cast<float>(acc / static_cast<double>(x.numel())));
}

Tensor var(const TensorView& x, bool unbiased) {
  const int64_t n = x.numel();
  if (n == 0 || (unbiased && n < 2)) {
    throw ValueError(fmt::format("var: needs at least {} elements, got {}", unbiased ? 2 : 1, n));
  }
  // Welford in float64, as PyTorch's CPU var kernel.
  double m = 0.0, m2 = 0.0;
  int64_t k = 0;
  for_each_offset(x, [&](int64_t o) {
    const double v = x.data()[o];
    ++k;
    const double delta = v - m;
    m += delta / static_cast<double>(k);
    m2 += delta * (v - m);
  });
  return Tensor::scalar(static_cast<float>(m2 / static_cast<double>(unbiased ? n - 1 : n)));
}

Tensor cat(std::span<const TensorView> tensors, int dim) {
  if (tensors.empty()) throw ValueError("cat: expected a non-empty list of tensors");
  const TensorView& first = tensors[0];
  const int d = wrap(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[d] = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorView& x = tensors[t];
    for (int i = 0; i < first.dim(); ++i) {
      if (x.dim() != first.dim() || (i != d && x.size(i) != first.size(i))) {
        throw ShapeError(fmt::format("cat: tensor {} has shape {}, expected {} except in dim {}",
                                     t, x.shape().str(), first.shape().str(), d));
      }
    }
    shape[d] += x.size(d);
  }
  Tensor out = Tensor::empty(shape);
  int64_t start = 0;
  for (const TensorView& x : tensors) {
    const TensorView dst = out.slice(d, start, start + x.size(d));
    std::vector<int64_t> offs;
    for_each_offset(dst, [&](int64_t o) { offs.push_back(o); });
    size_t i = 0;
    for_each_offset(x, [&](int64_t o) { dst.data()[offs[i++]] = x.data()[o]; });
    start += x.size(d);
  }
  return out;
}

Tensor stack(std::span<const TensorView> tensors, int dim) {
  if (tensors.empty()) throw ValueError("stack: expected a non-empty list of tensors");
  const int d = wrap(dim, tensors[0].dim() + 1, "stack");
  std::vector<TensorView> expanded;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (!(tensors[t].shape() == tensors[0].shape())) {
      throw ShapeError(fmt::format("stack: tensor {} has shape {}, expected {}", t,
                                   tensors[t].shape().str(), tensors[0].shape().str()));
    }
    expanded.push_back(tensors[t].unsqueeze(d));
  }
  return cat(expanded, d);
}

}  // namespace attn

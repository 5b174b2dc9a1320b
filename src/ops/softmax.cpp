// Softmax along one dimension: the stable form (subtract the row max) and the chapter's naive
// form (exp(x) / sum exp(x)), which overflows to inf/NaN for inputs above ~88.
#include <cmath>
#include <fmt/format.h>
#include <limits>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "ops/cascade_sum.hpp"

namespace attn {
namespace {

// Applies row_fn(in_row_ptr, in_stride, out_row_ptr, n) to every 1-D slice along `dim`.
template <typename RowFn>
Tensor along_dim(const TensorView& x, int dim, const char* name, RowFn row_fn) {
  const int nd = x.dim() == 0 ? 1 : x.dim();
  if (dim < -nd || dim >= nd) {
    throw IndexError(fmt::format("{}: dim {} out of range for a {}-D tensor (expected [{}, {}])",
                                 name, dim, x.dim(), -nd, nd - 1));
  }
  Tensor out = Tensor::empty(x.shape());
  if (x.dim() == 0) {
    row_fn(x.data(), 1, out.data(), 1, 1);
    return out;
  }
  const int d = dim < 0 ? dim + x.dim() : dim;
  // Iterate over every slice: the view with `dim` removed gives the slice starts.
  const TensorView starts_in = x.select(d, 0);
  const TensorView starts_out = out.select(d, 0);
  std::vector<int64_t> out_offsets;
  for_each_offset(starts_out, [&](int64_t o) { out_offsets.push_back(o); });
  size_t i = 0;
  const int64_t n = x.size(d);
  if (n == 0) return out;
  for_each_offset(starts_in, [&](int64_t o) {
    row_fn(x.data() + o, x.stride(d), out.data() + out_offsets[i++], out.stride(d), n);
  });
  return out;
}

}  // namespace

Tensor softmax(const TensorView& x, int dim) {
  return along_dim(x, dim, "softmax",
                   [](const float* in, int64_t is, float* out, int64_t os, int64_t n) {
                     float mx = -std::numeric_limits<float>::infinity();
                     for (int64_t j = 0; j < n; ++j) mx = std::max(mx, in[j * is]);
                     float s = 0.0f;
                     for (int64_t j = 0; j < n; ++j) {
                       const float e = std::exp(in[j * is] - mx);
                       out[j * os] = e;
                       s += e;
                     }
                     // PyTorch multiplies by the reciprocal of the sum (vec_softmax_lastdim).
                     const float inv = 1.0f / s;
                     for (int64_t j = 0; j < n; ++j) out[j * os] *= inv;
                   });
}

Tensor softmax_naive(const TensorView& x, int dim) {
  return along_dim(x, dim, "softmax_naive",
                   [](const float* in, int64_t is, float* out, int64_t os, int64_t n) {
                     // exp(x) / exp(x).sum(dim): the sum in PyTorch's order.
                     for (int64_t j = 0; j < n; ++j) out[j * os] = std::exp(in[j * is]);
                     const float s = detail::cascade_sum(out, n, os);
                     for (int64_t j = 0; j < n; ++j) out[j * os] /= s;
                   });
}

}  // namespace attn

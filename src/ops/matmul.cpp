// torch.matmul on top of CBLAS sgemm.
//
// Shapes: a (..., n, k) @ b (..., k, m) -> (..., n, m), batch dims broadcast; 1-D operands are
// promoted as in PyTorch (a vector on the left is a row, on the right a column) and the
// promoted dim removed from the result. A matrix operand whose last two dims are row-major or
// column-major (e.g. `keys.transpose(-2, -1)`) goes to BLAS as is with the matching transpose
// flag and leading dimension; any other layout is copied once into contiguous memory.
#include <algorithm>
#include <cblas.h>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/functional.hpp"

namespace attn {
namespace {

// A 2-D operand in BLAS terms.
struct BlasMatrix {
  const float* data;
  CBLAS_TRANSPOSE trans;
  int64_t ld;
};

// Returns the BLAS description of the (rows, cols) matrix starting at `data` with the given
// strides, or nullopt-like {nullptr} if the layout is not one BLAS accepts.
BlasMatrix as_blas(const float* data, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs == 1 && (rs >= cols || rows == 1)) return {data, CblasNoTrans, std::max<int64_t>(rs, std::max<int64_t>(cols, 1))};
  if (rs == 1 && (cs >= rows || cols == 1)) return {data, CblasTrans, std::max<int64_t>(cs, std::max<int64_t>(rows, 1))};
  return {nullptr, CblasNoTrans, 0};
}

}  // namespace

Tensor matmul(const TensorView& a_in, const TensorView& b_in) {
  if (!a_in.defined() || !b_in.defined()) throw ValueError("matmul: an operand is undefined");
  if (a_in.dim() == 0 || b_in.dim() == 0) {
    throw ShapeError(fmt::format("matmul: both arguments need at least 1 dimension, got shapes {} and {}",
                                 a_in.shape().str(), b_in.shape().str()));
  }
  const bool a_vec = a_in.dim() == 1, b_vec = b_in.dim() == 1;
  const TensorView a = a_vec ? a_in.unsqueeze(0) : a_in;   // (1, k)
  const TensorView b = b_vec ? b_in.unsqueeze(1) : b_in;   // (k, 1)
  const int64_t n = a.size(-2), k = a.size(-1), k2 = b.size(-2), m = b.size(-1);
  if (k != k2) {
    throw ShapeError(fmt::format(
        "matmul: inner dimensions differ: a has shape {} (k = {}), b has shape {} (k = {})",
        a_in.shape().str(), k, b_in.shape().str(), k2));
  }
  // Broadcast the batch dims.
  Shape a_batch, b_batch;
  for (int i = 0; i < a.dim() - 2; ++i) a_batch.push_back(a.size(i));
  for (int i = 0; i < b.dim() - 2; ++i) b_batch.push_back(b.size(i));
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul (batch dims)");
  Shape full_a = batch, full_b = batch, out_shape = batch;
  full_a.push_back(n), full_a.push_back(k);
  full_b.push_back(k), full_b.push_back(m);
  out_shape.push_back(n), out_shape.push_back(m);
  const TensorView ea = a.expand(full_a), eb = b.expand(full_b);

  Tensor out = Tensor::zeros(out_shape);
  const int64_t nbatch = batch.numel();
  if (nbatch > 0 && n > 0 && m > 0 && k > 0) {
    // Fall back to one contiguous copy when the matrix layout is not BLAS-compatible.
    Tensor ca, cb;
    const TensorView* pa = &ea;
    const TensorView* pb = &eb;
    const int bd = batch.ndim();
    if (as_blas(ea.data(), n, k, ea.stride(bd), ea.stride(bd + 1)).data == nullptr) {
      ca = ea.contiguous();
      pa = &ca;
    }
    if (as_blas(eb.data(), k, m, eb.stride(bd), eb.stride(bd + 1)).data == nullptr) {
      cb = eb.contiguous();
      pb = &cb;
    }
    Shape bstrides_a, bstrides_b;
    for (int i = 0; i < bd; ++i) {
      bstrides_a.push_back(pa->stride(i));
      bstrides_b.push_back(pb->stride(i));
    }
    for (int64_t bi = 0; bi < nbatch; ++bi) {
      int64_t rem = bi, oa = 0, ob = 0;
      for (int i = bd - 1; i >= 0; --i) {
        const int64_t idx = rem % batch[i];
        rem /= batch[i];
        oa += idx * bstrides_a[i];
        ob += idx * bstrides_b[i];
      }
      const BlasMatrix ma = as_blas(pa->data() + oa, n, k, pa->stride(bd), pa->stride(bd + 1));
      const BlasMatrix mb = as_blas(pb->data() + ob, k, m, pb->stride(bd), pb->stride(bd + 1));
      cblas_sgemm(CblasRowMajor, ma.trans, mb.trans, static_cast<int>(n), static_cast<int>(m),
                  static_cast<int>(k), 1.0f, ma.data, static_cast<int>(ma.ld), mb.data,
                  static_cast<int>(mb.ld), 0.0f, out.data() + bi * n * m, static_cast<int>(m));
    }
  }
  // Remove the dims added for 1-D operands.
  Shape final_shape = batch;
  if (!a_vec) final_shape.push_back(n);
  if (!b_vec) final_shape.push_back(m);
  if (final_shape == out_shape) return out;
  Tensor reshaped = Tensor::empty(final_shape);
  std::copy_n(out.data(), out.numel(), reshaped.data());
  return reshaped;
}

Tensor dot(const TensorView& a, const TensorView& b) {
  if (a.dim() != 1 || b.dim() != 1 || a.size(0) != b.size(0)) {
    throw ShapeError(fmt::format("dot: expected two 1-D tensors of equal length, got shapes {} and {}",
                                 a.shape().str(), b.shape().str()));
  }
  return matmul(a, b);
}

}  // namespace attn

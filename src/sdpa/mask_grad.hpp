// The gradient of an additive attn_mask (SdpaOptions::need_attn_mask_grad), shared by every
// backward: each kernel writes dS, the gradient of the final scores, of every (batch-head, query,
// key) it sees into zeroed (batch, L, S) rows (problem order: b row-major over p.lead), and the
// rows are then summed to the mask's own shape, as torch's autograd sums a broadcast operand's
// gradient.
//
// Memory traffic: a mask with an element per score (no broadcast: a per-head bias with batch 1,
// Swin's per-window ones) gets dS written into its float32 gradient tensor directly: one zeroing
// pass and one write of B*H*L*S floats, no reduction (a 16-bit mask: one more pass, rounding it).
// Any other mask gets a float32 buffer of that size (the tensor allocator's cached storage),
// which the reduction reads once.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/tensor.hpp"
#include "sdpa/problem.hpp"

namespace attn::detail {

// Where the kernels write dS: `rows` (batch * L * S floats, zeroed on construction by `threads`
// threads), then finish() returns the gradient in the mask's shape and dtype.
class MaskGradRows {
 public:
  MaskGradRows(const SdpaProblem& p, const TensorView& mask, int threads);
  float* rows() const { return rows_; }
  // Sums the rows over the dims the mask broadcasts along (its missing leading dims and its
  // size-1 ones) in float64, each output element over its rows in buffer order (deterministic for
  // any thread count), and rounds to the mask's dtype (16-bit: through float32, as every
  // float64 -> 16-bit conversion here and in c10 goes).
  Tensor finish(int threads);

 private:
  const SdpaProblem& p_;
  TensorView mask_;
  Tensor storage_;  // the float32 gradient itself (direct) or the buffer
  bool direct_;
  float* rows_;
};

// The float64 reference's version: dS rows in double, summed to the mask's shape (row-major).
std::vector<double> reduce_mask_grad(const double* ds, const SdpaProblem& p, const TensorView& mask);

// The float64 sums above as a tensor of the mask's shape and dtype (a 16-bit dtype rounded
// through float32, as in finish()).
Tensor mask_grad_tensor(const std::vector<double>& sums, const TensorView& mask);

}  // namespace attn::detail

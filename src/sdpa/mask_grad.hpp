// The gradient of an additive attn_mask (SdpaOptions::need_attn_mask_grad), shared by every
// backward: each kernel writes dS, the gradient of the final scores, of every (batch-head, query,
// key) it sees into zeroed (batch, L, S) rows (problem order: b row-major over p.lead), and the
// rows are then summed to the mask's own shape, as torch's autograd sums a broadcast operand's
// gradient.
//
// Memory traffic: a mask with an element per score (no broadcast: a per-head bias with batch 1,
// Swin's per-window ones) gets dS written into its gradient tensor directly: one zeroing pass and
// one write of B*H*L*S elements, no reduction. A bf16 one is written as bf16 by a kernel that
// rounds as it writes (the native bf16 backward); a 16-bit one from any other kernel takes a
// float32 buffer and one more pass, rounding it (measured on the bf16 backward, B 1, H 12, L = S
// 1024, E 64, 2 threads, AMD Zen 4: 14 ms of mask gradient on a 69 ms backward that way, the
// traffic of 3.5 passes over a float32 L x S). Any other mask gets a float32 buffer of that size
// (the tensor allocator's cached storage), which the reduction reads once.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/tensor.hpp"
#include "sdpa/problem.hpp"

namespace attn::detail {

// Where the kernels write dS: `rows` (batch * L * S floats, zeroed on construction by `threads`
// threads), then finish() returns the gradient in the mask's shape and dtype. With `bf16_rows`
// (the kernel can round dS to bf16 as it writes) a bf16 mask with an element per score gets
// rows_bf16() instead, the gradient's own bf16 elements, and rows() is null.
class MaskGradRows {
 public:
  MaskGradRows(const SdpaProblem& p, const TensorView& mask, int threads, bool bf16_rows = false);
  float* rows() const { return rows_; }
  uint16_t* rows_bf16() const { return rows_bf16_; }
  // Sums the rows over the dims the mask broadcasts along (its missing leading dims and its
  // size-1 ones) in float64, each output element over its rows in buffer order (deterministic for
  // any thread count), and rounds to the mask's dtype (16-bit: through float32, as every
  // float64 -> 16-bit conversion here and in c10 goes).
  Tensor finish(int threads);

 private:
  const SdpaProblem& p_;
  TensorView mask_;
  Tensor storage_;  // the gradient itself (direct: float32, or bf16 with bf16_rows) or the float32 buffer
  bool direct_;
  float* rows_ = nullptr;
  uint16_t* rows_bf16_ = nullptr;
};

// The float64 reference's version: dS rows in double, summed to the mask's shape (row-major).
std::vector<double> reduce_mask_grad(const double* ds, const SdpaProblem& p, const TensorView& mask);

// The float64 sums above as a tensor of the mask's shape and dtype (a 16-bit dtype rounded
// through float32, as in finish()).
Tensor mask_grad_tensor(const std::vector<double>& sums, const TensorView& mask);

}  // namespace attn::detail

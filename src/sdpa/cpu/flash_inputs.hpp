// Input preparation shared by the fused forward (flash_fwd.cpp) and backward (flash_bwd.cpp):
// one place turns a validated problem into kernel parameters, so the two passes cannot disagree
// on scale, masking or dropout.
#pragma once

#include <cmath>
#include <numbers>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "sdpa/cpu/flash_params.hpp"
#include "sdpa/problem.hpp"

namespace attn::cpu {

// The kernels read rows whose last dim is contiguous; anything else is copied once into storage.
inline TensorView rows_contiguous(const TensorView& t, Tensor& storage) {
  if (t.stride(-1) == 1) return t;
  storage = t.contiguous();
  return storage;
}

// False if t holds a NaN or Inf: the kernels then guard their products so that a zero weight
// never multiplies it (docs/NUMERICS.md).
inline bool all_finite(const TensorView& t) {
  bool ok = true;
  for_each_offset(t, [&](int64_t o) { ok = ok && std::isfinite(t.data()[o]); });
  return ok;
}

// The softmax scale actually applied: PyTorch's `scores / sqrt(E)` is a division by the float32
// divisor, which the kernels turn into a multiplication by its exact reciprocal.
inline double flash_softmax_scale(const detail::SdpaProblem& p) {
  return p.divide ? 1.0 / static_cast<double>(p.divisor) : p.scale;
}

// The parameters of one call, from the problem and the row-contiguous q, k, v the kernel reads.
// guard_v is left to the caller: the forward guards V only, the backward every input.
inline FlashParams make_flash_params(const detail::SdpaProblem& p, const SdpaOptions& options,
                                     const TensorView& q, const TensorView& k,
                                     const TensorView& v) {
  FlashParams fp;
  fp.L = p.L, fp.S = p.S, fp.E = p.E, fp.Ev = p.Ev;
  fp.q_row = q.stride(-2), fp.k_row = k.stride(-2), fp.v_row = v.stride(-2);
  fp.o_row = p.Ev;  // the forward's output is allocated contiguous
  fp.scale_log2 = static_cast<float>(flash_softmax_scale(p) * std::numbers::log2e);
  fp.causal = p.causal;
  fp.causal_offset = p.causal_offset;
  if (p.mask.defined()) {
    fp.mask_row = p.mask.stride(-2);
    fp.mask_col = p.mask.stride(-1);
    fp.mask_is_bool = p.mask_is_bool;
  }
  fp.dropout_p = p.dropout_p;
  fp.dropout_seed = options.dropout_seed;
  fp.dropout_offset = options.dropout_offset;
  return fp;
}

inline FlashBwdParams make_flash_bwd_params(const detail::SdpaProblem& p,
                                            const SdpaOptions& options, const TensorView& q,
                                            const TensorView& k, const TensorView& v) {
  FlashBwdParams bp;
  static_cast<FlashParams&>(bp) = make_flash_params(p, options, q, k, v);
  bp.scale = static_cast<float>(flash_softmax_scale(p));
  return bp;
}

}  // namespace attn::cpu

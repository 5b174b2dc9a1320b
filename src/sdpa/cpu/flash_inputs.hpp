// Input preparation shared by the fused forward (flash_fwd.cpp) and backward (flash_bwd.cpp).
#pragma once

#include <cmath>

#include "attn/tensor.hpp"

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

}  // namespace attn::cpu

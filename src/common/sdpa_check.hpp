// Argument checking and shape bookkeeping shared by every scaled_dot_product_attention backend,
// so each one rejects the same inputs with the same messages.
#pragma once

#include "attn/sdpa.hpp"

namespace attn::detail {

struct SdpaProblem {
  Shape lead;       // leading (batch, head) dims of the output; may be empty
  int64_t batch;    // product of lead
  int64_t L, S, E, Ev;
  double scale;     // the multiplier actually applied to q.k
  bool divide;      // true: scores are divided by sqrt(E) (PyTorch's `scores / d_k**0.5`)
  float divisor;    // sqrt(E) as float32, used when divide
  TensorView mask;  // expanded to lead + (L, S), or undefined
  bool mask_is_bool;
  float dropout_p;
};

// Validates the arguments and returns the problem description; throws attn::Error subclasses.
SdpaProblem check_sdpa(const TensorView& q, const TensorView& k, const TensorView& v,
                       const SdpaOptions& options);

// Offset of batch element `b` (row-major over `lead`) in a view whose leading dims match `lead`.
int64_t lead_offset(const TensorView& t, const Shape& lead, int64_t b);

}  // namespace attn::detail

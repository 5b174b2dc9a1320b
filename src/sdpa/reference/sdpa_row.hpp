// One row of the reference attention: scale, mask, softmax. Shared by the float32 and the
// float64 ("truth") reference paths so they differ only in precision.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "sdpa/problem.hpp"

namespace attn::detail {

// row[0..S) holds q_i . k_j on entry and the attention weights on exit (before dropout).
// mask_row is the (possibly strided) mask row for query i, or nullptr. The causal mask comes
// from p (p.causal, p.causal_offset: key j > i + causal_offset is masked).
// Returns the row's log-sum-exp of the scaled, masked scores, max + log(sum exp(s - max)):
// -inf when every key is masked, NaN when the row has a NaN score.
template <typename T>
T attention_row(T* row, const SdpaProblem& p, int64_t i, const float* mask_row,
                int64_t mask_stride) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  // float32 divides by sqrt(E) rounded to float (PyTorch's `scores / d_k**0.5`); the float64
  // truth divides by sqrt(E) in double, so it carries no float32 rounding of the scale.
  const T divisor = std::is_same_v<T, float> ? static_cast<T>(p.divisor)
                                             : static_cast<T>(std::sqrt(static_cast<double>(p.E)));
  T mx = neg_inf;
  for (int64_t j = 0; j < p.S; ++j) {
    T s = p.divide ? row[j] / divisor : row[j] * static_cast<T>(p.scale);
    if (p.causal && j > i + p.causal_offset) s = neg_inf;
    if (mask_row != nullptr) {
      const float m = mask_row[j * mask_stride];
      if (p.mask_is_bool) {
        if (m == 0.0f) s = neg_inf;
      } else {
        s += static_cast<T>(m);
      }
    }
    row[j] = s;
    if (s > mx || std::isnan(s)) mx = s;  // a NaN max makes the whole row NaN (it propagates)
  }
  if (mx == neg_inf) {  // every key masked out: weights 0, so the output row is 0 (not NaN)
    for (int64_t j = 0; j < p.S; ++j) row[j] = T(0);
    return neg_inf;  // log(0): the row has no probability mass
  }
  T sum = 0;
  for (int64_t j = 0; j < p.S; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  for (int64_t j = 0; j < p.S; ++j) row[j] /= sum;
  return mx + std::log(sum);
}

}  // namespace attn::detail

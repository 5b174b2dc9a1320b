// One row of the reference attention: scale, mask, softmax. Shared by the float32 and the
// float64 ("truth") reference paths so they differ only in precision.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "sdpa/problem.hpp"

namespace attn::detail {

// row[0..S) holds q_i . k_j on entry and the attention weights on exit (before dropout), for
// query i of batch-head b. Per key, in FlashAttention's order: scale, softcap, ALiBi, then the
// masks (is_causal and window_size from p: keys outside [p.key_lo(i), p.key_hi(i)]; the
// explicit mask: mask_row, possibly strided, for query i, or nullptr). With sinks the row's
// softmax has one more logit s_h with no value.
// cap_grad, if not null, receives d(capped score)/d(scaled score) = 1 - tanh^2 per key (1
// without softcap): the backward's chain through tanh.
// Returns the row's log-sum-exp, max + log(sum exp(s - max)) (the sink included): -inf when
// every key is masked and there is no sink, NaN when the row has a NaN score.
// The mask row is float32 (p.mask, what the kernels read) or float64 (the float64 paths read the
// caller's mask exactly: mask_f64).
template <typename T, typename M = float>
T attention_row(T* row, const SdpaProblem& p, int64_t b, int64_t i, const M* mask_row,
                int64_t mask_stride, T* cap_grad = nullptr) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  // float32 divides by sqrt(E) rounded to float (PyTorch's `scores / d_k**0.5`); the float64
  // truth divides by sqrt(E) in double, so it carries no float32 rounding of the scale.
  const T divisor = std::is_same_v<T, float> ? static_cast<T>(p.divisor)
                                             : static_cast<T>(std::sqrt(static_cast<double>(p.E)));
  const T cap = static_cast<T>(p.softcap);
  const T slope = static_cast<T>(p.alibi_slope(b));
  const int64_t lo = p.key_lo(i), hi = p.key_hi(i), pos = i + p.diag_offset;
  const bool has_sink = p.sinks.defined();
  const T sink = static_cast<T>(p.sink(b));
  T mx = has_sink ? sink : neg_inf;
  for (int64_t j = 0; j < p.S; ++j) {
    T s = p.divide ? row[j] / divisor : row[j] * static_cast<T>(p.scale);
    if (p.softcap > 0) {
      const T t = std::tanh(s / cap);
      s = cap * t;
      if (cap_grad != nullptr) cap_grad[j] = T(1) - t * t;
    } else if (cap_grad != nullptr) {
      cap_grad[j] = T(1);
    }
    if (slope != T(0)) s -= slope * static_cast<T>(pos > j ? pos - j : j - pos);
    if (mask_row != nullptr) {
      const M m = mask_row[j * mask_stride];
      if (p.mask_is_bool) {
        if (m == M(0)) s = neg_inf;
      } else {
        s += static_cast<T>(m);
      }
    }
    // Last, so that a key outside the band is hidden whatever an additive mask adds (NaN, +inf).
    if (j < lo || j > hi) s = neg_inf;
    row[j] = s;
    if (s > mx || std::isnan(s)) mx = s;  // a NaN max makes the whole row NaN (it propagates)
  }
  if (mx == neg_inf) {  // every key masked out: weights 0, so the output row is 0 (not NaN)
    for (int64_t j = 0; j < p.S; ++j) row[j] = T(0);
    return neg_inf;  // log(0): the row has no probability mass
  }
  T sum = has_sink ? std::exp(sink - mx) : T(0);
  for (int64_t j = 0; j < p.S; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  for (int64_t j = 0; j < p.S; ++j) row[j] /= sum;
  return mx + std::log(sum);
}

// The float64 paths' mask: options.attn_mask widened exactly (a float64 mask keeps its bits, which
// p.mask's float32 would round), expanded to lead + (L, S) in `storage`'s view; undefined without
// a mask. Rows of batch-head b: mask_f64_row.
inline TensorView mask_f64(const SdpaOptions& options, const SdpaProblem& p, Tensor& storage) {
  if (!p.mask.defined()) return {};
  storage = options.attn_mask->values.to(DType::kFloat64);
  return storage.expand(p.mask.shape());
}
inline const double* mask_f64_row(const TensorView& m, const SdpaProblem& p, int64_t b, int64_t i) {
  return m.defined() ? m.data_as<double>() + lead_offset(m, p.lead, b) + i * m.stride(-2) : nullptr;
}

}  // namespace attn::detail

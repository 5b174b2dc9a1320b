// Reference scaled dot-product attention in float32.
//
// Materialises the (..., L, S) score matrix: scores = q @ k^T (CBLAS), then per row scale, mask,
// softmax (sdpa_row.hpp), then dropout on the weights and out = weights @ v (CBLAS). Memory is
// O(L * S) per call; it is the path everything else is checked against, and the one the
// chapter's modules print, so it follows PyTorch's math step for step.
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "common/sdpa_backends.hpp"
#include "reference/sdpa_row.hpp"

namespace attn::reference {

SdpaResult sdpa_forward(const TensorView& query, const TensorView& key, const TensorView& value,
                        const SdpaOptions& options, const detail::SdpaProblem& p) {
  Tensor weights = matmul(query, key.transpose(-2, -1));  // (lead..., L, S), contiguous
  // Rows are independent; dropout below stays sequential so the random stream keeps its order.
  const int64_t rows = p.batch * p.L;
#pragma omp parallel for schedule(static) if (rows * p.S > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / p.L, i = r % p.L;
    const float* mrow = nullptr;
    int64_t mstride = 0;
    if (p.mask.defined()) {
      const int nd = p.mask.dim();
      mrow = p.mask.data() + detail::lead_offset(p.mask, p.lead, b) + i * p.mask.stride(nd - 2);
      mstride = p.mask.stride(nd - 1);
    }
    detail::attention_row(weights.data() + r * p.S, p, options.is_causal, i, mrow, mstride);
  }
  if (p.dropout_p > 0.0f) {
    Generator& gen = options.generator ? *options.generator : default_generator();
    weights = dropout(weights, p.dropout_p, /*training=*/true, gen);
  }
  SdpaResult r;
  r.output = matmul(weights, value);
  if (options.need_weights) r.attn_weights = std::move(weights);
  return r;
}

}  // namespace attn::reference

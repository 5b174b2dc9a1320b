// Reference scaled dot-product attention in float32.
//
// Materialises the (..., L, S) score matrix: scores = q @ k^T (CBLAS), then per row scale, mask,
// softmax and log-sum-exp (sdpa_row.hpp), then dropout on the weights and out = weights @ v
// (CBLAS). Memory is O(L * S) per call; it is the path everything else is checked against, and
// the one the chapter's modules print, so it follows PyTorch's math step for step.
//
// GQA is done the way PyTorch's math path does it: key and value are repeated along the head
// dim (repeat_interleave) into query's head count first, so the batched matmuls and everything
// after them are unchanged. That costs a copy of K and V per call, acceptable for a reference.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/philox.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/reference/sdpa_row.hpp"

namespace attn::reference {

namespace {

// kv (..., H_kv, S, D) -> contiguous (..., H_q, S, D) with query head h holding kv head
// h / group: k.repeat_interleave(group, dim=-3).
Tensor repeat_kv(const TensorView& kv, const detail::SdpaProblem& p) {
  Shape shape = p.lead;
  shape.push_back(kv.size(-2));
  shape.push_back(kv.size(-1));
  Tensor out = Tensor::empty(shape);
  const int64_t rows = kv.size(-2), cols = kv.size(-1);
  const int64_t rs = kv.stride(-2), cs = kv.stride(-1);
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* src = kv.data() + detail::kv_lead_offset(kv, p, b);
    float* dst = out.data() + b * rows * cols;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[r * rs + c * cs];
    }
  }
  return out;
}

// Philox dropout in place on the (batch, L, S) weights: the same keep decisions as the float64
// reference and the fused kernel (attn/philox.hpp), and torch's float32 scaling w * (1 / (1 - p)).
// A dropped weight is multiplied by 0 as in torch: 0 for a finite weight, NaN stays NaN.
void philox_dropout_(Tensor& weights, const detail::SdpaProblem& p, const SdpaOptions& o) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);  // inf at p == 1, but then nothing is kept
  const int64_t rows = p.batch * p.L;
#pragma omp parallel if (rows * p.S > 32768)
  {
    std::vector<uint8_t> keep(static_cast<size_t>(p.S));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      philox_dropout_keep_row(o.dropout_seed, o.dropout_offset, r / p.L + p.bh_base, p.q_pos + r % p.L, p.dropout_p, keep,
                              p.k_pos);
      float* w = weights.data() + r * p.S;
      for (int64_t j = 0; j < p.S; ++j) w[j] = keep[static_cast<size_t>(j)] ? w[j] * inv_keep : w[j] * 0.0f;
    }
  }
}

bool all_finite(const TensorView& t) {
  bool ok = true;
  for_each_offset(t, [&](int64_t o) { ok = ok && std::isfinite(t.data()[o]); });
  return ok;
}

// out = weights @ v, skipping zero weights: BLAS computes 0 * NaN = NaN, which would let a
// NaN/Inf value at a masked (or dropped) position reach the output.
Tensor weighted_sum_skipping_zeros(const Tensor& weights, const TensorView& v,
                                   const detail::SdpaProblem& p) {
  Shape shape = p.lead;
  shape.push_back(p.L);
  shape.push_back(p.Ev);
  Tensor out = Tensor::zeros(shape);
  const int64_t vr = v.stride(-2), vc = v.stride(-1);
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* vb = v.data() + detail::lead_offset(v, p.lead, b);
    for (int64_t i = 0; i < p.L; ++i) {
      const float* w = weights.data() + (b * p.L + i) * p.S;
      float* o = out.data() + (b * p.L + i) * p.Ev;
      for (int64_t j = 0; j < p.S; ++j) {
        if (w[j] == 0.0f) continue;
        for (int64_t e = 0; e < p.Ev; ++e) o[e] += w[j] * vb[j * vr + e * vc];
      }
    }
  }
  return out;
}

}  // namespace

SdpaResult sdpa_forward(const TensorView& query, const TensorView& key, const TensorView& value,
                        const SdpaOptions& options, const detail::SdpaProblem& p) {
  Tensor key_rep, value_rep;
  TensorView k = key, v = value;
  if (p.group > 1) {
    key_rep = repeat_kv(key, p);
    value_rep = repeat_kv(value, p);
    k = key_rep;
    v = value_rep;
  }
  Tensor weights = matmul(query, k.transpose(-2, -1));  // (lead..., L, S), contiguous
  Tensor lse;
  if (options.need_lse) {
    Shape ls = p.lead;
    ls.push_back(p.L);
    lse = Tensor::empty(ls);
  }
  // Rows are independent; torch-stream dropout below stays sequential so its order is kept.
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
    const float row_lse = detail::attention_row(weights.data() + r * p.S, p, b, i, mrow, mstride);
    if (lse.defined()) lse.data()[r] = row_lse;
  }
  if (p.dropout_p > 0.0f) {
    if (options.dropout_rng == DropoutRng::kPhilox) {
      philox_dropout_(weights, p, options);
    } else {
      Generator& gen = options.generator ? *options.generator : default_generator();
      weights = dropout(weights, p.dropout_p, /*training=*/true, gen);
    }
  }
  SdpaResult r;
  r.output = all_finite(v) ? matmul(weights, v) : weighted_sum_skipping_zeros(weights, v, p);
  if (options.need_weights) r.attn_weights = std::move(weights);
  r.lse = std::move(lse);
  return r;
}

}  // namespace attn::reference

// Reference backward of scaled dot-product attention in float32, the mirror of sdpa.cpp.
//
// Per (batch, head) b, with the forward's L x S matrices materialised again:
//   P   = softmax(scale * q k^T + mask)       recomputed row by row (sdpa_row.hpp), as the forward
//   P_d = dropout(P)                           keep decisions replayed (Philox) or read from the
//                                              forward's weights (kTorch)
//   dV += P_d^T dO
//   dP  = dropout'(dO v^T)                     the same keep mask and 1/(1-p) scaling
//   dS  = P * (dP - rowsum(P * dP))            softmax's backward
//   dQ  = scale dS k,   dK += scale dS^T q
//   d(attn_mask) = dS summed to the mask's shape (need_attn_mask_grad; mask_grad.hpp)
// The products go through CBLAS (matmul); memory is O(L * S) per head, like the forward. GQA:
// query heads are visited in order and their dK, dV added into their key/value head, so the sum
// over a group has a fixed order. dS is exactly 0 wherever P is 0 (masked keys, fully masked
// rows), and then the products skip it when an input holds NaN/Inf, so an excluded NaN/Inf
// never reaches a gradient (docs/NUMERICS.md).
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attn/functional.hpp"
#include "attn/philox.hpp"
#include "sdpa/mask_grad.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/reference/sdpa_row.hpp"

namespace attn::reference {

namespace {

bool all_finite(const TensorView& t) {
  bool ok = true;
  for_each_offset(t, [&](int64_t o) { ok = ok && std::isfinite(t.data()[o]); });
  return ok;
}

// The (rows, cols) matrix of batch-head b inside t (whose leading dims are `lead`, or key/value
// heads with kv = true).
TensorView head(const TensorView& t, const detail::SdpaProblem& p, int64_t b, bool kv) {
  const int64_t off = kv ? detail::kv_lead_offset(t, p, b) : detail::lead_offset(t, p.lead, b);
  return TensorView(t.data() + off, {t.size(-2), t.size(-1)}, {t.stride(-2), t.stride(-1)});
}

// c += a @ b for a (M, K) contiguous, b (K, N) any strides, c (M, N) contiguous. With
// skip_zeros, a zero a[m][k] never touches row k of b (0 * NaN would be NaN); otherwise BLAS.
void matmul_acc(const Tensor& a, const TensorView& b, float* c, bool skip_zeros) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (!skip_zeros) {
    const Tensor prod = matmul(a, b);
    for (int64_t i = 0; i < M * N; ++i) c[i] += prod.data()[i];
    return;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const float x = a.data()[m * K + k];
      if (x == 0.0f) continue;
      for (int64_t n = 0; n < N; ++n) c[m * N + n] += x * b.data()[k * b.stride(0) + n * b.stride(1)];
    }
  }
}

}  // namespace

SdpaGrads sdpa_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const SdpaSaved& forward, const SdpaOptions& options,
                        const detail::SdpaProblem& p) {
  SdpaGrads g{Tensor::zeros(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape()), Tensor(), Tensor()};
  const bool guard = !all_finite(q) || !all_finite(k) || !all_finite(v);
  const bool philox = p.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kPhilox;
  const bool torch_drop = p.dropout_p > 0.0f && !philox;
  // The saved weights (SdpaSaved views may be strided) read row by row below: made row-major.
  Tensor weights_copy;
  const float* const weights = !torch_drop ? nullptr
                               : forward.attn_weights.is_contiguous()
                                   ? forward.attn_weights.data()
                                   : (weights_copy = forward.attn_weights.contiguous()).data();
  const float inv_keep = p.dropout_p < 1.0f ? 1.0f / (1.0f - p.dropout_p) : 0.0f;
  std::vector<uint8_t> keep(static_cast<size_t>(p.S), 1);
  std::vector<float> cap_grad(static_cast<size_t>(p.S));
  // d(sinks)_h = -sum over rows of head h of p_sink * delta, p_sink = exp(s_h - lse).
  std::vector<double> dsinks(p.sinks.defined() ? static_cast<size_t>(p.heads_q) : 0, 0.0);
  // dS of every score, for the mask's gradient (mask_grad.hpp).
  std::optional<detail::MaskGradRows> dmask;
  if (options.need_attn_mask_grad) dmask.emplace(p, options.attn_mask->values, 1);

  for (int64_t b = 0; b < p.batch; ++b) {
    const TensorView qb = head(q, p, b, false), kb = head(k, p, b, true), vb = head(v, p, b, true);
    const TensorView dob = head(dout, p, b, false);
    Tensor probs = matmul(qb, kb.t());   // scores, then P (L, S)
    Tensor dp = matmul(dob, vb.t());     // dP_d, then dS (L, S)
    Tensor pd = Tensor::empty({p.L, p.S});  // P_d
    for (int64_t i = 0; i < p.L; ++i) {
      float* prow = probs.data() + i * p.S;
      const float* mrow = nullptr;
      int64_t mstride = 0;
      if (p.mask.defined()) {
        mrow = p.mask.data() + detail::lead_offset(p.mask, p.lead, b) + i * p.mask.stride(-2);
        mstride = p.mask.stride(-1);
      }
      const float lse = detail::attention_row(prow, p, b, i, mrow, mstride, cap_grad.data());
      if (philox) {
        philox_dropout_keep_row(options.dropout_seed, options.dropout_offset, b + p.bh_base, p.q_pos + i, p.dropout_p, keep, p.k_pos);
      } else if (torch_drop) {
        const float* w = weights + (b * p.L + i) * p.S;
        for (int64_t j = 0; j < p.S; ++j) keep[static_cast<size_t>(j)] = w[j] != 0.0f;
      }
      float* dprow = dp.data() + i * p.S;
      float* pdrow = pd.data() + i * p.S;
      // The keys given may be a slice of the forward's (context parallelism: the saved LSE then
      // covers more keys than this row's own): P is renormalised to the saved LSE and
      // rowsum(P * dP) is taken as rowsum(dO * O) over the saved output, as the fused backward
      // does. A whole call's LSE equals the row's own bit for bit and takes the exact path.
      const float saved_lse = forward.lse.data()[detail::lead_offset(forward.lse, p.lead, b) + i * forward.lse.stride(-1)];
      const bool slice = saved_lse != lse && !(std::isnan(saved_lse) && std::isnan(lse));
      if (slice) {
        const float f = lse == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(lse - saved_lse);
        for (int64_t j = 0; j < p.S; ++j) prow[j] *= f;
      }
      double delta = 0.0;  // rowsum(P * dP); a zero P contributes nothing, even against a NaN dP
      for (int64_t j = 0; j < p.S; ++j) {
        const bool kept = keep[static_cast<size_t>(j)] != 0;
        const float scale = p.dropout_p > 0.0f ? (kept ? inv_keep : 0.0f) : 1.0f;
        pdrow[j] = kept ? prow[j] * scale : prow[j] * 0.0f;
        dprow[j] = kept ? dprow[j] * scale : 0.0f;
        if (prow[j] != 0.0f) delta += static_cast<double>(prow[j]) * dprow[j];
      }
      if (slice) {
        const float* orow = forward.output.data() + detail::lead_offset(forward.output, p.lead, b) + i * forward.output.stride(-2);
        delta = 0.0;
        for (int64_t e = 0; e < p.Ev; ++e) {
          delta += static_cast<double>(dob.data()[i * dob.stride(0) + e * dob.stride(1)]) * orow[e * forward.output.stride(-1)];
        }
      }
      if (!dsinks.empty()) {
        dsinks[static_cast<size_t>(b % p.heads_q)] -= std::exp(static_cast<double>(p.sink(b)) - lse) * delta;
      }
      float* dmrow = dmask ? dmask->rows() + (b * p.L + i) * p.S : nullptr;
      for (int64_t j = 0; j < p.S; ++j) {
        const float dx = prow[j] == 0.0f ? 0.0f : prow[j] * (dprow[j] - static_cast<float>(delta));
        if (dmrow != nullptr) dmrow[j] = dx;  // the mask is added to the final score x
        const float ds = dx * cap_grad[static_cast<size_t>(j)];
        dprow[j] = p.divide ? ds / p.divisor : ds * static_cast<float>(p.scale);
      }
    }
    float* dq = g.grad_query.data() + detail::lead_offset(g.grad_query, p.lead, b);
    float* dk = g.grad_key.data() + detail::kv_lead_offset(g.grad_key, p, b);
    float* dv = g.grad_value.data() + detail::kv_lead_offset(g.grad_value, p, b);
    matmul_acc(dp, kb, dq, guard);
    matmul_acc(dp.t().contiguous(), qb, dk, guard);
    matmul_acc(pd.t().contiguous(), dob, dv, guard);
  }
  if (dmask) g.grad_attn_mask = dmask->finish(1);
  if (!dsinks.empty()) {
    g.grad_sinks = Tensor::empty({p.heads_q});
    for (int64_t h = 0; h < p.heads_q; ++h) g.grad_sinks.data()[h] = static_cast<float>(dsinks[static_cast<size_t>(h)]);
  }
  return g;
}

}  // namespace attn::reference

// Float64 gradients of scaled dot-product attention: the truth the float32 backward kernels are
// measured against. The same steps as sdpa_bwd.cpp, every product and sum in double, and the
// forward's P recomputed in double (sdpa_row.hpp), so nothing float32 enters but the inputs.
// Dropout keep decisions: a copy of the torch generator's state (kTorch, as the float64 forward)
// or the Philox row function (kPhilox).
#include <cmath>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/philox.hpp"
#include "sdpa/mask_grad.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/reference/sdpa_row.hpp"

namespace attn::reference {

namespace {
// Element (r, c) of the head at `off`; t is the float64 widening of an input (exact).
double at(const TensorView& t, int64_t off, int64_t r, int64_t c) {
  return t.data_as<double>()[off + r * t.stride(-2) + c * t.stride(-1)];
}
}  // namespace

SdpaGradsF64 scaled_dot_product_attention_backward_f64(const TensorView& dout_in,
                                                       const TensorView& q_in,
                                                       const TensorView& k_in,
                                                       const TensorView& v_in,
                                                       const SdpaOptions& options) {
  return scaled_dot_product_attention_backward_f64(dout_in, q_in, k_in, v_in, options,
                                                   detail::check_sdpa(q_in, k_in, v_in, options));
}

SdpaGradsF64 scaled_dot_product_attention_backward_f64(const TensorView& dout_in,
                                                       const TensorView& q_in,
                                                       const TensorView& k_in,
                                                       const TensorView& v_in,
                                                       const SdpaOptions& options,
                                                       const detail::SdpaProblem& p) {
  detail::check_attn_mask_grad(options, p, "scaled_dot_product_attention_backward_f64");
  const Tensor q = q_in.to(DType::kFloat64), k = k_in.to(DType::kFloat64), v = v_in.to(DType::kFloat64);
  Shape out_shape = p.lead;
  out_shape.push_back(p.L);
  out_shape.push_back(p.Ev);
  if (!dout_in.defined() || !(dout_in.shape() == out_shape)) {
    throw ShapeError("scaled_dot_product_attention_backward_f64: grad_output must have shape " +
                     out_shape.str() + ", got " + (dout_in.defined() ? dout_in.shape().str() : "undefined"));
  }
  const Tensor dout = dout_in.to(DType::kFloat64);
  SdpaGradsF64 g;
  g.grad_query.assign(static_cast<size_t>(q.numel()), 0.0);
  g.grad_key.assign(static_cast<size_t>(k.numel()), 0.0);
  g.grad_value.assign(static_cast<size_t>(v.numel()), 0.0);
  const Tensor dq_layout(q.shape()), dk_layout(k.shape());  // contiguous offsets of each head
  const Tensor dv_layout(v.shape());

  const bool philox = p.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kPhilox;
  std::vector<float> torch_keep;
  if (!philox && p.dropout_p > 0.0f && p.dropout_p < 1.0f) {
    Generator gen = options.generator ? *options.generator : default_generator();
    Shape ws = p.lead;
    ws.push_back(p.L);
    ws.push_back(p.S);
    Tensor noise = Tensor::empty(ws);
    bernoulli_(noise, 1.0 - static_cast<double>(p.dropout_p), gen);
    torch_keep = noise.to_vector();
  }
  const double inv_keep = p.dropout_p < 1.0f ? 1.0 / (1.0 - static_cast<double>(p.dropout_p)) : 0.0;
  std::vector<uint8_t> keep(static_cast<size_t>(p.S), 1);
  std::vector<double> prow(static_cast<size_t>(p.S)), dprow(static_cast<size_t>(p.S));
  std::vector<double> cap_grad(static_cast<size_t>(p.S));
  if (p.sinks.defined()) g.grad_sinks.assign(static_cast<size_t>(p.heads_q), 0.0);
  Tensor mask_storage;
  const TensorView mask = detail::mask_f64(options, p, mask_storage);
  // dS of every score, for the mask's gradient (mask_grad.hpp).
  std::vector<double> dmask(options.need_attn_mask_grad ? static_cast<size_t>(p.batch * p.L * p.S) : 0, 0.0);

  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t qo = detail::lead_offset(q, p.lead, b), ko = detail::kv_lead_offset(k, p, b);
    const int64_t vo = detail::kv_lead_offset(v, p, b), doo = detail::lead_offset(dout, p.lead, b);
    double* dq = g.grad_query.data() + detail::lead_offset(dq_layout, p.lead, b);
    double* dk = g.grad_key.data() + detail::kv_lead_offset(dk_layout, p, b);
    double* dv = g.grad_value.data() + detail::kv_lead_offset(dv_layout, p, b);
    for (int64_t i = 0; i < p.L; ++i) {
      for (int64_t j = 0; j < p.S; ++j) {
        double s = 0.0;
        for (int64_t e = 0; e < p.E; ++e) s += at(q, qo, i, e) * at(k, ko, j, e);
        prow[static_cast<size_t>(j)] = s;
      }
      const double* mrow = detail::mask_f64_row(mask, p, b, i);
      const double lse = detail::attention_row(prow.data(), p, b, i, mrow, mask.defined() ? mask.stride(-1) : 0,
                                               cap_grad.data());
      if (philox) {
        philox_dropout_keep_row(options.dropout_seed, options.dropout_offset, b + p.bh_base, p.q_pos + i, p.dropout_p, keep, p.k_pos);
      } else if (p.dropout_p > 0.0f) {
        for (int64_t j = 0; j < p.S; ++j) {
          keep[static_cast<size_t>(j)] =
              !torch_keep.empty() && torch_keep[static_cast<size_t>((b * p.L + i) * p.S + j)] != 0.0f;
        }
      }
      double delta = 0.0;
      for (int64_t j = 0; j < p.S; ++j) {
        const size_t js = static_cast<size_t>(j);
        const double scale = p.dropout_p > 0.0f ? (keep[js] ? inv_keep : 0.0) : 1.0;
        double dpd = 0.0;
        for (int64_t e = 0; e < p.Ev; ++e) dpd += at(dout, doo, i, e) * at(v, vo, j, e);
        dprow[js] = keep[js] ? dpd * scale : 0.0;
        if (prow[js] != 0.0) {
          const double pd = prow[js] * scale;
          for (int64_t e = 0; e < p.Ev; ++e) dv[j * p.Ev + e] += pd * at(dout, doo, i, e);
          delta += prow[js] * dprow[js];
        }
      }
      if (!g.grad_sinks.empty()) {
        g.grad_sinks[static_cast<size_t>(b % p.heads_q)] -= std::exp(static_cast<double>(p.sink(b)) - lse) * delta;
      }
      const double sc = p.divide ? 1.0 / std::sqrt(static_cast<double>(p.E)) : p.scale;
      for (int64_t j = 0; j < p.S; ++j) {
        const size_t js = static_cast<size_t>(j);
        if (prow[js] == 0.0) continue;
        const double dx = prow[js] * (dprow[js] - delta);  // the mask is added to the final score x
        if (!dmask.empty()) dmask[static_cast<size_t>((b * p.L + i) * p.S + j)] = dx;
        const double ds = dx * cap_grad[js] * sc;
        for (int64_t e = 0; e < p.E; ++e) {
          dq[i * p.E + e] += ds * at(k, ko, j, e);
          dk[j * p.E + e] += ds * at(q, qo, i, e);
        }
      }
    }
  }
  if (options.need_attn_mask_grad) g.grad_attn_mask = detail::reduce_mask_grad(dmask.data(), p, options.attn_mask->values);
  return g;
}

}  // namespace attn::reference

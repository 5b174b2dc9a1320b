// Float64 reference ("truth") for scaled dot-product attention: the same steps as the float32
// reference, every product and sum in double. Tests measure float32 kernels against it.
// GQA reads key/value head h / group in place (kv_lead_offset) instead of repeating K and V;
// dropout uses the very keep decisions of the float32 path (a copy of the torch generator's
// state, or the same Philox row function), so the two are comparable with dropout too.
// Inputs of any floating dtype are read exactly (widened to float64 once), the mask too (a
// float64 mask is not rounded to the float32 the kernels see: gradcheck perturbs it).
#include "attn/functional.hpp"
#include "attn/philox.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/reference/sdpa_row.hpp"

namespace attn::reference {

SdpaResultF64 scaled_dot_product_attention_f64(const TensorView& q_in, const TensorView& k_in,
                                               const TensorView& v_in, const SdpaOptions& options) {
  return scaled_dot_product_attention_f64(q_in, k_in, v_in, options,
                                          detail::check_sdpa(q_in, k_in, v_in, options));
}

SdpaResultF64 scaled_dot_product_attention_f64(const TensorView& q_in, const TensorView& k_in,
                                               const TensorView& v_in, const SdpaOptions& options,
                                               const detail::SdpaProblem& p) {
  const Tensor q = q_in.to(DType::kFloat64), k = k_in.to(DType::kFloat64), v = v_in.to(DType::kFloat64);
  SdpaResultF64 r;
  r.weights_shape = p.lead;
  r.weights_shape.push_back(p.L);
  r.weights_shape.push_back(p.S);
  r.output_shape = p.lead;
  r.output_shape.push_back(p.L);
  r.output_shape.push_back(p.Ev);
  r.attn_weights.assign(static_cast<size_t>(p.batch * p.L * p.S), 0.0);
  r.output.assign(static_cast<size_t>(p.batch * p.L * p.Ev), 0.0);
  if (options.need_lse) {
    r.lse_shape = p.lead;
    r.lse_shape.push_back(p.L);
    r.lse.assign(static_cast<size_t>(p.batch * p.L), 0.0);
  }

  // The same keep-mask as the float32 path. kTorch: draw from a copy of the generator's state.
  // kPhilox: one row at a time in the loop below.
  const bool philox = p.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kPhilox;
  std::vector<float> keep;  // kTorch only
  std::vector<uint8_t> philox_keep(philox ? static_cast<size_t>(p.S) : 0);
  if (!philox && p.dropout_p == 1.0f) {
    keep.assign(r.attn_weights.size(), 0.0f);  // everything dropped, nothing drawn (F.dropout)
  } else if (!philox && p.dropout_p > 0.0f) {
    Generator gen = options.generator ? *options.generator : default_generator();
    Tensor noise = Tensor::empty(r.weights_shape);
    bernoulli_(noise, 1.0 - static_cast<double>(p.dropout_p), gen);
    keep = noise.to_vector();
  }
  const int nd = q.dim();
  Tensor mask_storage;
  const TensorView mask = detail::mask_f64(options, p, mask_storage);
  for (int64_t b = 0; b < p.batch; ++b) {
    const double* qb = q.data_as<double>() + detail::lead_offset(q, p.lead, b);
    const double* kb = k.data_as<double>() + detail::kv_lead_offset(k, p, b);
    const double* vb = v.data_as<double>() + detail::kv_lead_offset(v, p, b);
    for (int64_t i = 0; i < p.L; ++i) {
      double* row = r.attn_weights.data() + (b * p.L + i) * p.S;
      for (int64_t j = 0; j < p.S; ++j) {
        double s = 0.0;
        for (int64_t e = 0; e < p.E; ++e) {
          s += qb[i * q.stride(nd - 2) + e * q.stride(nd - 1)] * kb[j * k.stride(nd - 2) + e * k.stride(nd - 1)];
        }
        row[j] = s;
      }
      const double* mrow = detail::mask_f64_row(mask, p, b, i);
      const double row_lse = detail::attention_row(row, p, b, i, mrow, mask.defined() ? mask.stride(-1) : 0);
      if (!r.lse.empty()) r.lse[static_cast<size_t>(b * p.L + i)] = row_lse;
      const double inv_keep = p.dropout_p == 1.0f ? 0.0 : 1.0 / (1.0 - static_cast<double>(p.dropout_p));
      if (!keep.empty()) {
        for (int64_t j = 0; j < p.S; ++j) row[j] *= keep[static_cast<size_t>((b * p.L + i) * p.S + j)] * inv_keep;
      } else if (philox) {
        philox_dropout_keep_row(options.dropout_seed, options.dropout_offset, b + p.bh_base, p.q_pos + i, p.dropout_p,
                                philox_keep, p.k_pos);
        for (int64_t j = 0; j < p.S; ++j) row[j] = philox_keep[static_cast<size_t>(j)] ? row[j] * inv_keep : row[j] * 0.0;
      }
      double* out = r.output.data() + (b * p.L + i) * p.Ev;
      for (int64_t j = 0; j < p.S; ++j) {
        if (row[j] == 0.0) continue;  // a masked or dropped NaN/Inf value must not reach out
        for (int64_t e = 0; e < p.Ev; ++e) {
          out[e] += row[j] * vb[j * v.stride(nd - 2) + e * v.stride(nd - 1)];
        }
      }
    }
  }
  return r;
}

}  // namespace attn::reference

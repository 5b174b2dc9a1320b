// fuzz_sdpa's float32 backward check (included by fuzz_sdpa.cpp, which decodes the problem):
// scaled_dot_product_attention_backward on the fused kernel the problem forces, against the
// float32 reference and the float64 truth, with the attn_mask's gradient asked for whenever the
// mask is additive.
//
// Properties (a violation aborts):
//  * Nothing throws on valid arguments; the gradients have the inputs' shapes, grad_attn_mask
//    the mask's (exactly when asked for), grad_sinks (H) exactly with sinks; asking for a mask
//    gradient without an additive mask throws ValueError.
//  * The fused gradients (dQ, dK, dV, d(mask), d(sinks)) are bit-identical for 1 and 2 threads.
//  * On a moderate problem (finite q, k, v, finite or -inf mask values, outside fuzz_sdpa's
//    overflow domain, score rounding bound delta <= 1), every element of every fused gradient
//    is within 2x the reference's largest error of that gradient plus twice a first-order bound
//    of float32 rounding for that element, built from the float64 truth's P (no dropout), per
//    (query row i, key j):
//        T_dS(i, j) = 2 P_ij |dO_i|_1 vmax inv_keep        (dS = P (dP - D); |dP|, |D| <= that)
//        dQ_ie:  (eps + (S + 8) u) scale sum_j T_dS(i, j) |K_je|
//        dK_je:  (eps + (n + 8) u) scale sum_i T_dS(i, j) |Q_ie|   (n: the rows reading the head)
//        dV_je:  (eps + (n + 8) u) sum_i inv_keep P_ij |dO_ie|
//        d(mask): (eps + (m + 8) u) sum over the m scores it broadcasts to of T_dS
//        d(sink_h): (eps + (n + 8) u) sum over the head's rows of |dO_i|_1 vmax inv_keep
//    with eps = 2 expm1(4 delta) + (Ev + 16) u (P's relative error from the scores' rounding and
//    the dot products of dP and D), u = 2^-24. The bound is loose (a first-order error analysis
//    with every term at its largest), so it never flags rounding; what it catches is a wrong
//    index, a missing or doubled term, a wrong scale or a NaN, which err by O(T), not O(u T).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "fuzz_util.hpp"

namespace attn::fuzz {

struct BackwardCase {
  TensorView q, k, v;      // float32, any layout
  SdpaOptions options;     // the forward's (kernel forced or ""; no torch-stream dropout)
  Shape out_shape;
  bool additive_mask = false;
  bool moderate = false;
  double delta = 0;        // the largest row's score rounding bound (natural-log units)
  uint64_t seed = 0;       // for dO
  std::string desc;
};

// Same shape and bits, or both undefined.
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (!(a.shape() == b.shape())) return false;
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// For each element of `target` (row-major), the row-major index of the element of `m` it reads
// when m is broadcast to target (m's dims align to target's last ones; size-1 dims repeat).
inline std::vector<int64_t> broadcast_index(const Shape& target, const Shape& m) {
  const int nt = target.ndim(), nm = m.ndim();
  std::vector<int64_t> out(static_cast<size_t>(target.numel()));
  std::vector<int64_t> idx(static_cast<size_t>(nt), 0);
  for (size_t f = 0; f < out.size(); ++f) {
    int64_t mi = 0;
    for (int d = 0; d < nm; ++d) {
      const int64_t sz = m[d], td = idx[static_cast<size_t>(nt - nm + d)];
      mi = mi * sz + (sz == 1 ? 0 : td);
    }
    out[f] = mi;
    for (int d = nt - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < target[d]) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  return out;
}

// The first-order bound of d(mask)'s float32 terms, per element of a mask of shape `ms` broadcast
// over the scores (q's leading dims, L, S): the sum over the m scores it collects of
// T_dS(i, j) = 2 P_ij |dO_i|_1 vmax inv_keep. `p` is P without dropout, (rows, S) row-major;
// `dout` is (rows, Ev) row-major. `terms` is m, the scores an element sums.
struct MaskGradBound {
  std::vector<double> bound;
  double terms = 1;
};
inline MaskGradBound mask_grad_bound(const std::vector<double>& p, const std::vector<float>& dout, int64_t Ev,
                                     double vmax, double inv_keep, const Shape& q_shape, int64_t S,
                                     const Shape& ms) {
  Shape target;
  for (int d = 0; d < q_shape.ndim() - 1; ++d) target.push_back(q_shape[d]);
  target.push_back(S);
  const std::vector<int64_t> to_mask = broadcast_index(target, ms);
  MaskGradBound out;
  out.bound.assign(static_cast<size_t>(ms.numel()), 0.0);
  out.terms = static_cast<double>(target.numel()) / static_cast<double>(std::max<int64_t>(1, ms.numel()));
  const size_t s = static_cast<size_t>(S), ev = static_cast<size_t>(Ev);
  for (size_t row = 0; row * s < to_mask.size(); ++row) {
    double d1 = 0;
    for (size_t e = 0; e < ev; ++e) d1 += std::fabs(static_cast<double>(dout[row * ev + e]));
    const double ci = d1 * vmax * inv_keep;
    for (size_t j = 0; j < s; ++j) out.bound[static_cast<size_t>(to_mask[row * s + j])] += 2 * p[row * s + j] * ci;
  }
  return out;
}

inline void check_f32_backward(const BackwardCase& c) {
  auto must_not_throw = [&](const char* what, auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      fuzz_fail("%s threw on valid arguments: %s\n  problem: %s", what, e.what(), c.desc.c_str());
    }
  };
  SplitMix rng(c.seed ^ 0xd0d0);
  Tensor dout = Tensor::empty(c.out_shape);
  for (int64_t i = 0; i < dout.numel(); ++i) dout.data()[i] = rng.normal();

  SdpaOptions fo = c.options;
  fo.need_lse = true;
  fo.backend = SdpaBackend::kFused;
  SdpaResult f;
  must_not_throw("fused forward for the backward", [&] { f = scaled_dot_product_attention(c.q, c.k, c.v, fo); });

  if (!c.additive_mask) {  // a mask gradient needs an additive mask: refused, typed
    SdpaOptions bad = fo;
    bad.need_attn_mask_grad = true;
    bool refused = false;
    try {
      (void)scaled_dot_product_attention_backward(dout, c.q, c.k, c.v, f, bad);
    } catch (const ValueError&) {
      refused = true;
    } catch (const std::exception& e) {
      fuzz_fail("need_attn_mask_grad without an additive mask threw the wrong type: %s\n  problem: %s", e.what(),
                c.desc.c_str());
    }
    ATTN_FUZZ_CHECKF(refused, "need_attn_mask_grad without an additive mask was accepted; %s", c.desc.c_str());
  }
  fo.need_attn_mask_grad = c.additive_mask;
  SdpaGrads g1, g2;
  fo.num_threads = 1;
  must_not_throw("fused backward", [&] { g1 = scaled_dot_product_attention_backward(dout, c.q, c.k, c.v, f, fo); });
  fo.num_threads = 2;
  must_not_throw("fused backward (2 threads)", [&] { g2 = scaled_dot_product_attention_backward(dout, c.q, c.k, c.v, f, fo); });
  ATTN_FUZZ_CHECKF(g1.grad_query.shape() == c.q.shape() && g1.grad_key.shape() == c.k.shape() &&
                       g1.grad_value.shape() == c.v.shape(),
                   "fused backward: gradient shapes; %s", c.desc.c_str());
  ATTN_FUZZ_CHECKF(g1.grad_attn_mask.defined() == c.additive_mask &&
                       (!c.additive_mask || g1.grad_attn_mask.shape() == c.options.attn_mask->values.shape()),
                   "fused backward: grad_attn_mask %s; %s", g1.grad_attn_mask.defined() ? "shape" : "missing",
                   c.desc.c_str());
  ATTN_FUZZ_CHECKF(g1.grad_sinks.defined() == c.options.sinks.has_value(), "fused backward: grad_sinks; %s",
                   c.desc.c_str());
  ATTN_FUZZ_CHECKF(same_bits(g1.grad_query, g2.grad_query) &&
                       same_bits(g1.grad_key, g2.grad_key) &&
                       same_bits(g1.grad_value, g2.grad_value) &&
                       same_bits(g1.grad_attn_mask, g2.grad_attn_mask) &&
                       same_bits(g1.grad_sinks, g2.grad_sinks),
                   "fused backward differs between 1 and 2 threads; %s", c.desc.c_str());
  if (!c.moderate || !(c.delta <= 1.0)) return;

  // The reference and the truth (the scale rounded to float32, as both float32 backends apply it).
  SdpaOptions ro = fo;
  ro.kernel = "reference";
  ro.backend = SdpaBackend::kReference;
  ro.num_threads = 1;
  SdpaGrads rg;
  must_not_throw("reference backward", [&] {
    const SdpaResult rf = scaled_dot_product_attention(c.q, c.k, c.v, ro);
    rg = scaled_dot_product_attention_backward(dout, c.q, c.k, c.v, rf, ro);
  });
  SdpaOptions to = ro;
  if (to.scale) to.scale = static_cast<double>(static_cast<float>(*to.scale));
  reference::SdpaGradsF64 truth;
  reference::SdpaResultF64 plain;  // P without dropout, for the bound
  must_not_throw("f64 backward truth", [&] { truth = reference::scaled_dot_product_attention_backward_f64(dout, c.q, c.k, c.v, to); });
  to.dropout_p = 0.0f;
  to.need_weights = true;
  must_not_throw("f64 forward truth (no dropout)", [&] { plain = reference::scaled_dot_product_attention_f64(c.q, c.k, c.v, to); });

  // Sizes: query heads b of (L, E) rows, kv heads kb of (S, E) rows.
  const int rank = c.q.dim();
  const int64_t L = c.q.size(-2), E = c.q.size(-1), S = c.k.size(-2), Ev = c.v.size(-1);
  const int64_t Hq = rank >= 3 ? c.q.size(-3) : 1, Hkv = rank >= 3 ? c.k.size(-3) : 1, group = Hq / Hkv;
  const int64_t batch = c.q.numel() / (L * E);
  const std::vector<float> qx = c.q.to_vector(), kx = c.k.to_vector(), vx = c.v.to_vector(), dx = dout.to_vector();
  double vmax = 0;
  for (float x : vx) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  const float dp = c.options.dropout_p;
  const double inv_keep = dp > 0.0f && dp < 1.0f ? 1.0 / (1.0 - static_cast<double>(dp)) : 1.0;
  const double scale = to.scale ? std::fabs(*to.scale) : 1.0 / std::sqrt(static_cast<double>(E));
  const double u = 0x1p-24, eps = 2 * std::expm1(4 * c.delta) + static_cast<double>(Ev + 16) * u;

  std::vector<double> t_dq(qx.size(), 0.0), t_dk(kx.size(), 0.0), t_dv(vx.size(), 0.0);
  std::vector<double> t_sink(static_cast<size_t>(Hq), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kb = (b / Hq) * Hkv + (b % Hq) / group;
    for (int64_t i = 0; i < L; ++i) {
      const size_t row = static_cast<size_t>(b * L + i);
      double d1 = 0;
      for (int64_t e = 0; e < Ev; ++e) d1 += std::fabs(dx[row * Ev + e]);
      const double ci = d1 * vmax * inv_keep;
      t_sink[static_cast<size_t>(b % Hq)] += ci;
      for (int64_t j = 0; j < S; ++j) {
        const double pij = plain.attn_weights[row * S + j];
        const double ts = 2 * pij * ci;
        const size_t kr = static_cast<size_t>(kb * S + j);
        for (int64_t e = 0; e < E; ++e) {
          t_dq[row * E + e] += scale * ts * std::fabs(kx[kr * E + e]);
          t_dk[kr * E + e] += scale * ts * std::fabs(qx[row * E + e]);
        }
        for (int64_t e = 0; e < Ev; ++e) t_dv[kr * Ev + e] += inv_keep * pij * std::fabs(dx[row * Ev + e]);
      }
    }
  }
  // How many terms each element sums: a dQ element over the keys, a dK or dV element over the
  // rows of the query heads that read its kv head.
  const double sum_q = static_cast<double>(S), sum_kv = static_cast<double>(L * group);

  auto compare = [&](const char* what, const Tensor& got, const Tensor& ref, const std::vector<double>& truth_v,
                     const std::vector<double>& bound, double terms) {
    const std::vector<float> a = got.to_vector(), r = ref.to_vector();
    ATTN_FUZZ_CHECKF(a.size() == truth_v.size() && r.size() == truth_v.size() && bound.size() == truth_v.size(),
                     "backward %s: sizes %zu / %zu / %zu; %s", what, a.size(), r.size(), truth_v.size(), c.desc.c_str());
    double er = 0;
    for (size_t x = 0; x < truth_v.size(); ++x) {
      if (!std::isfinite(truth_v[x])) return;  // a moderate problem's gradient overflowed
      const double d = std::fabs(static_cast<double>(r[x]) - truth_v[x]);
      er = std::max(er, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
    }
    const double fac = eps + (terms + 8) * u;
    for (size_t x = 0; x < truth_v.size(); ++x) {
      const double e = std::fabs(static_cast<double>(a[x]) - truth_v[x]);
      const double tol = 2 * er + 2 * fac * bound[x] + 1e-36;
      if (!(e <= tol)) {
        fuzz_fail("fused backward %s: element %zu is %.9g, truth %.9g (error %.3g > 2 * reference error %.3g + "
                  "2 * %.3g * bound %.3g)\n  problem: %s", what, x, static_cast<double>(a[x]), truth_v[x], e, er, fac,
                  bound[x], c.desc.c_str());
      }
    }
  };
  compare("dq", g1.grad_query, rg.grad_query, truth.grad_query, t_dq, sum_q);
  compare("dk", g1.grad_key, rg.grad_key, truth.grad_key, t_dk, sum_kv);
  compare("dv", g1.grad_value, rg.grad_value, truth.grad_value, t_dv, sum_kv);
  if (c.options.sinks) {
    compare("d(sinks)", g1.grad_sinks, rg.grad_sinks, truth.grad_sinks, t_sink,
            static_cast<double>(batch / Hq * L));
  }
  if (c.additive_mask) {
    const MaskGradBound mb = mask_grad_bound(plain.attn_weights, dx, Ev, vmax, inv_keep, c.q.shape(), S,
                                             c.options.attn_mask->values.shape());
    compare("d(attn_mask)", g1.grad_attn_mask, rg.grad_attn_mask, truth.grad_attn_mask, mb.bound, mb.terms);
  }
}

}  // namespace attn::fuzz

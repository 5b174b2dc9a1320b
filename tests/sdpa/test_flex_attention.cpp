// flex_attention (attn/flex_attention.hpp): user score_mod / mask_mod compiled into the kernel.
//
// Rule (FlashAttention's, as for the fused SDPA kernels): against a float64 truth, flex's max
// error is at most 2x a float32 reference's error plus a small floor. Where the mod has an SDPA
// equivalent (identity, causal, a boolean or additive mask) the reference is
// scaled_dot_product_attention with backend kReference and the truth attn's float64 reference;
// otherwise (softcap) both are the naive loops below, in float32 and in float64. Gradients are
// also checked against float64 finite differences on a small case.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/flex_attention.hpp"
#include "grad_check.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

using test::max_abs_err;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Dims {
  int64_t B, Hq, Hkv, L, S, E, Ev;
};

std::string describe(const Dims& d) {
  return "B" + std::to_string(d.B) + " Hq" + std::to_string(d.Hq) + " Hkv" + std::to_string(d.Hkv) + " L" +
         std::to_string(d.L) + " S" + std::to_string(d.S) + " E" + std::to_string(d.E) + " Ev" + std::to_string(d.Ev);
}

struct Problem {
  Dims d;
  Tensor q, k, v, dout;
};

Problem make(const Dims& d, uint64_t seed) {
  manual_seed(seed);
  Problem p{d, randn({d.B, d.Hq, d.L, d.E}), randn({d.B, d.Hkv, d.S, d.E}), randn({d.B, d.Hkv, d.S, d.Ev}),
            randn({d.B, d.Hq, d.L, d.Ev})};
  return p;
}

// Odd sizes: L = 1, 7, 33, 130; S != L; E = 1, 3, 64, 100; GQA ratios 1, 2, 3.
const std::vector<Dims>& shapes() {
  static const std::vector<Dims> s = {
      {1, 1, 1, 1, 1, 1, 1},     {2, 2, 2, 7, 7, 3, 3},      {1, 4, 2, 33, 20, 64, 64},
      {2, 2, 1, 130, 97, 100, 37}, {1, 2, 2, 130, 130, 64, 64}, {1, 3, 1, 7, 33, 1, 5},
      {1, 2, 2, 1, 130, 3, 3},   {1, 1, 1, 33, 1, 64, 2},
  };
  return s;
}

FlexOptions flex_options(const Dims& d) {
  FlexOptions o;
  o.enable_gqa = d.Hq != d.Hkv;
  o.need_lse = true;
  return o;
}

// ---- naive loops: the truth (T = double) and the float32 reference (T = float) --------------------

// mod(s, b, h, i, j) -> x, dmod(s, b, h, i, j) -> dx/ds, mask(b, h, i, j) -> bool.
template <class T>
struct ModFns {
  std::function<T(T, int64_t, int64_t, int64_t, int64_t)> mod, dmod;
  std::function<bool(int64_t, int64_t, int64_t, int64_t)> mask;
};

template <class T>
struct Naive {
  std::vector<double> out, lse, dq, dk, dv;
};

// Forward and (with dout) backward of flex_attention's definition, written out per row in T.
template <class T>
Naive<T> naive(const Problem& p, double scale_d, const ModFns<T>& f, bool backward) {
  const Dims& d = p.d;
  const std::vector<float> q = p.q.to_vector(), k = p.k.to_vector(), v = p.v.to_vector(), dout = p.dout.to_vector();
  const T scale = static_cast<T>(scale_d);
  const int64_t group = d.Hq / d.Hkv;
  Naive<T> r;
  r.out.assign(static_cast<size_t>(d.B * d.Hq * d.L * d.Ev), 0.0);
  r.lse.assign(static_cast<size_t>(d.B * d.Hq * d.L), -kInf);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  std::vector<T> s(d.S), x(d.S), pr(d.S), dp(d.S);
  std::vector<char> in(d.S);
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < d.L; ++i) {
        const float* qi = &q[((b * d.Hq + h) * d.L + i) * d.E];
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < d.S; ++j) {
          const float* kj = &k[((b * d.Hkv + hk) * d.S + j) * d.E];
          T dot = 0;
          for (int64_t e = 0; e < d.E; ++e) dot += static_cast<T>(qi[e]) * static_cast<T>(kj[e]);
          s[j] = dot * scale;
          in[j] = f.mask(b, h, i, j);
          if (in[j]) {
            x[j] = f.mod(s[j], b, h, i, j);
            mx = std::max(mx, x[j]);
          }
        }
        const int64_t row = (b * d.Hq + h) * d.L + i;
        if (mx == -std::numeric_limits<T>::infinity()) continue;  // every key excluded: 0, lse -inf
        T sum = 0;
        for (int64_t j = 0; j < d.S; ++j) {
          pr[j] = in[j] ? std::exp(x[j] - mx) : T(0);
          sum += pr[j];
        }
        for (int64_t j = 0; j < d.S; ++j) pr[j] /= sum;
        r.lse[row] = static_cast<double>(mx + std::log(sum));
        std::vector<T> o(d.Ev, T(0));
        for (int64_t j = 0; j < d.S; ++j) {
          if (!in[j]) continue;
          for (int64_t e = 0; e < d.Ev; ++e) o[e] += pr[j] * static_cast<T>(v[((b * d.Hkv + hk) * d.S + j) * d.Ev + e]);
        }
        for (int64_t e = 0; e < d.Ev; ++e) r.out[row * d.Ev + e] = static_cast<double>(o[e]);
        if (!backward) continue;
        const float* doi = &dout[row * d.Ev];
        T dd = 0;  // rowsum(dO * O)
        for (int64_t e = 0; e < d.Ev; ++e) dd += static_cast<T>(doi[e]) * o[e];
        for (int64_t j = 0; j < d.S; ++j) {
          if (!in[j]) continue;
          const int64_t kv_row = (b * d.Hkv + hk) * d.S + j;
          T dpj = 0;
          for (int64_t e = 0; e < d.Ev; ++e) dpj += static_cast<T>(doi[e]) * static_cast<T>(v[kv_row * d.Ev + e]);
          const T ds = pr[j] * (dpj - dd) * f.dmod(s[j], b, h, i, j);
          for (int64_t e = 0; e < d.Ev; ++e) r.dv[kv_row * d.Ev + e] += static_cast<double>(pr[j] * static_cast<T>(doi[e]));
          for (int64_t e = 0; e < d.E; ++e) {
            r.dq[row * d.E + e] += static_cast<double>(scale * ds * static_cast<T>(k[kv_row * d.E + e]));
            r.dk[kv_row * d.E + e] += static_cast<double>(scale * ds * static_cast<T>(qi[e]));
          }
        }
      }
    }
  }
  return r;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

double lse_tol(const Dims& d) { return 1e-5 * std::max(1.0, std::log(static_cast<double>(d.S)) + 1.0); }

// The 2x rule for output and lse, against a float32 reference's error.
void expect_forward_within_rule(const std::string& what, const SdpaResult& f, double ref_err,
                                const std::vector<double>& truth_out, const std::vector<double>& truth_lse, const Dims& d) {
  ASSERT_TRUE(std::isfinite(ref_err)) << what;
  const double err = max_abs_err(f.output, truth_out);
  EXPECT_LE(err, 2.0 * ref_err + 1e-6) << what << " (reference error " << ref_err << ")";
  EXPECT_LE(max_abs_err(f.lse, truth_lse), lse_tol(d)) << what << " lse";
}

void expect_grads_within_rule(const std::string& what, const SdpaGrads& g, const double ref_err[3],
                              const std::vector<double>* truth[3]) {
  const double call_scale = std::max({1.0, max_abs(*truth[0]), max_abs(*truth[1]), max_abs(*truth[2])});
  const Tensor* got[3] = {&g.grad_query, &g.grad_key, &g.grad_value};
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(std::isfinite(ref_err[t])) << what << " " << names[t];
    const double err = max_abs_err(*got[t], *truth[t]);
    EXPECT_LE(err, 2.0 * ref_err[t] + 1e-6 * call_scale) << what << " " << names[t] << " (reference error " << ref_err[t] << ")";
  }
}

// flex (forward and backward) against SDPA's reference for a mod with an SDPA equivalent.
template <class ScoreModT, class MaskModT>
void expect_matches_sdpa(const std::string& what, const Problem& p, const ScoreModT& sm, const MaskModT& mm,
                         SdpaOptions so, FlexOptions fo) {
  so.enable_gqa = fo.enable_gqa;
  so.need_lse = true;
  so.backend = SdpaBackend::kReference;
  if (fo.scale) so.scale = fo.scale;
  fo.need_lse = true;
  const SdpaResult ref = scaled_dot_product_attention(p.q, p.k, p.v, so);
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(p.q, p.k, p.v, so);
  const SdpaResult f = flex_attention(p.q, p.k, p.v, sm, mm, fo);
  expect_forward_within_rule(what, f, max_abs_err(ref.output, truth.output), truth.output, truth.lse, p.d);

  const SdpaGrads rg = scaled_dot_product_attention_backward(p.dout, p.q, p.k, p.v, ref, so);
  const reference::SdpaGradsF64 tg = reference::scaled_dot_product_attention_backward_f64(p.dout, p.q, p.k, p.v, so);
  const double ref_err[3] = {max_abs_err(rg.grad_query, tg.grad_query), max_abs_err(rg.grad_key, tg.grad_key),
                             max_abs_err(rg.grad_value, tg.grad_value)};
  const std::vector<double>* truth_g[3] = {&tg.grad_query, &tg.grad_key, &tg.grad_value};
  const SdpaGrads g = flex_attention_backward(p.dout, p.q, p.k, p.v, f, sm, mm, fo);
  expect_grads_within_rule(what + " backward", g, ref_err, truth_g);
}

// ---- functors of the tests ------------------------------------------------------------------------

struct SlidingWindow {  // causal, at most `window` keys back
  int64_t window;
  bool operator()(int64_t, int64_t, int64_t i, int64_t j) const { return j <= i && i - j < window; }
};

struct Softcap {  // c * tanh(s / c), Gemma 2's logit softcapping
  float cap;
  float operator()(float s, int64_t, int64_t, int64_t, int64_t) const { return cap * std::tanh(s / cap); }
  float grad(float s, int64_t, int64_t, int64_t, int64_t) const {
    const float t = std::tanh(s / cap);
    return 1.0f - t * t;
  }
};

struct Alibi {  // s + slope_h * (j - i), slope_h = 2^(-(h + 1) / 2)
  static float slope(int64_t h) { return std::exp2(-0.5f * static_cast<float>(h + 1)); }
  float operator()(float s, int64_t, int64_t h, int64_t i, int64_t j) const {
    return s + slope(h) * static_cast<float>(j - i);
  }
  float grad(float, int64_t, int64_t, int64_t, int64_t) const { return 1.0f; }
};

struct Document {  // causal within a document: ids[i] == ids[j]
  const std::vector<int>* q_ids;
  const std::vector<int>* kv_ids;
  bool operator()(int64_t, int64_t, int64_t i, int64_t j) const { return (*q_ids)[i] == (*kv_ids)[j] && j <= i; }
};

// A boolean (L, S) mask tensor with mask_mod's values (b = h = 0).
template <class M>
Tensor mask_tensor(const M& m, int64_t L, int64_t S) {
  Tensor t({L, S});
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < S; ++j) t.data()[i * S + j] = m(0, 0, i, j) ? 1.0f : 0.0f;
  }
  return t;
}

// ---- against SDPA ---------------------------------------------------------------------------------

TEST(FlexAttention, IdentityAndNoMaskEqualsSdpa) {
  uint64_t seed = 1;
  for (const Dims& d : shapes()) {
    const Problem p = make(d, seed++);
    expect_matches_sdpa("identity " + describe(d), p, flex::NoScoreMod{}, flex::NoMask{}, {}, flex_options(d));
    // A mask functor that is not NoMask but keeps everything takes the per-element path.
    expect_matches_sdpa("identity, all-true mask " + describe(d), p, flex::NoScoreMod{},
                        [](int64_t, int64_t, int64_t, int64_t) { return true; }, {}, flex_options(d));
  }
}

TEST(FlexAttention, ExplicitScaleEqualsSdpaScale) {
  const Dims d{1, 2, 2, 33, 20, 64, 64};
  const Problem p = make(d, 5);
  FlexOptions fo = flex_options(d);
  fo.scale = 0.37;
  expect_matches_sdpa("scale 0.37", p, flex::NoScoreMod{}, flex::NoMask{}, {}, fo);
}

TEST(FlexAttention, CausalMaskModEqualsIsCausal) {
  uint64_t seed = 11;
  for (const Dims& d : shapes()) {
    const Problem p = make(d, seed++);
    SdpaOptions so;
    so.is_causal = true;
    expect_matches_sdpa("causal " + describe(d), p, flex::NoScoreMod{}, flex::Causal{}, so, flex_options(d));
    // The same through a block mask (broadcast over batch and heads).
    const flex::BlockMask bm = flex::create_block_mask(flex::Causal{}, 1, 1, d.L, d.S, 32, 32);
    FlexOptions fo = flex_options(d);
    fo.block_mask = &bm;
    expect_matches_sdpa("causal, block mask " + describe(d), p, flex::NoScoreMod{}, flex::Causal{}, so, fo);
    // Bottom-right alignment is Causal{S - L}.
    so.causal_alignment = CausalAlignment::kBottomRight;
    expect_matches_sdpa("causal bottom-right " + describe(d), p, flex::NoScoreMod{}, flex::Causal{d.S - d.L}, so,
                        flex_options(d));
  }
}

TEST(FlexAttention, SlidingWindowMaskModEqualsBoolMask) {
  uint64_t seed = 21;
  for (const Dims& d : shapes()) {
    const Problem p = make(d, seed++);
    const SlidingWindow w{5};
    const Tensor m = mask_tensor(w, d.L, d.S);
    SdpaOptions so;
    so.attn_mask = AttnMask::boolean(m);
    const flex::BlockMask bm = flex::create_block_mask(w, 1, 1, d.L, d.S, 16, 16);
    FlexOptions fo = flex_options(d);
    fo.block_mask = &bm;
    expect_matches_sdpa("sliding window " + describe(d), p, flex::NoScoreMod{}, w, so, fo);
    expect_matches_sdpa("sliding window, no block mask " + describe(d), p, flex::NoScoreMod{}, w, so, flex_options(d));
  }
}

TEST(FlexAttention, AlibiScoreModEqualsAdditiveMask) {
  uint64_t seed = 31;
  for (const Dims& d : shapes()) {
    const Problem p = make(d, seed++);
    Tensor bias({1, d.Hq, d.L, d.S});
    for (int64_t h = 0; h < d.Hq; ++h) {
      for (int64_t i = 0; i < d.L; ++i) {
        for (int64_t j = 0; j < d.S; ++j) bias.at({0, h, i, j}) = Alibi::slope(h) * static_cast<float>(j - i);
      }
    }
    SdpaOptions so;
    so.attn_mask = AttnMask::additive(bias);
    expect_matches_sdpa("alibi " + describe(d), p, Alibi{}, flex::NoMask{}, so, flex_options(d));
  }
}

TEST(FlexAttention, DocumentMaskEqualsBoolMask) {
  const Dims d{2, 4, 2, 130, 130, 64, 64};
  const Problem p = make(d, 41);
  std::vector<int> ids(static_cast<size_t>(d.L));
  for (int64_t i = 0; i < d.L; ++i) ids[i] = i < 40 ? 0 : i < 41 ? 1 : i < 100 ? 2 : 3;  // lengths 40, 1, 59, 30
  const Document doc{&ids, &ids};
  const Tensor m = mask_tensor(doc, d.L, d.S);
  SdpaOptions so;
  so.attn_mask = AttnMask::boolean(m);
  const flex::BlockMask bm = flex::create_block_mask(doc, 1, 1, d.L, d.S, 32, 32);
  EXPECT_GT(bm.count(flex::TileKind::kEmpty), 0);
  FlexOptions fo = flex_options(d);
  fo.block_mask = &bm;
  expect_matches_sdpa("document", p, flex::NoScoreMod{}, doc, so, fo);
}

// ---- a score_mod without an SDPA equivalent: softcap ------------------------------------------------

TEST(FlexAttention, SoftcapAgainstFloat64Loops) {
  uint64_t seed = 51;
  for (const Dims& d : shapes()) {
    Problem p = make(d, seed++);
    // Large scores, so the cap bends them: q * 3.
    for (int64_t i = 0; i < p.q.numel(); ++i) p.q.data()[i] *= 3.0f;
    const float cap = 5.0f;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d.E));
    ModFns<double> f64{[&](double s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
                       [&](double s, int64_t, int64_t, int64_t, int64_t) {
                         const double t = std::tanh(s / cap);
                         return 1.0 - t * t;
                       },
                       SlidingWindow{9}};
    ModFns<float> f32{[&](float s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
                      [&](float s, int64_t, int64_t, int64_t, int64_t) {
                        const float t = std::tanh(s / cap);
                        return 1.0f - t * t;
                      },
                      SlidingWindow{9}};
    const Naive<double> truth = naive(p, scale, f64, true);
    const Naive<float> ref = naive(p, scale, f32, true);
    const FlexOptions fo = flex_options(d);
    const SdpaResult f = flex_attention(p.q, p.k, p.v, Softcap{cap}, SlidingWindow{9}, fo);
    double ref_err = 0;
    for (size_t i = 0; i < ref.out.size(); ++i) ref_err = std::max(ref_err, std::fabs(ref.out[i] - truth.out[i]));
    expect_forward_within_rule("softcap " + describe(d), f, ref_err, truth.out, truth.lse, d);

    const SdpaGrads g = flex_attention_backward(p.dout, p.q, p.k, p.v, f, Softcap{cap}, SlidingWindow{9}, fo);
    auto err = [](const std::vector<double>& a, const std::vector<double>& b) {
      double m = 0;
      for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
      return m;
    };
    const double ref_errs[3] = {err(ref.dq, truth.dq), err(ref.dk, truth.dk), err(ref.dv, truth.dv)};
    const std::vector<double>* truth_g[3] = {&truth.dq, &truth.dk, &truth.dv};
    expect_grads_within_rule("softcap backward " + describe(d), g, ref_errs, truth_g);
  }
}

TEST(FlexAttention, GradientsMatchFiniteDifferences) {
  // Softcap, a per-head ALiBi slope and a sliding window together, GQA 2:1, odd sizes.
  const Dims d{1, 2, 1, 5, 6, 3, 2};
  const Problem p = make(d, 61);
  const float cap = 2.0f;
  const double scale = 0.9;
  auto score_mod = flex::with_grad(
      [cap](float s, int64_t, int64_t h, int64_t i, int64_t j) {
        return cap * std::tanh(s / cap) + Alibi::slope(h) * static_cast<float>(j - i);
      },
      [cap](float s, int64_t, int64_t, int64_t, int64_t) {
        const float t = std::tanh(s / cap);
        return 1.0f - t * t;
      });
  const auto mask = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i + 1 && i - j < 3; };
  FlexOptions fo = flex_options(d);
  fo.scale = scale;
  const SdpaResult f = flex_attention(p.q, p.k, p.v, score_mod, mask, fo);
  const SdpaGrads g = flex_attention_backward(p.dout, p.q, p.k, p.v, f, score_mod, mask, fo);

  const test::F64 r = test::to_f64(p.dout);
  // Float64 forward of the same definition, on float64 inputs (finite differences need h = 1e-6).
  auto forward64 = [&](const std::vector<test::F64>& args) {
    const test::F64 &q = args[0], &k = args[1], &v = args[2];
    test::F64 out(static_cast<size_t>(d.Hq * d.L * d.Ev), 0.0);
    for (int64_t h = 0; h < d.Hq; ++h) {
      for (int64_t i = 0; i < d.L; ++i) {
        std::vector<double> x(d.S, -kInf);
        double mx = -kInf;
        for (int64_t j = 0; j < d.S; ++j) {
          if (!mask(0, h, i, j)) continue;
          double dot = 0;
          for (int64_t e = 0; e < d.E; ++e) dot += q[(h * d.L + i) * d.E + e] * k[j * d.E + e];
          const double s = dot * scale;
          x[j] = cap * std::tanh(s / cap) + static_cast<double>(Alibi::slope(h)) * static_cast<double>(j - i);
          mx = std::max(mx, x[j]);
        }
        if (mx == -kInf) continue;
        double sum = 0;
        for (int64_t j = 0; j < d.S; ++j) sum += x[j] == -kInf ? 0.0 : std::exp(x[j] - mx);
        for (int64_t j = 0; j < d.S; ++j) {
          if (x[j] == -kInf) continue;
          const double w = std::exp(x[j] - mx) / sum;
          for (int64_t e = 0; e < d.Ev; ++e) out[(h * d.L + i) * d.Ev + e] += w * v[j * d.Ev + e];
        }
      }
    }
    return test::weighted_sum(out, r);
  };
  const std::vector<test::F64> args = {test::to_f64(p.q), test::to_f64(p.k), test::to_f64(p.v)};
  EXPECT_TRUE(test::grads_close("dQ", g.grad_query.to_vector(), test::finite_diff(forward64, args, 0)));
  EXPECT_TRUE(test::grads_close("dK", g.grad_key.to_vector(), test::finite_diff(forward64, args, 1)));
  EXPECT_TRUE(test::grads_close("dV", g.grad_value.to_vector(), test::finite_diff(forward64, args, 2)));
}

// ---- block mask -----------------------------------------------------------------------------------

// Every tile partial, with the given tile sizes: the same tiling as a block mask, without the skipping.
flex::BlockMask all_partial(int64_t B, int64_t H, int64_t L, int64_t S, int64_t bq, int64_t bk) {
  const int64_t n = B * H * ((L + bq - 1) / bq) * ((S + bk - 1) / bk);
  return flex::BlockMask(B, H, L, S, bq, bk, std::vector<uint8_t>(static_cast<size_t>(n), 1));
}

struct CountingCausal {  // Causal, counting its calls
  std::atomic<int64_t>* calls;
  bool operator()(int64_t, int64_t, int64_t i, int64_t j) const {
    calls->fetch_add(1, std::memory_order_relaxed);
    return j <= i;
  }
};

// Returns NaN where the key would be excluded, and counts its calls: never called there.
struct PoisonOutsideCausal {
  std::atomic<int64_t>* calls;
  float operator()(float s, int64_t, int64_t, int64_t i, int64_t j) const {
    calls->fetch_add(1, std::memory_order_relaxed);
    return j <= i ? s : std::numeric_limits<float>::quiet_NaN();
  }
  float grad(float, int64_t, int64_t, int64_t i, int64_t j) const {
    return j <= i ? 1.0f : std::numeric_limits<float>::quiet_NaN();
  }
};

TEST(FlexAttentionBlockMask, ClassifiesTilesAndSkipsEmptyOnes) {
  const Dims d{2, 2, 2, 128, 128, 16, 16};
  const Problem p = make(d, 71);
  std::atomic<int64_t> build_calls{0}, mask_calls{0}, score_calls{0};
  const flex::BlockMask bm = flex::create_block_mask(CountingCausal{&build_calls}, 1, 1, d.L, d.S, 32, 32);
  // At most once per element, at b = h = 0 (a tile stops at the first row proving it partial).
  EXPECT_LE(build_calls.load(), d.L * d.S);
  EXPECT_EQ(bm.num_q_tiles(), 4);
  EXPECT_EQ(bm.num_kv_tiles(), 4);
  EXPECT_EQ(bm.count(flex::TileKind::kEmpty), 6);
  EXPECT_EQ(bm.count(flex::TileKind::kPartial), 4);
  EXPECT_EQ(bm.count(flex::TileKind::kFull), 6);
  EXPECT_EQ(bm.tile(0, 0, 0, 1), flex::TileKind::kEmpty);
  EXPECT_EQ(bm.tile(0, 0, 1, 1), flex::TileKind::kPartial);
  EXPECT_EQ(bm.tile(0, 0, 3, 0), flex::TileKind::kFull);

  FlexOptions fo = flex_options(d);
  fo.block_mask = &bm;
  const PoisonOutsideCausal sm{&score_calls};
  const SdpaResult f = flex_attention(p.q, p.k, p.v, sm, CountingCausal{&mask_calls}, fo);
  // mask_mod only in the 4 diagonal tiles; score_mod only at included positions.
  EXPECT_EQ(mask_calls.load(), d.B * d.Hq * 4 * 32 * 32);
  EXPECT_EQ(score_calls.load(), d.B * d.Hq * d.L * (d.L + 1) / 2);
  for (float x : f.output.to_vector()) ASSERT_TRUE(std::isfinite(x));

  // The same numbers as with every tile partial (same tiles), bit for bit: an empty tile adds
  // exactly nothing, a full one the same terms.
  const flex::BlockMask partial = all_partial(1, 1, d.L, d.S, 32, 32);
  FlexOptions no_bm = flex_options(d);
  no_bm.block_mask = &partial;
  const SdpaResult g = flex_attention(p.q, p.k, p.v, sm, CountingCausal{&mask_calls}, no_bm);
  EXPECT_EQ(f.output.to_vector(), g.output.to_vector());
  EXPECT_EQ(f.lse.to_vector(), g.lse.to_vector());
  const SdpaGrads gb = flex_attention_backward(p.dout, p.q, p.k, p.v, f, sm, CountingCausal{&mask_calls}, fo);
  const SdpaGrads gn = flex_attention_backward(p.dout, p.q, p.k, p.v, g, sm, CountingCausal{&mask_calls}, no_bm);
  EXPECT_EQ(gb.grad_query.to_vector(), gn.grad_query.to_vector());
  EXPECT_EQ(gb.grad_key.to_vector(), gn.grad_key.to_vector());
  EXPECT_EQ(gb.grad_value.to_vector(), gn.grad_value.to_vector());
  for (float x : gb.grad_query.to_vector()) ASSERT_TRUE(std::isfinite(x));
}

TEST(FlexAttentionBlockMask, PerHeadMaskAndBadExtentsAreRejected) {
  const Dims d{2, 3, 3, 40, 50, 8, 8};
  const Problem p = make(d, 72);
  // Head h sees keys j <= i + 10 h: the block mask per (b, h).
  const auto per_head = [](int64_t, int64_t h, int64_t i, int64_t j) { return j <= i + 10 * h; };
  const flex::BlockMask bm = flex::create_block_mask(per_head, 1, d.Hq, d.L, d.S, 16, 16);
  FlexOptions fo = flex_options(d);
  fo.block_mask = &bm;
  const SdpaResult with = flex_attention(p.q, p.k, p.v, flex::NoScoreMod{}, per_head, fo);
  const flex::BlockMask partial = all_partial(1, 1, d.L, d.S, 16, 16);
  FlexOptions fo_partial = flex_options(d);
  fo_partial.block_mask = &partial;
  const SdpaResult without = flex_attention(p.q, p.k, p.v, flex::NoScoreMod{}, per_head, fo_partial);
  EXPECT_EQ(with.output.to_vector(), without.output.to_vector());

  const flex::BlockMask wrong = flex::create_block_mask(per_head, 1, d.Hq, d.L + 1, d.S);
  fo.block_mask = &wrong;
  try {
    (void)flex_attention(p.q, p.k, p.v, flex::NoScoreMod{}, per_head, fo);
    ADD_FAILURE() << "no ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("block_mask"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)flex::create_block_mask(per_head, 1, 1, d.L, d.S, 16, 20), ValueError);
  EXPECT_THROW((void)flex::create_block_mask(per_head, 1, 1, d.L, d.S, 0, 16), ValueError);
  EXPECT_THROW((void)flex::create_block_mask(per_head, 1, 0, d.L, d.S), ValueError);
}

TEST(FlexAttentionNumerics, FullyMaskedRowsAreZeroWithLseMinusInf) {
  const Dims d{1, 2, 2, 70, 50, 8, 8};
  Problem p = make(d, 81);
  // Rows i < 3 see no key; key 7 is never seen, and its key and value are Inf / NaN.
  const auto mask = [](int64_t, int64_t, int64_t i, int64_t j) { return i >= 3 && j != 7 && j <= i; };
  for (int64_t h = 0; h < d.Hkv; ++h) {
    for (int64_t e = 0; e < d.E; ++e) p.k.at({0, h, 7, e}) = std::numeric_limits<float>::quiet_NaN();
    for (int64_t e = 0; e < d.Ev; ++e) p.v.at({0, h, 7, e}) = std::numeric_limits<float>::infinity();
  }
  for (int with_bm = 0; with_bm < 2; ++with_bm) {
    const flex::BlockMask bm = flex::create_block_mask(mask, 1, 1, d.L, d.S, 2, 16);
    FlexOptions fo = flex_options(d);
    if (with_bm) fo.block_mask = &bm;
    const SdpaResult f = flex_attention(p.q, p.k, p.v, flex::NoScoreMod{}, mask, fo);
    for (int64_t h = 0; h < d.Hq; ++h) {
      for (int64_t i = 0; i < d.L; ++i) {
        if (i < 3) {
          EXPECT_EQ(f.lse.at({0, h, i}), -std::numeric_limits<float>::infinity());
          for (int64_t e = 0; e < d.Ev; ++e) EXPECT_EQ(f.output.at({0, h, i, e}), 0.0f);
        } else {
          EXPECT_TRUE(std::isfinite(f.lse.at({0, h, i})));
        }
      }
    }
    for (float x : f.output.to_vector()) ASSERT_TRUE(std::isfinite(x)) << "with block mask " << with_bm;
    const SdpaGrads g = flex_attention_backward(p.dout, p.q, p.k, p.v, f, flex::NoScoreMod{}, mask, fo);
    for (const Tensor* t : {&g.grad_query, &g.grad_key, &g.grad_value}) {
      for (float x : t->to_vector()) ASSERT_TRUE(std::isfinite(x)) << "with block mask " << with_bm;
    }
    for (int64_t e = 0; e < d.E; ++e) EXPECT_EQ(g.grad_query.at({0, 0, 1, e}), 0.0f);
    for (int64_t e = 0; e < d.Ev; ++e) EXPECT_EQ(g.grad_value.at({0, 0, 7, e}), 0.0f);
  }
  // Every key excluded everywhere: all zero, lse all -inf, gradients zero.
  const auto none = [](int64_t, int64_t, int64_t, int64_t) { return false; };
  const SdpaResult z = flex_attention(p.q, p.k, p.v, flex::NoScoreMod{}, none, flex_options(d));
  for (float x : z.output.to_vector()) EXPECT_EQ(x, 0.0f);
  for (float x : z.lse.to_vector()) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  const SdpaGrads zg = flex_attention_backward(p.dout, p.q, p.k, p.v, z, flex::NoScoreMod{}, none, flex_options(d));
  for (float x : zg.grad_key.to_vector()) EXPECT_EQ(x, 0.0f);
}

TEST(FlexAttentionNumerics, NanInAnIncludedScorePropagates) {
  const Dims d{1, 1, 1, 4, 20, 4, 4};
  const Problem p = make(d, 82);
  const auto sm = [](float s, int64_t, int64_t, int64_t i, int64_t j) {
    return i == 2 && j == 5 ? std::numeric_limits<float>::quiet_NaN() : s;
  };
  const SdpaResult f = flex_attention(p.q, p.k, p.v, sm, flex::NoMask{}, flex_options(d));
  for (int64_t i = 0; i < d.L; ++i) {
    EXPECT_EQ(std::isnan(f.output.at({0, 0, i, 0})), i == 2) << "row " << i;
  }
}

// ---- threads, layouts, errors ---------------------------------------------------------------------

TEST(FlexAttention, SameBitsForOneTwoAndThreeThreads) {
  const Dims d{2, 4, 2, 130, 97, 64, 40};
  const Problem p = make(d, 91);
  const Softcap sm{4.0f};
  const SlidingWindow mm{50};
  const flex::BlockMask bm = flex::create_block_mask(mm, 1, 1, d.L, d.S, 32, 32);
  std::vector<float> out[3], dq[3], dk[3], dv[3];
  for (int t = 0; t < 3; ++t) {
    FlexOptions fo = flex_options(d);
    fo.num_threads = t + 1;
    fo.block_mask = &bm;
    const SdpaResult f = flex_attention(p.q, p.k, p.v, sm, mm, fo);
    const SdpaGrads g = flex_attention_backward(p.dout, p.q, p.k, p.v, f, sm, mm, fo);
    out[t] = f.output.to_vector();
    dq[t] = g.grad_query.to_vector();
    dk[t] = g.grad_key.to_vector();
    dv[t] = g.grad_value.to_vector();
  }
  for (int t = 1; t < 3; ++t) {
    EXPECT_EQ(out[0], out[t]) << t + 1 << " threads";
    EXPECT_EQ(dq[0], dq[t]) << t + 1 << " threads";
    EXPECT_EQ(dk[0], dk[t]) << t + 1 << " threads";
    EXPECT_EQ(dv[0], dv[t]) << t + 1 << " threads";
  }
}

TEST(FlexAttention, StridedAndUnbatchedInputsMatchContiguous) {
  const Dims d{1, 2, 2, 33, 20, 8, 8};
  const Problem p = make(d, 92);
  const SdpaResult base = flex_attention(p.q, p.k, p.v, Softcap{3.0f}, flex::Causal{}, flex_options(d));
  // (B, L, H, E) memory read through a transposed view.
  const Tensor qt = p.q.transpose(1, 2).contiguous(), kt = p.k.transpose(1, 2).contiguous(),
               vt = p.v.transpose(1, 2).contiguous();
  const SdpaResult strided =
      flex_attention(qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), Softcap{3.0f}, flex::Causal{}, flex_options(d));
  EXPECT_EQ(base.output.to_vector(), strided.output.to_vector());
  // (H, L, E) and (L, E).
  const SdpaResult heads = flex_attention(p.q.select(0, 0), p.k.select(0, 0), p.v.select(0, 0), Softcap{3.0f},
                                          flex::Causal{}, flex_options(d));
  EXPECT_EQ(heads.output.shape(), (Shape{d.Hq, d.L, d.Ev}));
  EXPECT_EQ(heads.lse.shape(), (Shape{d.Hq, d.L}));
  EXPECT_EQ(base.output.to_vector(), heads.output.to_vector());
  const SdpaResult one = flex_attention(p.q.select(0, 0).select(0, 1), p.k.select(0, 0).select(0, 1),
                                        p.v.select(0, 0).select(0, 1), Softcap{3.0f}, flex::Causal{}, flex_options(d));
  const std::vector<float> all = base.output.to_vector();
  EXPECT_EQ(one.output.to_vector(), std::vector<float>(all.begin() + d.L * d.Ev, all.end()));
  const SdpaGrads g = flex_attention_backward(p.dout.select(0, 0), p.q.select(0, 0), p.k.select(0, 0),
                                              p.v.select(0, 0), heads, Softcap{3.0f}, flex::Causal{}, flex_options(d));
  EXPECT_EQ(g.grad_key.shape(), (Shape{d.Hkv, d.S, d.E}));
}

template <class Fn>
void expect_error_naming(const Fn& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(FlexAttention, BadInputsThrowTypedErrorsNamingTheArgument) {
  const Dims d{1, 4, 2, 7, 9, 8, 8};
  const Problem p = make(d, 93);
  const flex::NoScoreMod sm;
  const flex::NoMask mm;
  FlexOptions gqa = flex_options(d);
  const Tensor q64 = p.q.to(DType::kFloat64), vbf = p.v.to(DType::kBFloat16);
  EXPECT_THROW((void)flex_attention(q64, p.k, p.v, sm, mm, gqa), DTypeError);
  expect_error_naming([&] { (void)flex_attention(q64, p.k, p.v, sm, mm, gqa); }, "query must be float32, got float64");
  expect_error_naming([&] { (void)flex_attention(p.q, p.k, vbf, sm, mm, gqa); }, "value must be float32, got bfloat16");
  // Without enable_gqa, 4 query heads and 2 kv heads do not match.
  EXPECT_THROW((void)flex_attention(p.q, p.k, p.v, sm, mm, {}), ShapeError);
  const Tensor k_bad = randn({1, 2, 9, 7});
  EXPECT_THROW((void)flex_attention(p.q, k_bad, p.v, sm, mm, gqa), ShapeError);
  expect_error_naming([&] { (void)flex_attention(p.q, k_bad, p.v, sm, mm, gqa); }, "key's embed dim must equal query's (8), got key shape [1, 2, 9, 7]");
  const Tensor v_bad = randn({1, 2, 10, 8});
  expect_error_naming([&] { (void)flex_attention(p.q, p.k, v_bad, sm, mm, gqa); }, "value's sequence length");
  const Tensor k3 = randn({1, 3, 9, 8}), v3 = randn({1, 3, 9, 8});
  EXPECT_THROW((void)flex_attention(p.q, k3, v3, sm, mm, gqa), ShapeError);
  const Tensor q5 = randn({8});
  EXPECT_THROW((void)flex_attention(q5, p.k, p.v, sm, mm, gqa), ShapeError);
  FlexOptions bad_scale = gqa;
  bad_scale.scale = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW((void)flex_attention(p.q, p.k, p.v, sm, mm, bad_scale), ValueError);

  // Backward: the forward's lse is needed, grad_output must have the output's shape.
  FlexOptions no_lse = gqa;
  no_lse.need_lse = false;
  const SdpaResult f_no_lse = flex_attention(p.q, p.k, p.v, sm, mm, no_lse);
  EXPECT_THROW((void)flex_attention_backward(p.dout, p.q, p.k, p.v, f_no_lse, sm, mm, gqa), ValueError);
  expect_error_naming([&] { (void)flex_attention_backward(p.dout, p.q, p.k, p.v, f_no_lse, sm, mm, gqa); }, "forward.lse");
  const SdpaResult f = flex_attention(p.q, p.k, p.v, sm, mm, gqa);
  const Tensor dout_bad = randn({1, 4, 7, 9});
  EXPECT_THROW((void)flex_attention_backward(dout_bad, p.q, p.k, p.v, f, sm, mm, gqa), ShapeError);
  expect_error_naming([&] { (void)flex_attention_backward(dout_bad, p.q, p.k, p.v, f, sm, mm, gqa); }, "grad_output must have shape [1, 4, 7, 8]");
  const Tensor dout64 = p.dout.to(DType::kFloat64);
  EXPECT_THROW((void)flex_attention_backward(dout64, p.q, p.k, p.v, f, sm, mm, gqa), DTypeError);
}

// The backward needs the derivative: a score_mod without `grad` is rejected at compile time
// (flex_attention_backward's static_assert; the CMake test FlexAttention.BackwardWithoutGradFailsToCompile
// compiles such a call and checks the message).
TEST(FlexAttention, ConceptsSeeTheDerivative) {
  const auto plain = [](float s, int64_t, int64_t, int64_t, int64_t) { return s; };
  static_assert(flex::ScoreMod<decltype(plain)>);
  static_assert(!flex::ScoreModWithGrad<decltype(plain)>);
  static_assert(flex::ScoreModWithGrad<flex::NoScoreMod>);
  static_assert(flex::ScoreModWithGrad<Softcap>);
  const auto with = flex::with_grad(plain, [](float, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  static_assert(flex::ScoreModWithGrad<decltype(with)>);
  static_assert(flex::MaskMod<flex::Causal>);
  static_assert(!flex::MaskMod<decltype(plain)>);
  // A forward with a grad-less lambda is fine.
  const Dims d{1, 1, 1, 3, 3, 2, 2};
  const Problem p = make(d, 94);
  const SdpaResult a = flex_attention(p.q, p.k, p.v, plain, flex::NoMask{}, flex_options(d));
  const SdpaResult b = flex_attention(p.q, p.k, p.v, with, flex::NoMask{}, flex_options(d));
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
}

}  // namespace
}  // namespace attn

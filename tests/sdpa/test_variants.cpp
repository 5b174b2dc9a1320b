// The attention variants (SdpaOptions: window_size, softcap, alibi_slopes, sinks) in every
// kernel family, forward and backward.
//
// 1. Semantics: the float64 reference against a naive float64 implementation written here from
//    the definitions in include/attn/sdpa.hpp (FlashAttention's), so that both reference paths
//    (which share sdpa_row.hpp) cannot agree on a wrong order of the steps.
// 2. The float64 reference's gradients (d(sinks) included) against float64 central differences.
// 3. Every fused kernel this CPU runs, over the forward/backward sweep's shapes (odd lengths, head
//    dims 1..256, GQA, every mask kind, both alignments, dropout), each variant and pairs of them:
//    error against float64 at most 2x the float32 reference's plus a small floor (FlashAttention's
//    rule), output, LSE and every gradient; bit-identical for 1 and 2 threads.
// 4. Equivalences (a window is a band mask, ALiBi an additive mask, Hugging Face's sliding_window),
//    the fully-masked-row policy with sinks, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

using test::Case;
using test::describe;
using test::Inputs;
using test::MaskKind;
using test::max_abs_err;

struct Variant {
  const char* name;
  WindowSize window;
  std::optional<double> softcap;
  int alibi = 0;  // 0: none, 1: slopes (H), 2: slopes (B, H)
  bool sinks = false;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"window_17_5", {17, 5}, {}, 0, false},
      {"window_left_40", {40, -1}, {}, 0, false},
      {"window_right_0", {-1, 0}, {}, 0, false},
      {"softcap_2", {}, 2.0, 0, false},
      {"alibi_h", {}, {}, 1, false},
      {"alibi_bh", {}, {}, 2, false},
      {"sinks", {}, {}, 0, true},
      {"window_sinks", {9, 0}, {}, 0, true},
      {"softcap_alibi", {}, 3.0, 1, false},
      {"window_alibi_softcap", {30, 3}, 5.0, 2, false},
      {"all", {25, 2}, 4.0, 1, true},
  };
  return v;
}

// The variant's tensors live next to the inputs (options hold views of them).
struct VariantInputs {
  Inputs in;
  Tensor slopes, sinks, dout;
};

VariantInputs make_variant_inputs(const Case& c, const Variant& var, uint64_t seed) {
  VariantInputs vi{test::make_inputs(c, seed), {}, {}, {}};
  SdpaOptions& o = vi.in.options;
  o.window_size = var.window;
  o.softcap = var.softcap;
  if (var.softcap) {
    // Scores of a few units, so tanh is well inside its curved part.
    o.scale = 1.5 / std::sqrt(static_cast<double>(c.E));
  }
  if (var.alibi != 0) {
    vi.slopes = var.alibi == 1 ? Tensor::empty({c.Hq}) : Tensor::empty({c.B, c.Hq});
    for (int64_t h = 0; h < vi.slopes.numel(); ++h) vi.slopes.data()[h] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(vi.slopes.numel())) * 0.7f;
    o.alibi_slopes = vi.slopes;
  }
  if (var.sinks) {
    vi.sinks = randn({c.Hq});
    o.sinks = vi.sinks;
  }
  vi.dout = randn({c.B, c.Hq, c.L, c.Ev});
  return vi;
}

// A shape sweep with each case given two variants in turn, so every variant meets several
// shapes, mask kinds, alignments and dropout settings.
struct VCase {
  Case c;
  int variant;
};

std::vector<VCase> variant_sweep() {
  std::vector<VCase> out;
  const int nv = static_cast<int>(variants().size());
  int n = 0;
  for (const Case& c : test::sweep()) {
    if (c.L * c.S * c.E * c.B * c.Hq > 60'000'000) continue;  // the float64 backward's cost
    out.push_back({c, n % nv});
    out.push_back({c, (n + 5) % nv});
    ++n;
  }
  return out;
}

std::string vdescribe(const VCase& vc) { return describe(vc.c) + " variant " + variants()[vc.variant].name; }
void PrintTo(const VCase& vc, std::ostream* os) { *os << vdescribe(vc); }

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

class Variants : public testing::TestWithParam<VCase> {};

TEST_P(Variants, ForwardAndBackwardWithinTwiceTheReferenceErrorOnEveryFusedKernel) {
  const VCase vc = GetParam();
  const Case& c = vc.c;
  VariantInputs vi = make_variant_inputs(c, variants()[vc.variant], 42);
  const Inputs& in = vi.in;
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(in.q, in.k, in.v, ref);
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  const double ref_err = max_abs_err(r.output, truth.output);
  ASSERT_TRUE(std::isfinite(ref_err)) << vdescribe(vc);
  SdpaOptions ref_w = ref;
  ref_w.need_weights = true;
  const double ref_werr = max_abs_err(scaled_dot_product_attention(in.q, in.k, in.v, ref_w).attn_weights, truth.attn_weights);
  EXPECT_LE(max_abs_err(r.lse, truth.lse), 1e-5 * (std::log(static_cast<double>(c.S)) + 2.0)) << vdescribe(vc);

  const SdpaGrads rg = scaled_dot_product_attention_backward(vi.dout, in.q, in.k, in.v, r, ref);
  const reference::SdpaGradsF64 tg =
      reference::scaled_dot_product_attention_backward_f64(vi.dout, in.q, in.k, in.v, ref);
  const double gscale = std::max({1.0, max_abs(tg.grad_query), max_abs(tg.grad_key), max_abs(tg.grad_value)});
  const double ref_gerr[4] = {max_abs_err(rg.grad_query, tg.grad_query), max_abs_err(rg.grad_key, tg.grad_key),
                              max_abs_err(rg.grad_value, tg.grad_value),
                              vi.sinks.defined() ? max_abs_err(rg.grad_sinks, tg.grad_sinks) : 0.0};
  ASSERT_EQ(rg.grad_sinks.defined(), vi.sinks.defined()) << vdescribe(vc);

  int kernels_run = 0;
  for (const std::string& kernel : test::runnable_fused_kernels()) {
    SdpaOptions fused = in.options;
    fused.kernel = kernel;
    if (test::decode_refuses(kernel, in.q, in.k, in.v, fused)) continue;
    ++kernels_run;
    const SdpaResult f = scaled_dot_product_attention(in.q, in.k, in.v, fused);
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6)
        << vdescribe(vc) << " kernel " << kernel << " (reference error " << ref_err << ")";
    EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-5 * (std::log(static_cast<double>(c.S)) + 2.0))
        << vdescribe(vc) << " lse, kernel " << kernel;
    SdpaOptions fused_w = fused;
    fused_w.need_weights = true;  // the second pass applies the variants too
    if (!test::decode_refuses(kernel, in.q, in.k, in.v, fused_w)) {
      const SdpaResult fw = scaled_dot_product_attention(in.q, in.k, in.v, fused_w);
      EXPECT_LE(max_abs_err(fw.attn_weights, truth.attn_weights), 2.0 * ref_werr + 1e-6)
          << vdescribe(vc) << " weights, kernel " << kernel;
    }
    const SdpaGrads g = scaled_dot_product_attention_backward(vi.dout, in.q, in.k, in.v, f, fused);
    const double err[4] = {max_abs_err(g.grad_query, tg.grad_query), max_abs_err(g.grad_key, tg.grad_key),
                           max_abs_err(g.grad_value, tg.grad_value),
                           vi.sinks.defined() ? max_abs_err(g.grad_sinks, tg.grad_sinks) : 0.0};
    const char* names[4] = {"dQ", "dK", "dV", "dSinks"};
    for (int t = 0; t < 4; ++t) {
      // d(sinks) sums over every row of a head: its floor grows with the number of rows.
      const double floor = t == 3 ? 1e-6 * gscale * static_cast<double>(c.B * c.L) : 1e-6 * gscale;
      EXPECT_LE(err[t], 2.0 * ref_gerr[t] + floor)
          << vdescribe(vc) << " " << names[t] << " kernel " << kernel << " (reference error " << ref_gerr[t] << ")";
    }
  }
  EXPECT_GT(kernels_run, 0);
}

TEST_P(Variants, SameBitsForOneAndTwoThreads) {
  const VCase vc = GetParam();
  if (vc.c.L * vc.c.S > 200'000) GTEST_SKIP() << "the sweep's larger shapes are covered by the error test";
  VariantInputs vi = make_variant_inputs(vc.c, variants()[vc.variant], 7);
  SdpaOptions o = vi.in.options;
  o.backend = SdpaBackend::kFused;
  o.num_threads = 1;
  const SdpaResult f1 = scaled_dot_product_attention(vi.in.q, vi.in.k, vi.in.v, o);
  const SdpaGrads g1 = scaled_dot_product_attention_backward(vi.dout, vi.in.q, vi.in.k, vi.in.v, f1, o);
  o.num_threads = 2;
  const SdpaResult f2 = scaled_dot_product_attention(vi.in.q, vi.in.k, vi.in.v, o);
  const SdpaGrads g2 = scaled_dot_product_attention_backward(vi.dout, vi.in.q, vi.in.k, vi.in.v, f2, o);
  EXPECT_EQ(f1.output.to_vector(), f2.output.to_vector()) << vdescribe(vc);
  EXPECT_EQ(g1.grad_query.to_vector(), g2.grad_query.to_vector()) << vdescribe(vc);
  EXPECT_EQ(g1.grad_key.to_vector(), g2.grad_key.to_vector()) << vdescribe(vc);
  EXPECT_EQ(g1.grad_value.to_vector(), g2.grad_value.to_vector()) << vdescribe(vc);
  if (vi.sinks.defined()) EXPECT_EQ(g1.grad_sinks.to_vector(), g2.grad_sinks.to_vector()) << vdescribe(vc);
}

// bfloat16 and float16 inputs with the variants, forward and backward, on every kernel that
// takes the dtype: the rule of tests/sdpa/test_low_precision.cpp (truth: float64 of the rounded
// inputs; bound: 2x the float32 reference's error after rounding its result to the dtype, plus
// 1e-4). A kernel that lacks the variants (the native bf16 one) must refuse them by name.
TEST_P(Variants, LowPrecisionWithinTwiceTheRoundedFloat32Reference) {
  const VCase vc = GetParam();
  const Case& c = vc.c;
  if (c.L * c.S * c.E > 2'000'000) GTEST_SKIP() << "float64 backward truth too slow for " << vdescribe(vc);
  VariantInputs vi = make_variant_inputs(c, variants()[vc.variant], 13);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Tensor q = vi.in.q.to(dtype), k = vi.in.k.to(dtype), v = vi.in.v.to(dtype), d = vi.dout.to(dtype);
    const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32),
                 d32 = d.to(DType::kFloat32);
    SdpaOptions ref = vi.in.options;
    ref.backend = SdpaBackend::kReference;
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
    const reference::SdpaGradsF64 tg = reference::scaled_dot_product_attention_backward_f64(d32, q32, k32, v32, ref);
    const SdpaResult rf = scaled_dot_product_attention(q32, k32, v32, ref);
    const SdpaGrads rg = scaled_dot_product_attention_backward(d32, q32, k32, v32, rf, ref);
    const double ref_err = max_abs_err(rf.output.to(dtype), truth.output);
    const double ref_g[3] = {max_abs_err(rg.grad_query.to(dtype), tg.grad_query),
                             max_abs_err(rg.grad_key.to(dtype), tg.grad_key),
                             max_abs_err(rg.grad_value.to(dtype), tg.grad_value)};
    for (const std::string& kernel : test::runnable_kernels_for(dtype)) {
      SdpaOptions o = vi.in.options;
      o.kernel = kernel;
      if (test::decode_refuses(kernel, q, k, v, o)) continue;
      std::string refused;
      try {
        (void)sdpa_kernel_name(q, k, v, o);
      } catch (const ValueError& e) {
        refused = e.what();
      }
      if (!refused.empty()) {  // a kernel without the variants names the one it lacks
        EXPECT_NE(refused.find("is served by the float32 kernels"), std::string::npos) << refused;
        continue;
      }
      const std::string what = vdescribe(vc) + " " + std::string(dtype_name(dtype)) + " kernel " + kernel;
      const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
      EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-4) << what;
      const SdpaGrads g = scaled_dot_product_attention_backward(d, q, k, v, f, o);
      EXPECT_LE(max_abs_err(g.grad_query, tg.grad_query), 2.0 * ref_g[0] + 1e-4) << what << " dq";
      EXPECT_LE(max_abs_err(g.grad_key, tg.grad_key), 2.0 * ref_g[1] + 1e-4) << what << " dk";
      EXPECT_LE(max_abs_err(g.grad_value, tg.grad_value), 2.0 * ref_g[2] + 1e-4) << what << " dv";
      if (vi.sinks.defined()) {
        EXPECT_LE(max_abs_err(g.grad_sinks, tg.grad_sinks), 2.0 * max_abs_err(rg.grad_sinks, tg.grad_sinks) + 1e-3) << what << " dsinks";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, Variants, testing::ValuesIn(variant_sweep()),
                         [](const testing::TestParamInfo<VCase>& info) {
                           return "case" + std::to_string(info.index) + "_" + variants()[info.param.variant].name +
                                  test::large_tag(test::case_work(info.param.c));
                         });

// ---- 1. semantics: a naive float64 implementation of the definitions ---------------------------

struct Naive {
  std::vector<double> out, lse;
};

// q (B, H, L, E), k/v (B, Hkv, S, E/Ev) contiguous float32; every step written out as in
// include/attn/sdpa.hpp, with no code shared with the library.
Naive naive_f64(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal,
                bool bottom_right, WindowSize w, double softcap, const std::vector<double>& slopes,
                const std::vector<double>& sinks) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Ev = v.size(3);
  Naive r;
  r.out.assign(static_cast<size_t>(B * H * L * Ev), 0.0);
  r.lse.assign(static_cast<size_t>(B * H * L), 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / (H / Hkv);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t ip = bottom_right ? i + S - L : i;
        std::vector<double> x(static_cast<size_t>(S));
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += double(q.at({b, h, i, e})) * double(k.at({b, hk, j, e}));
          s *= scale;
          if (softcap > 0) s = softcap * std::tanh(s / softcap);
          if (!slopes.empty()) s -= slopes[static_cast<size_t>(slopes.size() == size_t(H) ? h : b * H + h)] * std::fabs(double(ip - j));
          bool visible = true;
          if (causal && j > ip) visible = false;
          if (w.left >= 0 && j < ip - w.left) visible = false;
          if (w.right >= 0 && j > ip + w.right) visible = false;
          x[static_cast<size_t>(j)] = visible ? s : -inf;
        }
        double denom = sinks.empty() ? 0.0 : std::exp(sinks[static_cast<size_t>(h)]);
        for (double xj : x) denom += std::exp(xj);
        const size_t row = static_cast<size_t>((b * H + h) * L + i);
        r.lse[row] = std::log(denom);
        for (int64_t j = 0; j < S; ++j) {
          const double pj = denom > 0 ? std::exp(x[static_cast<size_t>(j)]) / denom : 0.0;
          for (int64_t e = 0; e < Ev; ++e) r.out[row * static_cast<size_t>(Ev) + static_cast<size_t>(e)] += pj * double(v.at({b, hk, j, e}));
        }
      }
    }
  }
  return r;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // equal infinities too
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

TEST(VariantSemantics, Float64ReferenceMatchesTheDefinitions) {
  manual_seed(11);
  const Tensor q = randn({2, 4, 9, 5}), k = randn({2, 2, 13, 5}), v = randn({2, 2, 13, 3});
  const Tensor slopes = Tensor::empty({2, 4}), sinks = randn({4});
  for (int64_t i = 0; i < 8; ++i) slopes.data()[i] = 0.1f * static_cast<float>(i + 1);
  std::vector<double> slopes64(slopes.data(), slopes.data() + 8), sinks64(sinks.data(), sinks.data() + 4);
  const WindowSize windows[] = {{-1, -1}, {3, 2}, {0, 0}, {4, -1}, {-1, 1}};
  int checked = 0;
  for (bool causal : {false, true}) {
    for (bool br : {false, true}) {
      for (const WindowSize& w : windows) {
        for (int mods = 0; mods < 8; ++mods) {
          SdpaOptions o;
          o.enable_gqa = true;
          o.is_causal = causal;
          o.causal_alignment = br ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
          o.window_size = w;
          o.scale = 0.9;
          o.need_lse = true;
          double cap = 0;
          if (mods & 1) o.softcap = cap = 1.3;
          if (mods & 2) o.alibi_slopes = slopes;
          if (mods & 4) o.sinks = sinks;
          const reference::SdpaResultF64 r = reference::scaled_dot_product_attention_f64(q, k, v, o);
          const Naive n = naive_f64(q, k, v, 0.9, causal, br, w, cap, (mods & 2) ? slopes64 : std::vector<double>{},
                                    (mods & 4) ? sinks64 : std::vector<double>{});
          const std::string what = "causal " + std::to_string(causal) + " br " + std::to_string(br) + " window (" +
                                   std::to_string(w.left) + "," + std::to_string(w.right) + ") mods " + std::to_string(mods);
          EXPECT_LE(max_diff(r.output, n.out), 1e-12) << what;
          EXPECT_LE(max_diff(r.lse, n.lse), 1e-12) << what;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 160);
}

// ---- 2. the float64 gradients against central differences ---------------------------------------

TEST(VariantGradients, Float64GradientsMatchFiniteDifferences) {
  manual_seed(5);
  const int64_t B = 1, H = 2, Hkv = 1, L = 5, S = 7, E = 3, Ev = 2;
  Tensor q = randn({B, H, L, E}).to(DType::kFloat64), k = randn({B, Hkv, S, E}).to(DType::kFloat64);
  Tensor v = randn({B, Hkv, S, Ev}).to(DType::kFloat64);
  const Tensor dout = randn({B, H, L, Ev});
  Tensor sinks = Tensor::empty({H}), slopes = Tensor::empty({H});
  sinks.data()[0] = 0.25f, sinks.data()[1] = -0.5f;
  slopes.data()[0] = 0.3f, slopes.data()[1] = 0.05f;
  struct Opt {
    const char* name;
    WindowSize w;
    std::optional<double> cap;
    bool alibi, sinks, causal;
  };
  const Opt opts[] = {{"window", {2, 1}, {}, false, false, false}, {"softcap", {}, 0.8, false, false, false},
                      {"alibi", {}, {}, true, false, true},         {"sinks", {}, {}, false, true, false},
                      {"all", {3, 0}, 1.1, true, true, true}};
  auto loss = [&](const SdpaOptions& o) {
    const reference::SdpaResultF64 r = reference::scaled_dot_product_attention_f64(q, k, v, o);
    double s = 0;
    for (size_t i = 0; i < r.output.size(); ++i) s += r.output[i] * dout.data()[i];
    return s;
  };
  for (const Opt& op : opts) {
    SdpaOptions o;
    o.enable_gqa = true;
    o.window_size = op.w;
    o.softcap = op.cap;
    o.is_causal = op.causal;
    o.causal_alignment = CausalAlignment::kBottomRight;
    if (op.alibi) o.alibi_slopes = slopes;
    if (op.sinks) o.sinks = sinks;
    const reference::SdpaGradsF64 g = reference::scaled_dot_product_attention_backward_f64(dout, q, k, v, o);
    const double h = 1e-6;
    Tensor* ts[3] = {&q, &k, &v};
    const std::vector<double>* gs[3] = {&g.grad_query, &g.grad_key, &g.grad_value};
    for (int t = 0; t < 3; ++t) {
      double* d = ts[t]->data_as<double>();
      for (int64_t i = 0; i < ts[t]->numel(); ++i) {
        const double x = d[i];
        d[i] = x + h;
        const double up = loss(o);
        d[i] = x - h;
        const double down = loss(o);
        d[i] = x;
        EXPECT_NEAR((*gs[t])[static_cast<size_t>(i)], (up - down) / (2 * h), 1e-7) << op.name << " input " << t << " element " << i;
      }
    }
    if (op.sinks) {
      ASSERT_EQ(g.grad_sinks.size(), size_t(H)) << op.name;
      for (int64_t i = 0; i < H; ++i) {
        // sinks are float32: a step of 2^-12 is exact, central differences are O(step^2).
        const float x = sinks.data()[i], st = 1.0f / 4096.0f;
        sinks.data()[i] = x + st;
        const double up = loss(o);
        sinks.data()[i] = x - st;
        const double down = loss(o);
        sinks.data()[i] = x;
        EXPECT_NEAR(g.grad_sinks[static_cast<size_t>(i)], (up - down) / (2.0 * st), 1e-6) << op.name << " sink " << i;
      }
    } else {
      EXPECT_TRUE(g.grad_sinks.empty());
    }
  }
}

// ---- 4. equivalences, policies, bad input -------------------------------------------------------

// Every float32 kernel this CPU runs that takes the call (a decode kernel takes short ones
// only), and the reference.
std::vector<std::string> every_kernel_for_f32(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const SdpaOptions& o) {
  std::vector<std::string> ks;
  for (const std::string& name : test::runnable_fused_kernels()) {
    if (!test::decode_refuses(name, q, k, v, o)) ks.push_back(name);
  }
  ks.push_back("reference");
  return ks;
}

TEST(VariantEquivalence, WindowIsABandMaskAndAlibiAnAdditiveMaskOnEveryKernel) {
  manual_seed(21);
  const int64_t L = 70, S = 90;
  const Tensor q = randn({1, 2, L, 16}), k = randn({1, 2, S, 16}), v = randn({1, 2, S, 8});
  Tensor slopes = Tensor::empty({2});
  slopes.data()[0] = 0.25f, slopes.data()[1] = 0.0625f;
  for (bool br : {false, true}) {
    for (bool causal : {false, true}) {
      const WindowSize w{11, 4};
      const int64_t off = br ? S - L : 0;
      Tensor band = Tensor::empty({L, S}), bias = Tensor::empty({1, 2, L, S});
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          const int64_t ip = i + off;
          const bool vis = j >= ip - w.left && j <= ip + w.right && (!causal || j <= ip);
          band.at({i, j}) = vis ? 1.0f : 0.0f;
          for (int64_t h = 0; h < 2; ++h) bias.at({0, h, i, j}) = (vis ? 0.0f : -INFINITY) - slopes.data()[h] * std::fabs(float(ip - j));
        }
      }
      SdpaOptions probe;
      probe.window_size = w;
      probe.alibi_slopes = slopes;
      for (const std::string& kernel : every_kernel_for_f32(q, k, v, probe)) {
        SdpaOptions o;
        o.kernel = kernel;
        o.causal_alignment = br ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
        o.window_size = w;
        o.is_causal = causal;
        SdpaOptions m;
        m.kernel = kernel;
        m.attn_mask = AttnMask::boolean(band);
        const std::vector<float> a = scaled_dot_product_attention(q, k, v, o).output.to_vector();
        const std::vector<float> b = scaled_dot_product_attention(q, k, v, m).output.to_vector();
        for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-6) << kernel << " window br " << br << " causal " << causal;
        o.alibi_slopes = slopes;
        SdpaOptions ma;
        ma.kernel = kernel;
        ma.attn_mask = AttnMask::additive(bias);
        const std::vector<float> c = scaled_dot_product_attention(q, k, v, o).output.to_vector();
        const std::vector<float> d = scaled_dot_product_attention(q, k, v, ma).output.to_vector();
        for (size_t i = 0; i < c.size(); ++i) ASSERT_NEAR(c[i], d[i], 2e-6) << kernel << " alibi br " << br << " causal " << causal;
      }
    }
  }
}

TEST(VariantEquivalence, HuggingFaceSlidingWindowIsLeftWMinusOneWithCausal) {
  manual_seed(8);
  const int64_t L = 40, w = 6;
  const Tensor q = randn({1, 1, L, 8}), k = randn({1, 1, L, 8}), v = randn({1, 1, L, 8});
  Tensor mask = Tensor::empty({L, L});  // Mistral's: token i sees i - w < j <= i
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < L; ++j) mask.at({i, j}) = (j <= i && j > i - w) ? 1.0f : 0.0f;
  }
  SdpaOptions o;
  o.is_causal = true;
  o.window_size = {w - 1, 0};
  SdpaOptions m;
  m.attn_mask = AttnMask::boolean(mask);
  const std::vector<float> a = scaled_dot_product_attention(q, k, v, o).output.to_vector();
  const std::vector<float> b = scaled_dot_product_attention(q, k, v, m).output.to_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-6);
}

TEST(VariantEquivalence, WindowSidesBeyondTheSequencesAreUnboundedAndNeverOverflow) {
  // i' - left and i' + right with sides up to INT64_MAX (found by fuzz_sdpa: signed overflow),
  // with both alignments and L > S (i' < 0 for bottom-right).
  manual_seed(6);
  const Tensor q = randn({1, 2, 9, 8}), k = randn({1, 2, 4, 8}), v = randn({1, 2, 4, 8});
  const int64_t huge[3] = {std::numeric_limits<int64_t>::max(), int64_t{1} << 62, 13};
  for (const CausalAlignment align : {CausalAlignment::kTopLeft, CausalAlignment::kBottomRight}) {
    for (const std::string kernel : {"reference", "cpu.flash.generic"}) {
      SdpaOptions plain;
      plain.is_causal = true;
      plain.causal_alignment = align;
      plain.kernel = kernel;
      plain.need_lse = true;
      const SdpaResult want = scaled_dot_product_attention(q, k, v, plain);
      for (const int64_t left : huge) {
        for (const int64_t right : huge) {
          SdpaOptions o = plain;
          o.window_size = {left, right};
          const SdpaResult got = scaled_dot_product_attention(q, k, v, o);
          EXPECT_EQ(got.output.to_vector(), want.output.to_vector()) << left << " " << right << " " << kernel;
          EXPECT_EQ(got.lse.to_vector(), want.lse.to_vector()) << left << " " << right << " " << kernel;
        }
      }
    }
  }
}

TEST(VariantPolicy, AFullyMaskedRowWithASinkHasOutputZeroAndLseTheSink) {
  manual_seed(2);
  // Top-left window (0, 0) with S < L: rows i >= S see no key.
  const Tensor q = randn({1, 2, 9, 4}), k = randn({1, 2, 5, 4}), v = randn({1, 2, 5, 4});
  Tensor sinks = Tensor::empty({2});
  sinks.data()[0] = 0.75f, sinks.data()[1] = -2.0f;
  SdpaOptions probe;
  probe.window_size = {0, 0};
  probe.sinks = sinks;
  for (const std::string& kernel : every_kernel_for_f32(q, k, v, probe)) {
    SdpaOptions o;
    o.kernel = kernel;
    o.window_size = {0, 0};
    o.sinks = sinks;
    o.need_lse = true;
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 5; i < 9; ++i) {
        EXPECT_FLOAT_EQ(r.lse.at({0, h, i}), sinks.data()[h]) << kernel;
        for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(r.output.at({0, h, i, e}), 0.0f) << kernel;
      }
      // A row that sees exactly one key j: weight exp(x) / (exp(s) + exp(x)) < 1.
      const float x = 0.5f * [&] {
        float d = 0;
        for (int64_t e = 0; e < 4; ++e) d += q.at({0, h, 0, e}) * k.at({0, h, 0, e});
        return d;
      }();
      const float p = 1.0f / (1.0f + std::exp(sinks.data()[h] - x));
      for (int64_t e = 0; e < 4; ++e) EXPECT_NEAR(r.output.at({0, h, 0, e}), p * v.at({0, h, 0, e}), 1e-5) << kernel;
    }
  }
}

TEST(VariantPolicy, NonFiniteKeysOutsideTheWindowDoNotLeak) {
  manual_seed(4);
  Tensor q = randn({1, 1, 100, 16}), k = randn({1, 1, 100, 16}), v = randn({1, 1, 100, 16});
  for (int64_t e = 0; e < 16; ++e) k.at({0, 0, 0, e}) = NAN, v.at({0, 0, 0, e}) = INFINITY;
  for (const std::string& kernel : every_kernel_for_f32(q, k, v, SdpaOptions{})) {
    SdpaOptions o;
    o.kernel = kernel;
    o.is_causal = true;
    o.window_size = {10, 0};
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    for (int64_t i = 0; i < 100; ++i) {
      for (int64_t e = 0; e < 16; ++e) {
        if (i <= 10) {
          EXPECT_TRUE(std::isnan(r.output.at({0, 0, i, e}))) << kernel << " row " << i;
        } else {
          EXPECT_TRUE(std::isfinite(r.output.at({0, 0, i, e}))) << kernel << " row " << i;
        }
      }
    }
  }
}

TEST(VariantPolicy, AKeyOutsideTheWindowStaysHiddenWhateverAnAdditiveMaskAdds) {
  manual_seed(6);
  const Tensor q = randn({1, 1, 40, 8}), k = randn({1, 1, 40, 8}), v = randn({1, 1, 40, 8});
  Tensor bias = Tensor::zeros({40, 40});
  for (int64_t i = 0; i < 40; ++i) bias.at({i, 0}) = i > 5 ? NAN : 0.5f, bias.at({i, 39}) = i < 30 ? INFINITY : 0.0f;
  SdpaOptions probe;
  probe.window_size = {5, 5};
  probe.attn_mask = AttnMask::additive(bias);
  for (const std::string& kernel : every_kernel_for_f32(q, k, v, probe)) {
    SdpaOptions o = probe;
    o.kernel = kernel;
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    for (float x : r.output.to_vector()) ASSERT_TRUE(std::isfinite(x)) << kernel;
  }
}

TEST(VariantPolicy, AHugeSoftcapLeavesTheScoresAsTheyAre) {
  // 1 / softcap is below float32's normal range here, and the fused kernels flush such results
  // to zero: a kernel that divided the score by the cap and multiplied it back would return 0.
  manual_seed(9);
  const Tensor q = randn({1, 2, 33, 16}), k = randn({1, 2, 50, 16}), v = randn({1, 2, 50, 16});
  SdpaOptions plain;
  plain.backend = SdpaBackend::kReference;
  const std::vector<float> want = scaled_dot_product_attention(q, k, v, plain).output.to_vector();
  for (double cap : {1e36, 1e38, 2.3e38}) {
    SdpaOptions probe;
    probe.softcap = cap;
    for (const std::string& kernel : every_kernel_for_f32(q, k, v, probe)) {
      SdpaOptions o = probe;
      o.kernel = kernel;
      const std::vector<float> got = scaled_dot_product_attention(q, k, v, o).output.to_vector();
      for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << kernel << " softcap " << cap;
    }
  }
}

// An infinite score under a cap above 2^126 (whose 1 / c is denormal, flushed in the kernels)
// is capped to +-c like any other, never inf * 0 = NaN (the fuzzer found a NaN row here).
TEST(VariantPolicy, AHugeSoftcapCapsInfiniteScores) {
  manual_seed(10);
  const Tensor q = randn({1, 2, 9, 8}), v = randn({1, 2, 25, 4});
  Tensor k = randn({1, 2, 25, 8});
  k.at({0, 0, 24, 3}) = INFINITY;   // scores +-inf by the sign of q[..., 3]
  k.at({0, 1, 7, 0}) = -INFINITY;
  for (double cap : {2e38, 1e30, 5.0}) {
    SdpaOptions probe;
    probe.softcap = cap;
    probe.backend = SdpaBackend::kReference;
    const std::vector<float> want = scaled_dot_product_attention(q, k, v, probe).output.to_vector();
    probe.backend = SdpaBackend::kAuto;
    for (const std::string& kernel : every_kernel_for_f32(q, k, v, probe)) {
      SdpaOptions o = probe;
      o.kernel = kernel;
      const std::vector<float> got = scaled_dot_product_attention(q, k, v, o).output.to_vector();
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(want[i])) << "reference, softcap " << cap;
        ASSERT_NEAR(got[i], want[i], 1e-5) << kernel << " softcap " << cap << " at " << i;
      }
    }
  }
}

TEST(VariantDispatch, KernelsThatLackAVariantSayWhichAndTheNextTakesTheCall) {
  const Tensor q = randn({1, 2, 1, 64}), k = randn({1, 2, 300, 64}), v = randn({1, 2, 300, 64});
  Tensor sinks = Tensor::zeros({2});
  SdpaOptions o;
  o.sinks = sinks;
  const std::string name = sdpa_kernel_name(q, k, v, o);
  EXPECT_EQ(name.rfind("cpu.", 0), 0u) << name;  // a fused kernel, whichever serves sinks
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  EXPECT_EQ(r.output.size(-1), 64);
}

template <class E, class F>
void expect_error_naming(F&& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << what;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(VariantBadInput, TypedErrorsNameTheArgumentAndTheValue) {
  const Tensor q = randn({2, 3, 4, 8}), k = randn({2, 3, 5, 8}), v = randn({2, 3, 5, 8});
  SdpaOptions o;
  o.window_size = {-2, 0};
  expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, o); }, "window_size");
  expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, o); }, "(-2, 0)");
  // Beyond float32's normal range the kernels' 1/softcap or softcap * log2(e) is infinite.
  for (double bad : {0.0, -1.0, static_cast<double>(INFINITY), 1e-300, 1e-39, 2.4e38, 1e300}) {
    SdpaOptions c;
    c.softcap = bad;
    expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, c); }, "softcap");
  }
  const Tensor wrong = Tensor::zeros({4}), wrong_bh = Tensor::zeros({3, 3});
  const Tensor as_f64 = Tensor::zeros({3}).to(DType::kFloat64);
  for (const Tensor* t : {&wrong, &wrong_bh}) {
    SdpaOptions a;
    a.alibi_slopes = *t;
    expect_error_naming<ShapeError>([&] { (void)scaled_dot_product_attention(q, k, v, a); }, "alibi_slopes");
    expect_error_naming<ShapeError>([&] { (void)scaled_dot_product_attention(q, k, v, a); }, t->shape().str());
  }
  SdpaOptions a64;
  a64.alibi_slopes = as_f64;
  expect_error_naming<DTypeError>([&] { (void)scaled_dot_product_attention(q, k, v, a64); }, "float64");
  SdpaOptions s;
  s.sinks = wrong_bh;
  expect_error_naming<ShapeError>([&] { (void)scaled_dot_product_attention(q, k, v, s); }, "sinks");
  s.sinks = as_f64;
  expect_error_naming<DTypeError>([&] { (void)scaled_dot_product_attention(q, k, v, s); }, "sinks");
  Tensor nan_sinks = Tensor::zeros({3});
  nan_sinks.data()[1] = NAN;
  s.sinks = nan_sinks;
  expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, s); }, "finite");
  // Finite float32 values whose base-2 form float(x * log2(e)) would overflow: refused too.
  for (float big : {3e38f, -2.4e38f}) {
    Tensor huge = Tensor::zeros({3});
    huge.data()[2] = big;
    SdpaOptions hs, ha;
    hs.sinks = huge;
    ha.alibi_slopes = huge;
    expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, hs); }, "sinks");
    expect_error_naming<ValueError>([&] { (void)scaled_dot_product_attention(q, k, v, ha); }, "alibi_slopes");
  }
  for (double edge : {1.2e-38, 2.3e38}) {  // inside the range: accepted
    SdpaOptions c;
    c.softcap = edge;
    EXPECT_NO_THROW((void)scaled_dot_product_attention(q, k, v, c)) << edge;
  }
  // (B, H) slopes need 4-D inputs; 3-D inputs take (H) only.
  const Tensor q3 = randn({3, 4, 8}), k3 = randn({3, 5, 8}), v3 = randn({3, 5, 8});
  SdpaOptions bh;
  const Tensor slopes_1h = Tensor::zeros({1, 3}), slopes_h = Tensor::zeros({3});  // options hold views
  bh.alibi_slopes = slopes_1h;
  expect_error_naming<ShapeError>([&] { (void)scaled_dot_product_attention(q3, k3, v3, bh); }, "alibi_slopes");
  bh.alibi_slopes = slopes_h;
  EXPECT_NO_THROW((void)scaled_dot_product_attention(q3, k3, v3, bh));
}

}  // namespace
}  // namespace attn

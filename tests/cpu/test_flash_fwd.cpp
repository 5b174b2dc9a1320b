// The fused CPU kernel against the reference path and the float64 truth, in the same test.
//
// Rule (FlashAttention's): on the same inputs, the fused kernel's max error against float64 is
// at most 2x the float32 reference's error plus a tiny absolute floor. The sweep covers odd
// sequence lengths, head dims 1..256, batch and heads > 1, GQA, every mask kind, both causal
// alignments and Philox dropout, for every instruction-set build this CPU can run; results must
// also be bit-identical for 1 and 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn {
namespace {

enum class MaskKind { kNone, kBool, kAdditive, kBoolBroadcast, kCausalTopLeft, kCausalBottomRight };

struct Case {
  int64_t B, Hq, Hkv, L, S, E, Ev;
  MaskKind mask;
  float dropout;
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + " Hq" + std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) +
         " L" + std::to_string(c.L) + " S" + std::to_string(c.S) + " E" + std::to_string(c.E) +
         " Ev" + std::to_string(c.Ev) + " mask" + std::to_string(static_cast<int>(c.mask)) +
         " p" + std::to_string(c.dropout);
}

double max_abs_err(const TensorView& a, const std::vector<double>& truth) {
  const std::vector<float> v = a.to_vector();
  double m = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double x = v[i], t = truth[i];
    if (std::isnan(x) || std::isnan(t)) {
      if (std::isnan(x) != std::isnan(t)) return INFINITY;  // NaN must match NaN
      continue;
    }
    if (x == t) continue;  // also equal infinities (LSE of a fully masked row)
    m = std::max(m, std::fabs(x - t));
  }
  return m;
}

struct Inputs {
  Tensor q, k, v, mask;
  SdpaOptions options;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  manual_seed(seed);
  Inputs in;
  in.q = randn({c.B, c.Hq, c.L, c.E});
  in.k = randn({c.B, c.Hkv, c.S, c.E});
  in.v = randn({c.B, c.Hkv, c.S, c.Ev});
  in.options.enable_gqa = c.Hq != c.Hkv;
  switch (c.mask) {
    case MaskKind::kNone:
      break;
    case MaskKind::kBool:  // per (batch, head), about 1 in 4 positions masked
      in.mask = rand({c.B, c.Hq, c.L, c.S});
      for (int64_t i = 0; i < in.mask.numel(); ++i) in.mask.data()[i] = in.mask.data()[i] > 0.25f ? 1.0f : 0.0f;
      in.options.attn_mask = AttnMask::boolean(in.mask);
      break;
    case MaskKind::kAdditive:  // broadcast over batch and heads
      in.mask = randn({c.L, c.S});
      in.options.attn_mask = AttnMask::additive(in.mask);
      break;
    case MaskKind::kBoolBroadcast:  // (B, 1, L, S), with some fully masked rows
      in.mask = rand({c.B, 1, c.L, c.S});
      for (int64_t i = 0; i < in.mask.numel(); ++i) in.mask.data()[i] = in.mask.data()[i] > 0.5f ? 1.0f : 0.0f;
      for (int64_t j = 0; j < c.S; ++j) in.mask.at({0, 0, c.L - 1, j}) = 0.0f;
      in.options.attn_mask = AttnMask::boolean(in.mask);
      break;
    case MaskKind::kCausalTopLeft:
      in.options.is_causal = true;
      break;
    case MaskKind::kCausalBottomRight:
      in.options.is_causal = true;
      in.options.causal_alignment = CausalAlignment::kBottomRight;
      break;
  }
  if (c.dropout > 0.0f) {
    in.options.dropout_p = c.dropout;
    in.options.dropout_rng = DropoutRng::kPhilox;
    in.options.dropout_seed = 1234 + seed;
    in.options.dropout_offset = 7;
  }
  in.options.need_lse = true;
  return in;
}

std::vector<Case> sweep() {
  std::vector<Case> cases;
  const int64_t Ls[] = {1, 7, 97, 257, 1025};
  const int64_t Es[] = {1, 3, 64, 80, 128, 256};
  const MaskKind masks[] = {MaskKind::kNone,          MaskKind::kCausalTopLeft, MaskKind::kBool,
                            MaskKind::kCausalBottomRight, MaskKind::kAdditive, MaskKind::kBoolBroadcast};
  int n = 0;
  for (int64_t L : Ls) {
    for (int64_t E : Es) {
      if (L == 1025 && E != 64 && E != 128) continue;  // keep the float64 truth affordable
      const int64_t group = int64_t{1} << (n % 3);   // GQA ratios 1, 2, 4
      const int64_t S = (n % 4 == 1) ? L + 13 : (n % 4 == 3 && L > 7) ? L / 2 + 1 : L;
      const int64_t Ev = (n % 5 == 2) ? E + 5 : E;
      const float p = (n % 7 == 3) ? 0.2f : 0.0f;
      const int64_t B = L >= 1025 ? 1 : 2;
      cases.push_back({B, 2 * group, 2, L, S, E, Ev, masks[n % 6], p});
      ++n;
    }
  }
  // Every mask kind at one mid-size shape, and the fast paths at E = 64 and 128.
  for (MaskKind m : masks) cases.push_back({2, 4, 2, 97, 131, 64, 64, m, 0.0f});
  for (MaskKind m : masks) cases.push_back({1, 2, 1, 130, 130, 128, 128, m, 0.1f});
  return cases;
}

class FlashForward : public testing::TestWithParam<Case> {};

TEST_P(FlashForward, ErrorWithinTwiceTheReferenceErrorOnEveryIsa) {
  const Case c = GetParam();
  Inputs in = make_inputs(c, 42);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(in.q, in.k, in.v, ref);
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  const double ref_err = max_abs_err(r.output, truth.output);
  ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);

  for (const char* isa : {"", "avx2", "generic"}) {
    setenv("ATTN_CPU_ISA", isa, 1);
    SdpaOptions fused = in.options;
    fused.backend = SdpaBackend::kFused;
    const SdpaResult f = scaled_dot_product_attention(in.q, in.k, in.v, fused);
    const double err = max_abs_err(f.output, truth.output);
    EXPECT_LE(err, 2.0 * ref_err + 1e-6) << describe(c) << " isa '" << isa << "' (reference error " << ref_err << ")";
    // LSE: natural log, -inf exactly where every key is masked.
    const double lse_err = max_abs_err(f.lse, truth.lse);
    EXPECT_LE(lse_err, 1e-5 * std::max(1.0, std::log(static_cast<double>(c.S)) + 1.0)) << describe(c) << " lse, isa '" << isa << "'";
  }
  unsetenv("ATTN_CPU_ISA");
}

TEST_P(FlashForward, SameBitsForOneAndTwoThreads) {
  const Case c = GetParam();
  Inputs in = make_inputs(c, 7);
  in.options.backend = SdpaBackend::kFused;
  in.options.num_threads = 1;
  const SdpaResult one = scaled_dot_product_attention(in.q, in.k, in.v, in.options);
  in.options.num_threads = 2;
  const SdpaResult two = scaled_dot_product_attention(in.q, in.k, in.v, in.options);
  EXPECT_EQ(one.output.to_vector(), two.output.to_vector()) << describe(c);
}

void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

INSTANTIATE_TEST_SUITE_P(Sweep, FlashForward, testing::ValuesIn(sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return "case" + std::to_string(info.index); });

// ---- behaviour beyond the sweep -----------------------------------------------------------------

SdpaOptions fused_options() {
  SdpaOptions o;
  o.backend = SdpaBackend::kFused;
  return o;
}

TEST(FlashForwardWeights, SecondPassEqualsReferenceWeights) {
  manual_seed(3);
  const Tensor q = randn({2, 3, 45, 32}), k = randn({2, 3, 70, 32}), v = randn({2, 3, 70, 16});
  for (bool causal : {false, true}) {
    SdpaOptions o = fused_options();
    o.is_causal = causal;
    o.need_weights = true;
    const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
    o.backend = SdpaBackend::kReference;
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    ASSERT_EQ(f.attn_weights.shape(), r.attn_weights.shape());
    const std::vector<float> a = f.attn_weights.to_vector(), b = r.attn_weights.to_vector();
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-6) << "causal " << causal << " at " << i;
    EXPECT_FALSE(f.lse.defined()) << "lse was not asked for";
  }
}

TEST(FlashForwardWeights, PhiloxDropoutMatchesReferenceWeightsAndOutput) {
  manual_seed(4);
  const Tensor q = randn({1, 2, 33, 16}), k = randn({1, 2, 40, 16}), v = randn({1, 2, 40, 16});
  SdpaOptions o = fused_options();
  o.dropout_p = 0.3f;
  o.dropout_rng = DropoutRng::kPhilox;
  o.dropout_seed = 99;
  o.need_weights = true;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  o.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const std::vector<float> fw = f.attn_weights.to_vector(), rw = r.attn_weights.to_vector();
  int zeros = 0;
  for (size_t i = 0; i < fw.size(); ++i) {
    ASSERT_EQ(fw[i] == 0.0f, rw[i] == 0.0f) << "dropout masks differ at " << i;
    zeros += fw[i] == 0.0f;
    ASSERT_NEAR(fw[i], rw[i], 2e-6);
  }
  EXPECT_GT(zeros, 0);
  const std::vector<float> fo = f.output.to_vector(), ro = r.output.to_vector();
  for (size_t i = 0; i < fo.size(); ++i) ASSERT_NEAR(fo[i], ro[i], 2e-5);
}

TEST(FlashForwardNumerics, FullyMaskedRowsAreZeroWithLseMinusInf) {
  manual_seed(5);
  const Tensor q = randn({1, 1, 40, 8}), k = randn({1, 1, 40, 8}), v = randn({1, 1, 40, 8});
  Tensor mask = Tensor::ones({40, 40});
  for (int64_t j = 0; j < 40; ++j) mask.at({17, j}) = 0.0f;
  SdpaOptions o = fused_options();
  o.attn_mask = AttnMask::boolean(mask);
  o.need_lse = true;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(f.output.at({0, 0, 17, e}), 0.0f);
  EXPECT_EQ(f.lse.at({0, 0, 17}), -INFINITY);
  EXPECT_TRUE(std::isfinite(f.lse.at({0, 0, 16})));
}

TEST(FlashForwardNumerics, NonFiniteKeysAndValuesOutsideTheMaskDoNotLeak) {
  manual_seed(6);
  Tensor q = randn({1, 1, 50, 8}), k = randn({1, 1, 50, 8}), v = randn({1, 1, 50, 8});
  // Causal: key 49 is visible only to query 49; poison it and a value row.
  for (int64_t e = 0; e < 8; ++e) {
    k.at({0, 0, 49, e}) = NAN;
    v.at({0, 0, 49, e}) = INFINITY;
    v.at({0, 0, 30, e}) = NAN;
  }
  SdpaOptions o = fused_options();
  o.is_causal = true;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  for (int64_t i = 0; i < 30; ++i) {
    for (int64_t e = 0; e < 8; ++e) ASSERT_TRUE(std::isfinite(f.output.at({0, 0, i, e}))) << "row " << i;
  }
  // Included positions propagate, as in PyTorch.
  EXPECT_TRUE(std::isnan(f.output.at({0, 0, 30, 0})));
  EXPECT_TRUE(std::isnan(f.output.at({0, 0, 49, 0})));
  // The reference paths follow the same policy.
  o.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t i = 0; i < 50; ++i) {
    for (int64_t e = 0; e < 8; ++e) {
      const float a = f.output.at({0, 0, i, e}), b = r.output.at({0, 0, i, e});
      const double c = t.output[static_cast<size_t>(i * 8 + e)];
      ASSERT_EQ(std::isnan(a), std::isnan(b)) << "row " << i;
      ASSERT_EQ(std::isnan(a), std::isnan(c)) << "row " << i;
    }
  }
}

TEST(FlashForwardLayout, StridedAndUnbatchedInputsMatchContiguous) {
  manual_seed(8);
  const Tensor base = randn({2, 19, 4, 24});  // (B, L, H, E) as after a Linear; SDPA wants (B, H, L, E)
  const TensorView q = base.transpose(1, 2);
  const Tensor qc = q.contiguous();
  SdpaOptions o = fused_options();
  o.is_causal = true;
  const SdpaResult a = scaled_dot_product_attention(q, q, q, o);
  const SdpaResult b = scaled_dot_product_attention(qc, qc, qc, o);
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
  // Unbatched (L, E).
  const TensorView q2 = qc.select(0, 1).select(0, 2);
  const SdpaResult c = scaled_dot_product_attention(q2, q2, q2, o);
  const std::vector<float> cv = c.output.to_vector();
  const std::vector<float> bv = b.output.select(0, 1).select(0, 2).to_vector();
  EXPECT_EQ(cv, bv);
}

TEST(FlashForwardDispatch, AutoUsesFusedUnlessTorchDropout) {
  manual_seed(9);
  const Tensor q = randn({1, 2, 9, 8});
  SdpaOptions o;
  o.backend = SdpaBackend::kFused;
  o.dropout_p = 0.5f;  // PyTorch's sequential stream: only the reference reproduces it
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, o), ValueError);
  o.backend = SdpaBackend::kAuto;
  EXPECT_NO_THROW(scaled_dot_product_attention(q, q, q, o));
}

}  // namespace
}  // namespace attn

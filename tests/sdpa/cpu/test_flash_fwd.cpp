// The fused CPU kernel against the reference path and the float64 truth, in the same test.
//
// Rule (FlashAttention's): on the same inputs, the fused kernel's max error against float64 is
// at most 2x the float32 reference's error plus a tiny absolute floor. The sweep covers odd
// sequence lengths, head dims 1..256, batch and heads > 1, GQA, every mask kind, both causal
// alignments and Philox dropout, for every fused kernel of the registry this CPU can run (one per
// instruction set, forced by name; the others are reported as skipped); results must
// also be bit-identical for 1 and 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

using test::Case;
using test::describe;
using test::Inputs;
using test::make_inputs;
using test::MaskKind;
using test::max_abs_err;
using test::sweep;

class FlashForward : public testing::TestWithParam<Case> {};

TEST_P(FlashForward, ErrorWithinTwiceTheReferenceErrorOnEveryKernel) {
  const Case c = GetParam();
  Inputs in = make_inputs(c, 42);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(in.q, in.k, in.v, ref);
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  const double ref_err = max_abs_err(r.output, truth.output);
  ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);

  for (const std::string& kernel : test::runnable_fused_kernels()) {
    SdpaOptions fused = in.options;
    fused.kernel = kernel;
    if (test::decode_refuses(kernel, in.q, in.k, in.v, fused)) continue;
    const SdpaResult f = scaled_dot_product_attention(in.q, in.k, in.v, fused);
    const double err = max_abs_err(f.output, truth.output);
    EXPECT_LE(err, 2.0 * ref_err + 1e-6) << describe(c) << " kernel " << kernel << " (reference error " << ref_err << ")";
    // LSE: natural log, -inf exactly where every key is masked.
    const double lse_err = max_abs_err(f.lse, truth.lse);
    EXPECT_LE(lse_err, 1e-5 * std::max(1.0, std::log(static_cast<double>(c.S)) + 1.0)) << describe(c) << " lse, kernel " << kernel;
  }
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

INSTANTIATE_TEST_SUITE_P(Sweep, FlashForward, testing::ValuesIn(sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return test::case_name(info.param, info.index); });

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

// Scores near 1e28: the LSE's ulp (~1e21) swallows log(3), so weights taken as exp(s - lse) were
// all 1; a softmax's exp(s - max) / sum gives 1/3 (the fuzzer found this with softcap 1e30).
TEST(FlashForwardWeights, HugeScoresStillSumToOne) {
  Tensor q = Tensor::full({1, 1, 3, 4}, 1e14f), k = Tensor::full({1, 1, 5, 4}, 1e14f);
  for (int64_t e = 0; e < 4; ++e) k.at({0, 0, 1, e}) = k.at({0, 0, 3, e}) = 0.5e14f;
  const Tensor v = Tensor::ones({1, 1, 5, 2});
  for (const std::string& kernel : test::runnable_fused_kernels()) {
    SdpaOptions o;
    o.kernel = kernel;
    o.need_weights = true;
    if (test::decode_refuses(kernel, q, k, v, o)) continue;
    const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 5; ++j) {
        EXPECT_NEAR(f.attn_weights.at({0, 0, i, j}), j % 2 == 0 ? 1.0 / 3 : 0.0, 1e-6)
            << "kernel " << kernel << " row " << i << " key " << j;
      }
    }
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

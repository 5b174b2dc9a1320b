// The fused CPU backward against the reference backward and the float64 truth, in the same test,
// over the forward's sweep (tests/sdpa/cpu/sdpa_cases.hpp): odd lengths, head dims 1..256, GQA,
// every mask kind, both causal alignments, Philox dropout, every fused kernel this CPU runs.
//
// Rule: for each of dQ, dK, dV the fused error against float64 is at most 2x the reference
// float32 backward's error plus a floor of 1e-6 relative to the call's largest gradient.
// The fused backward must also be bit-identical for 1 and 2 threads and from run to run, and,
// where a key/value head is split into key ranges (flash_bwd_split.hpp), for 1, 2, 3 and 8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/flash_bwd_split.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

using test::Case;
using test::describe;
using test::Inputs;
using test::make_inputs;
using test::MaskKind;
using test::max_abs_err;

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

struct Problem {
  Inputs in;
  Tensor dout;
  SdpaResult fwd;  // the fused forward's output and LSE
};

Problem make_problem(const Case& c, uint64_t seed) {
  Problem pr{make_inputs(c, seed), {}, {}};
  pr.dout = randn({c.B, c.Hq, c.L, c.Ev});
  SdpaOptions o = pr.in.options;
  o.backend = SdpaBackend::kFused;
  pr.fwd = scaled_dot_product_attention(pr.in.q, pr.in.k, pr.in.v, o);
  return pr;
}

// The backward sweep drops the largest float64 cases of the forward's (the float64 backward
// costs 3x the forward's) but keeps every mask kind, head dim and GQA ratio.
std::vector<Case> backward_sweep() {
  std::vector<Case> cases;
  for (const Case& c : test::sweep()) {
    if (c.L * c.S * c.E * c.B * c.Hq > 150'000'000) continue;
    cases.push_back(c);
  }
  return cases;
}

// The 2x rule for every fused kernel this CPU runs.
void expect_within_twice_reference_error(const Case& c, uint64_t seed) {
  const Problem pr = make_problem(c, seed);
  SdpaOptions ref = pr.in.options;
  ref.backend = SdpaBackend::kReference;
  const SdpaGrads r = scaled_dot_product_attention_backward(pr.dout, pr.in.q, pr.in.k, pr.in.v, pr.fwd, ref);
  const reference::SdpaGradsF64 truth =
      reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.in.q, pr.in.k, pr.in.v, ref);
  const double ref_err[3] = {max_abs_err(r.grad_query, truth.grad_query),
                             max_abs_err(r.grad_key, truth.grad_key),
                             max_abs_err(r.grad_value, truth.grad_value)};
  // FlashAttention's D = rowsum(dO * O) is rounded apart from dP, so dP - D cancels less exactly
  // than the reference's rowsum(P * dP): a row with one visible key (P = 1, true dS = 0) gets
  // dS ~ 1e-7 |dO . v| instead of 0. The floor covers that, relative to the call's gradients.
  const double scale_of_call = std::max({1.0, max_abs(truth.grad_query), max_abs(truth.grad_key),
                                         max_abs(truth.grad_value)});
  const double floor[3] = {1e-6 * scale_of_call, 1e-6 * scale_of_call, 1e-6 * scale_of_call};
  for (double e : ref_err) ASSERT_TRUE(std::isfinite(e)) << describe(c);

  for (const std::string& kernel : test::runnable_fused_kernels()) {
    SdpaOptions fused = pr.in.options;
    fused.kernel = kernel;
    if (test::decode_refuses(kernel, pr.in.q, pr.in.k, pr.in.v, fused)) continue;
    const SdpaGrads f = scaled_dot_product_attention_backward(pr.dout, pr.in.q, pr.in.k, pr.in.v, pr.fwd, fused);
    const double err[3] = {max_abs_err(f.grad_query, truth.grad_query),
                           max_abs_err(f.grad_key, truth.grad_key),
                           max_abs_err(f.grad_value, truth.grad_value)};
    const char* names[3] = {"dQ", "dK", "dV"};
    for (int t = 0; t < 3; ++t) {
      EXPECT_LE(err[t], 2.0 * ref_err[t] + floor[t])
          << describe(c) << " " << names[t] << " kernel " << kernel << " (reference error " << ref_err[t] << ")";
    }
  }
}

// The first thread count's gradients against every other's, each run twice.
void expect_same_bits_for_thread_counts(const Case& c, uint64_t seed, std::initializer_list<int> threads) {
  Problem pr = make_problem(c, seed);
  SdpaOptions o = pr.in.options;
  o.backend = SdpaBackend::kFused;
  o.num_threads = *threads.begin();
  const SdpaGrads first = scaled_dot_product_attention_backward(pr.dout, pr.in.q, pr.in.k, pr.in.v, pr.fwd, o);
  for (int n : threads) {
    o.num_threads = n;
    for (int run = 0; run < 2; ++run) {
      const SdpaGrads g = scaled_dot_product_attention_backward(pr.dout, pr.in.q, pr.in.k, pr.in.v, pr.fwd, o);
      EXPECT_EQ(first.grad_query.to_vector(), g.grad_query.to_vector()) << describe(c) << " threads " << n;
      EXPECT_EQ(first.grad_key.to_vector(), g.grad_key.to_vector()) << describe(c) << " threads " << n;
      EXPECT_EQ(first.grad_value.to_vector(), g.grad_value.to_vector()) << describe(c) << " threads " << n;
    }
  }
}

class FlashBackward : public testing::TestWithParam<Case> {};

TEST_P(FlashBackward, GradientErrorWithinTwiceTheReferenceErrorOnEveryKernel) {
  expect_within_twice_reference_error(GetParam(), 42);
}

TEST_P(FlashBackward, SameBitsForOneAndTwoThreadsAndRunToRun) {
  expect_same_bits_for_thread_counts(GetParam(), 7, {1, 2});
}

INSTANTIATE_TEST_SUITE_P(Sweep, FlashBackward, testing::ValuesIn(backward_sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return test::case_name(info.param, info.index); });

// ---- key-range split: one key/value head, a long sequence ------------------------------------------

// One kv head has few work items unless its keys are split; each split shape still obeys the
// 2x rule and gives the same bits on 1, 2, 3 and 8 threads (the split ignores the thread count).
std::vector<Case> split_cases() {
  return {{1, 4, 1, 700, 700, 64, 64, MaskKind::kNone, 0.1f},
          {1, 4, 1, 700, 700, 64, 64, MaskKind::kCausalTopLeft, 0.1f},
          {1, 4, 1, 600, 1100, 48, 40, MaskKind::kCausalBottomRight, 0.0f},
          {1, 2, 1, 520, 900, 64, 64, MaskKind::kBool, 0.2f},
          // Small E: the same split at a cost the sanitizer runs afford (the others are "_large").
          {1, 2, 1, 200, 650, 16, 24, MaskKind::kCausalBottomRight, 0.1f}};
}

TEST(FlashBackwardSplitRule, OneLongKeyValueHeadIsSplitIntoSeveralItems) {
  const cpu::FlashBwdKeySplit s = cpu::flash_bwd_key_split(700, 1);
  EXPECT_GT(s.ranges, 1);
  EXPECT_EQ(cpu::flash_bwd_key_split(700, 1, 256).ranges, s.ranges);  // the kernel's key group
  // Small problems and many kv heads keep one range: no partial dQ, today's bits.
  EXPECT_EQ(cpu::flash_bwd_key_split(511, 1).ranges, 1);
  EXPECT_EQ(cpu::flash_bwd_key_split(4096, 8).ranges, 1);
  EXPECT_EQ(cpu::flash_bwd_key_split(1, 1).ranges, 1);
  // Few kv heads on long sequences reach >= 8 items, capped by >= 256 keys per range.
  EXPECT_EQ(cpu::flash_bwd_key_split(4096, 1).ranges, 8);
  EXPECT_EQ(cpu::flash_bwd_key_split(4096, 3).ranges, 3);
  EXPECT_EQ(cpu::flash_bwd_key_split(1025, 2).ranges, 4);
  for (int64_t S : {1, 255, 256, 511, 512, 700, 1025, 1100, 2049, 4096, 10000}) {
    for (int64_t kv : {1, 2, 3, 5, 8, 16}) {
      const cpu::FlashBwdKeySplit sp = cpu::flash_bwd_key_split(S, kv);
      EXPECT_GE(sp.ranges, 1);
      EXPECT_EQ(sp.begin(0, S), 0);
      EXPECT_EQ(sp.begin(sp.ranges, S), S) << "S " << S << " kv " << kv;
      for (int64_t r = 0; r < sp.ranges; ++r) {
        const int64_t b = sp.begin(r, S), e = sp.begin(r + 1, S);
        EXPECT_EQ(b % cpu::kFlashBwdKeyGroup, 0);
        if (sp.ranges > 1) EXPECT_GE(e - b, cpu::kMinRangeKeys) << "S " << S << " kv " << kv << " r " << r;
        EXPECT_LT(b, e);
      }
    }
  }
}

class FlashBackwardSplit : public testing::TestWithParam<Case> {};

TEST_P(FlashBackwardSplit, HeadIsSplitAndWithinTwiceTheReferenceError) {
  const Case c = GetParam();
  ASSERT_GT(cpu::flash_bwd_key_split(c.S, c.B * c.Hkv).ranges, 1) << describe(c);
  expect_within_twice_reference_error(c, 21);
}

TEST_P(FlashBackwardSplit, SameBitsForOneTwoThreeAndEightThreads) {
  expect_same_bits_for_thread_counts(GetParam(), 22, {1, 2, 3, 8});
}

INSTANTIATE_TEST_SUITE_P(LongKv, FlashBackwardSplit, testing::ValuesIn(split_cases()),
                         [](const testing::TestParamInfo<Case>& info) { return test::case_name(info.param, info.index); });

// ---- numerics and layouts --------------------------------------------------------------------------

TEST(FlashBackwardNumerics, NonFiniteKeysAndValuesOutsideTheMaskDoNotLeak) {
  manual_seed(11);
  const Tensor q = randn({2, 37, 16}), dout = randn({2, 37, 24});
  Tensor k = randn({2, 53, 16}), v = randn({2, 53, 24});
  Tensor mask = Tensor::ones({37, 53});
  for (int64_t i = 0; i < 37; ++i) mask.at({i, 50}) = 0.0f;  // key 50 hidden from every query
  for (int64_t j = 0; j < 53; ++j) mask.at({36, j}) = 0.0f;  // query 36 sees nothing
  SdpaOptions o;
  o.attn_mask = AttnMask::boolean(mask);
  o.need_lse = true;
  const Tensor k_clean = k, v_clean = v;
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t e = 0; e < 16; ++e) k.at({h, 50, e}) = NAN;
    for (int64_t e = 0; e < 24; ++e) v.at({h, 50, e}) = INFINITY;
  }
  for (SdpaBackend backend : {SdpaBackend::kReference, SdpaBackend::kFused}) {
    o.backend = backend;
    const SdpaResult fwd = scaled_dot_product_attention(q, k, v, o);
    const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, fwd, o);
    const SdpaResult fwd_clean = scaled_dot_product_attention(q, k_clean, v_clean, o);
    const SdpaGrads g_clean = scaled_dot_product_attention_backward(dout, q, k_clean, v_clean, fwd_clean, o);
    // Equal up to rounding: the guarded products skip zeros in another order than BLAS/FMAs do.
    const std::pair<const Tensor*, const Tensor*> pairs[] = {{&g.grad_query, &g_clean.grad_query},
                                                             {&g.grad_key, &g_clean.grad_key},
                                                             {&g.grad_value, &g_clean.grad_value}};
    for (const auto& [got, want] : pairs) {
      const std::vector<float> a = got->to_vector(), b = want->to_vector();
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(std::isfinite(a[i])) << "element " << i;
        EXPECT_NEAR(a[i], b[i], 1e-6f * std::max(1.0f, std::fabs(b[i])));
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t e = 0; e < 16; ++e) {
        EXPECT_EQ(g.grad_query.at({h, 36, e}), 0.0f);  // the fully masked row has no gradient
        EXPECT_EQ(g.grad_key.at({h, 50, e}), 0.0f);    // nor the hidden key
      }
    }
  }
}

TEST(FlashBackwardNumerics, NanInAnIncludedValuePropagates) {
  manual_seed(12);
  const Tensor q = randn({9, 8}), k = randn({9, 8}), dout = randn({9, 8});
  Tensor v = randn({9, 8});
  v.at({0, 3}) = NAN;  // key 0 is seen by every query
  SdpaOptions o;
  o.need_lse = true;
  o.backend = SdpaBackend::kFused;
  const SdpaResult fwd = scaled_dot_product_attention(q, k, v, o);
  const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, fwd, o);
  EXPECT_TRUE(std::isnan(g.grad_query.at({4, 0})));
  EXPECT_TRUE(std::isnan(g.grad_key.at({0, 0})));
  EXPECT_FALSE(std::isnan(g.grad_value.at({0, 3})));  // dV does not depend on V
}

TEST(FlashBackwardLayout, StridedAndUnbatchedInputsMatchContiguous) {
  manual_seed(13);
  const Tensor qt = randn({3, 40, 2, 32}), kt = randn({3, 45, 2, 32}), vt = randn({3, 45, 2, 32});
  const Tensor dot = randn({3, 40, 2, 32});
  // (B, L, H, E) storage viewed as (B, H, L, E): the layout of a fused QKV projection.
  const TensorView q = qt.transpose(1, 2), k = kt.transpose(1, 2), v = vt.transpose(1, 2),
                   d = dot.transpose(1, 2);
  SdpaOptions o;
  o.is_causal = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.need_lse = true;
  o.backend = SdpaBackend::kFused;
  const SdpaResult f1 = scaled_dot_product_attention(q, k, v, o);
  const SdpaGrads g1 = scaled_dot_product_attention_backward(d, q, k, v, f1, o);
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), dc = d.contiguous();
  const SdpaResult f2 = scaled_dot_product_attention(qc, kc, vc, o);
  const SdpaGrads g2 = scaled_dot_product_attention_backward(dc, qc, kc, vc, f2, o);
  EXPECT_EQ(g1.grad_query.to_vector(), g2.grad_query.to_vector());
  EXPECT_EQ(g1.grad_key.to_vector(), g2.grad_key.to_vector());
  EXPECT_EQ(g1.grad_value.to_vector(), g2.grad_value.to_vector());
  // A transposed (column-major) query is copied by the kernel, with the same result.
  const Tensor q2 = randn({40, 16}), k2 = randn({45, 16}), v2 = randn({45, 16}), d2 = randn({40, 16});
  const Tensor q2t = q2.t().contiguous();
  const TensorView q2_strided = q2t.t();
  const SdpaResult f3 = scaled_dot_product_attention(q2, k2, v2, o);
  const SdpaGrads g3 = scaled_dot_product_attention_backward(d2, q2, k2, v2, f3, o);
  const SdpaGrads g4 = scaled_dot_product_attention_backward(d2, q2_strided, k2, v2, f3, o);
  EXPECT_EQ(g3.grad_query.to_vector(), g4.grad_query.to_vector());
}

// A framework passes its own saved output and LSE as views (SdpaSaved), in whatever layout it
// keeps them: the gradients equal those from the forward's SdpaResult, for every dtype.
TEST(FlashBackwardLayout, SavedViewsOfAnotherLayoutGiveTheSameGradients) {
  manual_seed(14);
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    const Tensor q = randn({2, 3, 20, 16}).to(dt), k = randn({2, 3, 24, 16}).to(dt),
                 v = randn({2, 3, 24, 8}).to(dt), d = randn({2, 3, 20, 8}).to(dt);
    SdpaOptions o;
    o.is_causal = true;
    o.need_lse = true;
    const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
    const SdpaGrads want = scaled_dot_product_attention_backward(d, q, k, v, f, o);
    // The output stored (B, L, H, Ev) and the LSE (L, B, H), viewed back as (B, H, L, ...).
    const Tensor out_blh = f.output.transpose(1, 2).contiguous();
    const Tensor lse_lbh = f.lse.transpose(0, 2).transpose(1, 2).contiguous();
    const SdpaSaved saved(out_blh.transpose(1, 2), lse_lbh.transpose(1, 2).transpose(0, 2));
    ASSERT_FALSE(saved.output.is_contiguous());
    const SdpaGrads got = scaled_dot_product_attention_backward(d, q, k, v, saved, o);
    EXPECT_EQ(got.grad_query.to_double_vector(), want.grad_query.to_double_vector()) << dtype_name(dt);
    EXPECT_EQ(got.grad_key.to_double_vector(), want.grad_key.to_double_vector()) << dtype_name(dt);
    EXPECT_EQ(got.grad_value.to_double_vector(), want.grad_value.to_double_vector()) << dtype_name(dt);
  }
}

TEST(FlashBackwardDispatch, AutoUsesFusedAndKFusedRejectsTorchDropout) {
  manual_seed(14);
  const Tensor q = randn({2, 20, 8}), k = randn({2, 20, 8}), v = randn({2, 20, 8}), d = randn({2, 20, 8});
  SdpaOptions o;
  o.need_lse = true;
  const SdpaResult fwd = scaled_dot_product_attention(q, k, v, o);
  SdpaOptions fused = o;
  fused.backend = SdpaBackend::kFused;
  const SdpaGrads a = scaled_dot_product_attention_backward(d, q, k, v, fwd, o);
  const SdpaGrads f = scaled_dot_product_attention_backward(d, q, k, v, fwd, fused);
  EXPECT_EQ(a.grad_query.to_vector(), f.grad_query.to_vector());
  fused.dropout_p = 0.3f;  // kTorch by default
  fused.need_weights = true;
  EXPECT_THROW(scaled_dot_product_attention_backward(d, q, k, v, fwd, fused), ValueError);
}

}  // namespace
}  // namespace attn

// The split-KV decode kernels (src/sdpa/cpu/decode*.cpp), every build this CPU runs: a few
// queries against many keys, with every option the decode path takes, against float64 maths.
// Rule: error vs float64 <= 2x the float32 reference's error (plus a tiny floor); for 16-bit
// keys/values the truth is float64 of the rounded values. Long key ranges are split across
// work items and merged through their LSEs, so the cases include S large enough to split.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

// The decode builds this CPU runs (the others reported as skipped, with the reason).
const std::vector<std::string>& decode_kernels() {
  static const std::vector<std::string> names = test::runnable_kernels_named("cpu.decode.");
  return names;
}

std::vector<Case> decode_sweep() {
  std::vector<Case> cases;
  const int64_t Es[] = {1, 3, 64, 80, 96, 128, 256};
  const MaskKind masks[] = {MaskKind::kNone, MaskKind::kCausalBottomRight, MaskKind::kBool,
                            MaskKind::kCausalTopLeft, MaskKind::kAdditive, MaskKind::kBoolBroadcast};
  int n = 0;
  for (int64_t L : {1, 2, 16}) {
    for (int64_t S : {1, 37, 700, 2500}) {  // 2500: split into several ranges
      const int64_t E = Es[n % 7];
      const int64_t group = int64_t{1} << (n % 3);
      const int64_t Ev = (n % 5 == 2) ? E + 5 : E;
      cases.push_back({2, 2 * group, 2, L, S, E, Ev, masks[n % 6], 0.0f});
      ++n;
    }
  }
  for (MaskKind m : masks) cases.push_back({1, 8, 2, 4, 1300, 128, 128, m, 0.0f});
  return cases;
}

class Decode : public testing::TestWithParam<Case> {};

TEST_P(Decode, ErrorWithinTwiceTheReferenceError) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c, 21);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  const double ref_err = max_abs_err(scaled_dot_product_attention(in.q, in.k, in.v, ref).output, truth.output);
  ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);
  for (const std::string& kernel : decode_kernels()) {
    SdpaOptions o = in.options;
    o.kernel = kernel;
    const SdpaResult f = scaled_dot_product_attention(in.q, in.k, in.v, o);
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6) << describe(c) << " " << kernel;
    EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-5 * (std::log(double(c.S)) + 2.0)) << describe(c) << " lse " << kernel;
  }
}

// Float32 queries against a bfloat16 or float16 cache: the keys and values are exact in float32,
// so the truth is float64 of those widened values, and the float32 reference on them the rival.
TEST_P(Decode, Float32QueriesAgainstSixteenBitKeysAndValues) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c, 22);
  for (DType kv : {DType::kBFloat16, DType::kFloat16}) {
    const Tensor k = in.k.to(kv), v = in.v.to(kv);
    const Tensor k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
    SdpaOptions ref = in.options;
    ref.backend = SdpaBackend::kReference;
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, k32, v32, ref);
    const double ref_err = max_abs_err(scaled_dot_product_attention(in.q, k32, v32, ref).output, truth.output);
    for (const std::string& kernel : decode_kernels()) {
      SdpaOptions o = in.options;
      o.kernel = kernel;
      const SdpaResult f = scaled_dot_product_attention(in.q, k, v, o);
      ASSERT_EQ(f.output.dtype(), DType::kFloat32);
      EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6)
          << describe(c) << " " << kernel << " kv " << dtype_name(kv);
    }
    // kAuto takes it too (a decode kernel is the only kind that does).
    EXPECT_TRUE(sdpa_kernel_name(in.q, k, v, in.options).starts_with("cpu.decode.")) << describe(c);
  }
}

TEST_P(Decode, SameBitsForAnyThreadCount) {
  const Case c = GetParam();
  Inputs in = make_inputs(c, 23);
  for (const std::string& kernel : decode_kernels()) {
    in.options.kernel = kernel;
    in.options.num_threads = 1;
    const SdpaResult one = scaled_dot_product_attention(in.q, in.k, in.v, in.options);
    for (int t : {2, 3}) {
      in.options.num_threads = t;
      const SdpaResult r = scaled_dot_product_attention(in.q, in.k, in.v, in.options);
      EXPECT_EQ(one.output.to_vector(), r.output.to_vector()) << describe(c) << " " << kernel << " threads " << t;
      EXPECT_EQ(one.lse.to_vector(), r.lse.to_vector()) << describe(c) << " " << kernel << " threads " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, Decode, testing::ValuesIn(decode_sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return "case" + std::to_string(info.index); });

// ---- layouts, choice, refusals ---------------------------------------------------------------------

// FlashAttention's (B, L, H, E) layout, read through transposed views, gives the same bits as
// contiguous copies (the kernel reads rows; it copies nothing).
TEST(DecodeLayout, TransposedViewsGiveTheSameBits) {
  manual_seed(5);
  const Tensor q = randn({2, 3, 8, 64}), k = randn({2, 900, 4, 64}), v = randn({2, 900, 4, 64});
  const TensorView qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
  SdpaOptions o;
  o.enable_gqa = true;
  o.is_causal = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  for (const std::string& kernel : decode_kernels()) {
    o.kernel = kernel;
    const SdpaResult a = scaled_dot_product_attention(qt, kt, vt, o);
    const SdpaResult b = scaled_dot_product_attention(qt.contiguous(), kt.contiguous(), vt.contiguous(), o);
    EXPECT_EQ(a.output.to_vector(), b.output.to_vector()) << kernel;
  }
}

TEST(DecodeChoice, ShortInferenceProblemsOnlyAndEachRefusalSaysWhy) {
  manual_seed(6);
  const Tensor k = randn({1, 2, 50, 16});
  const Tensor q16 = randn({1, 2, 16, 16}), q17 = randn({1, 2, 17, 16});
  EXPECT_TRUE(sdpa_kernel_name(q16, k, k).starts_with("cpu.decode."));
  EXPECT_TRUE(sdpa_kernel_name(q17, k, k).starts_with("cpu.flash."));
  SdpaOptions o;
  o.kernel = "cpu.decode.generic";
  auto refusal = [&](const Tensor& q, const SdpaOptions& opt) {
    try {
      (void)scaled_dot_product_attention(q, k, k, opt);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(q17, o).find("at most 16"), std::string::npos) << refusal(q17, o);
  SdpaOptions w = o;
  w.need_weights = true;
  EXPECT_NE(refusal(q16, w).find("need_weights"), std::string::npos);
  SdpaOptions d = o;
  d.dropout_p = 0.1f;
  d.dropout_rng = DropoutRng::kPhilox;
  EXPECT_NE(refusal(q16, d).find("dropout"), std::string::npos);
  // kAuto hands those to the flash kernels.
  d.kernel.clear();
  EXPECT_TRUE(sdpa_kernel_name(q16, k, k, d).starts_with("cpu.flash."));
}

TEST(DecodeChoice, MixedDtypesBeyondTheDecodeRangeNameBoth) {
  const Tensor q = Tensor::ones({1, 2, 17, 16}), kv = Tensor::ones({1, 2, 40, 16}, DType::kBFloat16);
  try {
    (void)scaled_dot_product_attention(q, kv, kv);
    FAIL() << "float32 queries against bfloat16 keys accepted for 17 queries";
  } catch (const DTypeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("query float32 with key/value bfloat16"), std::string::npos) << m;
  }
  // A flash kernel forced by name refuses the pair with that reason.
  SdpaOptions o;
  o.kernel = "cpu.flash.generic";
  const Tensor q1 = Tensor::ones({1, 2, 1, 16});
  EXPECT_THROW((void)scaled_dot_product_attention(q1, kv, kv, o), ValueError);
  // bfloat16 queries against float32 keys are never a declared pair.
  EXPECT_THROW((void)scaled_dot_product_attention(q1.to(DType::kBFloat16), q1, q1), DTypeError);
}

// The backward of a decode call is the flash backward of the same build; a 16-bit cache gets
// its gradients back in its dtype, equal to the widened float32 gradients rounded once.
TEST(DecodeBackward, GradientsOfSixteenBitKeysComeBackInTheirDtype) {
  manual_seed(7);
  const Tensor q = randn({1, 4, 3, 32}), dout = randn({1, 4, 3, 32});
  const Tensor k = randn({1, 2, 70, 32}).to(DType::kBFloat16), v = randn({1, 2, 70, 32}).to(DType::kBFloat16);
  const Tensor k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
  SdpaOptions o;
  o.enable_gqa = true;
  o.need_lse = true;
  o.is_causal = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
  EXPECT_EQ(g.grad_query.dtype(), DType::kFloat32);
  EXPECT_EQ(g.grad_key.dtype(), DType::kBFloat16);
  EXPECT_EQ(g.grad_value.dtype(), DType::kBFloat16);
  const SdpaResult f32 = scaled_dot_product_attention(q, k32, v32, o);
  const SdpaGrads g32 = scaled_dot_product_attention_backward(dout, q, k32, v32, f32, o);
  EXPECT_EQ(g.grad_key.to_vector(), g32.grad_key.to(DType::kBFloat16).to_vector());
  EXPECT_EQ(g.grad_value.to_vector(), g32.grad_value.to(DType::kBFloat16).to_vector());
  const std::vector<float> a = g.grad_query.to_vector(), b = g32.grad_query.to_vector();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << i;
}

// ---- numerics policy across split ranges ----------------------------------------------------------

// A range whose weights all underflow against a later range's max is skipped whole when merged,
// so an Inf value there cannot become NaN; a row whose keys are all masked is 0 with LSE -inf;
// a NaN query poisons its own row only.
TEST(DecodeNumerics, ZeroWeightsNeverTouchValuesAcrossRanges) {
  const int64_t S = 3000;
  Tensor q = Tensor::zeros({1, 1, 3, 8}), k = Tensor::zeros({1, 1, S, 8}), v = Tensor::ones({1, 1, S, 8});
  for (int64_t e = 0; e < 8; ++e) q.at({0, 0, 0, e}) = q.at({0, 0, 1, e}) = 1.0f;
  for (int64_t j = 0; j < S; ++j) k.at({0, 0, j, 0}) = j < 1000 ? -400.0f : 0.0f;  // weights ~e^-141
  v.at({0, 0, 5, 3}) = INFINITY;
  Tensor mask = Tensor::ones({3, S});
  for (int64_t j = 0; j < S; ++j) mask.at({2, j}) = 0.0f;  // row 2 sees nothing
  q.at({0, 0, 1, 2}) = std::nanf("");
  SdpaOptions o;
  o.attn_mask = AttnMask::boolean(mask);
  o.need_lse = true;
  for (const std::string& kernel : decode_kernels()) {
    o.kernel = kernel;
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    const std::vector<float> out = r.output.to_vector(), lse = r.lse.to_vector();
    for (int64_t e = 0; e < 8; ++e) {
      EXPECT_FLOAT_EQ(out[static_cast<size_t>(e)], 1.0f) << kernel << " row 0, e " << e;
      EXPECT_TRUE(std::isnan(out[static_cast<size_t>(8 + e)])) << kernel << " row 1 (NaN query)";
      EXPECT_EQ(out[static_cast<size_t>(16 + e)], 0.0f) << kernel << " row 2 (fully masked)";
    }
    EXPECT_TRUE(std::isfinite(lse[0])) << kernel;
    EXPECT_EQ(lse[2], -std::numeric_limits<float>::infinity()) << kernel;
  }
}

// The same rule inside one range: a later key block raising the max by more than 126 (base 2)
// makes the earlier weights underflow to exactly 0, so an Inf value among them is excluded, not
// turned into NaN by the rescale. Every fused kernel, prefill and decode, keeps it.
TEST(DecodeNumerics, UnderflowedEarlierWeightsExcludeAnInfValue) {
  const int64_t S = 65, E = 16;
  Tensor q = Tensor::zeros({1, 1, 1, E}), k = Tensor::zeros({1, 1, S, E}), v = Tensor::zeros({1, 1, S, E});
  q.at({0, 0, 0, 0}) = 1.0f;
  k.at({0, 0, 64, 0}) = 100.0f;  // score 100 against 0 for keys 0..63: e^-100 underflows
  v.at({0, 0, 0, 0}) = INFINITY;
  v.at({0, 0, 64, 0}) = 1.0f;
  SdpaOptions o;
  o.scale = 1.0;
  std::vector<std::string> kernels = test::runnable_kernels_named("cpu.");
  for (const std::string& kernel : kernels) {
    if (kernel == "cpu.flash.avx512_bf16") continue;  // float32 inputs: not its dtype
    o.kernel = kernel;
    const std::vector<float> out = scaled_dot_product_attention(q, k, v, o).output.to_vector();
    EXPECT_EQ(out[0], 1.0f) << kernel;
    for (int64_t e = 1; e < E; ++e) EXPECT_EQ(out[static_cast<size_t>(e)], 0.0f) << kernel;
  }
}

}  // namespace
}  // namespace attn

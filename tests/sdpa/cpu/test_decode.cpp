// The split-KV decode kernels (src/sdpa/cpu/decode*.cpp), every build this CPU runs: a few
// queries against many keys, with every option the decode path takes, against float64 maths.
// Rule: error vs float64 <= 2x the float32 reference's error (plus a tiny floor); for 16-bit
// keys/values the truth is float64 of the rounded values. Long key ranges are split across
// work items and merged through their LSEs, so the cases include S large enough to split.
// The variants (window_size, softcap, alibi_slopes, sinks) each and in pairs, with the same rule
// for output and LSE; a sliding window reads only the window's keys (the others are made
// unreadable memory).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif

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
  // Four rows per kv head (group 4, one query): the pipelined steps (decode_pipeline.hpp), whose
  // scores of a chunk are computed during the last chunk's P.V, over 21 chunks and every mask.
  for (MaskKind m : masks) cases.push_back({1, 8, 2, 1, 1300, 64, 64, m, 0.0f});
  // The same from E 128, where 16-bit caches take the pipelined steps too (their scores inline).
  cases.push_back({1, 8, 2, 1, 1300, 128, 128, MaskKind::kNone, 0.0f});
  cases.push_back({1, 8, 2, 1, 1300, 128, 128, MaskKind::kCausalBottomRight, 0.0f});
  // Group 4, one query, E off 64 and 128, odd key counts: bf16 queries on a bf16 cache take the
  // pipelined steps at every E (two key rows a feed, an odd last row alone; E 80 and 144 with the
  // plain P.V and masked key blocks, E 96 with the permuted one, 64 + 32 columns).
  cases.push_back({1, 8, 2, 1, 1301, 80, 80, MaskKind::kNone, 0.0f});
  cases.push_back({1, 8, 2, 1, 999, 96, 96, MaskKind::kCausalBottomRight, 0.0f});
  cases.push_back({1, 8, 2, 1, 777, 144, 144, MaskKind::kBool, 0.0f});
  // One row per kv head (no GQA, one query): single_row_step's straight line, E 64 and 128 (bf16
  // on the dot unit with its permuted P.V in the AVX512-BF16 build), over 21 chunks.
  cases.push_back({1, 2, 2, 1, 1300, 64, 64, MaskKind::kNone, 0.0f});
  cases.push_back({1, 2, 2, 1, 1300, 128, 128, MaskKind::kCausalBottomRight, 0.0f});
  // Six rows per kv head (group 3, two queries): AVX-512's scores by four rows and four tokens,
  // with two rows and (333 = 5 chunks + 13) one token left over, keys in place and widened.
  cases.push_back({1, 6, 2, 2, 333, 128, 128, MaskKind::kNone, 0.0f});
  cases.push_back({1, 6, 2, 2, 333, 72, 72, MaskKind::kCausalBottomRight, 0.0f});
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

// Every decode build gives the same output and LSE bits for 1, 2 and 3 threads.
void expect_same_bits_for_any_thread_count(const Tensor& q, const Tensor& k, const Tensor& v, SdpaOptions o,
                                           const std::string& what) {
  for (const std::string& kernel : decode_kernels()) {
    o.kernel = kernel;
    o.num_threads = 1;
    const SdpaResult one = scaled_dot_product_attention(q, k, v, o);
    for (int t : {2, 3}) {
      o.num_threads = t;
      const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
      EXPECT_EQ(one.output.to_vector(), r.output.to_vector()) << what << " " << kernel << " threads " << t;
      EXPECT_EQ(one.lse.to_vector(), r.lse.to_vector()) << what << " " << kernel << " threads " << t;
    }
  }
}

TEST_P(Decode, SameBitsForAnyThreadCount) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c, 23);
  expect_same_bits_for_any_thread_count(in.q, in.k, in.v, in.options, describe(c));
}

// Queries, keys and values all 16-bit (a bf16 or fp16 model decoding from a cache of its dtype),
// under the low-precision rule of tests/sdpa/test_low_precision.cpp: the truth is float64 of the
// rounded values, the rival the float32 reference on them with its output rounded to the dtype.
// With bf16, cpu.decode.avx512_bf16 multiplies on the dot unit (decode_bf16_dot.hpp): S up to
// 2500 crosses its chunks, odd token tails, ranges and the masks' zero weights (guarded path).
TEST_P(Decode, SixteenBitQueriesWithinTwiceTheRoundedFloat32Reference) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c, 24);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Tensor q = in.q.to(dtype), k = in.k.to(dtype), v = in.v.to(dtype);
    const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
    SdpaOptions ref = in.options;
    ref.backend = SdpaBackend::kReference;
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
    const double ref_err = max_abs_err(scaled_dot_product_attention(q32, k32, v32, ref).output.to(dtype), truth.output);
    ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);
    for (const std::string& kernel : decode_kernels()) {
      SdpaOptions o = in.options;
      o.kernel = kernel;
      const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
      ASSERT_EQ(f.output.dtype(), dtype) << kernel;
      EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-4)
          << describe(c) << " " << kernel << " " << dtype_name(dtype) << " (reference error " << ref_err << ")";
      EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-4 * std::max(1.0, std::log(double(c.S)) + 1.0))
          << describe(c) << " lse " << kernel << " " << dtype_name(dtype);
    }
  }
}

TEST_P(Decode, SixteenBitSameBitsForAnyThreadCount) {
  const Case c = GetParam();
  const Inputs in = make_inputs(c, 25);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    expect_same_bits_for_any_thread_count(in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.options,
                                          describe(c) + " " + std::string(dtype_name(dtype)));
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, Decode, testing::ValuesIn(decode_sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return test::case_name(info.param, info.index); });

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

// Where the CPU has AVX512-BF16, kAuto decodes on the build that uses it, for every dtype (it is
// the AVX-512 build for the others).
TEST(DecodeChoice, TheBf16DotBuildIsChosenWhereItRuns) {
  const std::vector<std::string> bf16 = test::runnable_kernels_named("cpu.decode.avx512_bf16");
  if (bf16.empty()) GTEST_SKIP() << "cpu.decode.avx512_bf16 does not run on this CPU (reason printed above)";
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (k.name == "cpu.decode.avx512_bf16" && !k.auto_declines.empty()) {
      GTEST_SKIP() << "kAuto declines it here: " << k.auto_declines;
    }
  }
  const Tensor q = Tensor::ones({1, 4, 1, 64}), kv = Tensor::ones({1, 2, 300, 64});
  SdpaOptions o;
  o.enable_gqa = true;
  for (DType d : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    EXPECT_EQ(sdpa_kernel_name(q.to(d), kv.to(d), kv.to(d), o), "cpu.decode.avx512_bf16") << dtype_name(d);
  }
  EXPECT_EQ(sdpa_kernel_name(q, kv.to(DType::kBFloat16), kv.to(DType::kBFloat16), o), "cpu.decode.avx512_bf16");
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
  // Every value is exact in bf16 and fp16, and so are the weights that count (1, at score 0).
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const std::string& kernel : decode_kernels()) {
      o.kernel = kernel;
      const SdpaResult r = scaled_dot_product_attention(q.to(d), k.to(d), v.to(d), o);
      const std::vector<float> out = r.output.to_vector(), lse = r.lse.to_vector();
      const std::string what = kernel + " " + std::string(dtype_name(d));
      for (int64_t e = 0; e < 8; ++e) {
        EXPECT_FLOAT_EQ(out[static_cast<size_t>(e)], 1.0f) << what << " row 0, e " << e;
        EXPECT_TRUE(std::isnan(out[static_cast<size_t>(8 + e)])) << what << " row 1 (NaN query)";
        EXPECT_EQ(out[static_cast<size_t>(16 + e)], 0.0f) << what << " row 2 (fully masked)";
      }
      EXPECT_TRUE(std::isfinite(lse[0])) << what;
      EXPECT_EQ(lse[2], -std::numeric_limits<float>::infinity()) << what;
    }
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
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const std::string& kernel : test::runnable_kernels_for(d)) {
      if (kernel == "reference") continue;
      o.kernel = kernel;
      const std::vector<float> out = scaled_dot_product_attention(q.to(d), k.to(d), v.to(d), o).output.to_vector();
      EXPECT_EQ(out[0], 1.0f) << kernel << " " << dtype_name(d);
      for (int64_t e = 1; e < E; ++e) EXPECT_EQ(out[static_cast<size_t>(e)], 0.0f) << kernel << " " << dtype_name(d);
    }
  }
}


// ---- variants ---------------------------------------------------------------------------------------

struct DecodeVariant {
  const char* name;
  WindowSize window;
  std::optional<double> softcap;
  int alibi = 0;  // 0: none, 1: slopes (H), 2: slopes (B, H)
  bool sinks = false;
};

const std::vector<DecodeVariant>& decode_variants() {
  static const std::vector<DecodeVariant> v = {
      {"window_100_0", {100, 0}, {}, 0, false},
      {"window_17_5", {17, 5}, {}, 0, false},
      {"window_left_700", {700, -1}, {}, 0, false},
      {"window_right_3", {-1, 3}, {}, 0, false},
      {"softcap", {}, 2.0, 0, false},
      {"alibi_h", {}, {}, 1, false},
      {"alibi_bh", {}, {}, 2, false},
      {"sinks", {}, {}, 0, true},
      {"window_sinks", {60, 0}, {}, 0, true},
      {"softcap_alibi", {}, 3.0, 1, false},
      {"window_alibi", {300, 2}, {}, 2, false},
      {"softcap_sinks", {}, 2.5, 0, true},
      {"alibi_sinks", {}, {}, 1, true},
      {"all", {250, 1}, 4.0, 2, true},
  };
  return v;
}

// One case: B sequences, Hq = 2 * group query heads on 2 kv heads, L new queries, S keys.
struct VariantCase {
  int64_t L, S, group, E;
  bool bottom_right, causal;
  int variant;
  DType kv;  // float32, or a 16-bit cache read by float32 queries
};

std::string vdescribe(const VariantCase& c) {
  return "L" + std::to_string(c.L) + " S" + std::to_string(c.S) + " group" + std::to_string(c.group) +
         " E" + std::to_string(c.E) + (c.bottom_right ? " bottom-right" : " top-left") +
         (c.causal ? " causal" : "") + " " + decode_variants()[c.variant].name + " kv " + std::string(dtype_name(c.kv));
}
void PrintTo(const VariantCase& c, std::ostream* os) { *os << vdescribe(c); }

// Every (L, S) of the issue with every variant; GQA group, alignment, causality, head dim and the
// cache dtype rotate, so each variant meets each of them several times.
std::vector<VariantCase> variant_sweep() {
  std::vector<VariantCase> out;
  const int64_t groups[] = {1, 4, 8}, Es[] = {64, 80, 128, 32};
  const DType kvs[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const int nv = static_cast<int>(decode_variants().size());
  int n = 0;
  for (int64_t L : {1, 3, 16}) {
    for (int64_t S : {1, 100, 1000, 5000}) {
      for (int v = 0; v < nv; ++v, ++n) {
        out.push_back({L, S, groups[n % 3], Es[n % 4], (n / 2) % 2 == 0, n % 5 < 3, v, kvs[(n / 3) % 3]});
      }
    }
  }
  return out;
}

struct VariantInputs {
  Tensor q, k, v, slopes, sinks;
  SdpaOptions options;
};

int64_t variant_batch(const VariantCase& c) { return c.S >= 5000 ? 1 : 2; }

// q float32; k, v in c.kv (their float32 widening is exact, and what the truth is computed on).
VariantInputs make_variant_inputs(const VariantCase& c, uint64_t seed) {
  manual_seed(seed);
  const DecodeVariant& var = decode_variants()[c.variant];
  const int64_t B = variant_batch(c), Hq = 2 * c.group;
  VariantInputs in;
  in.q = randn({B, Hq, c.L, c.E});
  in.k = randn({B, 2, c.S, c.E}).to(c.kv);
  in.v = randn({B, 2, c.S, c.E}).to(c.kv);
  SdpaOptions& o = in.options;
  o.enable_gqa = c.group > 1;
  o.is_causal = c.causal;
  o.causal_alignment = c.bottom_right ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
  o.need_lse = true;
  o.window_size = var.window;
  o.softcap = var.softcap;
  if (var.softcap) o.scale = 1.5 / std::sqrt(static_cast<double>(c.E));  // scores where tanh bends
  if (var.alibi != 0) {
    in.slopes = var.alibi == 1 ? Tensor::empty({Hq}) : Tensor::empty({B, Hq});
    const int64_t n = in.slopes.numel();
    for (int64_t h = 0; h < n; ++h) in.slopes.data()[h] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(n));
    o.alibi_slopes = in.slopes;
  }
  if (var.sinks) {
    in.sinks = randn({Hq});
    for (int64_t h = 0; h < Hq; ++h) in.sinks.data()[h] *= 3.0f;  // from negligible to dominant
    o.sinks = in.sinks;
  }
  return in;
}

class DecodeVariants : public testing::TestWithParam<VariantCase> {};

TEST_P(DecodeVariants, ErrorWithinTwiceTheReferenceErrorForOutputAndLse) {
  const VariantCase c = GetParam();
  const VariantInputs in = make_variant_inputs(c, 31);
  const Tensor k32 = in.k.to(DType::kFloat32), v32 = in.v.to(DType::kFloat32);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, k32, v32, ref);
  const SdpaResult r = scaled_dot_product_attention(in.q, k32, v32, ref);
  const double ref_err = max_abs_err(r.output, truth.output), ref_lse_err = max_abs_err(r.lse, truth.lse);
  ASSERT_TRUE(std::isfinite(ref_err) && std::isfinite(ref_lse_err)) << vdescribe(c);
  for (const std::string& kernel : decode_kernels()) {
    SdpaOptions o = in.options;
    o.kernel = kernel;
    const SdpaResult f = scaled_dot_product_attention(in.q, in.k, in.v, o);
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6)
        << vdescribe(c) << " " << kernel << " (reference error " << ref_err << ")";
    EXPECT_LE(max_abs_err(f.lse, truth.lse), 2.0 * ref_lse_err + 1e-6)
        << vdescribe(c) << " lse " << kernel << " (reference error " << ref_lse_err << ")";
  }
  // kAuto takes a decode kernel for them (none refuses a variant).
  EXPECT_TRUE(sdpa_kernel_name(in.q, in.k, in.v, in.options).starts_with("cpu.decode.")) << vdescribe(c);
}

// A 16-bit cache read by queries of its own dtype (the output then in that dtype too), under the
// low-precision rule: the rival is the float32 reference on the same values, rounded.
TEST_P(DecodeVariants, SixteenBitQueriesWithinTwiceTheRoundedReference) {
  const VariantCase c = GetParam();
  if (c.kv == DType::kFloat32) GTEST_SKIP() << "float32 cache: ErrorWithinTwiceTheReferenceErrorForOutputAndLse";
  const VariantInputs in = make_variant_inputs(c, 33);
  const Tensor q = in.q.to(c.kv);
  const Tensor q32 = q.to(DType::kFloat32), k32 = in.k.to(DType::kFloat32), v32 = in.v.to(DType::kFloat32);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
  const double ref_err = max_abs_err(scaled_dot_product_attention(q32, k32, v32, ref).output.to(c.kv), truth.output);
  ASSERT_TRUE(std::isfinite(ref_err)) << vdescribe(c);
  for (const std::string& kernel : decode_kernels()) {
    SdpaOptions o = in.options;
    o.kernel = kernel;
    const SdpaResult f = scaled_dot_product_attention(q, in.k, in.v, o);
    ASSERT_EQ(f.output.dtype(), c.kv) << kernel;
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-4)
        << vdescribe(c) << " " << kernel << " (reference error " << ref_err << ")";
    EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-4 * std::max(1.0, std::log(double(c.S)) + 1.0))
        << vdescribe(c) << " lse " << kernel;
  }
}

TEST_P(DecodeVariants, SameBitsForOneTwoAndThreeThreads) {
  const VariantCase c = GetParam();
  const VariantInputs in = make_variant_inputs(c, 32);
  expect_same_bits_for_any_thread_count(in.q, in.k, in.v, in.options, vdescribe(c));
}

INSTANTIATE_TEST_SUITE_P(Sweep, DecodeVariants, testing::ValuesIn(variant_sweep()),
                         [](const testing::TestParamInfo<VariantCase>& info) {
                           const VariantCase& c = info.param;
                           const int64_t work = variant_batch(c) * 2 * c.group * c.L * c.S * 2 * c.E;
                           return "case" + std::to_string(info.index) + "_" + decode_variants()[c.variant].name +
                                  test::large_tag(work);
                         });

// A row that sees no key (top-left window (0, 0) with S < L) has output 0 and LSE its sink, also
// when its sequence is long enough to be split into several ranges for the other rows.
TEST(DecodeVariantPolicy, ARowThatSeesNoKeyIsZeroWithLseTheSink) {
  manual_seed(3);
  const Tensor q = randn({1, 4, 16, 32}), k = randn({1, 2, 10, 32}), v = randn({1, 2, 10, 32});
  Tensor sinks = Tensor::empty({4});
  for (int64_t h = 0; h < 4; ++h) sinks.data()[h] = 0.5f * static_cast<float>(h) - 1.0f;
  SdpaOptions o;
  o.enable_gqa = true;
  o.window_size = {0, 0};
  o.sinks = sinks;
  o.need_lse = true;
  for (const std::string& kernel : decode_kernels()) {
    o.kernel = kernel;
    const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 10; i < 16; ++i) {
        EXPECT_FLOAT_EQ(r.lse.at({0, h, i}), sinks.data()[h]) << kernel;
        for (int64_t e = 0; e < 32; ++e) EXPECT_EQ(r.output.at({0, h, i, e}), 0.0f) << kernel;
      }
    }
  }
}

#if defined(__unix__)
// Memory of which only rows [lo, hi) of a (1, 1, S, E) float32 tensor may be read: the rest is
// mapped PROT_NONE, so reading it kills the test. E * 4 is the OS page size, one row a page.
class GuardedRows {
 public:
  GuardedRows(int64_t S, int64_t E, int64_t lo, int64_t hi, const Tensor& values) : bytes_(S * E * 4) {
    void* m = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    base_ = static_cast<float*>(m);
    std::memcpy(base_, values.data(), static_cast<size_t>(bytes_));
    const int64_t row = E * 4;
    if (lo > 0) mprotect(base_, static_cast<size_t>(lo * row), PROT_NONE);
    if (hi < S) mprotect(reinterpret_cast<char*>(base_) + hi * row, static_cast<size_t>((S - hi) * row), PROT_NONE);
    view_ = TensorView(base_, Shape{1, 1, S, E});
  }
  ~GuardedRows() { munmap(base_, static_cast<size_t>(bytes_)); }
  GuardedRows(const GuardedRows&) = delete;
  GuardedRows& operator=(const GuardedRows&) = delete;
  const TensorView& view() const { return view_; }

 private:
  int64_t bytes_;
  float* base_ = nullptr;
  TensorView view_;
};

// A sliding window reads the window's keys and values only, whatever S: every other row of K
// and V is unreadable memory. The result equals the call on readable copies, bit for bit.
TEST(DecodeVariantWindow, KeysOutsideTheWindowAreNeverRead) {
  const int64_t E = sysconf(_SC_PAGESIZE) / 4, S = 3000;
  struct W {
    int64_t L;
    WindowSize w;
    bool bottom_right, causal;
  };
  const W windows[] = {{1, {100, 0}, true, true}, {3, {100, 0}, true, true}, {16, {64, -1}, true, true},
                       {3, {40, 7}, false, false}, {16, {5, 30}, false, true}};
  manual_seed(9);
  const Tensor k = randn({1, 1, S, E}), v = randn({1, 1, S, E});
  Tensor slopes = Tensor::empty({8}), sinks = randn({8});
  for (int64_t h = 0; h < 8; ++h) slopes.data()[h] = 0.01f * static_cast<float>(h + 1);
  for (const W& w : windows) {
    const Tensor q = randn({1, 8, w.L, E});
    const int64_t diag = w.bottom_right ? S - w.L : 0;
    const int64_t lo = std::max<int64_t>(0, diag - w.w.left);
    int64_t hi = w.w.right >= 0 ? diag + w.L - 1 + w.w.right + 1 : S;
    if (w.causal) hi = std::min(hi, diag + w.L);
    hi = std::min(hi, S);
    const GuardedRows gk(S, E, lo, hi, k), gv(S, E, lo, hi, v);
    for (int mods = 0; mods < 2; ++mods) {
      SdpaOptions o;
      o.enable_gqa = true;
      o.need_lse = true;
      o.is_causal = w.causal;
      o.causal_alignment = w.bottom_right ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
      o.window_size = w.w;
      if (mods == 1) {
        o.softcap = 20.0;
        o.alibi_slopes = slopes;
        o.sinks = sinks;
      }
      for (const std::string& kernel : decode_kernels()) {
        o.kernel = kernel;
        const SdpaResult guarded = scaled_dot_product_attention(q, gk.view(), gv.view(), o);
        const SdpaResult plain = scaled_dot_product_attention(q, k, v, o);
        EXPECT_EQ(guarded.output.to_vector(), plain.output.to_vector()) << kernel << " L" << w.L << " mods " << mods;
        EXPECT_EQ(guarded.lse.to_vector(), plain.lse.to_vector()) << kernel << " L" << w.L << " mods " << mods;
      }
    }
  }
}
#endif

// Non-finite keys and values outside the window change nothing (they are never read, and were
// they read, a hidden key's score would be -inf and its weight a skipped 0).
TEST(DecodeVariantWindow, NonFiniteKeysAndValuesOutsideTheWindowChangeNothing) {
  manual_seed(10);
  const int64_t S = 5000, L = 3;
  const Tensor q = randn({1, 8, L, 64}), k = randn({1, 2, S, 64}), v = randn({1, 2, S, 64});
  Tensor kp = k.to(DType::kFloat32), vp = v.to(DType::kFloat32);
  const int64_t first = S - L - 200;  // the window's first key (row 0's i' - 200)
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t j = 0; j < first; ++j) {
      for (int64_t e = 0; e < 64; ++e) kp.at({0, h, j, e}) = NAN, vp.at({0, h, j, e}) = INFINITY;
    }
  }
  SdpaOptions o;
  o.enable_gqa = true;
  o.need_lse = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.window_size = {200, 0};
  for (DType kv : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const std::string& kernel : decode_kernels()) {
      o.kernel = kernel;
      const SdpaResult a = scaled_dot_product_attention(q, kp.to(kv), vp.to(kv), o);
      const SdpaResult b = scaled_dot_product_attention(q, k.to(kv), v.to(kv), o);
      EXPECT_EQ(a.output.to_vector(), b.output.to_vector()) << kernel << " " << dtype_name(kv);
      EXPECT_EQ(a.lse.to_vector(), b.lse.to_vector()) << kernel << " " << dtype_name(kv);
    }
  }
}

}  // namespace
}  // namespace attn

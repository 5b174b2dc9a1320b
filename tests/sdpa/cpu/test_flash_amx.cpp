// The AMX-BF16 forward kernel's code (src/sdpa/cpu/flash_amx_kernel.hpp), bf16, fp16 and float32
// at float32_matmul_precision "high" and "medium", on emulated tiles (amx_emulated.cpp), on any CPU with AVX512-BF16: the low-precision rule of
// tests/sdpa/test_low_precision.cpp (error vs the float64 truth of the rounded inputs at most 2x
// the float32 reference's rounded to the dtype, plus a small floor) over the sweep's masks, GQA,
// dropout, odd lengths and head dims, and 1 vs 2 threads giving the same bits. On a CPU with AMX
// the registry's cpu.flash.amx_bf16 also runs in test_low_precision.cpp's sweep on the real
// tiles, and here against the emulation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/amx_emulated.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"
#include "sdpa/problem.hpp"
#include "sdpa/registry.hpp"

namespace attn {
namespace {

using test::Case;
using test::describe;
using test::MaskKind;
using test::max_abs_err;

// The table the registry takes for the call (bf16: P as two terms with output_residual, unless
// the call allows fp16/bf16 reduction, or a small Ev).
SdpaResult run_emulated(const TensorView& q, const TensorView& k, const TensorView& v, const SdpaOptions& o,
                        Float32MatmulPrecision precision = Float32MatmulPrecision::kHigh) {
  const detail::SdpaProblem p = detail::check_sdpa(q, k, v, o);
  const bool two = cpu::bf16_p_two_terms(v.size(-1), o.need_output_residual && !o.allow_fp16_bf16_reduction);
  return cpu::flash_forward_bf16(cpu::amx_kernel_emulated(q.dtype(), precision, two), q, k, v, o, p);
}

// What the kernel computes in: bf16 (one term; P in two with output_residual), fp16 (two),
// float32 "high" (three), "medium" (one).
struct Mode {
  DType dtype;
  Float32MatmulPrecision precision;
  const char* name;
  bool residual = false;
};
constexpr Mode kModes[] = {{DType::kBFloat16, Float32MatmulPrecision::kHighest, "bfloat16"},
                           {DType::kBFloat16, Float32MatmulPrecision::kHighest, "bfloat16 with output_residual", true},
                           {DType::kFloat16, Float32MatmulPrecision::kHighest, "float16"},
                           {DType::kFloat32, Float32MatmulPrecision::kHigh, "float32 high"},
                           {DType::kFloat32, Float32MatmulPrecision::kMedium, "float32 medium"}};

std::vector<Case> amx_sweep() {
  std::vector<Case> cases;
  const MaskKind masks[] = {MaskKind::kNone, MaskKind::kCausalTopLeft, MaskKind::kBool,
                            MaskKind::kCausalBottomRight, MaskKind::kAdditive, MaskKind::kBoolBroadcast};
  int n = 0;
  for (int64_t L : {1, 7, 33, 97, 200}) {
    for (int64_t E : {1, 3, 31, 64, 80, 96, 128, 256}) {
      const int64_t group = int64_t{1} << (n % 3);
      const int64_t S = (n % 4 == 1) ? L + 13 : (n % 4 == 3 && L > 7) ? L / 2 + 1 : (n % 4 == 2) ? L + 64 : L;
      const int64_t Ev = (n % 5 == 2) ? E + 5 : (n % 5 == 4) ? E + 16 : E;
      const float p = (n % 7 == 3) ? 0.2f : 0.0f;
      cases.push_back({2, 2 * group, 2, L, S, E, Ev, masks[n % 6], p});
      ++n;
    }
  }
  return cases;
}

class AmxEmulated : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!cpu::amx_emulation_runs_here()) {
      GTEST_SKIP() << "the AMX kernel's AVX-512 part needs avx512f/vl/dq/bw/bf16 and fma (this CPU: "
                   << cpu::cpu_features().describe() << ")";
    }
  }
};

// bf16 runs one tile product per product, fp16 three (its values as two bf16 terms).
constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16};

TEST_P(AmxEmulated, ForwardErrorWithinTwiceTheRoundedFloat32Reference) {
  const Case c = GetParam();
  const test::Inputs in = test::make_inputs(c, 21);
  for (DType dtype : kDtypes) {
    const Tensor q = in.q.to(dtype), k = in.k.to(dtype), v = in.v.to(dtype);
    const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
    SdpaOptions ref = in.options;
    ref.backend = SdpaBackend::kReference;
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
    const double ref_err = max_abs_err(scaled_dot_product_attention(q32, k32, v32, ref).output.to(dtype),
                                       truth.output);
    ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);

    const SdpaResult f = run_emulated(q, k, v, in.options);
    ASSERT_EQ(f.output.dtype(), dtype);
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-4)
        << describe(c) << " " << dtype_name(dtype) << " (reference error " << ref_err << ")";
    EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-4 * std::max(1.0, std::log(double(c.S)) + 1.0))
        << describe(c) << " " << dtype_name(dtype);
  }
}

// float32 at "high" (bf16x3): error vs float64 at most 2x the float32 reference's, the bar the
// issue sets (a 1e-6 floor for the near-exact small cases); the LSE to float32's accuracy.
TEST_P(AmxEmulated, Float32HighWithinTwiceTheFloat32Reference) {
  const Case c = GetParam();
  const test::Inputs in = test::make_inputs(c, 24);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  const double ref_err = max_abs_err(scaled_dot_product_attention(in.q, in.k, in.v, ref).output, truth.output);
  const SdpaResult f = run_emulated(in.q, in.k, in.v, in.options, Float32MatmulPrecision::kHigh);
  ASSERT_EQ(f.output.dtype(), DType::kFloat32);
  EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6) << describe(c) << " (reference error " << ref_err << ")";
  EXPECT_LE(max_abs_err(f.lse, truth.lse), 1e-5 * std::max(1.0, std::log(double(c.S)) + 1.0)) << describe(c);
}

// float32 at "medium" (plain bf16 products, float32 output): the bf16 rule's bar, 2x the error
// of a float32 reference on the bf16-rounded inputs with its output rounded to bf16 (+ 1e-4),
// measured against the float64 truth of the float32 inputs.
TEST_P(AmxEmulated, Float32MediumWithinTheBf16Rule) {
  const Case c = GetParam();
  const test::Inputs in = test::make_inputs(c, 25);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
  auto rounded = [](const Tensor& t) { return t.to(DType::kBFloat16).to(DType::kFloat32); };
  const double bf16_err = max_abs_err(
      scaled_dot_product_attention(rounded(in.q), rounded(in.k), rounded(in.v), ref).output.to(DType::kBFloat16),
      truth.output);
  const SdpaResult f = run_emulated(in.q, in.k, in.v, in.options, Float32MatmulPrecision::kMedium);
  ASSERT_EQ(f.output.dtype(), DType::kFloat32);
  EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * bf16_err + 1e-4) << describe(c) << " (bf16 rule's error " << bf16_err << ")";
}

// The tiles form output_residual themselves, P in two bf16 terms: fp16 always, bf16 in the table
// for such calls (its plain table, one term of P, says it cannot). Output + residual is the
// float32 attention (far closer to the truth than the 16-bit output), and the backward that reads
// it (native for bf16, widened for fp16) meets the low-precision rule.
TEST_P(AmxEmulated, OutputResidualFeedsTheBackward) {
  const Case c = GetParam();
  if (c.L * c.S * c.E > 4'000'000) GTEST_SKIP() << "float64 backward truth too slow for " << describe(c);
  const test::Inputs in = test::make_inputs(c, 26);
  EXPECT_FALSE(cpu::amx_kernel_emulated(DType::kBFloat16, Float32MatmulPrecision::kHighest).residual_ok);
  SdpaOptions ref = in.options;
  ref.backend = SdpaBackend::kReference;
  for (DType dt : kDtypes) {
    const std::string what = describe(c) + " " + std::string(dtype_name(dt));
    const Tensor q = in.q.to(dt), k = in.k.to(dt), v = in.v.to(dt);
    const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
    SdpaOptions o = in.options;
    o.need_output_residual = true;
    ASSERT_TRUE(cpu::amx_kernel_emulated(dt, Float32MatmulPrecision::kHighest, true).residual_ok) << what;
    const SdpaResult f = run_emulated(q, k, v, o);
    ASSERT_TRUE(f.output_residual.defined()) << what;
    ASSERT_EQ(f.output_residual.dtype(), dt) << what;
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
    const double ref_err = max_abs_err(scaled_dot_product_attention(q32, k32, v32, ref).output.to(dt), truth.output);
    EXPECT_LE(max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-4) << what;
    Tensor sum = f.output.to(DType::kFloat32);
    const Tensor res = f.output_residual.to(DType::kFloat32);
    for (int64_t i = 0; i < sum.numel(); ++i) sum.data()[i] += res.data()[i];
    // fp16 drops the lo.lo products, bf16 has none to drop (P's lo times V's one term): output +
    // residual is good to ~2^-16, measured 1/20-1/40 of the fp16 output's error.
    EXPECT_LE(max_abs_err(sum, truth.output), max_abs_err(f.output, truth.output) / 8 + 1e-6) << what;

    manual_seed(31);
    const Tensor dout = randn({c.B, c.Hq, c.L, c.Ev}).to(dt), d32 = dout.to(DType::kFloat32);
    const reference::SdpaGradsF64 gt = reference::scaled_dot_product_attention_backward_f64(d32, q32, k32, v32, ref);
    const SdpaResult rf = scaled_dot_product_attention(q32, k32, v32, ref);
    const SdpaGrads rg = scaled_dot_product_attention_backward(d32, q32, k32, v32, rf, ref);
    const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
    EXPECT_LE(max_abs_err(g.grad_query, gt.grad_query), 2.0 * max_abs_err(rg.grad_query.to(dt), gt.grad_query) + 1e-4) << what;
    EXPECT_LE(max_abs_err(g.grad_key, gt.grad_key), 2.0 * max_abs_err(rg.grad_key.to(dt), gt.grad_key) + 1e-4) << what;
    EXPECT_LE(max_abs_err(g.grad_value, gt.grad_value), 2.0 * max_abs_err(rg.grad_value.to(dt), gt.grad_value) + 1e-4) << what;
  }
}

TEST_P(AmxEmulated, SameBitsForOneAndTwoThreads) {
  const Case c = GetParam();
  const test::Inputs in = test::make_inputs(c, 22);
  for (const Mode& mode : kModes) {
    const Tensor q = in.q.to(mode.dtype), k = in.k.to(mode.dtype), v = in.v.to(mode.dtype);
    SdpaOptions o = in.options;
    o.need_output_residual = mode.residual;
    o.num_threads = 1;
    const SdpaResult one = run_emulated(q, k, v, o, mode.precision);
    o.num_threads = 2;
    const SdpaResult two = run_emulated(q, k, v, o, mode.precision);
    EXPECT_EQ(one.output.to_vector(), two.output.to_vector()) << describe(c) << " " << mode.name;
    if (mode.residual) EXPECT_EQ(one.output_residual.to_vector(), two.output_residual.to_vector()) << describe(c);
    EXPECT_EQ(one.lse.to_vector(), two.lse.to_vector()) << describe(c) << " " << mode.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, AmxEmulated, testing::ValuesIn(amx_sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return "case" + std::to_string(info.index); });

// Where the CPU has AMX, the registered kernel on the real tiles agrees with the emulation to
// within the rounding of one 16-bit output (their sums may differ in the last float32 bits), in
// every mode the kernel has.
TEST(AmxHardware, AgreesWithTheEmulation) {
  const SdpaKernelInfo* amx = nullptr;
  std::vector<SdpaKernelInfo> all = sdpa_kernels();
  for (const SdpaKernelInfo& k : all) amx = k.name == "cpu.flash.amx_bf16" ? &k : amx;
  ASSERT_NE(amx, nullptr) << "cpu.flash.amx_bf16 is not registered";
  if (!amx->runs_on_this_cpu) GTEST_SKIP() << "cpu.flash.amx_bf16 on this CPU: " << amx->reason_if_not;
  for (const Case& c : {Case{1, 4, 2, 97, 131, 80, 64, MaskKind::kCausalBottomRight, 0.0f},
                        Case{2, 2, 2, 200, 200, 128, 128, MaskKind::kBool, 0.2f}}) {
    const test::Inputs in = test::make_inputs(c, 23);
    for (const Mode& mode : kModes) {
      const Tensor q = in.q.to(mode.dtype), k = in.k.to(mode.dtype), v = in.v.to(mode.dtype);
      SdpaOptions o = in.options;
      o.need_output_residual = mode.residual;
      const SdpaResult er = run_emulated(q, k, v, o, mode.precision);
      o.kernel = "cpu.flash.amx_bf16";
      o.float32_matmul_precision = mode.precision;
      const SdpaResult hr = scaled_dot_product_attention(q, k, v, o);
      // With the residual, output + residual: the float32 attention, which both carry.
      auto values = [&](const SdpaResult& r) {
        std::vector<float> x = r.output.to_vector();
        if (mode.residual) {
          const std::vector<float> lo = r.output_residual.to_vector();
          for (size_t i = 0; i < x.size(); ++i) x[i] += lo[i];
        }
        return x;
      };
      const std::vector<float> hw = values(hr), emu = values(er);
      ASSERT_EQ(hw.size(), emu.size());
      // One bf16 output's rounding for the 16-bit modes; float32 outputs agree far closer, and so
      // do output + residual (to 16 bits or more).
      const float tol = mode.dtype == DType::kFloat32 ? 1e-5f : mode.residual ? 1e-4f : 1e-2f;
      for (size_t i = 0; i < hw.size(); ++i) {
        ASSERT_NEAR(hw[i], emu[i], tol * std::max(1.0f, std::fabs(emu[i]))) << describe(c) << " " << mode.name << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

// The measured accuracy of each float32 level on the tiles' code (emulated: the tiles' products
// are exact and summed in float32 as the ISA defines, so the errors are the hardware's up to
// summation order), printed for docs/API.md's table: max |error| vs float64 over B=1, H=4,
// L=S=512 of randn inputs. Asserts the levels' order: "high" within 2x float32's, "medium" no
// better than "high" and within the bf16 rule.
TEST(AmxPrecision, MeasuredErrorsPerLevel) {
  if (!cpu::amx_emulation_runs_here()) GTEST_SKIP() << "needs AVX512-BF16 (this CPU: " << cpu::cpu_features().describe() << ")";
  for (int64_t E : {64, 128}) {
    for (bool causal : {false, true}) {
      const Case c{1, 4, 4, 512, 512, E, E, causal ? MaskKind::kCausalTopLeft : MaskKind::kNone, 0.0f};
      const test::Inputs in = test::make_inputs(c, 26);
      SdpaOptions ref = in.options;
      ref.backend = SdpaBackend::kReference;
      const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(in.q, in.k, in.v, ref);
      const double highest = max_abs_err(scaled_dot_product_attention(in.q, in.k, in.v, in.options).output, truth.output);
      const double reference32 = max_abs_err(scaled_dot_product_attention(in.q, in.k, in.v, ref).output, truth.output);
      const double high = max_abs_err(run_emulated(in.q, in.k, in.v, in.options, Float32MatmulPrecision::kHigh).output, truth.output);
      const double medium = max_abs_err(run_emulated(in.q, in.k, in.v, in.options, Float32MatmulPrecision::kMedium).output, truth.output);
      const Tensor qb = in.q.to(DType::kBFloat16), kb = in.k.to(DType::kBFloat16), vb = in.v.to(DType::kBFloat16);
      const double bf16 = max_abs_err(run_emulated(qb, kb, vb, in.options).output, truth.output);
      std::printf("[ ERRORS   ] E=%lld %-6s highest (%s) %.3g, float32 reference %.3g, high %.3g, medium %.3g, "
                  "bf16 inputs %.3g\n",
                  static_cast<long long>(E), causal ? "causal" : "full", sdpa_kernel_name(in.q, in.k, in.v, in.options).c_str(),
                  highest, reference32, high, medium, bf16);
      EXPECT_LE(high, 2.0 * reference32 + 1e-6) << describe(c);
      EXPECT_GE(medium, high) << describe(c);
      EXPECT_LE(medium, bf16) << describe(c) << ": medium keeps float32 output, bf16 rounds it";
    }
  }
}

// allow_fp16_bf16_reduction with output_residual: the one-term table forms the residual (of its
// own float32 output, P in one bf16 term), and the output is the call's without the residual.
TEST(AmxReduction, OneTermTableFormsTheResidual) {
  if (!cpu::amx_emulation_runs_here()) GTEST_SKIP() << "needs AVX512-BF16 (this CPU: " << cpu::cpu_features().describe() << ")";
  const Case c{1, 2, 2, 70, 90, 64, 64, MaskKind::kCausalBottomRight, 0.0f};
  const test::Inputs in = test::make_inputs(c, 27);
  const Tensor q = in.q.to(DType::kBFloat16), k = in.k.to(DType::kBFloat16), v = in.v.to(DType::kBFloat16);
  SdpaOptions o = in.options;
  o.allow_fp16_bf16_reduction = true;
  const SdpaResult plain = run_emulated(q, k, v, o);
  o.need_output_residual = true;
  const SdpaResult f = run_emulated(q, k, v, o);
  ASSERT_TRUE(f.output_residual.defined());
  EXPECT_EQ(f.output.to_vector(), plain.output.to_vector());
  // Each residual is what rounding the float32 output to bf16 dropped: within half a bf16 unit
  // of the output, and not all zero.
  const std::vector<float> out = f.output.to_vector(), res = f.output_residual.to_vector();
  double nonzero = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_LE(std::fabs(res[i]), std::ldexp(std::fabs(out[i]), -8) + 1e-30) << i;
    nonzero += res[i] != 0.0f;
  }
  EXPECT_GT(nonzero, out.size() / 2);
}

}  // namespace
}  // namespace attn

// The AMX-BF16 forward kernel's code (src/sdpa/cpu/flash_amx_kernel.hpp), bf16 and fp16, on
// emulated tiles (amx_emulated.cpp), on any CPU with AVX512-BF16: the low-precision rule of
// tests/sdpa/test_low_precision.cpp (error vs the float64 truth of the rounded inputs at most 2x
// the float32 reference's rounded to the dtype, plus a small floor) over the sweep's masks, GQA,
// dropout, odd lengths and head dims, and 1 vs 2 threads giving the same bits. On a CPU with AMX
// the registry's cpu.flash.amx_bf16 also runs in test_low_precision.cpp's sweep on the real
// tiles, and here against the emulation.
#include <gtest/gtest.h>

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

SdpaResult run_emulated(const TensorView& q, const TensorView& k, const TensorView& v, const SdpaOptions& o) {
  const detail::SdpaProblem p = detail::check_sdpa(q, k, v, o);
  return cpu::flash_forward_bf16(cpu::amx_kernel_emulated(q.dtype()), q, k, v, o, p);
}

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

TEST_P(AmxEmulated, SameBitsForOneAndTwoThreads) {
  const Case c = GetParam();
  const test::Inputs in = test::make_inputs(c, 22);
  for (DType dtype : kDtypes) {
    const Tensor q = in.q.to(dtype), k = in.k.to(dtype), v = in.v.to(dtype);
    SdpaOptions o = in.options;
    o.num_threads = 1;
    const SdpaResult one = run_emulated(q, k, v, o);
    o.num_threads = 2;
    const SdpaResult two = run_emulated(q, k, v, o);
    EXPECT_EQ(one.output.to_vector(), two.output.to_vector()) << describe(c) << " " << dtype_name(dtype);
    EXPECT_EQ(one.lse.to_vector(), two.lse.to_vector()) << describe(c) << " " << dtype_name(dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, AmxEmulated, testing::ValuesIn(amx_sweep()),
                         [](const testing::TestParamInfo<Case>& info) { return "case" + std::to_string(info.index); });

// Where the CPU has AMX, the registered kernel on the real tiles agrees with the emulation to
// within the rounding of one bf16 output (their sums may differ in the last float32 bits).
TEST(AmxHardware, AgreesWithTheEmulation) {
  const SdpaKernelInfo* amx = nullptr;
  std::vector<SdpaKernelInfo> all = sdpa_kernels();
  for (const SdpaKernelInfo& k : all) amx = k.name == "cpu.flash.amx_bf16" ? &k : amx;
  ASSERT_NE(amx, nullptr) << "cpu.flash.amx_bf16 is not registered";
  if (!amx->runs_on_this_cpu) GTEST_SKIP() << "cpu.flash.amx_bf16 on this CPU: " << amx->reason_if_not;
  for (const Case& c : {Case{1, 4, 2, 97, 131, 80, 64, MaskKind::kCausalBottomRight, 0.0f},
                        Case{2, 2, 2, 200, 200, 128, 128, MaskKind::kBool, 0.2f}}) {
    const test::Inputs in = test::make_inputs(c, 23);
    for (DType dtype : kDtypes) {
      const Tensor q = in.q.to(dtype), k = in.k.to(dtype), v = in.v.to(dtype);
      SdpaOptions o = in.options;
      o.kernel = "cpu.flash.amx_bf16";
      const std::vector<float> hw = scaled_dot_product_attention(q, k, v, o).output.to_vector();
      const std::vector<float> emu = run_emulated(q, k, v, in.options).output.to_vector();
      ASSERT_EQ(hw.size(), emu.size());
      for (size_t i = 0; i < hw.size(); ++i) {
        ASSERT_NEAR(hw[i], emu[i], 1e-2 * std::max(1.0f, std::fabs(emu[i])))
            << describe(c) << " " << dtype_name(dtype) << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace attn

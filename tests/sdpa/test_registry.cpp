// The SDPA kernel registry (src/sdpa/registry.cpp): CPU feature detection, the kernel list, the
// choice kAuto makes, forcing a kernel by name, and the reasons a kernel gives for refusing.
//
// Every kernel this CPU can run is held to the reference here on a few problems (forward and
// backward); the full sweeps force each fused kernel in tests/sdpa/cpu/. A kernel this CPU
// cannot run is skipped with its printed reason, never silently.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"
#include "sdpa/cpu/cpu_features.hpp"
#include "sdpa/cpu/unit_rates.hpp"
#include "sdpa/problem.hpp"
#include "sdpa/registry.hpp"

namespace attn {
namespace {

using cpu::CpuFeatures;

// The message of the ValueError `f` throws ("" if it throws nothing; fails on another type).
std::string value_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected ValueError, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected ValueError, nothing was thrown";
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- CPU features ---------------------------------------------------------------------------------

TEST(CpuFeatures, DetectedOnceAndConsistent) {
  const CpuFeatures& f = cpu::cpu_features();
  EXPECT_EQ(&f, &cpu::cpu_features()) << "features must be computed once per process";
  // Every AVX-512 extension presupposes the foundation; AMX types presuppose the tile unit.
  for (cpu::CpuFeatureMask ext : {cpu::kAvx512dq, cpu::kAvx512bw, cpu::kAvx512vl, cpu::kAvx512Bf16,
                                  cpu::kAvx512Fp16}) {
    if (f.has(ext)) EXPECT_TRUE(f.has(cpu::kAvx512f)) << cpu::feature_names(ext) << " without avx512f";
  }
  for (cpu::CpuFeatureMask ext : {cpu::kAmxBf16, cpu::kAmxFp16}) {
    if (f.has(ext)) EXPECT_TRUE(f.has(cpu::kAmxTile)) << cpu::feature_names(ext) << " without amx_tile";
  }
  // describe() names exactly the bits of the mask.
  const std::string d = f.describe();
  EXPECT_FALSE(d.empty());
  for (int b = 0; b < 12; ++b) {
    const cpu::CpuFeatureMask bit = 1u << b;
    const std::string name = cpu::feature_names(bit);
    ASSERT_FALSE(name.empty()) << "bit " << b << " has no name";
    const bool listed = contains(" " + d + " ", " " + name + " ");
    EXPECT_EQ(listed, f.has(bit)) << name << " in \"" << d << "\"";
  }
  std::printf("[   INFO   ] %s\n", cpu_description().c_str());
  EXPECT_TRUE(contains(cpu_description(), d));
}

#if defined(__x86_64__) && defined(__GNUC__)
TEST(CpuFeatures, AgreesWithTheCompilersCpuSupports) {
  // GCC's __builtin_cpu_supports reads the same CPUID bits and checks the OS state too.
  const CpuFeatures& f = cpu::cpu_features();
  EXPECT_EQ(f.has(cpu::kAvx2), static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(f.has(cpu::kFma), static_cast<bool>(__builtin_cpu_supports("fma")));
  EXPECT_EQ(f.has(cpu::kAvx512f), static_cast<bool>(__builtin_cpu_supports("avx512f")));
  EXPECT_EQ(f.has(cpu::kAvx512vl), static_cast<bool>(__builtin_cpu_supports("avx512vl")));
  EXPECT_EQ(f.has(cpu::kAvx512dq), static_cast<bool>(__builtin_cpu_supports("avx512dq")));
  EXPECT_EQ(f.has(cpu::kAvx512bw), static_cast<bool>(__builtin_cpu_supports("avx512bw")));
}
#endif

// ---- the kernel list ------------------------------------------------------------------------------

TEST(SdpaRegistry, ListsEveryKernelWithItsFamilyAndDtypes) {
  const std::vector<SdpaKernelInfo> ks = sdpa_kernels();
  std::vector<std::string> names;
  for (const SdpaKernelInfo& k : ks) {
    names.push_back(k.name);
    const std::vector<DType> fused = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
    if (k.name == "reference") {
      EXPECT_EQ(k.dtypes, (std::vector<DType>{DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                              DType::kFloat64}));
    } else if (k.name == "cpu.flash.avx512_bf16") {
      EXPECT_EQ(k.dtypes, std::vector<DType>{DType::kBFloat16});
    } else if (k.name == "cpu.flash.amx_bf16") {  // fp16 as two bf16 terms on the same tiles
      EXPECT_EQ(k.dtypes, (std::vector<DType>{DType::kBFloat16, DType::kFloat16}));
    } else {
      EXPECT_EQ(k.dtypes, fused) << k.name;
    }
    EXPECT_EQ(k.runs_on_this_cpu, k.reason_if_not.empty()) << k.name << ": " << k.reason_if_not;
    if (!k.runs_on_this_cpu) {
      EXPECT_TRUE(contains(k.reason_if_not, "needs CPU features")) << k.reason_if_not;
    }
  }
  std::vector<std::string> want = {"cpu.decode.generic", "cpu.flash.generic", "reference"};
#if defined(__x86_64__)
  want = {"cpu.decode.avx512_bf16", "cpu.decode.avx512", "cpu.decode.avx2", "cpu.decode.generic", "cpu.flash.amx_bf16",
          "cpu.flash.avx512_bf16", "cpu.flash.avx512", "cpu.flash.avx2", "cpu.flash.generic",
          "reference"};
#endif
  EXPECT_EQ(names, want);
  for (const SdpaKernelInfo& k : ks) {
    EXPECT_EQ(k.family, k.name == "reference" ? SdpaBackend::kReference : SdpaBackend::kFused) << k.name;
    if (k.name == "reference" || k.name.ends_with(".generic")) EXPECT_TRUE(k.runs_on_this_cpu) << k.name;
  }
}

TEST(SdpaRegistry, Avx512BuildNeedsEveryFeatureItsFlagsAssume) {
  // flash_avx512.cpp is compiled with -mavx512f -mavx512vl -mavx512dq -mfma: a CPU with
  // avx512f alone must not run it.
  const CpuFeatures& f = cpu::cpu_features();
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (k.name == "cpu.flash.avx512") {
      EXPECT_EQ(k.runs_on_this_cpu,
                f.has(cpu::kAvx512f | cpu::kAvx512vl | cpu::kAvx512dq | cpu::kFma));
    }
    if (k.name == "cpu.flash.avx2") EXPECT_EQ(k.runs_on_this_cpu, f.has(cpu::kAvx2 | cpu::kFma));
    // decode_avx512_bf16.cpp: the AVX-512 build's flags plus -mavx512bw -mavx512bf16.
    if (k.name == "cpu.decode.avx512_bf16") {
      EXPECT_EQ(k.runs_on_this_cpu, f.has(cpu::kAvx512f | cpu::kAvx512vl | cpu::kAvx512dq | cpu::kAvx512bw |
                                          cpu::kAvx512Bf16 | cpu::kFma));
    }
    // flash_amx_bf16.cpp adds -mamx-tile -mamx-bf16 to the AVX512-BF16 build's flags.
    if (k.name == "cpu.flash.amx_bf16") {
      EXPECT_EQ(k.runs_on_this_cpu, f.has(cpu::kAvx512f | cpu::kAvx512vl | cpu::kAvx512dq | cpu::kAvx512bw |
                                          cpu::kAvx512Bf16 | cpu::kFma | cpu::kAmxTile | cpu::kAmxBf16));
    }
  }
}

// ---- every runnable kernel against the reference ------------------------------------------------

struct Problem {
  std::vector<int64_t> q, kv;
  bool causal;
  bool gqa;
  float philox_dropout;
};

TEST(SdpaRegistry, EveryRunnableKernelMatchesTheReference) {
  const std::vector<Problem> problems = {
      {{1, 2, 37, 16}, {1, 2, 53, 16}, false, false, 0.0f},
      {{2, 4, 40, 32}, {2, 2, 40, 32}, true, true, 0.0f},
      {{19, 8}, {23, 8}, false, false, 0.2f},
      {{2, 4, 5, 16}, {2, 2, 90, 16}, true, true, 0.0f},  // a decode step: 5 new queries
  };
  int ran = 0;
  for (const SdpaKernelInfo& kernel : sdpa_kernels()) {
    if (!kernel.runs_on_this_cpu) {
      std::printf("[ SKIPPED  ] kernel %s on this CPU: %s\n", kernel.name.c_str(), kernel.reason_if_not.c_str());
      continue;
    }
    for (DType dtype : kernel.dtypes) {
    // The inputs rounded to the dtype for both; the tolerance is a few units of its last place.
    const double tol = dtype == DType::kBFloat16 ? 3e-2 : dtype == DType::kFloat16 ? 4e-3 : 2e-5;
    for (size_t n = 0; n < problems.size(); ++n) {
      const Problem& pr = problems[n];
      manual_seed(200 + n);
      const Tensor q = randn(Shape(pr.q)).to(dtype), k = randn(Shape(pr.kv)).to(dtype),
                   v = randn(Shape(pr.kv)).to(dtype), dout = randn(Shape(pr.q)).to(dtype);
      SdpaOptions o;
      o.is_causal = pr.causal;
      o.enable_gqa = pr.gqa;
      o.need_lse = true;
      if (pr.philox_dropout > 0.0f) {
        o.dropout_p = pr.philox_dropout;
        o.dropout_rng = DropoutRng::kPhilox;
        o.dropout_seed = 7;
      }
      if (pr.causal && pr.q[2] < pr.kv[2]) o.causal_alignment = CausalAlignment::kBottomRight;
      SdpaOptions ref = o;
      ref.backend = SdpaBackend::kReference;
      SdpaOptions forced = o;
      forced.kernel = kernel.name;
      if (test::decode_refuses(kernel.name, q, k, v, forced)) continue;
      ASSERT_EQ(sdpa_kernel_name(q, k, v, forced), kernel.name);
      const SdpaResult r = scaled_dot_product_attention(q, k, v, ref);
      const SdpaResult f = scaled_dot_product_attention(q, k, v, forced);
      const std::vector<float> a = f.output.to_vector(), b = r.output.to_vector();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_NEAR(a[i], b[i], tol) << kernel.name << " " << dtype_name(dtype) << " problem " << n << " output " << i;
      }
      const SdpaGrads gr = scaled_dot_product_attention_backward(dout, q, k, v, r, ref);
      const SdpaGrads gf = scaled_dot_product_attention_backward(dout, q, k, v, f, forced);
      const std::vector<float> dq = gf.grad_query.to_vector(), dq_ref = gr.grad_query.to_vector();
      const std::vector<float> dk = gf.grad_key.to_vector(), dk_ref = gr.grad_key.to_vector();
      for (size_t i = 0; i < dq.size(); ++i) ASSERT_NEAR(dq[i], dq_ref[i], 5 * tol) << kernel.name << " dQ " << i;
      for (size_t i = 0; i < dk.size(); ++i) ASSERT_NEAR(dk[i], dk_ref[i], 5 * tol) << kernel.name << " dK " << i;
    }
    }
    ++ran;
  }
  EXPECT_GE(ran, 2) << "the reference and the generic build run everywhere";
}

// ---- choice and refusals ------------------------------------------------------------------------

TEST(SdpaRegistry, AutoPicksTheBestKernelThisCpuRuns) {
  manual_seed(1);
  const Tensor q = randn({1, 2, 40, 8});          // prefill: the flash kernels
  const Tensor step = randn({1, 2, 16, 8});       // a decode step: the decode kernels
  auto best = [](const std::string& prefix) {
    for (const SdpaKernelInfo& k : sdpa_kernels()) {  // highest priority first
      const bool f32 = std::find(k.dtypes.begin(), k.dtypes.end(), DType::kFloat32) != k.dtypes.end();
      if (k.name.starts_with(prefix) && k.runs_on_this_cpu && k.auto_declines.empty() && f32) return k.name;
    }
    return std::string();
  };
  const std::string best_fused = best("cpu.flash."), best_decode = best("cpu.decode.");
  const CpuFeatures& f = cpu::cpu_features();
  if (f.has(cpu::kAvx512f | cpu::kAvx512vl | cpu::kAvx512dq | cpu::kFma)) {
    EXPECT_EQ(best_fused, "cpu.flash.avx512");
    // The bf16 build where the CPU has AVX512-BF16 and its dot unit pays (kAuto's choice).
    const bool bf16 = f.has(cpu::kAvx512bw | cpu::kAvx512Bf16) &&
                      cpu::unit_rates().bf16_dot_speedup() >= 0.9;
    EXPECT_EQ(best_decode, bf16 ? "cpu.decode.avx512_bf16" : "cpu.decode.avx512");
  }
  SdpaOptions o;
  EXPECT_EQ(sdpa_kernel_name(q, q, q, o), best_fused);
  EXPECT_EQ(sdpa_kernel_name(step, q, q, o), best_decode);
  o.need_weights = true;  // the decode kernels leave the weights to the flash ones
  EXPECT_EQ(sdpa_kernel_name(step, q, q, o), best_fused);
  o.need_weights = false;
  o.backend = SdpaBackend::kFused;
  EXPECT_EQ(sdpa_kernel_name(q, q, q, o), best_fused);
  EXPECT_EQ(sdpa_kernel_name(step, q, q, o), best_decode);
  o.backend = SdpaBackend::kReference;
  EXPECT_EQ(sdpa_kernel_name(q, q, q, o), "reference");
  // PyTorch's dropout stream: only the reference reproduces it, so kAuto falls back to it.
  o.backend = SdpaBackend::kAuto;
  o.dropout_p = 0.5f;
  EXPECT_EQ(sdpa_kernel_name(q, q, q, o), "reference");
}

TEST(SdpaRegistry, UnknownKernelNameListsTheRegisteredOnes) {
  manual_seed(2);
  const Tensor q = randn({1, 2, 8, 8});
  SdpaOptions o;
  o.kernel = "cpu.flash.avx1024";
  const std::string msg = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_TRUE(contains(msg, "unknown kernel 'cpu.flash.avx1024'")) << msg;
  for (const SdpaKernelInfo& k : sdpa_kernels()) EXPECT_TRUE(contains(msg, k.name)) << msg;
  EXPECT_FALSE(value_error_of([&] { sdpa_kernel_name(q, q, q, o); }).empty());
}

TEST(SdpaRegistry, ForcedFusedKernelWithTorchDropoutNamesTheReason) {
  manual_seed(3);
  const Tensor q = randn({1, 2, 8, 8});
  SdpaOptions o;
  o.dropout_p = 0.3f;  // DropoutRng::kTorch by default
  o.kernel = "cpu.flash.generic";
  const std::string msg = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_TRUE(contains(msg, "kernel 'cpu.flash.generic' cannot take this problem")) << msg;
  EXPECT_TRUE(contains(msg, "DropoutRng::kTorch")) << msg;
  EXPECT_TRUE(contains(msg, "reference-only")) << msg;
  // The backward makes the same choice and refuses the same way.
  SdpaOptions fo;
  fo.dropout_p = 0.3f;
  fo.need_lse = true;
  fo.need_weights = true;
  const SdpaResult fwd = scaled_dot_product_attention(q, q, q, fo);
  const std::string bmsg = value_error_of([&] { scaled_dot_product_attention_backward(q, q, q, q, fwd, o); });
  EXPECT_TRUE(contains(bmsg, "scaled_dot_product_attention_backward: kernel 'cpu.flash.generic'")) << bmsg;
  // kFused keeps the message it has always had.
  o.kernel.clear();
  o.backend = SdpaBackend::kFused;
  const std::string legacy = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_TRUE(contains(legacy, "backend kFused does not support dropout with DropoutRng::kTorch")) << legacy;
}

TEST(SdpaRegistry, KernelOfAnotherFamilyThanTheBackendIsRefused) {
  manual_seed(4);
  const Tensor q = randn({1, 2, 8, 8});
  SdpaOptions o;
  o.backend = SdpaBackend::kReference;
  o.kernel = "cpu.flash.generic";
  const std::string msg = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_TRUE(contains(msg, "kernel 'cpu.flash.generic' is a fused kernel")) << msg;
  o.backend = SdpaBackend::kAuto;
  EXPECT_EQ(sdpa_kernel_name(q, q, q, o), "cpu.flash.generic");
}

TEST(SdpaRegistry, KernelsThisCpuCannotRunAreRefusedWithTheMissingFeatures) {
  manual_seed(5);
  const Tensor q = randn({1, 1, 8, 8});
  int refused = 0;
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (k.runs_on_this_cpu) continue;
    SdpaOptions o;
    o.kernel = k.name;
    const std::string msg = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
    EXPECT_TRUE(contains(msg, "kernel '" + k.name + "' cannot take this problem: needs CPU features")) << msg;
    ++refused;
  }
  if (refused == 0) GTEST_SKIP() << "this CPU runs every registered kernel (" << cpu_description() << ")";
}

TEST(SdpaRegistry, RefusedCallChangesNothing) {
  manual_seed(6);
  const Tensor q = randn({1, 2, 8, 8});
  Generator gen(123), fresh(123);
  SdpaOptions o;
  o.dropout_p = 0.5f;
  o.generator = &gen;
  o.kernel = "cpu.flash.generic";
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, o), ValueError);
  o.kernel = "nope";
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, o), ValueError);
  // No dropout draw happened: the generator is where a fresh one with the same seed is.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(gen.random(), fresh.random());
  // The inputs are untouched, and the same call with the reference runs as if nothing happened.
  const std::vector<float> before = q.to_vector();
  o.kernel = "reference";
  Generator gen2(123);
  o.generator = &gen2;
  const SdpaResult a = scaled_dot_product_attention(q, q, q, o);
  Generator gen3(123);
  o.generator = &gen3;
  o.kernel.clear();
  const SdpaResult b = scaled_dot_product_attention(q, q, q, o);
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
  EXPECT_EQ(q.to_vector(), before);
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

using cpu::CpuFeatures;
bool has_part(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The per-CPU choice for bfloat16: kAuto takes the native AVX512-BF16 kernel only where the
// measured vdpbf16ps rate is at least 0.9x the FMA rate; otherwise the widened AVX-512 float32
// kernel, and sdpa_kernels() says why. Forcing the native kernel by name works either way.
TEST(SdpaRegistry, Bf16ChoiceFollowsTheMeasuredUnitRates) {
  const CpuFeatures& f = cpu::cpu_features();
  const cpu::UnitRates& rates = cpu::unit_rates();
  std::printf("unit rates: FMA %.1f GFLOP/s, BF16 dot %.1f GFLOP/s (%.2fx)\n", rates.fma_gflops,
              rates.bf16_dot_gflops, rates.bf16_dot_speedup());
  if (!f.has(cpu::kAvx512f | cpu::kAvx512vl | cpu::kAvx512dq | cpu::kAvx512bw | cpu::kAvx512Bf16 | cpu::kFma)) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16 (" << f.describe() << ")";
  }
  EXPECT_GT(rates.fma_gflops, 0.0);
  EXPECT_GT(rates.bf16_dot_gflops, 0.0);
  const Tensor q = Tensor::ones({1, 2, 32, 16}, DType::kBFloat16);  // past the decode kernels' 16
  const bool native = rates.bf16_dot_speedup() >= 0.9;
  const bool amx = f.has(cpu::kAmxTile | cpu::kAmxBf16);  // the tiles outrank both, always
  EXPECT_EQ(sdpa_kernel_name(q, q, q, {}),
            amx ? "cpu.flash.amx_bf16" : native ? "cpu.flash.avx512_bf16" : "cpu.flash.avx512");
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (k.name != "cpu.flash.avx512_bf16") {
      EXPECT_TRUE(k.auto_declines.empty()) << k.name;
      continue;
    }
    EXPECT_EQ(k.auto_declines.empty(), native) << k.auto_declines;
    if (!native) EXPECT_TRUE(has_part(k.auto_declines, "FMA rate")) << k.auto_declines;
  }
  SdpaOptions forced;
  forced.kernel = "cpu.flash.avx512_bf16";
  EXPECT_EQ(sdpa_kernel_name(q, q, q, forced), "cpu.flash.avx512_bf16");
}

}  // namespace
}  // namespace attn

// ---- float32_matmul_precision ---------------------------------------------------------------------

namespace attn {
namespace {

bool amx_runs_here() {
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (k.name == "cpu.flash.amx_bf16") return k.runs_on_this_cpu;
  }
  return false;
}

// Restores the process-wide level whatever a test does to it.
struct PrecisionGuard {
  Float32MatmulPrecision saved = get_float32_matmul_precision();
  ~PrecisionGuard() { set_float32_matmul_precision(saved); }
};

// "high" and "medium" are permissions, as in PyTorch: the AMX kernel takes float32 under them
// where the CPU has it; elsewhere, and always at "highest", the float32 kernels run.
TEST(SdpaFloat32Precision, HighAndMediumRunOnTheTilesWhereTheCpuHasThem) {
  manual_seed(11);
  const Tensor q = randn({1, 2, 40, 16});
  const std::string highest = sdpa_kernel_name(q, q, q, {});
  EXPECT_NE(highest, "cpu.flash.amx_bf16");
  for (Float32MatmulPrecision p : {Float32MatmulPrecision::kHigh, Float32MatmulPrecision::kMedium}) {
    SdpaOptions o;
    o.float32_matmul_precision = p;
    EXPECT_EQ(sdpa_kernel_name(q, q, q, o), amx_runs_here() ? "cpu.flash.amx_bf16" : highest)
        << float32_matmul_precision_name(p);
    o.need_weights = true;  // the tiles' kernel leaves the weights to the float32 kernels
    EXPECT_EQ(sdpa_kernel_name(q, q, q, o), highest);
  }
  for (const SdpaKernelInfo& k : sdpa_kernels()) EXPECT_EQ(k.reduced_float32, k.name == "cpu.flash.amx_bf16") << k.name;
}

TEST(SdpaFloat32Precision, ForcingTheTilesAtHighestSaysWhy) {
  const Tensor q = Tensor::ones({1, 1, 8, 16});
  SdpaOptions o;
  o.kernel = "cpu.flash.amx_bf16";
  const std::string msg = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  if (amx_runs_here()) {
    EXPECT_TRUE(contains(msg, "dtype float32 at float32_matmul_precision 'highest' not supported")) << msg;
    EXPECT_TRUE(contains(msg, "float32 at float32_matmul_precision 'high' or 'medium'")) << msg;
  } else {
    EXPECT_TRUE(contains(msg, "needs CPU features")) << msg;
  }
  o.kernel = "cpu.flash.avx512_bf16";  // takes no float32 at any level: says so without the level
  o.float32_matmul_precision = Float32MatmulPrecision::kHigh;
  const std::string bf16 = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_FALSE(contains(bf16, "float32_matmul_precision")) << bf16;
}

// The process-wide level (torch.set_float32_matmul_precision) applies where the call's option is
// kDefault; the call's own level wins otherwise; bad values are ValueErrors that change nothing.
TEST(SdpaFloat32Precision, ProcessWideLevelAndItsErrors) {
  PrecisionGuard guard;
  const Tensor q = Tensor::ones({1, 1, 8, 16});
  EXPECT_EQ(detail::check_sdpa(q, q, q, {}).f32_precision, Float32MatmulPrecision::kHighest);
  set_float32_matmul_precision("high");
  EXPECT_EQ(get_float32_matmul_precision(), Float32MatmulPrecision::kHigh);
  EXPECT_EQ(detail::check_sdpa(q, q, q, {}).f32_precision, Float32MatmulPrecision::kHigh);
  SdpaOptions o;
  o.float32_matmul_precision = Float32MatmulPrecision::kHighest;
  EXPECT_EQ(detail::check_sdpa(q, q, q, o).f32_precision, Float32MatmulPrecision::kHighest);
  set_float32_matmul_precision("medium");
  EXPECT_EQ(detail::check_sdpa(q, q, q, {}).f32_precision, Float32MatmulPrecision::kMedium);

  const std::string msg = value_error_of([] { set_float32_matmul_precision("bf16"); });
  EXPECT_TRUE(contains(msg, "'highest', 'high' or 'medium', got 'bf16'")) << msg;
  EXPECT_EQ(get_float32_matmul_precision(), Float32MatmulPrecision::kMedium);
  set_float32_matmul_precision(Float32MatmulPrecision::kDefault);  // back to the default level
  EXPECT_EQ(get_float32_matmul_precision(), Float32MatmulPrecision::kHighest);

  o.float32_matmul_precision = static_cast<Float32MatmulPrecision>(9);
  const std::string bad = value_error_of([&] { scaled_dot_product_attention(q, q, q, o); });
  EXPECT_TRUE(contains(bad, "float32_matmul_precision must be")) << bad;
  EXPECT_TRUE(contains(bad, "got 9")) << bad;
}

// Values split into several bf16 terms (fp16, float32 "high") multiply an infinite element's
// zero terms too: Inf * 0 = NaN where float32 gives +-Inf, so NaN/Inf in q or k send such calls
// to the float32 kernel; one-term modes (bf16, "medium") differ only for V, as before.
TEST(SdpaFloat32Precision, SplitTermsLeaveInfiniteQueriesAndKeysToFloat32) {
  const Tensor ones = Tensor::ones({1, 1, 4, 16});
  Tensor inf_q = Tensor::ones({1, 1, 4, 16});
  inf_q.data()[5] = -std::numeric_limits<float>::infinity();
  Tensor nan_v = Tensor::ones({1, 1, 4, 16});
  nan_v.data()[7] = std::numeric_limits<float>::quiet_NaN();
  auto takes = [](const Tensor& q, const Tensor& k, const Tensor& v, DType dtype, Float32MatmulPrecision level) {
    SdpaOptions o;
    o.float32_matmul_precision = level;
    const Tensor qd = q.to(dtype), kd = k.to(dtype), vd = v.to(dtype);
    return detail::tiles_take_values(qd, kd, vd, detail::check_sdpa(qd, kd, vd, o));
  };
  using P = Float32MatmulPrecision;
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (P level : {P::kHigh, P::kMedium}) {
      EXPECT_TRUE(takes(ones, ones, ones, d, level)) << dtype_name(d);
      EXPECT_FALSE(takes(ones, ones, nan_v, d, level)) << dtype_name(d);
    }
  }
  EXPECT_FALSE(takes(inf_q, ones, ones, DType::kFloat32, P::kHigh));
  EXPECT_FALSE(takes(ones, inf_q, ones, DType::kFloat32, P::kHigh));
  EXPECT_FALSE(takes(inf_q, ones, ones, DType::kFloat16, P::kHighest));
  EXPECT_TRUE(takes(inf_q, ones, ones, DType::kFloat32, P::kMedium));
  EXPECT_TRUE(takes(inf_q, inf_q, ones, DType::kBFloat16, P::kHighest));
}

// At "high" the result of kAuto's choice (the tiles where present) keeps float32's accuracy, and
// its backward (the float32 kernels') works from that forward.
TEST(SdpaFloat32Precision, HighKeepsFloat32Accuracy) {
  manual_seed(12);
  const Tensor q = randn({1, 2, 70, 64}), k = randn({1, 2, 90, 64}), v = randn({1, 2, 90, 64});
  SdpaOptions ref;
  ref.backend = SdpaBackend::kReference;
  ref.need_lse = true;
  const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q, k, v, ref);
  const double ref_err = test::max_abs_err(scaled_dot_product_attention(q, k, v, ref).output, truth.output);
  SdpaOptions o;
  o.float32_matmul_precision = Float32MatmulPrecision::kHigh;
  o.need_lse = true;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  EXPECT_LE(test::max_abs_err(f.output, truth.output), 2.0 * ref_err + 1e-6) << sdpa_kernel_name(q, k, v, o);
  const Tensor dout = randn({1, 2, 70, 64});
  const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
  const SdpaGrads g_ref = scaled_dot_product_attention_backward(dout, q, k, v, scaled_dot_product_attention(q, k, v, ref), ref);
  const std::vector<float> dq = g.grad_query.to_vector(), dq_ref = g_ref.grad_query.to_vector();
  ASSERT_EQ(dq.size(), dq_ref.size());
  for (size_t i = 0; i < dq.size(); ++i) ASSERT_NEAR(dq[i], dq_ref[i], 1e-4) << "dQ element " << i;
}

}  // namespace
}  // namespace attn

// The gradient of an additive attn_mask (SdpaOptions::need_attn_mask_grad): every backend's
// against the float64 truth (2x the float32 reference's error, FlashAttention's rule), the truth
// against central differences of the float64 forward, the broadcast sum against the full-shape
// gradient summed by hand, dtypes, determinism and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

using test::max_abs_err;

// A mask case: inputs (B, Hq, L, E) / (B, Hkv, S, E), an additive mask of shape `mask`, and the
// variants it is combined with.
struct MaskCase {
  int64_t B, Hq, Hkv, L, S, E;
  Shape mask;
  float dropout = 0.0f;
  double softcap = 0.0;
  bool window = false;
  bool sinks = false;
};

std::string describe(const MaskCase& c) {
  return "B" + std::to_string(c.B) + " Hq" + std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) + " L" +
         std::to_string(c.L) + " S" + std::to_string(c.S) + " E" + std::to_string(c.E) + " mask " + c.mask.str() +
         " p" + std::to_string(c.dropout) + " softcap " + std::to_string(c.softcap) + (c.window ? " window" : "") +
         (c.sinks ? " sinks" : "");
}

void PrintTo(const MaskCase& c, std::ostream* os) { *os << describe(c); }

struct Problem {
  Tensor q, k, v, mask, dout, sinks;
  SdpaOptions options;
};

Problem make_problem(const MaskCase& c, uint64_t seed) {
  manual_seed(seed);
  Problem pr;
  pr.q = randn({c.B, c.Hq, c.L, c.E});
  pr.k = randn({c.B, c.Hkv, c.S, c.E});
  pr.v = randn({c.B, c.Hkv, c.S, c.E});
  pr.dout = randn({c.B, c.Hq, c.L, c.E});
  pr.mask = randn(c.mask);
  // Some hidden keys: their gradient is exactly 0 (P = 0 there).
  for (int64_t i = 0; i < pr.mask.numel(); i += 7) pr.mask.data()[i] = -INFINITY;
  SdpaOptions& o = pr.options;
  o.attn_mask = AttnMask::additive(pr.mask);
  o.enable_gqa = c.Hq != c.Hkv;
  o.need_lse = true;
  o.need_attn_mask_grad = true;
  if (c.dropout > 0.0f) {
    o.dropout_p = c.dropout;
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 99 + seed;
  }
  if (c.softcap > 0.0) o.softcap = c.softcap;
  if (c.window) o.window_size = {5, 3};
  if (c.sinks) {
    pr.sinks = randn({c.Hq});
    o.sinks = TensorView(pr.sinks);
  }
  return pr;
}

std::vector<MaskCase> cases() {
  return {
      {2, 3, 3, 17, 23, 8, {2, 3, 17, 23}},           // one mask per (batch, head)
      {2, 3, 3, 17, 23, 8, {17, 23}},                 // shared by every (batch, head)
      {2, 3, 3, 17, 23, 8, {1, 3, 17, 23}},           // per head (T5's relative bias)
      {2, 3, 3, 17, 23, 8, {2, 1, 17, 23}},           // per batch element
      {2, 3, 3, 17, 23, 8, {2, 1, 1, 23}},            // key padding, as a float bias
      {2, 3, 3, 17, 23, 8, {3, 17, 1}},               // per query: softmax ignores it, gradient ~0
      {1, 4, 2, 70, 90, 16, {1, 4, 70, 90}, 0.2f},    // GQA with Philox dropout
      {1, 2, 2, 33, 41, 24, {2, 33, 41}, 0.0f, 7.5},  // softcap: the mask adds after tanh
      {1, 2, 2, 40, 40, 16, {40, 40}, 0.0f, 0.0, true, true},  // window and sinks
      {1, 2, 1, 150, 650, 16, {1, 1, 150, 650}},      // keys split into ranges (flash_bwd_split.hpp)
  };
}

class MaskGrad : public testing::TestWithParam<MaskCase> {};

TEST_P(MaskGrad, EveryKernelWithinTwiceTheReferenceErrorOfTheFloat64Truth) {
  const MaskCase& c = GetParam();
  const Problem pr = make_problem(c, 5);
  SdpaOptions ref = pr.options;
  ref.backend = SdpaBackend::kReference;
  const SdpaResult rf = scaled_dot_product_attention(pr.q, pr.k, pr.v, ref);
  const SdpaGrads r = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, rf, ref);
  const reference::SdpaGradsF64 truth =
      reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.q, pr.k, pr.v, ref);
  ASSERT_EQ(r.grad_attn_mask.shape(), c.mask) << describe(c);
  ASSERT_EQ(truth.grad_attn_mask.size(), static_cast<size_t>(c.mask.numel()));
  double scale = 1.0;
  for (double x : truth.grad_attn_mask) scale = std::max(scale, std::fabs(x));
  const double ref_err = max_abs_err(r.grad_attn_mask, truth.grad_attn_mask);
  ASSERT_TRUE(std::isfinite(ref_err)) << describe(c);
  // Hidden keys (a -inf bias) get exactly 0.
  const std::vector<float> rg = r.grad_attn_mask.to_vector();
  if (c.mask.numel() == c.B * c.Hq * c.L * c.S) {
    for (int64_t i = 0; i < c.mask.numel(); i += 7) EXPECT_EQ(rg[static_cast<size_t>(i)], 0.0f) << describe(c);
  }
  for (const std::string& kernel : test::runnable_fused_kernels()) {
    SdpaOptions fused = pr.options;
    fused.kernel = kernel;
    if (test::decode_refuses(kernel, pr.q, pr.k, pr.v, fused)) continue;
    const SdpaResult ff = scaled_dot_product_attention(pr.q, pr.k, pr.v, fused);
    const SdpaGrads f = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, ff, fused);
    ASSERT_EQ(f.grad_attn_mask.shape(), c.mask) << describe(c) << " " << kernel;
    EXPECT_EQ(f.grad_attn_mask.dtype(), DType::kFloat32);
    EXPECT_LE(max_abs_err(f.grad_attn_mask, truth.grad_attn_mask), 2.0 * ref_err + 1e-6 * scale)
        << describe(c) << " kernel " << kernel << " (reference error " << ref_err << ")";
    // The query/key/value gradients do not change when the mask's is asked for.
    SdpaOptions plain = fused;
    plain.need_attn_mask_grad = false;
    const SdpaGrads g = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, ff, plain);
    EXPECT_FALSE(g.grad_attn_mask.defined());
    EXPECT_EQ(g.grad_query.to_vector(), f.grad_query.to_vector()) << describe(c) << " " << kernel;
    EXPECT_EQ(g.grad_key.to_vector(), f.grad_key.to_vector()) << describe(c) << " " << kernel;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MaskGrad, testing::ValuesIn(cases()));

// loss = sum(dout * out) of the float64 forward; d loss / d mask by central differences against
// the float64 backward (float64 mask and inputs: the perturbation is not rounded away).
TEST(MaskGradTruth, Float64BackwardMatchesCentralDifferences) {
  for (const MaskCase& c : {MaskCase{1, 2, 2, 5, 7, 4, {2, 5, 7}, 0.0f, 3.0},
                            MaskCase{2, 2, 1, 4, 6, 4, {2, 1, 1, 6}}}) {
    Problem pr = make_problem(c, 11);
    Tensor mask = pr.mask.to(DType::kFloat64);
    pr.options.attn_mask = AttnMask::additive(mask);
    const reference::SdpaGradsF64 g =
        reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.q, pr.k, pr.v, pr.options);
    const std::vector<float> dout = pr.dout.to_vector();
    auto loss = [&]() {
      const reference::SdpaResultF64 r = reference::scaled_dot_product_attention_f64(pr.q, pr.k, pr.v, pr.options);
      double s = 0;
      for (size_t i = 0; i < r.output.size(); ++i) s += r.output[i] * dout[i];
      return s;
    };
    double* m = mask.data_as<double>();
    for (int64_t i = 0; i < mask.numel(); ++i) {
      if (std::isinf(m[i])) {
        EXPECT_EQ(g.grad_attn_mask[static_cast<size_t>(i)], 0.0);
        continue;
      }
      const double h = 1e-5, x = m[i];
      m[i] = x + h;
      const double up = loss();
      m[i] = x - h;
      const double down = loss();
      m[i] = x;
      EXPECT_NEAR(g.grad_attn_mask[static_cast<size_t>(i)], (up - down) / (2 * h), 1e-7) << describe(c) << " element " << i;
    }
  }
}

// A broadcast mask's gradient is the full-shape gradient summed over the broadcast dims: the same
// dS per score (the kernel sees the same values), summed in buffer order in float64.
TEST(MaskGradBroadcast, SumOfTheFullShapeGradient) {
  const MaskCase c{2, 3, 3, 19, 29, 8, {3, 1, 29}};
  const Problem pr = make_problem(c, 3);
  const Tensor full = pr.mask.expand({2, 3, 19, 29}).contiguous();
  for (const char* kernel : {"reference", ""}) {
    SdpaOptions o = pr.options;
    o.kernel = kernel;
    const SdpaResult f = scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
    const SdpaGrads gb = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o);
    o.attn_mask = AttnMask::additive(full);
    const SdpaGrads gf = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o);
    ASSERT_EQ(gf.grad_attn_mask.shape(), Shape({2, 3, 19, 29}));
    std::vector<double> sum(3 * 29, 0.0);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t i = 0; i < 19; ++i) {
          for (int64_t j = 0; j < 29; ++j) sum[static_cast<size_t>(h * 29 + j)] += gf.grad_attn_mask.at({b, h, i, j});
        }
      }
    }
    const std::vector<float> got = gb.grad_attn_mask.to_vector();
    for (size_t e = 0; e < sum.size(); ++e) EXPECT_EQ(got[e], static_cast<float>(sum[e])) << kernel << " element " << e;
  }
}

// The same bits for any thread count and run to run, keys split into ranges or not.
TEST(MaskGradDeterminism, SameBitsForOneTwoAndThreeThreads) {
  for (const MaskCase& c : {cases()[2], cases().back()}) {
    const Problem pr = make_problem(c, 8);
    SdpaOptions o = pr.options;
    o.backend = SdpaBackend::kFused;
    const SdpaResult f = scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
    o.num_threads = 1;
    const std::vector<float> first = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o).grad_attn_mask.to_vector();
    for (int n : {2, 3, 2}) {
      o.num_threads = n;
      EXPECT_EQ(first, scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o).grad_attn_mask.to_vector())
          << describe(c) << " threads " << n;
    }
    // bf16 on every kernel that takes it (the native backward where it runs).
    const Tensor q16 = pr.q.to(DType::kBFloat16), k16 = pr.k.to(DType::kBFloat16), v16 = pr.v.to(DType::kBFloat16);
    const Tensor d16 = pr.dout.to(DType::kBFloat16);
    for (const std::string& kernel : test::runnable_kernels_for(DType::kBFloat16)) {
      SdpaOptions b = pr.options;
      b.kernel = kernel;
      if (test::decode_refuses(kernel, q16, k16, v16, b)) continue;
      const SdpaResult fb = scaled_dot_product_attention(q16, k16, v16, b);
      b.num_threads = 1;
      const std::vector<float> one = scaled_dot_product_attention_backward(d16, q16, k16, v16, fb, b).grad_attn_mask.to_vector();
      b.num_threads = 2;
      EXPECT_EQ(one, scaled_dot_product_attention_backward(d16, q16, k16, v16, fb, b).grad_attn_mask.to_vector())
          << describe(c) << " bf16 kernel " << kernel;
    }
  }
}

// The gradient has the mask's dtype: bf16 inputs with a bf16 mask (every kernel that takes bf16,
// cpu.flash.avx512_bf16 forced by name running its native backward where the CPU has the unit),
// a float64 mask on float32 inputs, and float64 throughout (the float64 path).
TEST(MaskGradDtypes, Bf16InputsAndMaskOnEveryBf16Kernel) {
  for (const MaskCase& c : {MaskCase{1, 2, 2, 24, 40, 32, {1, 2, 24, 40}},
                            MaskCase{2, 4, 2, 70, 90, 16, {2, 1, 70, 90}, 0.2f},  // GQA, dropout, broadcast
                            MaskCase{1, 2, 1, 150, 650, 16, {1, 1, 150, 650}}}) {  // key ranges
    const Problem pr = make_problem(c, 4);
    const reference::SdpaGradsF64 truth =
        reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.q, pr.k, pr.v, pr.options);
    double scale = 0;
    for (double x : truth.grad_attn_mask) scale = std::max(scale, std::fabs(x));
    const Tensor q16 = pr.q.to(DType::kBFloat16), k16 = pr.k.to(DType::kBFloat16), v16 = pr.v.to(DType::kBFloat16);
    const Tensor d16 = pr.dout.to(DType::kBFloat16), m16 = pr.mask.to(DType::kBFloat16);
    // The truth of the bf16 values widened: what float32 work rounded to bf16 once approaches.
    const Tensor q32 = q16.to(DType::kFloat32), k32 = k16.to(DType::kFloat32), v32 = v16.to(DType::kFloat32);
    const Tensor m32 = m16.to(DType::kFloat32);
    SdpaOptions t = pr.options;
    t.attn_mask = AttnMask::additive(m32);
    const reference::SdpaGradsF64 t16 =
        reference::scaled_dot_product_attention_backward_f64(d16.to(DType::kFloat32), q32, k32, v32, t);
    std::vector<std::string> kernels = test::runnable_kernels_for(DType::kBFloat16);
    kernels.push_back("");
    for (const std::string& kernel : kernels) {
      SdpaOptions o = pr.options;
      o.kernel = kernel;
      o.attn_mask = AttnMask::additive(m16);
      if (test::decode_refuses(kernel, q16, k16, v16, o)) continue;
      const SdpaResult f = scaled_dot_product_attention(q16, k16, v16, o);
      const SdpaGrads g = scaled_dot_product_attention_backward(d16, q16, k16, v16, f, o);
      ASSERT_EQ(g.grad_attn_mask.dtype(), DType::kBFloat16) << kernel;
      ASSERT_EQ(g.grad_attn_mask.shape(), c.mask);
      const std::vector<float> got = g.grad_attn_mask.to(DType::kFloat32).to_vector();
      for (size_t e = 0; e < got.size(); ++e) {
        EXPECT_NEAR(got[e], t16.grad_attn_mask[e], std::fabs(t16.grad_attn_mask[e]) / 128 + 1e-5 * scale)
            << describe(c) << " kernel " << kernel << " element " << e;
      }
      // Rounded once, however it is stored: the bf16 mask's gradient (written as bf16 by the
      // native kernel where the mask has an element per score) has the bits of the same values'
      // float32 mask's gradient rounded to bf16 afterwards.
      SdpaOptions o32 = o;
      o32.attn_mask = AttnMask::additive(m32);
      const SdpaResult f32 = scaled_dot_product_attention(q16, k16, v16, o32);
      const SdpaGrads g32 = scaled_dot_product_attention_backward(d16, q16, k16, v16, f32, o32);
      ASSERT_EQ(g32.grad_attn_mask.dtype(), DType::kFloat32);
      const Tensor rounded = g32.grad_attn_mask.to(DType::kBFloat16);
      EXPECT_EQ(std::memcmp(rounded.raw_data(), g.grad_attn_mask.raw_data(), static_cast<size_t>(rounded.numel()) * 2), 0)
          << describe(c) << " kernel " << kernel;
    }
  }
}

// A float64 mask on float32 inputs, and float64 throughout (the float64 path).
TEST(MaskGradDtypes, Float64MaskAndFloat64Inputs) {
  const MaskCase c{1, 2, 2, 24, 40, 32, {1, 2, 24, 40}};
  const Problem pr = make_problem(c, 4);
  const reference::SdpaGradsF64 truth =
      reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.q, pr.k, pr.v, pr.options);
  double scale = 0;
  for (double x : truth.grad_attn_mask) scale = std::max(scale, std::fabs(x));
  SdpaOptions o = pr.options;
  const Tensor m64 = pr.mask.to(DType::kFloat64);
  o.attn_mask = AttnMask::additive(m64);
  const SdpaResult f = scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
  const SdpaGrads g = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o);
  EXPECT_EQ(g.grad_attn_mask.dtype(), DType::kFloat64);
  EXPECT_LE(max_abs_err(g.grad_attn_mask.to(DType::kFloat32), truth.grad_attn_mask), 1e-5 * scale);

  const Tensor q64 = pr.q.to(DType::kFloat64), k64 = pr.k.to(DType::kFloat64), v64 = pr.v.to(DType::kFloat64);
  const Tensor d64 = pr.dout.to(DType::kFloat64);
  const SdpaResult f64 = scaled_dot_product_attention(q64, k64, v64, o);
  const SdpaGrads g64 = scaled_dot_product_attention_backward(d64, q64, k64, v64, f64, o);
  ASSERT_EQ(g64.grad_attn_mask.dtype(), DType::kFloat64);
  const double* gd = g64.grad_attn_mask.data_as<double>();
  for (size_t e = 0; e < truth.grad_attn_mask.size(); ++e) EXPECT_NEAR(gd[e], truth.grad_attn_mask[e], 1e-12 * scale);
}

// A NaN value at a key the bias hides from every query (a -inf column) reaches no gradient: the
// mask's gradient equals that of the same problem with the value finite (docs/NUMERICS.md).
TEST(MaskGradNumerics, NanValueAtAHiddenKeyDoesNotLeak) {
  const MaskCase c{1, 2, 2, 20, 30, 16, {1, 2, 20, 30}};
  Problem pr = make_problem(c, 6);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 20; ++i) pr.mask.at({0, h, i, 11}) = -INFINITY;
  }
  const Tensor finite = pr.v.contiguous();
  for (int64_t h = 0; h < 2; ++h) pr.v.at({0, h, 11, 3}) = NAN;
  std::vector<std::string> kernels = test::runnable_fused_kernels();
  kernels.push_back("reference");
  for (const std::string& kernel : kernels) {
    SdpaOptions o = pr.options;
    o.kernel = kernel;
    if (test::decode_refuses(kernel, pr.q, pr.k, pr.v, o)) continue;
    const SdpaResult fn = scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
    const SdpaResult ff = scaled_dot_product_attention(pr.q, pr.k, finite, o);
    const std::vector<float> with_nan = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, fn, o).grad_attn_mask.to_vector();
    const std::vector<float> without = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, finite, ff, o).grad_attn_mask.to_vector();
    for (float x : with_nan) ASSERT_TRUE(std::isfinite(x)) << kernel;
    EXPECT_EQ(with_nan, without) << kernel;
  }
}

TEST(MaskGradErrors, NeedsAnAdditiveMask) {
  const MaskCase c{1, 2, 2, 6, 9, 4, {6, 9}};
  const Problem pr = make_problem(c, 2);
  SdpaOptions o = pr.options;
  const SdpaResult f = scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
  o.attn_mask.reset();
  try {
    (void)scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("need_attn_mask_grad needs an additive attn_mask, got none"), std::string::npos)
        << e.what();
  }
  o.attn_mask = AttnMask::boolean(pr.mask);
  EXPECT_THROW((void)scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, f, o), ValueError);
  EXPECT_THROW((void)reference::scaled_dot_product_attention_backward_f64(pr.dout, pr.q, pr.k, pr.v, o), ValueError);
}

}  // namespace
}  // namespace attn

// SdpaOptions::allow_fp16_bf16_reduction: bf16 attention with FlashAttention's numerics, held to
// FlashAttention's own rule (tests/test_flash_attn.py there): the output and each gradient within
// 2x the error of a bf16 *math* reference against the float64 truth, plus a small floor. The math
// reference is PyTorch's attention computed op by op in bf16, as FlashAttention's attention_ref
// builds it (upcast=False, reorder_ops=True), with autograd's backward through the same ops:
//   ks = bf16(k * scale)   S = bf16(q ks^T)   P = bf16(softmax(S))   O = bf16(P v)
//   dP = bf16(dO v^T)   dV = bf16(P^T dO)   dS = bf16(P (dP - rowsum(P dP)))
//   dQ = bf16(dS ks)    dK = bf16(bf16(dS^T q) * scale)
// each product accumulated exactly and rounded once (a GEMM with float32 accumulation, as near as
// matters here). Under GQA the query heads' dK, dV (each bf16) are summed and rounded once, as the
// backward of repeat_interleave does. attn's default numerics (test_low_precision.cpp) are held to
// the stricter float32-rounded reference; this file tests what the allowance gives up.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

struct RCase {
  int64_t Hq, Hkv, L, S, E, Ev;
  bool causal;
  CausalAlignment align;
};

std::string describe(const RCase& c) {
  return "Hq" + std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) + " L" + std::to_string(c.L) + " S" +
         std::to_string(c.S) + " E" + std::to_string(c.E) + " Ev" + std::to_string(c.Ev) +
         (c.causal ? (c.align == CausalAlignment::kBottomRight ? " causal bottom-right" : " causal top-left") : "");
}

double r16(double x) { return bf16_to_float(float_to_bf16(static_cast<float>(x))); }

using Vec = std::vector<double>;
Vec widen(const Tensor& t) {
  const std::vector<float> f = t.to_vector();
  return Vec(f.begin(), f.end());
}

// The bf16 math reference, batch 1: outputs laid out as the tensors (heads, rows, cols).
struct MathRef {
  Vec o, dq, dk, dv;
};
MathRef math_reference(const RCase& c, const Vec& q, const Vec& k, const Vec& v, const Vec& dout) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
  const int64_t group = c.Hq / c.Hkv, L = c.L, S = c.S, E = c.E, Ev = c.Ev;
  const int64_t shift = c.align == CausalAlignment::kBottomRight ? S - L : 0;
  MathRef m{Vec(c.Hq * L * Ev), Vec(c.Hq * L * E), Vec(c.Hkv * S * E, 0.0), Vec(c.Hkv * S * Ev, 0.0)};
  Vec ks(S * E), p(L * S), dp(L * S), ds(L * S);
  for (int64_t h = 0; h < c.Hq; ++h) {
    const int64_t g = h / group;
    const double* qh = q.data() + h * L * E;
    const double* kh = k.data() + g * S * E;
    const double* vh = v.data() + g * S * Ev;
    const double* doh = dout.data() + h * L * Ev;
    for (int64_t i = 0; i < S * E; ++i) ks[i] = r16(kh[i] * scale);
    for (int64_t i = 0; i < L; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += qh[i * E + e] * ks[j * E + e];
        p[i * S + j] = (c.causal && j > i + shift) ? -std::numeric_limits<double>::infinity() : r16(s);
        mx = std::max(mx, p[i * S + j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < S; ++j) sum += (p[i * S + j] = std::exp(p[i * S + j] - mx));
      for (int64_t j = 0; j < S; ++j) p[i * S + j] = r16(p[i * S + j] / sum);
      for (int64_t e = 0; e < Ev; ++e) {
        double o = 0;
        for (int64_t j = 0; j < S; ++j) o += p[i * S + j] * vh[j * Ev + e];
        m.o[(h * L + i) * Ev + e] = r16(o);
      }
      double pdp = 0;
      for (int64_t j = 0; j < S; ++j) {
        double d = 0;
        for (int64_t e = 0; e < Ev; ++e) d += doh[i * Ev + e] * vh[j * Ev + e];
        dp[i * S + j] = r16(d);
        pdp += p[i * S + j] * dp[i * S + j];
      }
      for (int64_t j = 0; j < S; ++j) ds[i * S + j] = r16(p[i * S + j] * (dp[i * S + j] - pdp));
      for (int64_t e = 0; e < E; ++e) {
        double d = 0;
        for (int64_t j = 0; j < S; ++j) d += ds[i * S + j] * ks[j * E + e];
        m.dq[(h * L + i) * E + e] = r16(d);
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      for (int64_t e = 0; e < E; ++e) {
        double d = 0;
        for (int64_t i = 0; i < L; ++i) d += ds[i * S + j] * qh[i * E + e];
        m.dk[(g * S + j) * E + e] += r16(r16(d) * scale);
      }
      for (int64_t e = 0; e < Ev; ++e) {
        double d = 0;
        for (int64_t i = 0; i < L; ++i) d += p[i * S + j] * doh[i * Ev + e];
        m.dv[(g * S + j) * Ev + e] += r16(d);
      }
    }
  }
  for (double& x : m.dk) x = r16(x);
  for (double& x : m.dv) x = r16(x);
  return m;
}

double max_err(const Vec& a, const std::vector<double>& truth) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - truth[i]));
  return m;
}

std::vector<RCase> reduced_sweep() {
  return {
      {2, 2, 97, 97, 64, 64, false, CausalAlignment::kTopLeft},
      {4, 2, 130, 130, 128, 128, true, CausalAlignment::kTopLeft},
      {2, 1, 70, 300, 64, 64, true, CausalAlignment::kBottomRight},
      {2, 2, 7, 40, 80, 96, false, CausalAlignment::kTopLeft},
      // Few queries per key under GQA: the dS terms of a key cancel (where one term for dK broke
      // the default's stricter rule, flash_bwd_avx512_bf16.cpp).
      {8, 2, 9, 520, 64, 64, true, CausalAlignment::kBottomRight},
      {2, 2, 40, 777, 16, 24, false, CausalAlignment::kTopLeft},  // several key ranges
      {2, 2, 1, 256, 128, 128, false, CausalAlignment::kTopLeft},
  };
}

class ReducedPrecision : public testing::TestWithParam<RCase> {};

// Every kernel that takes bf16 on this CPU, with the allowance and without the output_residual
// (as attn.torch calls it in this mode) and with it.
TEST_P(ReducedPrecision, WithinTwiceTheBf16MathReferenceError) {
  const RCase c = GetParam();
  manual_seed(41);
  const Tensor q = randn({1, c.Hq, c.L, c.E}).to(DType::kBFloat16), k = randn({1, c.Hkv, c.S, c.E}).to(DType::kBFloat16),
               v = randn({1, c.Hkv, c.S, c.Ev}).to(DType::kBFloat16),
               dout = randn({1, c.Hq, c.L, c.Ev}).to(DType::kBFloat16);
  const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32),
               d32 = dout.to(DType::kFloat32);
  SdpaOptions base;
  base.is_causal = c.causal;
  base.causal_alignment = c.align;
  base.enable_gqa = c.Hq != c.Hkv;
  SdpaOptions ref = base;
  ref.backend = SdpaBackend::kReference;
  ref.need_lse = true;
  const reference::SdpaResultF64 fwd = reference::scaled_dot_product_attention_f64(q32, k32, v32, ref);
  const reference::SdpaGradsF64 truth = reference::scaled_dot_product_attention_backward_f64(d32, q32, k32, v32, ref);
  const MathRef m = math_reference(c, widen(q), widen(k), widen(v), widen(dout));
  const double eo = max_err(m.o, fwd.output), eq = max_err(m.dq, truth.grad_query),
               ek = max_err(m.dk, truth.grad_key), ev = max_err(m.dv, truth.grad_value);
  ASSERT_GT(eo, 0.0) << describe(c) << ": the math reference must carry bf16 rounding errors";
  for (const std::string& kernel : test::runnable_kernels_for(DType::kBFloat16)) {
    for (bool residual : {false, true}) {
      SdpaOptions o = base;
      o.kernel = kernel;
      o.need_lse = true;
      o.need_output_residual = residual;
      o.allow_fp16_bf16_reduction = true;
      if (test::decode_refuses(kernel, q, k, v, o)) continue;
      const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
      const std::string what = describe(c) + " kernel " + kernel + (residual ? " with output_residual" : "");
      EXPECT_LE(max_err(widen(f.output), fwd.output), 2.0 * eo + 1e-4) << what << " output";
      SdpaGrads g;
      try {
        g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
      } catch (const ValueError& e) {  // a forward-only kernel: the backward runs on kAuto's
        ASSERT_NE(std::string(e.what()).find("backward"), std::string::npos) << e.what();
        o.kernel.clear();
        g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
      }
      EXPECT_LE(max_err(widen(g.grad_query), truth.grad_query), 2.0 * eq + 1e-4) << what << " dq";
      EXPECT_LE(max_err(widen(g.grad_key), truth.grad_key), 2.0 * ek + 1e-4) << what << " dk";
      EXPECT_LE(max_err(widen(g.grad_value), truth.grad_value), 2.0 * ev + 1e-4) << what << " dv";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, ReducedPrecision, testing::ValuesIn(reduced_sweep()),
                         [](const testing::TestParamInfo<RCase>& info) { return "case" + std::to_string(info.index); });

// The allowance reaches the native bf16 backward: its gradients change (one term, D from the
// bf16 output), and stay deterministic.
TEST(ReducedPrecisionBackward, ChangesTheNativeBf16Gradients) {
  if (test::runnable_kernels_named("cpu.flash.avx512_bf16").empty()) GTEST_SKIP() << "cpu.flash.avx512_bf16 does not run on this CPU (no AVX512-BF16)";
  manual_seed(5);
  const Tensor q = randn({1, 2, 77, 64}).to(DType::kBFloat16), k = randn({1, 2, 90, 64}).to(DType::kBFloat16),
               v = randn({1, 2, 90, 64}).to(DType::kBFloat16), dout = randn({1, 2, 77, 64}).to(DType::kBFloat16);
  SdpaOptions o;
  o.kernel = "cpu.flash.avx512_bf16";
  o.need_lse = true;
  const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
  const SdpaGrads exact = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
  o.allow_fp16_bf16_reduction = true;
  const SdpaGrads a = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
  const SdpaGrads b = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
  EXPECT_NE(a.grad_query.to_vector(), exact.grad_query.to_vector());
  EXPECT_NE(a.grad_key.to_vector(), exact.grad_key.to_vector());
  EXPECT_NE(a.grad_value.to_vector(), exact.grad_value.to_vector());
  EXPECT_EQ(a.grad_query.to_vector(), b.grad_query.to_vector());
  EXPECT_EQ(a.grad_key.to_vector(), b.grad_key.to_vector());
  EXPECT_EQ(a.grad_value.to_vector(), b.grad_value.to_vector());
}

// With the allowance the forward keeps P in one term when it saves output_residual too: the output
// is the call's without the residual, bit for bit, on every kernel that takes bf16 here.
TEST(ReducedPrecisionForward, TheOutputDoesNotDependOnTheResidual) {
  manual_seed(7);
  const Tensor q = randn({1, 2, 50, 64}).to(DType::kBFloat16), k = randn({1, 2, 80, 64}).to(DType::kBFloat16),
               v = randn({1, 2, 80, 64}).to(DType::kBFloat16);
  for (const std::string& kernel : test::runnable_kernels_for(DType::kBFloat16)) {
    SdpaOptions o;
    o.kernel = kernel;
    o.is_causal = true;
    o.allow_fp16_bf16_reduction = true;
    // The decode kernels decline output_residual (and L = 50 besides).
    if (kernel.starts_with("cpu.decode.") || test::decode_refuses(kernel, q, k, v, o)) continue;
    const SdpaResult plain = scaled_dot_product_attention(q, k, v, o);
    o.need_output_residual = true;
    const SdpaResult with = scaled_dot_product_attention(q, k, v, o);
    ASSERT_TRUE(with.output_residual.defined()) << kernel;
    EXPECT_EQ(with.output.to_vector(), plain.output.to_vector()) << kernel;
  }
}

// An allowance, not an order: float32 calls and the kernels that do not use it give the same
// bits with it as without.
TEST(ReducedPrecisionBackward, Float32AndFloat16CallsAreUnchanged) {
  manual_seed(6);
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    const Tensor q = randn({1, 2, 50, 32}).to(dtype), k = randn({1, 2, 60, 32}).to(dtype),
                 v = randn({1, 2, 60, 32}).to(dtype), dout = randn({1, 2, 50, 32}).to(dtype);
    SdpaOptions o;
    o.is_causal = true;
    o.need_lse = true;
    const SdpaResult f = scaled_dot_product_attention(q, k, v, o);
    const SdpaGrads g = scaled_dot_product_attention_backward(dout, q, k, v, f, o);
    o.allow_fp16_bf16_reduction = true;
    const SdpaResult fr = scaled_dot_product_attention(q, k, v, o);
    const SdpaGrads gr = scaled_dot_product_attention_backward(dout, q, k, v, fr, o);
    const std::string what(dtype_name(dtype));
    EXPECT_EQ(fr.output.to_vector(), f.output.to_vector()) << what;
    EXPECT_EQ(gr.grad_query.to_vector(), g.grad_query.to_vector()) << what;
    EXPECT_EQ(gr.grad_key.to_vector(), g.grad_key.to_vector()) << what;
    EXPECT_EQ(gr.grad_value.to_vector(), g.grad_value.to_vector()) << what;
  }
}

}  // namespace
}  // namespace attn

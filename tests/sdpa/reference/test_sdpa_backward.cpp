// scaled_dot_product_attention_backward on the reference path:
//   1. the float64 analytic gradients against central finite differences of the float64
//      forward (the formula is right), for every option the forward has;
//   2. the float32 reference backward against the float64 gradients (the implementation is right);
//   3. bad input.
// The fused backward is held against both in tests/sdpa/cpu/test_flash_bwd.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn {
namespace {

struct GradCase {
  std::string name;
  int64_t H, Hkv, L, S, E, Ev;
  int mask;  // 0 none, 1 causal top-left, 2 causal bottom-right, 3 bool (with a fully masked row),
             // 4 additive, 5 Philox dropout, 6 torch dropout, 7 custom scale
};

// Values on a grid of 2^-6 so that x +- 2^-12 is exact in float32: the finite difference then
// perturbs by exactly h, and its error is h^2 f'''/6 ~ 1e-8 (plus 1e-16 / h of float64 rounding).
Tensor grid_randn(Shape s) {
  Tensor t = randn(s);
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = std::round(t.data()[i] * 64.0f) / 64.0f;
  return t;
}

struct GradSetup {
  Tensor q, k, v, dout, mask;
  SdpaOptions options;
  Generator gen{0};
};

void configure(GradSetup& s, const GradCase& c) {
  s.options.enable_gqa = c.H != c.Hkv;
  s.options.need_lse = true;
  switch (c.mask) {
    case 1: s.options.is_causal = true; break;
    case 2:
      s.options.is_causal = true;
      s.options.causal_alignment = CausalAlignment::kBottomRight;
      break;
    case 3:
      s.mask = rand({c.L, c.S});
      for (int64_t i = 0; i < s.mask.numel(); ++i) s.mask.data()[i] = s.mask.data()[i] > 0.3f ? 1.0f : 0.0f;
      for (int64_t j = 0; j < c.S; ++j) s.mask.at({1, j}) = 0.0f;
      s.options.attn_mask = AttnMask::boolean(s.mask);
      break;
    case 4:
      s.mask = randn({c.H, c.L, c.S});
      s.options.attn_mask = AttnMask::additive(s.mask);
      break;
    case 5:
      s.options.dropout_p = 0.3f;
      s.options.dropout_rng = DropoutRng::kPhilox;
      s.options.dropout_seed = 99;
      break;
    case 6:
      s.options.dropout_p = 0.3f;
      s.gen.manual_seed(5);
      s.options.generator = &s.gen;  // the float64 paths draw from a copy: same mask every call
      break;
    case 7: s.options.scale = 0.7; break;
    default: break;
  }
}

GradSetup make_setup(const GradCase& c) {
  manual_seed(2024);
  GradSetup s;
  s.q = grid_randn({c.H, c.L, c.E});
  s.k = grid_randn({c.Hkv, c.S, c.E});
  s.v = grid_randn({c.Hkv, c.S, c.Ev});
  s.dout = randn({c.H, c.L, c.Ev});
  configure(s, c);
  return s;
}

double loss(const GradSetup& s) {  // sum(out * dout) in float64
  const reference::SdpaResultF64 r = reference::scaled_dot_product_attention_f64(s.q, s.k, s.v, s.options);
  const std::vector<float> d = s.dout.to_vector();
  double l = 0;
  for (size_t i = 0; i < d.size(); ++i) l += r.output[i] * d[i];
  return l;
}

std::vector<GradCase> cases() {
  return {{"plain", 2, 2, 5, 6, 4, 3, 0},          {"causal_top_left", 2, 2, 6, 6, 4, 4, 1},
          {"causal_bottom_right", 1, 1, 3, 7, 5, 2, 2}, {"bool_mask", 2, 2, 4, 5, 3, 3, 3},
          {"additive_mask", 2, 2, 4, 6, 4, 2, 4},  {"gqa", 4, 2, 3, 5, 4, 3, 0},
          {"philox_dropout", 2, 2, 5, 5, 3, 3, 5}, {"torch_dropout", 2, 2, 5, 4, 3, 2, 6},
          {"custom_scale", 2, 1, 4, 4, 6, 3, 7}};
}

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class SdpaBackwardGrad : public testing::TestWithParam<GradCase> {};

TEST_P(SdpaBackwardGrad, Float64GradientsEqualCentralFiniteDifferences) {
  GradSetup s = make_setup(GetParam());
  const reference::SdpaGradsF64 g =
      reference::scaled_dot_product_attention_backward_f64(s.dout, s.q, s.k, s.v, s.options);
  const float h = 1.0f / 4096.0f;
  struct Input { Tensor* t; const std::vector<double>* grad; const char* name; };
  for (Input in : {Input{&s.q, &g.grad_query, "query"}, Input{&s.k, &g.grad_key, "key"},
                   Input{&s.v, &g.grad_value, "value"}}) {
    for (int64_t i = 0; i < in.t->numel(); ++i) {
      float& x = in.t->data()[i];
      const float x0 = x;
      x = x0 + h;
      const double up = loss(s);
      x = x0 - h;
      const double down = loss(s);
      x = x0;
      const double fd = (up - down) / (2.0 * static_cast<double>(h));
      const double an = (*in.grad)[static_cast<size_t>(i)];
      EXPECT_NEAR(an, fd, 1e-6 * std::max(1.0, std::fabs(fd))) << in.name << "[" << i << "]";
    }
  }
}

TEST_P(SdpaBackwardGrad, Float32ReferenceMatchesFloat64) {
  GradSetup s = make_setup(GetParam());
  SdpaOptions o = s.options;
  o.backend = SdpaBackend::kReference;
  o.need_weights = true;  // kTorch dropout needs the forward's weights
  Generator g64 = s.gen;  // the float64 truth draws from the state the forward starts from
  const SdpaResult fwd = scaled_dot_product_attention(s.q, s.k, s.v, o);
  const SdpaGrads g = scaled_dot_product_attention_backward(s.dout, s.q, s.k, s.v, fwd, o);
  SdpaOptions o64 = s.options;
  if (o64.generator != nullptr) o64.generator = &g64;
  const reference::SdpaGradsF64 t =
      reference::scaled_dot_product_attention_backward_f64(s.dout, s.q, s.k, s.v, o64);
  ASSERT_EQ(g.grad_key.shape(), s.k.shape());
  ASSERT_EQ(g.grad_value.shape(), s.v.shape());
  const std::pair<const Tensor*, const std::vector<double>*> pairs[] = {
      {&g.grad_query, &t.grad_query}, {&g.grad_key, &t.grad_key}, {&g.grad_value, &t.grad_value}};
  for (const auto& [got, want] : pairs) {
    const std::vector<float> v = got->to_vector();
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], (*want)[i], 2e-6 * std::max(1.0, std::fabs((*want)[i])));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaBackwardGrad, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<GradCase>& info) { return info.param.name; });

// ---- bad input --------------------------------------------------------------------------------------

struct Small {
  Tensor q = randn({2, 4, 8}), k = randn({2, 5, 8}), v = randn({2, 5, 8}), dout = randn({2, 4, 8});
};

TEST(SdpaBackwardErrors, MissingLseSaysToRunTheForwardWithNeedLse) {
  Small s;
  const SdpaResult fwd = scaled_dot_product_attention(s.q, s.k, s.v);
  try {
    scaled_dot_product_attention_backward(s.dout, s.q, s.k, s.v, fwd);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("need_lse = true"), std::string::npos) << e.what();
  }
}

TEST(SdpaBackwardErrors, GradOutputOfTheWrongShapeIsAShapeError) {
  Small s;
  SdpaOptions o;
  o.need_lse = true;
  const SdpaResult fwd = scaled_dot_product_attention(s.q, s.k, s.v, o);
  const Tensor bad = randn({2, 4, 7});
  try {
    scaled_dot_product_attention_backward(bad, s.q, s.k, s.v, fwd, o);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("grad_output must have shape [2, 4, 8] (the forward's), got [2, 4, 7]"),
              std::string::npos) << e.what();
  }
}

TEST(SdpaBackwardErrors, AForwardOfOtherInputsIsRejected) {
  Small s;
  SdpaOptions o;
  o.need_lse = true;
  const Tensor q_other = randn({2, 3, 8});
  const SdpaResult fwd = scaled_dot_product_attention(q_other, s.k, s.v, o);  // L = 3, not 4
  EXPECT_THROW(scaled_dot_product_attention_backward(s.dout, s.q, s.k, s.v, fwd, o), ShapeError);
}

TEST(SdpaBackwardErrors, TorchDropoutWithoutTheForwardWeightsIsAValueError) {
  Small s;
  SdpaOptions o;
  o.need_lse = true;
  o.dropout_p = 0.2f;
  const SdpaResult fwd = scaled_dot_product_attention(s.q, s.k, s.v, o);
  try {
    scaled_dot_product_attention_backward(s.dout, s.q, s.k, s.v, fwd, o);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("need_weights = true"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace attn

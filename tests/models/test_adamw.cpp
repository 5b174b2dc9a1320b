// AdamW against torch.optim.AdamW (tests/fixtures/gen_adamw.py), gradient clipping against its
// definition, and the learning-rate schedule's shape.
#include <gtest/gtest.h>

#include <cmath>

#include "attn/error.hpp"
#include "attn/optim.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

TEST(AdamW, MatchesTorchOverFiveStepsWithTwoDecayGroupsAndAChangingLr) {
  const test::FixtureFile f = test::load_fixtures("adamw.txt");
  Tensor w = f.at("w/init").tensor(), b = f.at("b/init").tensor();
  Tensor gw(w.shape()), gb(b.shape());
  std::vector<nn::ParameterWithGrad> params{{"w", &w, &gw}, {"b", &b, &gb}};
  optim::AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.98;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  optim::AdamW opt(params, o, [](const nn::ParameterWithGrad& p) { return p.name == "w"; });
  for (int s = 1; s <= 5; ++s) {
    const std::string k = std::to_string(s);
    gw = f.at("w/grad/" + k).tensor();
    gb = f.at("b/grad/" + k).tensor();
    opt.set_lr(f.at("lr/" + k).values[0]);
    opt.step();
    const Tensor ew = f.at("w/step/" + k).tensor(), eb = f.at("b/step/" + k).tensor();
    // float32 arithmetic in a possibly different order (PyTorch's vector kernels): a few ulp.
    for (int64_t i = 0; i < w.numel(); ++i) EXPECT_NEAR(w.data()[i], ew.data()[i], 2e-6) << "w step " << s << " [" << i << "]";
    for (int64_t i = 0; i < b.numel(); ++i) EXPECT_NEAR(b.data()[i], eb.data()[i], 2e-6) << "b step " << s << " [" << i << "]";
  }
  EXPECT_EQ(opt.steps(), 5);
}

TEST(AdamW, StateRoundTripsAndRejectsWrongShapes) {
  Tensor w = Tensor::full({2, 2}, 1.0f), g = Tensor::full({2, 2}, 0.5f);
  optim::AdamW a({{"w", &w, &g}}, {});
  a.step();
  std::vector<std::pair<std::string, Tensor>> saved;
  for (auto& [name, t] : a.state()) saved.emplace_back(name, *t);
  Tensor w2 = Tensor::full({2, 2}, 1.0f), g2 = g;
  optim::AdamW b({{"w", &w2, &g2}}, {});
  b.load_state(1, saved);
  EXPECT_EQ(b.steps(), 1);
  EXPECT_EQ(b.state()[0].second->to_vector(), saved[0].second.to_vector());
  const Tensor good = saved[0].second;
  saved[0].second = Tensor::zeros({3});
  EXPECT_THROW(b.load_state(1, saved), ShapeError);
  saved[0].second = good;
  saved.pop_back();
  EXPECT_THROW(b.load_state(1, saved), ValueError);
}

TEST(ClipGradNorm, ScalesToMaxNormOnlyWhenAbove) {
  Tensor p({4}), g = Tensor::of({4}, {3.0f, 4.0f, 0.0f, 0.0f});
  std::vector<nn::ParameterWithGrad> params{{"p", &p, &g}};
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm(params, 10.0), 5.0);
  EXPECT_FLOAT_EQ(g.data()[0], 3.0f);  // below max_norm: untouched
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm(params, 1.0), 5.0);
  EXPECT_NEAR(g.data()[0], 0.6f, 1e-6);
  EXPECT_NEAR(g.data()[1], 0.8f, 1e-6);
}

TEST(WarmupCosineLr, RisesLinearlyThenDecaysToMin) {
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(0, 10, 110, 1.0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(9, 10, 110, 1.0, 0.1), 1.0);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(10, 10, 110, 1.0, 0.1), 1.0);
  EXPECT_NEAR(optim::warmup_cosine_lr(60, 10, 110, 1.0, 0.1), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine_lr(110, 10, 110, 1.0, 0.1), 0.1);
}

}  // namespace
}  // namespace attn

// format_tensor / format_size against the text PyTorch 1.13 prints (tests/fixtures/print.txt,
// written by tests/fixtures/gen_print.py).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "attn/print.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fixtures() {
  static const test::FixtureFile f = test::load_fixtures("print.txt");
  return f;
}

// The options gen_print.py recorded: precision threshold edgeitems linewidth sci_mode(-1/0/1).
PrintOptions recorded_options(const std::string& name) {
  const auto& v = fixtures().at("opts/" + name).values;
  PrintOptions o;
  o.precision = static_cast<int>(v[0]);
  o.threshold = std::isinf(v[1]) ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(v[1]);
  o.edgeitems = static_cast<int>(v[2]);
  o.linewidth = static_cast<int>(v[3]);
  if (v[4] >= 0) o.sci_mode = v[4] > 0;
  return o;
}

std::string recorded_suffix(const std::string& name) {
  const auto& texts = fixtures().texts;
  auto it = texts.find("suffix/" + name);
  return it == texts.end() ? "" : it->second;
}

// The view_* cases print a view of the stored tensor, built here as in gen_print.py.
TensorView view_for(const std::string& name, const TensorView& t) {
  if (name == "view_transpose") return t.t();
  if (name == "view_slice") return t.slice(0, 1, 5).slice(1, 1, 3);
  if (name == "view_column") return t.select(1, 2);
  return t;
}

TEST(Print, MatchesPyTorchOnEveryFixture) {
  int cases = 0;
  for (const auto& [name, expected] : fixtures().texts) {
    if (name.rfind("suffix/", 0) == 0) continue;
    SCOPED_TRACE(name);
    const Tensor t = fixtures().at(name).tensor();
    EXPECT_EQ(format_tensor(view_for(name, t), recorded_options(name), recorded_suffix(name)),
              expected);
    ++cases;
  }
  EXPECT_GE(cases, 70);
}

// set_printoptions(precision=1, sci_mode=False, profile='short'): the profile is applied first,
// then the explicit arguments override it, so precision is 1 (not the profile's 2).
TEST(Print, ShortProfileWithExplicitPrecision) {
  PrintOptions o;
  o.precision = 1;
  o.edgeitems = 2;
  o.sci_mode = false;
  for (const char* name : {"short_p1", "short_p1_sum"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(format_tensor(fixtures().at(name).tensor(), o), fixtures().text(name));
  }
}

TEST(Print, ChapterTensorsWithDefaultOptions) {
  EXPECT_EQ(format_tensor(fixtures().at("inputs").tensor()), fixtures().text("inputs"));
  EXPECT_EQ(format_tensor(Tensor::scalar(0.9544f)), "tensor(0.9544)");
  EXPECT_EQ(format_tensor(Tensor::scalar(1.0f)), "tensor(1.)");
  EXPECT_EQ(format_tensor(Tensor::scalar(0.99999994f)), "tensor(1.0000)");
  EXPECT_EQ(format_tensor(Tensor::of({2}, {-0.0f, 0.5f})), "tensor([-0.0000, 0.5000])");
  EXPECT_EQ(format_tensor(Tensor::of({3}, {-INFINITY, 0.25f, NAN})),
            "tensor([  -inf, 0.2500,    nan])");
  EXPECT_EQ(format_tensor(Tensor::zeros({0})), "tensor([])");
  EXPECT_EQ(format_tensor(Tensor::zeros({2, 0})), "tensor([], size=(2, 0))");
  EXPECT_EQ(format_tensor(fixtures().at("grad_mul").tensor(), {}, "grad_fn=<MulBackward0>"),
            fixtures().text("grad_mul"));
}

// -x of a NaN sets its sign bit; Python still prints "nan" where fmt alone would print "-nan".
// (The fixture file cannot carry the sign: repr() of every NaN is "nan".)
TEST(Print, NegativeNanPrintsWithoutSign) {
  const float neg_nan = std::copysign(NAN, -1.0f);
  EXPECT_EQ(format_tensor(Tensor::of({2}, {neg_nan, -1.5f})), fixtures().text("neg_nan"));
  EXPECT_EQ(format_tensor(Tensor::scalar(neg_nan)), "tensor(nan)");
  EXPECT_EQ(format_tensor(Tensor::of({2}, {neg_nan, 2.0f})), "tensor([nan, 2.])");
  PrintOptions sci;
  sci.sci_mode = true;
  EXPECT_EQ(format_tensor(Tensor::of({2}, {neg_nan, 2.5f}), sci), "tensor([   nan, 2.5000e+00])");
}

TEST(Print, FormatSize) {
  EXPECT_EQ(format_size(Shape{2, 6, 3}), "torch.Size([2, 6, 3])");
  EXPECT_EQ(format_size(Shape{6}), "torch.Size([6])");
  EXPECT_EQ(format_size(Shape{}), "torch.Size([])");
  EXPECT_EQ(format_size(Shape{0, 3}), "torch.Size([0, 3])");
}

}  // namespace
}  // namespace attn

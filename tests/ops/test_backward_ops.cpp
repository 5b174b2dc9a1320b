// The functional backward functions (functional.hpp) against central finite differences of
// float64 re-implementations of their forwards (tolerance: tests/grad_check.hpp), against
// PyTorch 1.13.1's autograd (tests/fixtures/gen_grads.py), and on bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "fixture.hpp"
#include "grad_check.hpp"

namespace attn {
namespace {

using test::F64;
using test::finite_diff;
using test::grads_close;
using test::to_f64;
using test::weighted_sum;

Tensor randn_scaled(Shape s, float scale) { return mul(randn(s), scale); }

// A dim splits a row-major shape into (outer, n, inner): element (o, j, i) is at
// (o * n + j) * inner + i.
struct Split {
  int64_t outer = 1, n = 1, inner = 1;
};
Split split_at(const Shape& s, int dim) {
  const int d = dim < 0 ? dim + s.ndim() : dim;
  Split r;
  for (int i = 0; i < s.ndim(); ++i) {
    if (i < d) r.outer *= s[i];
    if (i == d) r.n = s[i];
    if (i > d) r.inner *= s[i];
  }
  return r;
}

// ---- float64 forwards -----------------------------------------------------------------------------

// x (rows, in) @ w (out, in)^T + b
F64 linear64(const F64& x, const F64& w, const F64& b, int64_t in, int64_t out) {
  const int64_t rows = static_cast<int64_t>(x.size()) / in;
  F64 y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

// softmax along dim; mask (same size, nonzero = excluded) optional; fully masked slices are 0.
F64 softmax64(const F64& x, const Shape& shape, int dim, const F64& mask = {}) {
  const Split sp = split_at(shape, dim);
  F64 y(x.size(), 0.0);
  for (int64_t o = 0; o < sp.outer; ++o) {
    for (int64_t i = 0; i < sp.inner; ++i) {
      auto at = [&](int64_t j) { return static_cast<size_t>((o * sp.n + j) * sp.inner + i); };
      auto on = [&](int64_t j) { return mask.empty() || mask[at(j)] == 0.0; };
      double mx = -std::numeric_limits<double>::infinity(), s = 0.0;
      for (int64_t j = 0; j < sp.n; ++j) if (on(j)) mx = std::max(mx, x[at(j)]);
      for (int64_t j = 0; j < sp.n; ++j) if (on(j)) s += std::exp(x[at(j)] - mx);
      for (int64_t j = 0; j < sp.n; ++j) y[at(j)] = on(j) ? std::exp(x[at(j)] - mx) / s : 0.0;
    }
  }
  return y;
}

F64 layer_norm64(const F64& x, int64_t c, const F64& w, const F64& b, double eps) {
  F64 y(x.size());
  for (size_t r = 0; r < x.size() / c; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t j = 0; j < c; ++j) mean += x[r * c + j] / c;
    for (int64_t j = 0; j < c; ++j) var += (x[r * c + j] - mean) * (x[r * c + j] - mean) / c;
    for (int64_t j = 0; j < c; ++j) {
      const double v = (x[r * c + j] - mean) / std::sqrt(var + eps);
      y[r * c + j] = w.empty() ? v : v * w[j] + b[j];
    }
  }
  return y;
}

F64 gelu64(const F64& x, bool tanh_form) {
  F64 y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    y[i] = tanh_form ? 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v)))
                     : 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
  }
  return y;
}

double cross_entropy64(const F64& logits, int64_t c, const std::vector<int64_t>& targets) {
  double total = 0.0;
  for (size_t r = 0; r < targets.size(); ++r) {
    double mx = -std::numeric_limits<double>::infinity(), s = 0.0;
    for (int64_t j = 0; j < c; ++j) mx = std::max(mx, logits[r * c + j]);
    for (int64_t j = 0; j < c; ++j) s += std::exp(logits[r * c + j] - mx);
    total += mx + std::log(s) - logits[r * c + targets[r]];
  }
  return total / static_cast<double>(targets.size());
}

// ---- finite differences ---------------------------------------------------------------------------

TEST(GradCheck, DetectsAGradientWrongByOnePerMille) {
  // d/dx sum(x^3 * r) = 3 x^2 r; the check passes the right gradient, fails one 0.1 % off.
  const F64 x{0.5, -1.25, 2.0}, r{1.0, -2.0, 0.75};
  auto loss = [&](const std::vector<F64>& a) {
    double s = 0.0;
    for (size_t i = 0; i < 3; ++i) s += a[0][i] * a[0][i] * a[0][i] * r[i];
    return s;
  };
  const F64 fd = finite_diff(loss, {x}, 0);
  std::vector<float> right, wrong;
  for (size_t i = 0; i < 3; ++i) {
    right.push_back(static_cast<float>(3 * x[i] * x[i] * r[i]));
    wrong.push_back(right.back() * 1.001f);
  }
  EXPECT_TRUE(grads_close("right", right, fd));
  EXPECT_FALSE(grads_close("wrong", wrong, fd));
}

TEST(BackwardFD, LinearInputWeightBiasWithStridedInput) {
  manual_seed(1);
  const Tensor xb = randn({2, 5, 3});
  const TensorView x = xb.transpose(1, 2);  // (2, 3, 5), not contiguous
  const Tensor w = randn({4, 5}), b = randn({4}), r = randn({2, 3, 4});
  const LinearGrads g = linear_backward(r, x, w, true);
  auto loss = [&](const std::vector<F64>& a) { return weighted_sum(linear64(a[0], a[1], a[2], 5, 4), to_f64(r)); };
  const std::vector<F64> args{to_f64(x), to_f64(w), to_f64(b)};
  EXPECT_EQ(g.grad_input.shape(), x.shape());
  EXPECT_TRUE(grads_close("dx", g.grad_input.to_vector(), finite_diff(loss, args, 0)));
  EXPECT_TRUE(grads_close("dW", g.grad_weight.to_vector(), finite_diff(loss, args, 1)));
  EXPECT_TRUE(grads_close("db", g.grad_bias.to_vector(), finite_diff(loss, args, 2)));
  EXPECT_FALSE(linear_backward(r, x, w, false).grad_bias.defined());
}

TEST(BackwardFD, SoftmaxAlongLastAndMiddleDims) {
  manual_seed(2);
  const Shape s{2, 5, 7};
  const Tensor x = randn_scaled(s, 2.0f), r = randn(s);
  for (int dim : {-1, 1, 0}) {
    const Tensor dx = softmax_backward(r, softmax(x, dim), dim);
    auto loss = [&](const std::vector<F64>& a) { return weighted_sum(softmax64(a[0], s, dim), to_f64(r)); };
    EXPECT_TRUE(grads_close("softmax dim " + std::to_string(dim), dx.to_vector(),
                            finite_diff(loss, {to_f64(x)}, 0)));
  }
}

TEST(BackwardFD, MaskedSoftmaxWithAFullyMaskedRow) {
  manual_seed(3);
  const Shape s{2, 4, 5};
  const Tensor x = randn(s), r = randn(s);
  Tensor mask = triu(Tensor::ones({4, 5}), 1);  // broadcast over the batch
  for (int64_t j = 0; j < 5; ++j) mask.at({2, j}) = 1.0f;  // row 2: every key excluded
  const Tensor y = masked_softmax(x, mask, -1);
  for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(y.at({1, 2, j}), 0.0f) << "fully masked row is 0, not NaN";
  const Tensor dx = masked_softmax_backward(r, y, mask, -1);
  const F64 m64 = to_f64(mask.expand(s));
  auto loss = [&](const std::vector<F64>& a) { return weighted_sum(softmax64(a[0], s, -1, m64), to_f64(r)); };
  EXPECT_TRUE(grads_close("masked softmax", dx.to_vector(), finite_diff(loss, {to_f64(x)}, 0)));
  for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(dx.at({0, 2, j}), 0.0f);
}

TEST(BackwardFD, MaskedFillPassesGradientOnlyWhereNotFilled) {
  manual_seed(4);
  const Tensor x = randn({3, 4}), r = randn({3, 4});
  const Tensor mask = Tensor::of({1, 4}, {0, 1, 0, 1});
  const Tensor dx = masked_fill_backward(r, mask);
  auto loss = [&](const std::vector<F64>& a) {
    F64 y = a[0];
    for (size_t i = 0; i < y.size(); ++i) if (i % 4 == 1 || i % 4 == 3) y[i] = 7.0;
    return weighted_sum(y, to_f64(r));
  };
  EXPECT_TRUE(grads_close("masked_fill", dx.to_vector(), finite_diff(loss, {to_f64(x)}, 0)));
}

TEST(BackwardFD, DropoutReplaysTheForwardMask) {
  manual_seed(5);
  const Tensor x = randn({6, 8}), r = randn({6, 8});
  const DropoutResult d = dropout_with_mask(x, 0.4f, true);
  EXPECT_EQ(d.output.to_vector(), [&] { manual_seed(5); randn({6, 8}); randn({6, 8}); return dropout(x, 0.4f).to_vector(); }());
  const Tensor dx = dropout_backward(r, d.keep_mask, d.p);
  const F64 m = to_f64(d.keep_mask);
  auto loss = [&](const std::vector<F64>& a) {
    F64 y(a[0].size());
    for (size_t i = 0; i < y.size(); ++i) y[i] = a[0][i] * m[i] / 0.6;
    return weighted_sum(y, to_f64(r));
  };
  EXPECT_TRUE(grads_close("dropout", dx.to_vector(), finite_diff(loss, {to_f64(x)}, 0)));
  // Not training, p = 0 and p = 1: identity, identity, zeros, in forward and backward alike.
  for (auto [p, training] : {std::pair{0.4f, false}, std::pair{0.0f, true}, std::pair{1.0f, true}}) {
    const DropoutResult e = dropout_with_mask(x, p, training);
    const Tensor de = dropout_backward(r, e.keep_mask, e.p);
    const Tensor want = p == 1.0f && training ? Tensor::zeros({6, 8}) : r;
    EXPECT_EQ(de.to_vector(), want.to_vector()) << "p " << p << " training " << training;
  }
}

TEST(BackwardFD, EmbeddingAddsRowsOfRepeatedIds) {
  manual_seed(6);
  const Tensor w = randn({7, 3});
  const std::vector<int64_t> ids{2, 5, 2, 0, 2, 6};
  const Shape ids_shape{2, 3};
  const Tensor r = randn({2, 3, 3});
  const Tensor dw = embedding_backward(r, ids, ids_shape, 7);
  auto loss = [&](const std::vector<F64>& a) {
    F64 y;
    for (int64_t id : ids) for (int64_t j = 0; j < 3; ++j) y.push_back(a[0][id * 3 + j]);
    return weighted_sum(y, to_f64(r));
  };
  EXPECT_TRUE(grads_close("embedding", dw.to_vector(), finite_diff(loss, {to_f64(w)}, 0)));
}

TEST(BackwardFD, LayerNormInputWeightBiasAndWithoutAffine) {
  manual_seed(7);
  const Tensor x = randn_scaled({3, 4, 6}, 3.0f), w = randn({6}), b = randn({6}), r = randn({3, 4, 6});
  const LayerNormGrads g = layer_norm_backward(r, x, {6}, w, b);
  auto loss = [&](const std::vector<F64>& a) { return weighted_sum(layer_norm64(a[0], 6, a[1], a[2], 1e-5), to_f64(r)); };
  const std::vector<F64> args{to_f64(x), to_f64(w), to_f64(b)};
  EXPECT_TRUE(grads_close("dx", g.grad_input.to_vector(), finite_diff(loss, args, 0)));
  EXPECT_TRUE(grads_close("dweight", g.grad_weight.to_vector(), finite_diff(loss, args, 1)));
  EXPECT_TRUE(grads_close("dbias", g.grad_bias.to_vector(), finite_diff(loss, args, 2)));
  const LayerNormGrads plain = layer_norm_backward(r, x, {6});
  EXPECT_FALSE(plain.grad_weight.defined());
  auto loss_plain = [&](const std::vector<F64>& a) { return weighted_sum(layer_norm64(a[0], 6, {}, {}, 1e-5), to_f64(r)); };
  EXPECT_TRUE(grads_close("dx plain", plain.grad_input.to_vector(), finite_diff(loss_plain, {to_f64(x)}, 0)));
}

TEST(BackwardFD, GeluErfAndTanh) {
  manual_seed(8);
  const Tensor x = randn_scaled({5, 7}, 3.0f), r = randn({5, 7});
  for (const char* approximate : {"none", "tanh"}) {
    const bool t = std::string(approximate) == "tanh";
    const Tensor dx = gelu_backward(r, x, approximate);
    auto loss = [&](const std::vector<F64>& a) { return weighted_sum(gelu64(a[0], t), to_f64(r)); };
    EXPECT_TRUE(grads_close(approximate, dx.to_vector(), finite_diff(loss, {to_f64(x)}, 0)));
  }
}

TEST(BackwardFD, CrossEntropyMeanWithUpstreamGradient) {
  manual_seed(9);
  const Tensor logits = randn_scaled({5, 6}, 2.0f);
  const std::vector<int64_t> targets{0, 5, 2, 2, 3};
  const float upstream = 0.7f;
  const Tensor dl = cross_entropy_backward(Tensor::scalar(upstream), logits, targets);
  auto loss = [&](const std::vector<F64>& a) { return upstream * cross_entropy64(a[0], 6, targets); };
  EXPECT_TRUE(grads_close("cross_entropy", dl.to_vector(), finite_diff(loss, {to_f64(logits)}, 0)));
  EXPECT_NEAR(cross_entropy(logits, targets).item(), cross_entropy64(to_f64(logits), 6, targets), 1e-6);
}

// ---- against PyTorch -----------------------------------------------------------------------------

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("grads.txt");
  return f;
}

// PyTorch computes in float32 too, in other orders: values agree to a few float32 ulps of the
// magnitudes summed, ~1e-6 relative here; 2e-5 leaves room without hiding a wrong formula.
::testing::AssertionResult torch_close(const std::string& name, const TensorView& actual) {
  const test::FixtureTensor& want = fx().at(name);
  if (!(actual.shape() == want.shape)) {
    return ::testing::AssertionFailure() << name << ": shape " << actual.shape().str() << " want " << want.shape.str();
  }
  return grads_close(name, actual.to_vector(), want.values, 2e-5);
}

std::vector<int64_t> ids_of(const std::string& name) {
  std::vector<int64_t> ids;
  for (double v : fx().at(name).values) ids.push_back(static_cast<int64_t>(v));
  return ids;
}

TEST(BackwardVsPyTorch, Linear) {
  manual_seed(100);
  const Tensor x = randn({3, 5, 7}), w = randn({4, 7}), b = randn({4});
  const Tensor out = linear(x, w, b);
  const LinearGrads g = linear_backward(randn(out.shape()), x, w, true);
  EXPECT_TRUE(torch_close("op/linear/out", out));
  EXPECT_TRUE(torch_close("op/linear/grad/x", g.grad_input));
  EXPECT_TRUE(torch_close("op/linear/grad/weight", g.grad_weight));
  EXPECT_TRUE(torch_close("op/linear/grad/bias", g.grad_bias));
}

TEST(BackwardVsPyTorch, SoftmaxAndMaskedSoftmax) {
  manual_seed(101);
  const Tensor x = randn_scaled({3, 5, 6}, 3.0f);
  const Tensor y = softmax(x, 1);
  EXPECT_TRUE(torch_close("op/softmax/out", y));
  EXPECT_TRUE(torch_close("op/softmax/grad/x", softmax_backward(randn(y.shape()), y, 1)));
  manual_seed(102);
  const Tensor xm = randn({2, 6, 6});
  const Tensor mask = triu(Tensor::ones({6, 6}), 1);
  const Tensor ym = masked_softmax(xm, mask, -1);
  EXPECT_TRUE(torch_close("op/masked_softmax/out", ym));
  EXPECT_TRUE(torch_close("op/masked_softmax/grad/x", masked_softmax_backward(randn(ym.shape()), ym, mask, -1)));
}

TEST(BackwardVsPyTorch, DropoutSameMaskSameGradient) {
  manual_seed(103);
  const Tensor x = randn({5, 8});
  manual_seed(104);
  const DropoutResult d = dropout_with_mask(x, 0.3f, true);
  EXPECT_TRUE(torch_close("op/dropout/out", d.output));
  EXPECT_TRUE(torch_close("op/dropout/grad/x", dropout_backward(randn(x.shape()), d.keep_mask, d.p)));
}

TEST(BackwardVsPyTorch, Embedding) {
  manual_seed(105);
  const Tensor w = randn({10, 6});
  const std::vector<int64_t> ids = ids_of("op/embedding/ids");
  const Tensor out = embedding(ids, {3, 4}, w);
  EXPECT_TRUE(torch_close("op/embedding/out", out));
  EXPECT_TRUE(torch_close("op/embedding/grad/weight", embedding_backward(randn(out.shape()), ids, {3, 4}, 10)));
}

TEST(BackwardVsPyTorch, LayerNorm) {
  manual_seed(106);
  const Tensor x = randn({2, 5, 8}), w = randn({8}), b = randn({8});
  const Tensor out = layer_norm(x, {8}, w, b, 1e-5f);
  const LayerNormGrads g = layer_norm_backward(randn(out.shape()), x, {8}, w, b, 1e-5f);
  EXPECT_TRUE(torch_close("op/layer_norm/out", out));
  EXPECT_TRUE(torch_close("op/layer_norm/grad/x", g.grad_input));
  EXPECT_TRUE(torch_close("op/layer_norm/grad/weight", g.grad_weight));
  EXPECT_TRUE(torch_close("op/layer_norm/grad/bias", g.grad_bias));
}

TEST(BackwardVsPyTorch, GeluBothForms) {
  for (const std::string approximate : {"none", "tanh"}) {
    manual_seed(107);
    const Tensor x = randn_scaled({4, 9}, 3.0f);
    const Tensor out = gelu(x, approximate);
    EXPECT_TRUE(torch_close("op/gelu_" + approximate + "/out", out));
    EXPECT_TRUE(torch_close("op/gelu_" + approximate + "/grad/x", gelu_backward(randn(out.shape()), x, approximate)));
  }
}

TEST(BackwardVsPyTorch, CrossEntropy) {
  manual_seed(108);
  const Tensor logits = randn_scaled({7, 11}, 2.0f);
  const std::vector<int64_t> targets = ids_of("op/cross_entropy/targets");
  EXPECT_TRUE(torch_close("op/cross_entropy/out", cross_entropy(logits, targets)));
  EXPECT_TRUE(torch_close("op/cross_entropy/grad/logits",
                          cross_entropy_backward(Tensor::scalar(1.0f), logits, targets)));
}

// ---- bad input -------------------------------------------------------------------------------------

template <typename E, typename Fn>
void expect_error(Fn fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << *parts.begin();
  } catch (const E& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(BackwardErrors, GradientOfTheWrongShapeNamesArgumentExpectedAndActual) {
  const Tensor x = Tensor::ones({2, 3}), w = Tensor::ones({4, 3}), g = Tensor::ones({2, 5});
  expect_error<ShapeError>([&] { linear_backward(g, x, w, true); }, {"grad_out", "[2, 4]", "[2, 5]"});
  expect_error<ShapeError>([&] { softmax_backward(g, x, -1); }, {"grad_out", "[2, 3]", "[2, 5]"});
  expect_error<ShapeError>([&] { dropout_backward(x, g, 0.5f); }, {"keep_mask", "[2, 3]", "[2, 5]"});
  expect_error<ShapeError>([&] { gelu_backward(g, x); }, {"grad_out", "[2, 3]", "[2, 5]"});
  expect_error<ShapeError>([&] { layer_norm_backward(g, x, {3}); }, {"grad_out", "[2, 3]", "[2, 5]"});
  expect_error<ShapeError>([&] { layer_norm(x, {2}); }, {"normalized_shape", "[3]", "[2]"});
  const std::vector<int64_t> ids{0, 1};
  expect_error<ShapeError>([&] { embedding_backward(Tensor::ones({3, 5}), ids, {2}, 4); },
                           {"grad_out", "[2, 5]", "[3, 5]"});
  expect_error<IndexError>([&] { embedding_backward(x, std::vector<int64_t>{0, 4}, {2}, 4); }, {"id 4", "[0, 4)"});
  expect_error<ShapeError>([&] { cross_entropy_backward(Tensor::ones({1}), x, ids); }, {"grad_out", "[]", "[1]"});
}

TEST(BackwardErrors, BadValuesAreRejected) {
  const Tensor x = Tensor::ones({2, 3});
  expect_error<ValueError>([&] { gelu(x, "fast"); }, {"approximate", "'fast'"});
  expect_error<ValueError>([&] { gelu_backward(x, x, "erf"); }, {"approximate", "'erf'"});
  expect_error<IndexError>([&] { cross_entropy(x, std::vector<int64_t>{0, 3}); }, {"target 3", "[0, 3)"});
  expect_error<ShapeError>([&] { cross_entropy(x, std::vector<int64_t>{0}); }, {"N = 2", "got 1"});
  expect_error<ValueError>([&] { dropout_backward(x, x, 1.5f); }, {"[0, 1]", "1.5"});
}

}  // namespace
}  // namespace attn

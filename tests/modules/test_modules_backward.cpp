// Module backward passes: the chapter's attention modules against PyTorch 1.13.1's autograd
// (tests/fixtures/gen_grads.py: loss = sum(out * R), gradients of the input and of every
// parameter, eval and training with dropout), against float64 finite differences, and the
// forward/backward contract (saved context, NoGradGuard, zero_grad, errors).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "fixture.hpp"
#include "grad_check.hpp"

namespace attn {
namespace {

using test::F64;
using test::grads_close;
using test::to_f64;

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("grads.txt");
  return f;
}

Tensor book_inputs() {
  return Tensor::of({6, 3}, {0.43f, 0.15f, 0.89f, 0.55f, 0.87f, 0.66f, 0.57f, 0.85f, 0.64f,
                             0.22f, 0.58f, 0.33f, 0.77f, 0.25f, 0.10f, 0.05f, 0.80f, 0.55f});
}

struct Spec {
  std::map<std::string, std::string> kv;
  explicit Spec(const std::string& line) {
    std::stringstream ss(line);
    std::string item;
    while (ss >> item) kv[item.substr(0, item.find('='))] = item.substr(item.find('=') + 1);
  }
  const std::string& str(const std::string& k) const { return kv.at(k); }
  int64_t i64(const std::string& k) const { return std::stoll(str(k)); }
  Shape shape(const std::string& k) const {
    Shape s;
    std::stringstream ss(str(k));
    std::string d;
    while (std::getline(ss, d, ',')) s.push_back(std::stoll(d));
    return s;
  }
};

// Any of the chapter's modules behind one interface.
struct AnyModule {
  std::unique_ptr<nn::Module> module;
  std::function<Tensor(const TensorView&)> forward, backward;
};

template <typename M>
AnyModule wrap(std::unique_ptr<M> m) {
  M* raw = m.get();
  return {std::move(m), [raw](const TensorView& x) { return raw->forward(x); },
          [raw](const TensorView& g) { return raw->backward(g); }};
}

AnyModule build(const Spec& s) {
  const std::string& kind = s.str("module");
  const int64_t d_in = s.i64("d_in"), d_out = s.i64("d_out");
  const int64_t ctx = s.i64("context_length"), heads = s.i64("num_heads");
  const bool bias = s.i64("qkv_bias") != 0;
  const float p = std::stof(s.str("dropout"));
  if (kind == "SelfAttentionV1") return wrap(std::make_unique<nn::SelfAttentionV1>(d_in, d_out));
  if (kind == "SelfAttentionV2") return wrap(std::make_unique<nn::SelfAttentionV2>(d_in, d_out, bias));
  if (kind == "CausalAttention") return wrap(std::make_unique<nn::CausalAttention>(d_in, d_out, ctx, p, bias));
  if (kind == "MultiHeadAttentionWrapper") {
    return wrap(std::make_unique<nn::MultiHeadAttentionWrapper>(d_in, d_out, ctx, p, heads, bias));
  }
  if (kind == "MultiHeadAttention") {
    return wrap(std::make_unique<nn::MultiHeadAttention>(d_in, d_out, ctx, p, heads, bias));
  }
  throw std::runtime_error("unknown module " + kind);
}

std::vector<float> every_kth(const std::vector<float>& v, int64_t k) {
  std::vector<float> out;
  for (size_t i = 0; i < v.size(); i += static_cast<size_t>(k)) out.push_back(v[i]);
  return out;
}

const char* const kCases[] = {
    "v1_book", "v2_book_bias", "ca_book_drop05", "mhaw_book", "mha_book", "v1_odd", "v2_odd_bias",
    "ca_odd_eval", "ca_odd_train01", "mhaw_odd_train05", "mha_odd_h3_eval", "mha_odd_h4_train01",
    "mha_odd_train_p1", "mha_headdim1_train01", "mha_big_train01",
};

class ModuleBackwardVsPyTorch : public ::testing::TestWithParam<const char*> {};

// Both sides are float32 with different summation orders, so they agree only to rounding
// amplified by the softmax's conditioning. Measured scaled errors (|a - e| / (1 + |e|)): <= 2e-7
// for the nn.Linear modules, up to 1.7e-5 for v1_odd, whose torch.rand weights give scores of
// O(10) and near one-hot softmax rows. The FD tolerance 1e-4 (grad_check.hpp) covers that with
// 6x margin, while a dropped term, a wrong dropout mask or a missing scale errs by O(1e-1).
TEST_P(ModuleBackwardVsPyTorch, InputAndParameterGradientsOfWeightedSum) {
  const std::string n = GetParam();
  const Spec spec(fx().text(n + "/spec"));
  const int64_t k = spec.i64("sample");
  manual_seed(static_cast<uint64_t>(spec.i64("seed")));
  AnyModule m = build(spec);
  m.module->train(spec.str("mode") == "train");
  manual_seed(static_cast<uint64_t>(spec.i64("input_seed")));
  Tensor x;
  if (spec.str("input") == "book") {
    x = book_inputs();
  } else if (spec.str("input") == "book_batch") {
    const Tensor b = book_inputs();
    const TensorView both[2] = {b, b};
    x = stack(both, 0);
  } else {
    x = randn(spec.shape("shape"));
  }
  const Tensor r = randn(spec.shape("out_shape"));
  if (spec.str("fwd_seed") != "none") manual_seed(static_cast<uint64_t>(spec.i64("fwd_seed")));
  const Tensor out = m.forward(x);
  const Tensor dx = m.backward(r);
  const Tensor after = rand({3});

  auto check = [&](const std::string& name, const TensorView& t) {
    const test::FixtureTensor& want = fx().at(n + "/" + name);
    if (k <= 1) EXPECT_EQ(t.shape().str(), want.shape.str()) << name;
    EXPECT_TRUE(grads_close(n + " " + name, every_kth(t.to_vector(), k), want.values));
  };
  check("out", out);
  check("grad/x", dx);
  const std::vector<nn::ParameterWithGrad> params = m.module->parameters_with_grads();
  EXPECT_FALSE(params.empty());
  for (const nn::ParameterWithGrad& p : params) check("grad/" + p.name, *p.grad);
  const std::vector<double>& want_after = fx().at(n + "/after").values;
  EXPECT_EQ(after.to_vector(), std::vector<float>(want_after.begin(), want_after.end()))
      << "forward + backward consumed a different number of random draws than PyTorch";
}

INSTANTIATE_TEST_SUITE_P(Module, ModuleBackwardVsPyTorch, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

TEST(ModuleBackwardFixtures, EveryFixtureCaseIsTested) {
  std::set<std::string> in_file, listed(std::begin(kCases), std::end(kCases));
  for (const auto& [name, text] : fx().texts) {
    if (name.size() > 5 && name.ends_with("/spec")) in_file.insert(name.substr(0, name.size() - 5));
  }
  EXPECT_EQ(in_file, listed);
  EXPECT_NE(fx().header.find("torch 1.13"), std::string::npos) << fx().header;
}

}  // namespace
}  // namespace attn

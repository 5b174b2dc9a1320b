// Module backward beyond the PyTorch fixtures: attention modules against float64 finite
// differences (tolerance: tests/grad_check.hpp), gradient bookkeeping (named_grads, zero_grad,
// accumulation) and the forward/backward contract (saved context, NoGradGuard, errors).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "grad_check.hpp"

namespace attn {
namespace {

using test::F64;
using test::finite_diff;
using test::grads_close;
using test::to_f64;
using test::weighted_sum;

// ---- float64 attention modules -------------------------------------------------------------------

// x (rows, in) @ W where W is (in, out) (transposed = false) or (out, in) (nn.Linear, true).
F64 project64(const F64& x, const F64& w, const F64& b, int64_t in, int64_t out, bool linear) {
  const size_t rows = x.size() / in;
  F64 y(rows * out);
  for (size_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * (linear ? w[o * in + i] : w[i * out + o]);
      y[r * out + o] = s;
    }
  }
  return y;
}

// q, k, v (B, T, H * hd), head h in columns [h hd, (h+1) hd); softmax(q k^T / sqrt(hd)) v.
F64 attention64(const F64& q, const F64& k, const F64& v, int64_t B, int64_t T, int64_t H,
                int64_t hd, bool causal) {
  const int64_t w = H * hd;
  F64 out(q.size(), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const int64_t last = causal ? i : T - 1;
        std::vector<double> p(static_cast<size_t>(last + 1));
        double mx = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j <= last; ++j) {
          double s = 0.0;
          for (int64_t e = 0; e < hd; ++e) s += q[(b * T + i) * w + h * hd + e] * k[(b * T + j) * w + h * hd + e];
          p[j] = s / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, p[j]);
        }
        for (double& s : p) sum += (s = std::exp(s - mx));
        for (int64_t j = 0; j <= last; ++j) {
          for (int64_t e = 0; e < hd; ++e) out[(b * T + i) * w + h * hd + e] += p[j] / sum * v[(b * T + j) * w + h * hd + e];
        }
      }
    }
  }
  return out;
}

// Checks dL/dx and dL/d(every parameter) of `module` (eval, no dropout) for L = sum(out * r)
// against finite differences of `forward64(x, params)`.
template <typename M>
void expect_module_matches_fd(M& module, const Tensor& x, const std::function<F64(const std::vector<F64>&)>& forward64) {
  manual_seed(77);
  const Tensor out = module.forward(x);
  const Tensor r = randn(out.shape());
  const Tensor dx = module.backward(r);
  std::vector<F64> args{to_f64(x)};
  for (const auto& p : module.parameters_with_grads()) args.push_back(to_f64(*p.param));
  auto loss = [&](const std::vector<F64>& a) { return weighted_sum(forward64(a), to_f64(r)); };
  EXPECT_TRUE(grads_close("x", dx.to_vector(), finite_diff(loss, args, 0)));
  size_t i = 1;
  for (const auto& p : module.parameters_with_grads()) {
    EXPECT_TRUE(grads_close(p.name, p.grad->to_vector(), finite_diff(loss, args, i++)));
  }
}

TEST(ModuleBackwardFD, SelfAttentionV1) {
  manual_seed(1);
  nn::SelfAttentionV1 m(3, 4);
  const Tensor x = randn({5, 3});
  expect_module_matches_fd(m, x, [](const std::vector<F64>& a) {
    const F64 q = project64(a[0], a[1], {}, 3, 4, false), k = project64(a[0], a[2], {}, 3, 4, false),
              v = project64(a[0], a[3], {}, 3, 4, false);
    return attention64(q, k, v, 1, 5, 1, 4, false);
  });
}

TEST(ModuleBackwardFD, MultiHeadAttentionWithBiases) {
  manual_seed(2);
  nn::MultiHeadAttention m(4, 6, 8, 0.0f, 2, /*qkv_bias=*/true);
  const Tensor x = randn({2, 5, 4});
  expect_module_matches_fd(m, x, [](const std::vector<F64>& a) {
    // a: x, W_query.{weight,bias}, W_key.{weight,bias}, W_value.{weight,bias}, out_proj.{weight,bias}
    const F64 q = project64(a[0], a[1], a[2], 4, 6, true), k = project64(a[0], a[3], a[4], 4, 6, true),
              v = project64(a[0], a[5], a[6], 4, 6, true);
    return project64(attention64(q, k, v, 2, 5, 2, 3, true), a[7], a[8], 6, 6, true);
  });
}

TEST(ModuleBackwardFD, CausalAttentionAndWrapperHeads) {
  manual_seed(3);
  nn::MultiHeadAttentionWrapper m(4, 3, 6, 0.0f, 2);
  const Tensor x = randn({2, 6, 4});
  expect_module_matches_fd(m, x, [](const std::vector<F64>& a) {
    F64 out(2 * 6 * 6);
    for (int h = 0; h < 2; ++h) {
      const F64 q = project64(a[0], a[1 + 3 * h], {}, 4, 3, true), k = project64(a[0], a[2 + 3 * h], {}, 4, 3, true),
                v = project64(a[0], a[3 + 3 * h], {}, 4, 3, true);
      const F64 o = attention64(q, k, v, 2, 6, 1, 3, true);
      for (size_t r = 0; r < 12; ++r) for (int e = 0; e < 3; ++e) out[r * 6 + h * 3 + e] = o[r * 3 + e];
    }
    return out;
  });
}

// ---- gradient bookkeeping -----------------------------------------------------------------------

std::vector<std::string> names(const nn::NamedTensors& t) {
  std::vector<std::string> out;
  for (const auto& [n, p] : t) out.push_back(n);
  return out;
}

void expect_grads_align(nn::Module& m, const std::string& what) {
  EXPECT_EQ(names(m.named_grads()), names(m.named_parameters())) << what;
  for (const auto& p : m.parameters_with_grads()) {
    EXPECT_EQ(p.grad->shape(), p.param->shape()) << what << " " << p.name;
    for (float g : p.grad->to_vector()) ASSERT_EQ(g, 0.0f) << what << " " << p.name << " starts at 0";
  }
}

TEST(ModuleGrads, NamedGradsAlignWithNamedParametersAndStartAtZero) {
  nn::Linear lin(3, 4), lin_nb(3, 4, false);
  nn::Embedding emb(5, 2);
  nn::LayerNorm ln(6), ln_plain(6, 1e-5f, false);
  nn::GELU gelu;
  nn::SelfAttentionV1 v1(3, 2);
  nn::SelfAttentionV2 v2(3, 2, true);
  nn::CausalAttention ca(3, 2, 6, 0.1f);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.1f, 2, true);
  nn::MultiHeadAttention mha(3, 4, 6, 0.1f, 2);
  for (auto [m, what] : std::initializer_list<std::pair<nn::Module*, const char*>>{
           {&lin, "Linear"}, {&lin_nb, "Linear no bias"}, {&emb, "Embedding"}, {&ln, "LayerNorm"},
           {&ln_plain, "LayerNorm no affine"}, {&gelu, "GELU"}, {&v1, "V1"}, {&v2, "V2"}, {&ca, "CA"},
           {&w, "MHAW"}, {&mha, "MHA"}}) {
    expect_grads_align(*m, what);
  }
  EXPECT_EQ(names(ln.named_parameters()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(ln.weight.to_vector(), std::vector<float>(6, 1.0f));  // nn.LayerNorm's init
  EXPECT_EQ(ln.bias.to_vector(), std::vector<float>(6, 0.0f));
  EXPECT_TRUE(ln_plain.named_parameters().empty());
  EXPECT_EQ(names(w.named_grads()).front(), "heads.0.W_query.weight");
  EXPECT_EQ(mha.parameters_with_grads().back().grad, &mha.out_proj.grad_bias);
}

TEST(ModuleGrads, BackwardAccumulatesAndZeroGradClearsRecursively) {
  manual_seed(4);
  nn::MultiHeadAttention mha(5, 4, 6, 0.0f, 2, true);
  const Tensor x = randn({2, 6, 5}), r = randn({2, 6, 4});
  mha.forward(x);
  const Tensor dx1 = mha.backward(r);
  const std::vector<float> once = mha.out_proj.grad_weight.to_vector(), q_once = mha.W_query.grad_weight.to_vector();
  mha.forward(x);
  const Tensor dx2 = mha.backward(r);
  EXPECT_EQ(dx1.to_vector(), dx2.to_vector()) << "dx is returned, not accumulated";
  for (size_t i = 0; i < once.size(); ++i) EXPECT_FLOAT_EQ(mha.out_proj.grad_weight.to_vector()[i], 2 * once[i]);
  for (size_t i = 0; i < q_once.size(); ++i) EXPECT_FLOAT_EQ(mha.W_query.grad_weight.to_vector()[i], 2 * q_once[i]);
  mha.zero_grad();
  for (const auto& p : mha.parameters_with_grads()) {
    for (float g : p.grad->to_vector()) ASSERT_EQ(g, 0.0f) << p.name;
  }
}

TEST(ModuleGrads, LayerModulesEqualTheirFunctionalBackward) {
  manual_seed(5);
  const Tensor x = randn({3, 4, 6}), r = randn({3, 4, 6});
  nn::LayerNorm ln(6);
  ln.weight = randn({6});
  ln.forward(x);
  const LayerNormGrads want = layer_norm_backward(r, x, {6}, ln.weight, ln.bias);
  EXPECT_EQ(ln.backward(r).to_vector(), want.grad_input.to_vector());
  EXPECT_EQ(ln.grad_weight.to_vector(), want.grad_weight.to_vector());
  EXPECT_EQ(ln.grad_bias.to_vector(), want.grad_bias.to_vector());

  nn::GELU gelu("tanh");
  gelu.forward(x);
  EXPECT_EQ(gelu.backward(r).to_vector(), gelu_backward(r, x, "tanh").to_vector());

  nn::Dropout drop(0.5f);
  manual_seed(6);
  const Tensor y = drop.forward(x);
  manual_seed(6);
  const DropoutResult d = dropout_with_mask(x, 0.5f, true);
  EXPECT_EQ(y.to_vector(), d.output.to_vector());
  EXPECT_EQ(drop.backward(r).to_vector(), dropout_backward(r, d.keep_mask, 0.5f).to_vector());

  nn::Embedding emb(5, 6);
  const std::vector<int64_t> ids{4, 0, 4, 1};
  emb.forward(ids, {2, 2});
  emb.backward(r.select(0, 0).view({2, 2, 6}));
  EXPECT_EQ(emb.grad_weight.to_vector(), embedding_backward(r.select(0, 0).view({2, 2, 6}), ids, {2, 2}, 5).to_vector());
}

// ---- the forward/backward contract -----------------------------------------------------------------

template <typename E, typename Fn>
void expect_error(Fn fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << *parts.begin();
  } catch (const E& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(BackwardContract, BackwardWithoutForwardThrowsValueErrorNamingTheModule) {
  const Tensor g = Tensor::ones({2, 6, 4});
  nn::Linear lin(3, 4);
  nn::Dropout drop;
  nn::Embedding emb(5, 4);
  nn::LayerNorm ln(4);
  nn::GELU gelu;
  nn::SelfAttentionV1 v1(3, 4);
  nn::SelfAttentionV2 v2(3, 4);
  nn::CausalAttention ca(3, 4, 6, 0.0f);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.0f, 2);
  nn::MultiHeadAttention mha(3, 4, 6, 0.0f, 2);
  expect_error<ValueError>([&] { lin.backward(g); }, {"Linear.backward", "no saved forward"});
  expect_error<ValueError>([&] { drop.backward(g); }, {"Dropout.backward", "no saved forward"});
  expect_error<ValueError>([&] { emb.backward(g); }, {"Embedding.backward", "no saved forward"});
  expect_error<ValueError>([&] { ln.backward(g); }, {"LayerNorm.backward", "no saved forward"});
  expect_error<ValueError>([&] { gelu.backward(g); }, {"GELU.backward", "no saved forward"});
  expect_error<ValueError>([&] { v1.backward(g); }, {"SelfAttentionV1.backward", "no saved forward"});
  expect_error<ValueError>([&] { v2.backward(g); }, {"SelfAttentionV2.backward", "no saved forward"});
  expect_error<ValueError>([&] { ca.backward(g); }, {"CausalAttention.backward", "no saved forward"});
  expect_error<ValueError>([&] { w.backward(g); }, {"MultiHeadAttentionWrapper.backward", "no saved forward"});
  expect_error<ValueError>([&] { mha.backward(g); }, {"MultiHeadAttention.backward", "no saved forward"});
}

TEST(BackwardContract, SecondBackwardThroughTheSameForwardThrows) {
  manual_seed(7);
  nn::CausalAttention ca(3, 4, 6, 0.5f);
  nn::Linear lin(3, 4);
  const Tensor x = randn({2, 6, 3}), g = randn({2, 6, 4});
  ca.forward(x);
  ca.backward(g);
  expect_error<ValueError>([&] { ca.backward(g); }, {"CausalAttention.backward", "already consumed"});
  lin.forward(x);
  lin.backward(g);
  expect_error<ValueError>([&] { lin.backward(g); }, {"Linear.backward"});
}

TEST(BackwardContract, WrongGradientShapeNamesGradOutputAndKeepsTheContext) {
  manual_seed(8);
  nn::MultiHeadAttention mha(3, 4, 6, 0.0f, 2);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.0f, 2);
  nn::GELU gelu;
  const Tensor x = randn({2, 5, 3});
  mha.forward(x);
  w.forward(x);
  gelu.forward(x);
  expect_error<ShapeError>([&] { mha.backward(Tensor::ones({2, 5, 3})); },
                           {"MultiHeadAttention.backward", "grad_output", "[2, 5, 4]", "[2, 5, 3]"});
  expect_error<ShapeError>([&] { w.backward(Tensor::ones({2, 6, 4})); },
                           {"MultiHeadAttentionWrapper.backward", "grad_output", "[2, 5, 4]", "[2, 6, 4]"});
  expect_error<ShapeError>([&] { gelu.backward(Tensor()); }, {"GELU.backward", "grad_output", "[2, 5, 3]", "undefined"});
  EXPECT_EQ(mha.backward(Tensor::ones({2, 5, 4})).shape(), x.shape()) << "the context survives a bad call";
  EXPECT_EQ(w.backward(Tensor::ones({2, 5, 4})).shape(), x.shape());
}

TEST(BackwardContract, NoGradGuardForwardSavesNothingAndDropsTheOlderContext) {
  manual_seed(9);
  nn::MultiHeadAttention mha(3, 4, 6, 0.0f, 2);
  const Tensor x = randn({1, 4, 3}), g = randn({1, 4, 4});
  const Tensor recorded = mha.forward(x);
  EXPECT_TRUE(is_grad_enabled());
  {
    NoGradGuard outer;
    {
      NoGradGuard inner;
      EXPECT_FALSE(is_grad_enabled());
    }
    EXPECT_FALSE(is_grad_enabled()) << "an inner guard restores the outer mode";
    EXPECT_EQ(mha.forward(x).to_vector(), recorded.to_vector());
    bool other_thread = false;
    std::thread([&] { other_thread = is_grad_enabled(); }).join();
    EXPECT_TRUE(other_thread) << "grad mode is thread-local";
  }
  EXPECT_TRUE(is_grad_enabled());
  expect_error<ValueError>([&] { mha.backward(g); }, {"MultiHeadAttention.backward", "NoGradGuard"});
  expect_error<ValueError>([&] { mha.out_proj.backward(g); }, {"Linear.backward"});
}

TEST(BackwardContract, ConstForwardRecordsNothingAndComputesTheSameBits) {
  manual_seed(10);
  nn::MultiHeadAttention mha(5, 6, 8, 0.3f, 3, true);
  const Tensor x = randn({2, 7, 5});
  for (bool training : {false, true}) {
    mha.train(training);
    manual_seed(11);
    const Tensor recorded = mha.forward(x);
    mha.backward(Tensor::ones(recorded.shape()));
    manual_seed(11);
    const nn::MultiHeadAttention& frozen = mha;
    EXPECT_EQ(frozen.forward(x).to_vector(), recorded.to_vector()) << "training " << training;
    expect_error<ValueError>([&] { mha.backward(Tensor::ones(recorded.shape())); }, {"MultiHeadAttention.backward"});
  }
}

}  // namespace
}  // namespace attn

// The tiny GPT: gradients against float64 finite differences of a float64 re-implementation, the
// KV cache against full recomputation, loss and perplexity against float64, and a short training
// run whose loss falls.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "attn/error.hpp"
#include "attn/gpt.hpp"
#include "attn/gpt_train.hpp"
#include "grad_check.hpp"
#include "models/gpt_fixtures.hpp"

namespace attn {
namespace {

using test::OneThread;
class GPT : public OneThread {};
class KVCache : public OneThread {};
class Training : public OneThread {};

using gpt::GPTConfig;
using gpt::GPTModel;
using Params = std::map<std::string, std::vector<double>>;

Params params_f64(GPTModel& m) {
  Params p;
  for (auto& [name, t] : m.named_parameters()) p[name] = test::to_f64(*t);
  return p;
}

// y (n, out) = x (n, in) W^T (+ b), W (out, in) row-major.
std::vector<double> lin(const std::vector<double>& x, int64_t n, int64_t in, const std::vector<double>& W,
                        int64_t out, const std::vector<double>* b) {
  std::vector<double> y(static_cast<size_t>(n * out));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double s = b != nullptr ? (*b)[static_cast<size_t>(o)] : 0.0;
      for (int64_t k = 0; k < in; ++k) s += x[static_cast<size_t>(i * in + k)] * W[static_cast<size_t>(o * in + k)];
      y[static_cast<size_t>(i * out + o)] = s;
    }
  return y;
}

std::vector<double> ln(const std::vector<double>& x, int64_t n, int64_t C, const std::vector<double>& w,
                       const std::vector<double>& b) {
  std::vector<double> y(x.size());
  for (int64_t i = 0; i < n; ++i) {
    double mu = 0.0, var = 0.0;
    for (int64_t c = 0; c < C; ++c) mu += x[static_cast<size_t>(i * C + c)];
    mu /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) var += std::pow(x[static_cast<size_t>(i * C + c)] - mu, 2);
    const double r = 1.0 / std::sqrt(var / static_cast<double>(C) + 1e-5);
    for (int64_t c = 0; c < C; ++c) {
      y[static_cast<size_t>(i * C + c)] = (x[static_cast<size_t>(i * C + c)] - mu) * r * w[static_cast<size_t>(c)] + b[static_cast<size_t>(c)];
    }
  }
  return y;
}

// The model's mean masked cross-entropy, entirely in float64 from the parameters P.
double loss_f64(const GPTConfig& c, Params P, const std::vector<int64_t>& ids,
                const std::vector<int64_t>& targets, int64_t B, int64_t T) {
  const int64_t C = c.d_model, H = c.n_heads, hd = C / H, n = B * T, V = c.vocab_size;
  std::vector<double> x(static_cast<size_t>(n * C));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < C; ++e) {
      x[static_cast<size_t>(i * C + e)] = P["tok_emb.weight"][static_cast<size_t>(ids[static_cast<size_t>(i)] * C + e)] +
                                          P["pos_emb.weight"][static_cast<size_t>((i % T) * C + e)];
    }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string pre = "blocks." + std::to_string(l) + ".";
    const auto h = ln(x, n, C, P[pre + "norm1.weight"], P[pre + "norm1.bias"]);
    const auto q = lin(h, n, C, P[pre + "att.W_query.weight"], C, nullptr);
    const auto k = lin(h, n, C, P[pre + "att.W_key.weight"], C, nullptr);
    const auto v = lin(h, n, C, P[pre + "att.W_value.weight"], C, nullptr);
    std::vector<double> ctx(x.size(), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < H; ++hh)
        for (int64_t i = 0; i < T; ++i) {
          std::vector<double> s(static_cast<size_t>(i + 1));
          double m = -1e300, z = 0.0;
          for (int64_t j = 0; j <= i; ++j) {
            double d = 0.0;
            for (int64_t e = 0; e < hd; ++e) {
              d += q[static_cast<size_t>((b * T + i) * C + hh * hd + e)] * k[static_cast<size_t>((b * T + j) * C + hh * hd + e)];
            }
            s[static_cast<size_t>(j)] = c.attention == gpt::AttentionKind::kUniform ? 0.0 : d / std::sqrt(static_cast<double>(hd));
            m = std::max(m, s[static_cast<size_t>(j)]);
          }
          for (double& e : s) z += (e = std::exp(e - m));
          for (int64_t j = 0; j <= i; ++j)
            for (int64_t e = 0; e < hd; ++e) {
              ctx[static_cast<size_t>((b * T + i) * C + hh * hd + e)] +=
                  s[static_cast<size_t>(j)] / z * v[static_cast<size_t>((b * T + j) * C + hh * hd + e)];
            }
        }
    const auto a = lin(ctx, n, C, P[pre + "att.out_proj.weight"], C, &P[pre + "att.out_proj.bias"]);
    for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
    const auto h2 = ln(x, n, C, P[pre + "norm2.weight"], P[pre + "norm2.bias"]);
    const int64_t F = c.mlp_ratio * C;
    auto f = lin(h2, n, C, P[pre + "ff.layers.0.weight"], F, &P[pre + "ff.layers.0.bias"]);
    for (double& e : f) e = 0.5 * e * (1.0 + std::erf(e / std::sqrt(2.0)));
    const auto f2 = lin(f, n, F, P[pre + "ff.layers.2.weight"], C, &P[pre + "ff.layers.2.bias"]);
    for (size_t i = 0; i < x.size(); ++i) x[i] += f2[i];
  }
  const auto fin = ln(x, n, C, P["final_norm.weight"], P["final_norm.bias"]);
  const auto logits = lin(fin, n, C, c.tie_weights ? P["tok_emb.weight"] : P["out_head.weight"], V, nullptr);
  double total = 0.0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = targets[static_cast<size_t>(i)];
    if (t < 0) continue;
    double m = -1e300, z = 0.0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, logits[static_cast<size_t>(i * V + j)]);
    for (int64_t j = 0; j < V; ++j) z += std::exp(logits[static_cast<size_t>(i * V + j)] - m);
    total += m + std::log(z) - logits[static_cast<size_t>(i * V + t)];
    ++count;
  }
  return total / static_cast<double>(count);
}

GPTConfig tiny(gpt::AttentionKind kind, bool tied) {
  GPTConfig c;
  c.vocab_size = 7;
  c.context_length = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.mlp_ratio = 2;
  c.tie_weights = tied;
  c.attention = kind;
  return c;
}

void check_gradients(const GPTConfig& c) {
  Generator gen(42);
  GPTModel m(c, gen);
  // Larger embeddings than the 0.02 init, so that every path carries a visible gradient.
  normal_(m.tok_emb.weight, 0.0, 1.0, gen);
  normal_(m.pos_emb.weight, 0.0, 1.0, gen);
  const int64_t B = 2, T = 5;
  const std::vector<int64_t> ids{1, 3, 0, 6, 2, 5, 5, 1, 4, 0};
  const std::vector<int64_t> targets{3, -1, 6, 2, 5, -1, 1, 4, 0, 2};
  m.zero_grad();
  const Tensor logits = m.forward(ids, B, T);
  const double analytic_loss = gpt::masked_cross_entropy(logits, targets).mean();
  m.backward(gpt::masked_cross_entropy_backward(logits, targets));
  Params P = params_f64(m);
  EXPECT_NEAR(analytic_loss, loss_f64(c, P, ids, targets, B, T), 1e-5);
  for (auto& [name, grad] : m.named_grads()) {
    // Every third element keeps the test fast; each parameter is still covered.
    std::vector<float> got;
    test::F64 want;
    const size_t N = P[name].size();
    for (size_t i = 0; i < N; i += 3) {
      Params up = P, down = P;
      up[name][i] += 1e-6;
      down[name][i] -= 1e-6;
      want.push_back((loss_f64(c, up, ids, targets, B, T) - loss_f64(c, down, ids, targets, B, T)) / 2e-6);
      got.push_back(grad->data()[i]);
    }
    EXPECT_TRUE(test::grads_close(name, got, want)) << c.describe();
  }
}

TEST_F(GPT, GradientsMatchFloat64FiniteDifferences) { check_gradients(tiny(gpt::AttentionKind::kSoftmax, false)); }
TEST_F(GPT, GradientsMatchFiniteDifferencesTiedHead) { check_gradients(tiny(gpt::AttentionKind::kSoftmax, true)); }
TEST_F(GPT, GradientsMatchFiniteDifferencesUniformAttention) {
  check_gradients(tiny(gpt::AttentionKind::kUniform, false));
}

TEST_F(GPT, ParameterNamesArePyTorchStyle) {
  Generator gen(1);
  GPTModel m(tiny(gpt::AttentionKind::kSoftmax, false), gen);
  std::vector<std::string> names;
  for (auto& [name, t] : m.state_dict()) names.push_back(name);
  ASSERT_GE(names.size(), 8u);
  EXPECT_EQ(names[0], "tok_emb.weight");
  EXPECT_EQ(names[1], "pos_emb.weight");
  EXPECT_EQ(names[2], "blocks.0.norm1.weight");
  EXPECT_EQ(names[4], "blocks.0.att.mask");
  EXPECT_EQ(names[5], "blocks.0.att.W_query.weight");
  EXPECT_EQ(names.back(), "out_head.weight");
}

// ---- KV cache ------------------------------------------------------------------------------------

using test::decode_config;

void expect_cached_equals_full(const gpt::SamplingOptions& base) {
  Generator gen(3);
  GPTModel m(decode_config(), gen);
  // Sharper weights than the init, so that the logits differ visibly from step to step.
  normal_(m.tok_emb.weight, 0.0, 1.0, gen);
  m.eval();
  const std::vector<int64_t> prompt{3, 14, 15, 9, 2, 6};
  gpt::SamplingOptions o = base;
  o.max_new_tokens = 64;
  std::vector<Tensor> cached, full;
  o.use_cache = true;
  const std::vector<int64_t> a = gpt::generate(m, prompt, o, &cached);
  o.use_cache = false;
  const std::vector<int64_t> b = gpt::generate(m, prompt, o, &full);
  ASSERT_EQ(a.size(), 64u);
  ASSERT_EQ(cached.size(), 64u);
  ASSERT_EQ(full.size(), 64u);
  EXPECT_EQ(a, b);
  double worst = 0.0;
  for (size_t s = 0; s < 64; ++s) {
    for (int64_t j = 0; j < 20; ++j) {
      const double d = std::abs(cached[s].data()[j] - full[s].data()[j]);
      worst = std::max(worst, d);
      EXPECT_LE(d, 1e-5) << "step " << s << " token " << j;
    }
  }
  ::testing::Test::RecordProperty("max_abs_diff", std::to_string(worst));
}

TEST_F(KVCache, GreedyLogitsEqualFullRecomputeForEvery64Steps) { expect_cached_equals_full({}); }

TEST_F(KVCache, SampledLogitsEqualFullRecompute) {
  gpt::SamplingOptions o;
  o.temperature = 0.8f;
  o.top_k = 5;
  o.seed = 11;
  expect_cached_equals_full(o);
}

TEST_F(KVCache, ChunkedPrefillEqualsFullForward) {
  Generator gen(5);
  const GPTModel m(decode_config(), gen);
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < 30; ++t) ids.push_back((t * 7 + 3) % 20);
  const Tensor full = m.forward(ids, 1, 30);
  gpt::KVCache cache(m.config, 1);
  const Tensor first = m.forward_cached(std::span(ids).first(17), 1, 17, cache);
  const Tensor rest = m.forward_cached(std::span(ids).subspan(17), 1, 13, cache);
  EXPECT_EQ(cache.length, 30);
  for (int64_t t = 0; t < 30; ++t)
    for (int64_t j = 0; j < 20; ++j) {
      const float got = t < 17 ? first.at({0, t, j}) : rest.at({0, t - 17, j});
      EXPECT_NEAR(got, full.at({0, t, j}), 1e-5);
    }
  // A full cache refuses another token.
  gpt::KVCache small(m.config, 1);
  std::vector<int64_t> many(80, 1);
  m.forward_cached(many, 1, 80, small);
  const std::vector<int64_t> one{1};
  EXPECT_THROW(m.forward_cached(one, 1, 1, small), ShapeError);
}

// ---- loss and perplexity ---------------------------------------------------------------------------

TEST(Perplexity, IsExpOfMeanCrossEntropyAgainstFloat64) {
  const int64_t N = 40, V = 17;
  Generator gen(9);
  const Tensor logits = mul(randn({N, V}, gen), 3.0f);
  std::vector<int64_t> targets;
  for (int64_t i = 0; i < N; ++i) targets.push_back(i % 5 == 0 ? -1 : (i * 13) % V);
  const gpt::LossStats s = gpt::masked_cross_entropy(logits, targets);
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[static_cast<size_t>(i)] < 0) continue;
    long double z = 0.0L;
    for (int64_t j = 0; j < V; ++j) z += std::exp(static_cast<long double>(logits.at({i, j})));
    sum += static_cast<double>(std::log(z) - logits.at({i, targets[static_cast<size_t>(i)]}));
    ++n;
  }
  EXPECT_EQ(s.count, n);
  EXPECT_NEAR(s.mean(), sum / n, 1e-12);
  EXPECT_NEAR(s.perplexity(), std::exp(sum / n), 1e-10 * std::exp(sum / n));
  // Uniform logits: perplexity is the vocabulary size.
  const gpt::LossStats u = gpt::masked_cross_entropy(Tensor::zeros({3, V}), std::vector<int64_t>{1, 2, 3});
  EXPECT_NEAR(u.perplexity(), static_cast<double>(V), 1e-9);
  EXPECT_THROW(gpt::masked_cross_entropy(logits, std::vector<int64_t>(N, V)), IndexError);
  EXPECT_THROW(gpt::masked_cross_entropy(logits, std::vector<int64_t>(3, 0)), ShapeError);
}

TEST(Perplexity, BackwardMatchesFiniteDifferences) {
  Generator gen(10);
  const Tensor logits = randn({4, 5}, gen);
  const std::vector<int64_t> targets{2, -1, 0, 4};
  const Tensor g = gpt::masked_cross_entropy_backward(logits, targets);
  std::vector<float> got = g.to_vector();
  const test::F64 want = test::finite_diff(
      [&](const std::vector<test::F64>& a) {
        std::vector<float> f(a[0].begin(), a[0].end());
        double s = 0.0;
        for (int64_t i = 0; i < 4; ++i) {
          if (targets[static_cast<size_t>(i)] < 0) continue;
          double z = 0.0;
          for (int64_t j = 0; j < 5; ++j) z += std::exp(a[0][static_cast<size_t>(i * 5 + j)]);
          s += std::log(z) - a[0][static_cast<size_t>(i * 5 + targets[static_cast<size_t>(i)])];
        }
        return s / 3.0;
      },
      {test::to_f64(logits)}, 0);
  EXPECT_TRUE(test::grads_close("dlogits", got, want));
}

// ---- the task and training ------------------------------------------------------------------------

TEST(RecallTask, DefaultIsLookupWithEveryLetterOnceAndDistinctQueries) {
  gpt::RecallTask task;
  ASSERT_EQ(task.kind, gpt::TaskKind::kLookup);
  const int64_t n = task.copy_length, Q = task.num_queries;
  const auto b = task.sample(64, 3, 0, 0);
  ASSERT_EQ(b.T, task.context_length());
  ASSERT_EQ(b.T, n + 2 * Q);
  for (int64_t s = 0; s < b.B; ++s) {
    const int64_t* in = b.inputs.data() + s * b.T;
    const int64_t* tg = b.targets.data() + s * b.T;
    // Every letter exactly once, so the letters alone say nothing about any answer.
    std::vector<int64_t> letters(in, in + n);
    std::sort(letters.begin(), letters.end());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(letters[static_cast<size_t>(i)], i);
    EXPECT_EQ(in[n], task.separator());
    std::vector<int64_t> asked;
    for (int64_t t = 0; t < b.T; ++t) {
      const bool query = t > n && (t - n - 1) % 2 == 0;
      if (!query) {
        EXPECT_EQ(tg[t], -1) << "t " << t;
        continue;
      }
      const int64_t p = in[t] - task.num_keys;  // 'A' + p names position p
      ASSERT_GE(p, 0);
      ASSERT_LT(p, n);
      asked.push_back(p);
      EXPECT_EQ(tg[t], in[p]);
      if (t + 1 < b.T) EXPECT_EQ(in[t + 1], in[p]);  // the answer follows its query
    }
    std::sort(asked.begin(), asked.end());
    EXPECT_EQ(std::adjacent_find(asked.begin(), asked.end()), asked.end()) << "repeated query";
    EXPECT_EQ(static_cast<int64_t>(asked.size()), Q);
  }
  // sources(): each query row points at the position it names.
  const std::vector<int64_t> ids(b.inputs.begin(), b.inputs.begin() + b.T);
  const auto src = task.sources(ids);
  ASSERT_EQ(static_cast<int64_t>(src.size()), Q);
  for (const auto& [t, p] : src) EXPECT_EQ(ids[static_cast<size_t>(t)], task.num_keys + p);
  EXPECT_EQ(task.decode(task.encode("cab|Bc")), "cab|Bc");
  // The queries are distinct positions and the letters distinct: sizes that cannot be are refused.
  gpt::RecallTask bad = task;
  bad.num_queries = n + 1;
  EXPECT_THROW(bad.validate(), ValueError);
  bad = task;
  bad.copy_length = task.num_keys + 1;
  EXPECT_THROW(bad.validate(), ValueError);
  EXPECT_EQ(gpt::RecallTask::kind_from_name("lookup"), gpt::TaskKind::kLookup);
  EXPECT_THROW(gpt::RecallTask::kind_from_name("sort"), ValueError);
}

TEST(RecallTask, CopySequencesRepeatAfterTheSeparator) {
  gpt::RecallTask task;
  task.kind = gpt::TaskKind::kCopy;
  task.copy_length = 5;
  const auto b = task.sample(3, 2, 0, 0);
  ASSERT_EQ(b.T, 10);
  for (int64_t s = 0; s < 3; ++s) {
    const int64_t* in = b.inputs.data() + s * b.T;
    const int64_t* tg = b.targets.data() + s * b.T;
    EXPECT_EQ(in[5], task.separator());
    for (int64_t t = 0; t < 5; ++t) EXPECT_EQ(tg[t], -1);
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(tg[5 + i], in[i]);
    for (int64_t i = 0; i + 1 < 5; ++i) EXPECT_EQ(in[6 + i], in[i]);
  }
  const std::vector<int64_t> ids(b.inputs.begin(), b.inputs.begin() + 10);
  const auto src = task.sources(ids);
  ASSERT_EQ(src.size(), 5u);
  EXPECT_EQ(src[0], (std::pair<int64_t, int64_t>{5, 0}));
  EXPECT_EQ(src[4], (std::pair<int64_t, int64_t>{9, 4}));
}

TEST(RecallTask, SequencesHaveTheAnnouncedStructure) {
  gpt::RecallTask task;
  task.kind = gpt::TaskKind::kRecall;
  const auto b = task.sample(4, 1, 0, 0);
  ASSERT_EQ(b.T, task.context_length());
  for (int64_t s = 0; s < 4; ++s) {
    const int64_t* in = b.inputs.data() + s * b.T;
    const int64_t* tg = b.targets.data() + s * b.T;
    EXPECT_EQ(in[2 * task.num_pairs], task.separator());
    for (int64_t t = 2 * task.num_pairs + 1; t < b.T; t += 2) {
      // The target of a query is the value after the same key in the pairs.
      int64_t want = -2;
      for (int64_t p = 0; p < task.num_pairs; ++p) {
        if (in[2 * p] == in[t]) want = in[2 * p + 1];
      }
      EXPECT_EQ(tg[t], want);
    }
  }
  EXPECT_EQ(task.decode(task.encode("aB c|")), "aBc|");
  EXPECT_THROW(task.encode("a?"), ValueError);
  EXPECT_THROW(task.encode("z"), ValueError);  // only 16 keys: 'a'..'p'
  // Held-out batches come from another stream: different sequences.
  EXPECT_NE(task.sample(4, 1, 1, 0).inputs, b.inputs);
  EXPECT_EQ(task.sample(4, 1, 0, 0).inputs, b.inputs);
}

gpt::TrainConfig small_train() {
  gpt::TrainConfig c;
  c.task.kind = gpt::TaskKind::kCopy;
  c.task.copy_length = 8;
  c.model.vocab_size = c.task.vocab_size();
  c.model.context_length = c.task.context_length();
  c.model.d_model = 32;
  c.model.n_heads = 2;
  c.batch_size = 16;
  c.steps = 40;
  c.warmup_steps = 5;
  c.eval_batches = 2;
  return c;
}

TEST_F(Training, LossFallsInAShortRun) {
  gpt::Trainer t(small_train());
  double first = 0.0, last = 0.0;
  for (int i = 0; i < 40; ++i) {
    const gpt::StepStats s = t.train_step();
    if (i < 5) first += s.loss / 5;
    if (i >= 35) last += s.loss / 5;
  }
  EXPECT_LT(last, first - 0.1) << "first " << first << " last " << last;
  const gpt::LossStats e = t.evaluate(2);
  EXPECT_GT(e.count, 0);
  EXPECT_TRUE(std::isfinite(e.perplexity()));
}

}  // namespace
}  // namespace attn

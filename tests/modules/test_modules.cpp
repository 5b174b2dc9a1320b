// The chapter's attention modules against PyTorch 1.13.1 (fixtures from
// tests/fixtures/gen_modules.py), plus properties that need no fixture.
//
// attn's generator reproduces torch's CPU generator bit for bit, so a module built after
// attn::manual_seed(s) has exactly PyTorch's weights after torch.manual_seed(s); inputs are
// randn drawn from a seed on both sides, and in training mode the dropout masks come from the
// same bernoulli stream. Parameters are therefore compared bit for bit, outputs to ~1e-5.
// Each fixture case carries its own spec record, parsed here, so the C++ and Python sides run
// the same thing by construction.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "fixture.hpp"

namespace attn {

// gtest prints shapes as "[2, 6, 3]" instead of bytes (internal linkage: one per test file).
[[maybe_unused]] static void PrintTo(const Shape& s, std::ostream* os) { *os << s.str(); }

namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("modules.txt");
  return f;
}

// The chapter's six 3-d token embeddings ("Your journey starts with one step").
Tensor book_inputs() {
  return Tensor::of({6, 3}, {0.43f, 0.15f, 0.89f, 0.55f, 0.87f, 0.66f, 0.57f, 0.85f, 0.64f,
                             0.22f, 0.58f, 0.33f, 0.77f, 0.25f, 0.10f, 0.05f, 0.80f, 0.55f});
}

Tensor book_batch() {
  const Tensor x = book_inputs();
  const TensorView both[2] = {x, x};
  return stack(both, 0);
}

// ---- comparison helpers -------------------------------------------------------------------------

std::vector<float> every_kth(const std::vector<float>& v, int64_t k) {
  if (k <= 1) return v;
  std::vector<float> out;
  for (size_t i = 0; i < v.size(); i += static_cast<size_t>(k)) out.push_back(v[i]);
  return out;
}

// Bit-exact equality with the fixture; reports the number of mismatches and the first one.
void expect_bits(const std::string& what, const std::vector<float>& actual,
                 const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size()) << what << ": element count";
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < actual.size(); ++i) {
    const float e = static_cast<float>(expected[i]);
    if (std::bit_cast<uint32_t>(actual[i]) != std::bit_cast<uint32_t>(e)) {
      if (bad++ == 0) first = fmt::format("first at [{}]: got {} want {}", i, actual[i], e);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << actual.size() << " values differ; " << first;
}

// |a - e| <= atol + rtol * |e| everywhere; reports the worst element.
void expect_close(const std::string& what, const std::vector<float>& actual,
                  const std::vector<double>& expected, double atol = 1e-5, double rtol = 1e-5) {
  ASSERT_EQ(actual.size(), expected.size()) << what << ": element count";
  int64_t bad = 0;
  double worst = 0.0;
  size_t worst_i = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (!(err <= atol + rtol * std::abs(expected[i]))) ++bad;
    if (!(err <= worst)) {
      worst = err;
      worst_i = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << actual.size()
                    << " values outside tolerance; worst at [" << worst_i << "]: got "
                    << actual[worst_i] << " want " << expected[worst_i] << " (|err| = " << worst << ")";
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string l;
  while (std::getline(ss, l)) out.push_back(l);
  return out;
}

std::vector<std::string> names(const nn::NamedTensors& t) {
  std::vector<std::string> out;
  for (const auto& [n, p] : t) out.push_back(n);
  return out;
}

// ---- the case spec ------------------------------------------------------------------------------

struct Spec {
  std::map<std::string, std::string> kv;

  explicit Spec(const std::string& line) {
    std::stringstream ss(line);
    std::string item;
    while (ss >> item) {
      const size_t eq = item.find('=');
      if (eq == std::string::npos) throw std::runtime_error("bad spec item " + item);
      kv[item.substr(0, eq)] = item.substr(eq + 1);
    }
  }
  const std::string& str(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error("spec has no key " + k);
    return it->second;
  }
  int64_t i64(const std::string& k) const { return std::stoll(str(k)); }
  float f32(const std::string& k) const { return std::stof(str(k)); }
  bool has_seed(const std::string& k) const { return str(k) != "none"; }
  Shape shape() const {
    Shape s;
    std::stringstream ss(str("shape"));
    std::string d;
    while (std::getline(ss, d, ',')) s.push_back(std::stoll(d));
    return s;
  }
};

// A module of any of the chapter's classes behind one interface.
struct AnyModule {
  std::unique_ptr<nn::Module> module;
  std::function<Tensor(const TensorView&)> forward;
};

template <typename M>
AnyModule wrap(std::unique_ptr<M> m) {
  M* raw = m.get();
  return {std::move(m), [raw](const TensorView& x) { return raw->forward(x); }};
}

AnyModule build(const Spec& s) {
  const std::string& kind = s.str("module");
  const int64_t d_in = s.i64("d_in"), d_out = s.i64("d_out");
  const bool bias = s.i64("qkv_bias") != 0;
  if (kind == "SelfAttentionV1") return wrap(std::make_unique<nn::SelfAttentionV1>(d_in, d_out));
  if (kind == "SelfAttentionV2") {
    return wrap(std::make_unique<nn::SelfAttentionV2>(d_in, d_out, bias));
  }
  const int64_t ctx = s.i64("context_length"), heads = s.i64("num_heads");
  const float p = s.f32("dropout");
  if (kind == "CausalAttention") {
    return wrap(std::make_unique<nn::CausalAttention>(d_in, d_out, ctx, p, bias));
  }
  if (kind == "MultiHeadAttentionWrapper") {
    return wrap(std::make_unique<nn::MultiHeadAttentionWrapper>(d_in, d_out, ctx, p, heads, bias));
  }
  if (kind == "MultiHeadAttention") {
    return wrap(std::make_unique<nn::MultiHeadAttention>(d_in, d_out, ctx, p, heads, bias));
  }
  throw std::runtime_error("unknown module " + kind);
}

// Every case gen_modules.py writes; a case missing from either side fails.
const char* const kCases[] = {
    "v1_book", "v2_book", "v2_book_bias", "ca_book", "ca_book_drop05", "mhaw_book", "mha_book",
    "mha_book_eval_drop05", "v1_odd", "v2_odd", "v2_odd_bias", "ca_odd_eval", "ca_odd_train01",
    "ca_odd_train05_chain", "ca_odd_train_p1", "mhaw_odd_eval", "mhaw_odd_train05", "mha_odd_h3_eval",
    "mha_odd_h4_train01", "mha_odd_h4_train05_chain", "mha_odd_train_p1", "mha_h12_full_context",
    "mha_headdim1_train01", "mha_t1", "mha_big_eval", "mha_big_train01", "ca_big_train05",
};

class ModuleVsPyTorch : public ::testing::TestWithParam<const char*> {};

TEST_P(ModuleVsPyTorch, ParametersNamesOutputAndStreamMatch) {
  const std::string n = GetParam();
  const Spec spec(fx().text(n + "/spec"));
  const int64_t k = spec.i64("sample");

  manual_seed(static_cast<uint64_t>(spec.i64("seed")));
  AnyModule m = build(spec);
  m.module->train(spec.str("mode") == "train");
  EXPECT_EQ(m.module->training(), spec.str("mode") == "train");

  // Names and order: torch's named_parameters(), named_buffers() and state_dict().keys().
  EXPECT_EQ(names(m.module->named_parameters()), lines(fx().text(n + "/named_parameters")));
  EXPECT_EQ(names(m.module->named_buffers()), lines(fx().text(n + "/named_buffers")));
  EXPECT_EQ(names(m.module->state_dict()), lines(fx().text(n + "/state_dict_keys")));

  // Every parameter bit for bit (same generator, same draw order).
  for (const auto& [name, t] : m.module->named_parameters()) {
    const test::FixtureTensor& want = fx().at(n + "/param/" + name);
    if (k <= 1) {
      EXPECT_EQ(t->shape(), want.shape) << name;
    }
    expect_bits(n + " " + name, every_kth(t->to_vector(), k), want.values);
  }

  Tensor x;
  const std::string& input = spec.str("input");
  if (input == "book") {
    x = book_inputs();
  } else if (input == "book_batch") {
    x = book_batch();
  } else {
    if (spec.has_seed("input_seed")) manual_seed(static_cast<uint64_t>(spec.i64("input_seed")));
    x = randn(spec.shape());
  }
  ASSERT_EQ(x.shape(), spec.shape());
  if (spec.has_seed("fwd_seed")) manual_seed(static_cast<uint64_t>(spec.i64("fwd_seed")));
  const Tensor out = m.forward(x);
  const Tensor after = rand({3});

  const test::FixtureTensor& want = fx().at(n + "/out");
  if (k <= 1) {
    EXPECT_EQ(out.shape(), want.shape);
  }
  expect_close(n + " output", every_kth(out.to_vector(), k), want.values);
  // Same number of engine outputs consumed by forward (dropout draws) on both sides.
  expect_bits(n + " rand(3) after forward", after.to_vector(), fx().at(n + "/after").values);
}

INSTANTIATE_TEST_SUITE_P(Module, ModuleVsPyTorch, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

TEST(ModuleFixtures, EveryFixtureCaseIsTested) {
  std::set<std::string> in_file, listed(std::begin(kCases), std::end(kCases));
  for (const auto& [name, text] : fx().texts) {
    const size_t slash = name.rfind("/spec");
    if (slash != std::string::npos && slash + 5 == name.size()) in_file.insert(name.substr(0, slash));
  }
  EXPECT_EQ(in_file, listed);
  EXPECT_NE(fx().header.find("torch 1.13"), std::string::npos) << fx().header;
}

// ---- names, counts, buffers ---------------------------------------------------------------------

TEST(ModuleNames, LinearAndEmbedding) {
  nn::Linear with(4, 3), without(4, 3, false);
  EXPECT_EQ(names(with.named_parameters()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(names(without.named_parameters()), (std::vector<std::string>{"weight"}));
  EXPECT_EQ(names(with.state_dict()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(with.num_parameters(), 4 * 3 + 3);
  nn::Embedding emb(6, 16);
  EXPECT_EQ(names(emb.state_dict()), (std::vector<std::string>{"weight"}));
  EXPECT_EQ(emb.num_parameters(), 96);
}

TEST(ModuleNames, ParameterPointersAliasTheMembers) {
  nn::MultiHeadAttention mha(17, 24, 16, 0.0f, 3, true);
  const nn::NamedTensors p = mha.named_parameters();
  ASSERT_EQ(p.size(), 8u);
  EXPECT_EQ(p[0].second, &mha.W_query.weight);
  EXPECT_EQ(p[1].second, &mha.W_query.bias);
  EXPECT_EQ(p[7].second, &mha.out_proj.bias);
  EXPECT_EQ(mha.state_dict()[0].second, &mha.mask);
  EXPECT_EQ(mha.num_parameters(), 3 * (24 * 17 + 24) + 24 * 24 + 24);
}

TEST(ModuleNames, NumParametersOfWrapperCountsEveryHead) {
  nn::MultiHeadAttentionWrapper w(17, 8, 16, 0.0f, 3);
  EXPECT_EQ(w.num_parameters(), 3 * 3 * 8 * 17);
  EXPECT_EQ(w.named_buffers().size(), 3u);
}

TEST(ModuleBuffers, CausalMaskIsTriuOnesDiagonal1) {
  nn::CausalAttention ca(3, 2, 5, 0.0f);
  nn::MultiHeadAttention mha(3, 4, 5, 0.0f, 2);
  for (const Tensor* m : {&ca.mask, &mha.mask}) {
    ASSERT_EQ(m->shape(), (Shape{5, 5}));
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(m->at({i, j}), j > i ? 1.0f : 0.0f) << i << "," << j;
    }
  }
}

TEST(ModuleConstruction, ExplicitGeneratorEqualsSeededDefault) {
  Generator gen(123);
  nn::MultiHeadAttention a(17, 24, 16, 0.1f, 3, true, gen);
  manual_seed(123);
  nn::MultiHeadAttention b(17, 24, 16, 0.1f, 3, true);
  auto pa = a.state_dict(), pb = b.state_dict();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].second->to_vector(), pb[i].second->to_vector()) << pa[i].first;
  }
}

// ---- train / eval -------------------------------------------------------------------------------

TEST(ModuleTrainEval, DefaultIsTrainingAsInPyTorch) {
  nn::MultiHeadAttention mha(3, 4, 6, 0.5f, 2);
  EXPECT_TRUE(mha.training());
  EXPECT_TRUE(mha.dropout.training());
}

TEST(ModuleTrainEval, PropagatesToWrapperHeadsAndDropouts) {
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.5f, 3);
  w.eval();
  EXPECT_FALSE(w.training());
  for (const auto& h : w.heads) {
    EXPECT_FALSE(h.training());
    EXPECT_FALSE(h.dropout.training());
  }
  w.train();
  EXPECT_TRUE(w.training());
  for (const auto& h : w.heads) {
    EXPECT_TRUE(h.training());
    EXPECT_TRUE(h.dropout.training());
  }
  w.train(false);
  for (const auto& h : w.heads) EXPECT_FALSE(h.dropout.training());
}

TEST(ModuleTrainEval, PropagatesToDropoutOfCausalAndMha) {
  nn::CausalAttention ca(3, 2, 6, 0.5f);
  nn::MultiHeadAttention mha(3, 4, 6, 0.5f, 2);
  ca.eval();
  mha.eval();
  EXPECT_FALSE(ca.dropout.training());
  EXPECT_FALSE(mha.dropout.training());
  ca.train();
  mha.train();
  EXPECT_TRUE(ca.dropout.training());
  EXPECT_TRUE(mha.dropout.training());
}

TEST(ModuleTrainEval, EvalIsDeterministicAndDrawsNothing) {
  manual_seed(1);
  nn::MultiHeadAttention mha(17, 24, 16, 0.5f, 4, true);
  mha.eval();
  const Tensor x = randn({3, 13, 17});
  manual_seed(99);
  const Tensor a = mha.forward(x);
  const Tensor b = mha.forward(x);
  const Tensor next = rand({4});
  manual_seed(99);
  EXPECT_EQ(rand({4}).to_vector(), next.to_vector()) << "eval forward consumed random numbers";
  EXPECT_EQ(a.to_vector(), b.to_vector());
}

TEST(ModuleTrainEval, TrainingDropoutChangesWithTheStreamAndRepeatsWithTheSeed) {
  manual_seed(1);
  nn::MultiHeadAttention mha(17, 24, 16, 0.5f, 4);
  const Tensor x = randn({3, 13, 17});
  manual_seed(5);
  const Tensor a = mha.forward(x);
  const Tensor b = mha.forward(x);  // the stream moved on: another mask
  manual_seed(5);
  const Tensor c = mha.forward(x);
  EXPECT_NE(a.to_vector(), b.to_vector());
  EXPECT_EQ(a.to_vector(), c.to_vector());
  mha.eval();
  const Tensor e1 = mha.forward(x);
  mha.dropout.p = 0.0f;
  mha.train();
  const Tensor e2 = mha.forward(x);  // p = 0 in training: identical to eval
  EXPECT_EQ(e1.to_vector(), e2.to_vector());
}

TEST(ModuleTrainEval, DropoutUsesTheModulesOwnGenerator) {
  manual_seed(1);
  nn::CausalAttention ca(5, 4, 8, 0.5f);
  const Tensor x = randn({2, 8, 5});
  Generator g(77);
  ca.dropout.generator = &g;
  manual_seed(3);
  const Tensor a = ca.forward(x);
  const Tensor after_default = rand({2});
  manual_seed(3);
  EXPECT_EQ(after_default.to_vector(), rand({2}).to_vector()) << "the default generator was used";
  g.manual_seed(77);
  EXPECT_EQ(ca.forward(x).to_vector(), a.to_vector());
}

// ---- properties ---------------------------------------------------------------------------------

// Output rows 0..j-1 must not change when token j (and later) changes.
template <typename M>
void expect_causal(M& m, int64_t d_in, int64_t T, uint64_t dropout_seed, bool with_dropout = false) {
  manual_seed(2024);
  const Tensor x = randn({2, T, d_in});
  manual_seed(dropout_seed);
  const Tensor base = m.forward(x);
  for (int64_t j : {int64_t{0}, T / 2, T - 1}) {
    Tensor y = x;
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = j; t < T; ++t) {
        for (int64_t c = 0; c < d_in; ++c) y.at({b, t, c}) += 3.0f + static_cast<float>(c);
      }
    }
    manual_seed(dropout_seed);
    const Tensor out = m.forward(y);
    ASSERT_EQ(out.shape(), base.shape());
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<float> r0 = base.select(0, b).select(0, t).to_vector();
        const std::vector<float> r1 = out.select(0, b).select(0, t).to_vector();
        if (t < j) {
          EXPECT_EQ(r0, r1) << "row " << t << " changed when token " << j << " was perturbed";
        } else if (t == j && !with_dropout) {  // a dropped-out row 0 would be 0 both times
          EXPECT_NE(r0, r1) << "row " << t << " ignored its own token";
        }
      }
    }
  }
}

TEST(ModuleCausal, CausalAttentionRowsIgnoreLaterTokens) {
  manual_seed(7);
  nn::CausalAttention ca(17, 24, 16, 0.0f, true);
  expect_causal(ca, 17, 13, 0);
  ca.dropout.p = 0.3f;  // with dropout the mask is the same for the same seed
  expect_causal(ca, 17, 13, 11, true);
}

TEST(ModuleCausal, MultiHeadAttentionRowsIgnoreLaterTokens) {
  manual_seed(8);
  nn::MultiHeadAttention mha(17, 24, 16, 0.0f, 4, true);
  mha.eval();
  expect_causal(mha, 17, 16, 0);
}

TEST(ModuleCausal, WrapperRowsIgnoreLaterTokens) {
  manual_seed(9);
  nn::MultiHeadAttentionWrapper w(17, 8, 16, 0.0f, 3);
  expect_causal(w, 17, 11, 0);
}

TEST(ModuleCausal, FirstRowOfCausalAttentionIsItsOwnValue) {
  manual_seed(10);
  nn::CausalAttention ca(5, 4, 8, 0.0f, true);
  const Tensor x = randn({1, 6, 5});
  const Tensor out = ca.forward(x);
  const Tensor v = ca.W_value.forward(x);
  for (int64_t c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out.at({0, 0, c}), v.at({0, 0, c}));
}

TEST(ModuleCausal, SelfAttentionIsNotCausal) {
  manual_seed(11);
  nn::SelfAttentionV2 sa(5, 4);
  Tensor x = randn({6, 5});
  const Tensor a = sa.forward(x);
  x.at({5, 0}) += 1.0f;
  const Tensor b = sa.forward(x);
  EXPECT_NE(a.select(0, 0).to_vector(), b.select(0, 0).to_vector());
}

// ---- inputs -------------------------------------------------------------------------------------

TEST(ModuleInputs, SelfAttentionBatchedEqualsPerSample) {
  manual_seed(12);
  nn::SelfAttentionV1 v1(5, 4);
  nn::SelfAttentionV2 v2(5, 4, true);
  const Tensor x = randn({3, 7, 5});
  const Tensor o1 = v1.forward(x), o2 = v2.forward(x);
  ASSERT_EQ(o1.shape(), (Shape{3, 7, 4}));
  for (int64_t b = 0; b < 3; ++b) {
    const Tensor s1 = v1.forward(x.select(0, b)), s2 = v2.forward(x.select(0, b));
    const auto r1 = o1.select(0, b).to_vector(), r2 = o2.select(0, b).to_vector();
    const auto e1 = s1.to_vector(), e2 = s2.to_vector();
    for (size_t i = 0; i < r1.size(); ++i) {
      EXPECT_NEAR(r1[i], e1[i], 1e-5);
      EXPECT_NEAR(r2[i], e2[i], 1e-5);
    }
  }
}

TEST(ModuleInputs, NonContiguousInputEqualsContiguous) {
  manual_seed(13);
  nn::MultiHeadAttention mha(6, 8, 10, 0.0f, 2, true);
  nn::CausalAttention ca(6, 8, 10, 0.0f);
  const Tensor xt = randn({2, 6, 9});
  const TensorView x = xt.transpose(1, 2);  // (2, 9, 6), not contiguous
  ASSERT_FALSE(x.is_contiguous());
  const Tensor xc = x.contiguous();
  for (auto [a, b] : {std::pair{mha.forward(x), mha.forward(xc)}, std::pair{ca.forward(x), ca.forward(xc)}}) {
    const auto va = a.to_vector(), vb = b.to_vector();
    ASSERT_EQ(va.size(), vb.size());
    for (size_t i = 0; i < va.size(); ++i) EXPECT_NEAR(va[i], vb[i], 1e-5) << i;
  }
}

TEST(ModuleInputs, ShorterSequencesUseTheTopLeftOfTheMask) {
  // num_tokens < context_length: the result equals a module whose context is exactly num_tokens.
  manual_seed(14);
  nn::MultiHeadAttention big(5, 6, 32, 0.0f, 3);
  manual_seed(14);
  nn::MultiHeadAttention exact(5, 6, 7, 0.0f, 3);
  const Tensor x = randn({2, 7, 5});
  EXPECT_EQ(big.forward(x).to_vector(), exact.forward(x).to_vector());
}

TEST(ModuleInputs, OutputShapes) {
  manual_seed(15);
  const Tensor x = randn({3, 13, 17});
  EXPECT_EQ(nn::CausalAttention(17, 24, 16, 0.0f).forward(x).shape(), (Shape{3, 13, 24}));
  EXPECT_EQ(nn::MultiHeadAttentionWrapper(17, 8, 16, 0.0f, 3).forward(x).shape(), (Shape{3, 13, 24}));
  EXPECT_EQ(nn::MultiHeadAttention(17, 24, 16, 0.0f, 4).forward(x).shape(), (Shape{3, 13, 24}));
  EXPECT_EQ(nn::SelfAttentionV2(17, 24).forward(x.select(0, 0)).shape(), (Shape{13, 24}));
}

}  // namespace
}  // namespace attn

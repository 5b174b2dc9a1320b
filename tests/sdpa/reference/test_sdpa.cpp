// scaled_dot_product_attention (float32) and reference::scaled_dot_product_attention_f64 against
// the attention math written out in torch 1.13.1, in float32 and in float64 (fixtures from
// tests/fixtures/gen_sdpa.py).
//
// The fixture file describes every case (shapes, seeds, mask, options); the inputs are re-created
// here from the same seeds, since attn's generator reproduces torch's bit for bit. Expected values
// are stored whole for small results and as a deterministic sample (with the float64 sum and sum
// of squares of the whole tensor) for large ones.
//
// Tolerances: attn float32 vs torch float32 and vs the float64 truth within kF32 (both round the
// same float32 inputs through float32 matmuls and a float32 softmax); attn's float64 reference vs
// torch's float64 within kF64 (only the summation order differs).
//
// Features beyond torch 1.13's math are written out in the script: GQA as
// k.repeat_interleave(group, dim=-3), bottom-right causal as the mask
// ones(L, S).tril(diagonal=S-L), the lse as torch.logsumexp of the masked scaled scores, and
// Philox dropout with a numpy Philox4x32-10 of attn/philox.hpp's documented counter layout (an
// implementation independent of attn's, checked against Random123's known answers).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/philox.hpp"
#include "attn/random.hpp"
#include "attn/sdpa.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("sdpa.txt");
  return f;
}

struct Tol {
  double rtol, atol;
};
constexpr Tol kF32{1e-5, 1e-5};    // attn float32 vs torch float32 / vs float64 truth
constexpr Tol kF64{1e-12, 1e-13};  // attn float64 reference vs torch float64

const float kInf = std::numeric_limits<float>::infinity();

Shape shape_of(const std::vector<double>& v) {
  Shape s;
  for (double d : v) s.push_back(static_cast<int64_t>(d));
  return s;
}

// ---- cases from the fixture ----------------------------------------------------------------------

// Field order of "<case>/config" (CONFIG_FIELDS in gen_sdpa.py).
enum Field {
  kSeed, kLayoutBhle, kMaskKind, kMaskSeed, kIsCausal, kHasScale, kScale, kDropoutP, kDropoutSeed,
  kNeedWeights, kDefaultGenerator, kBottomRight, kEnableGqa, kNeedLse, kDropoutRng, kDropoutOffset,
  kNumFields
};

struct Case {
  std::string name;
  Tensor qd, kd, vd, mask;  // drawn tensors (own the memory the views alias)
  TensorView q, k, v;
  SdpaOptions options;      // without a generator
  uint64_t dropout_seed = 0;
  bool default_generator = false;
};

// Re-creates the inputs of a case exactly as gen_sdpa.py draws them.
std::unique_ptr<Case> load_case(const std::string& name) {
  auto c = std::make_unique<Case>();
  c->name = name;
  const auto& cfg = fx().at(name + "/config").values;
  if (cfg.size() != kNumFields) throw std::runtime_error(name + ": config has the wrong length");
  manual_seed(static_cast<uint64_t>(cfg[kSeed]));
  c->qd = randn(shape_of(fx().at(name + "/q_shape").values));
  c->kd = randn(shape_of(fx().at(name + "/k_shape").values));
  c->vd = randn(shape_of(fx().at(name + "/v_shape").values));
  const bool bhle = cfg[kLayoutBhle] != 0;
  c->q = bhle ? c->qd.transpose(1, 2) : TensorView(c->qd);
  c->k = bhle ? c->kd.transpose(1, 2) : TensorView(c->kd);
  c->v = bhle ? c->vd.transpose(1, 2) : TensorView(c->vd);

  const int mask_kind = static_cast<int>(cfg[kMaskKind]);
  if (mask_kind != 0) {
    const Shape ms = shape_of(fx().at(name + "/mask_shape").values);
    manual_seed(static_cast<uint64_t>(cfg[kMaskSeed]));
    if (mask_kind == 1) {  // keep = rand > 0.25, then the listed rows all false
      c->mask = rand(ms);
      float* m = c->mask.data();
      for (int64_t i = 0; i < c->mask.numel(); ++i) m[i] = m[i] > 0.25f ? 1.0f : 0.0f;
      const auto& rows = fx().at(name + "/masked_rows").values;
      const int64_t L = ms[ms.ndim() - 2], S = ms[ms.ndim() - 1];
      for (size_t r = 0; r + 1 < rows.size(); r += 2) {
        const int64_t b = static_cast<int64_t>(rows[r]), i = static_cast<int64_t>(rows[r + 1]);
        for (int64_t j = 0; j < S; ++j) m[(b * L + i) * S + j] = 0.0f;
      }
      c->options.attn_mask = AttnMask::boolean(c->mask);
    } else {  // m = randn * 0.5; m[rand < 0.125] = -inf
      c->mask = mul(randn(ms), 0.5f);
      const Tensor r = rand(ms);
      for (int64_t i = 0; i < r.numel(); ++i) {
        if (r.data()[i] < 0.125f) c->mask.data()[i] = -kInf;
      }
      c->options.attn_mask = AttnMask::additive(c->mask);
    }
  }
  c->options.is_causal = cfg[kIsCausal] != 0;
  if (cfg[kHasScale] != 0) c->options.scale = cfg[kScale];
  c->options.dropout_p = static_cast<float>(cfg[kDropoutP]);
  c->options.need_weights = cfg[kNeedWeights] != 0;
  c->dropout_seed = static_cast<uint64_t>(cfg[kDropoutSeed]);
  c->default_generator = cfg[kDefaultGenerator] != 0;
  if (cfg[kBottomRight] != 0) c->options.causal_alignment = CausalAlignment::kBottomRight;
  c->options.enable_gqa = cfg[kEnableGqa] != 0;
  c->options.need_lse = cfg[kNeedLse] != 0;
  if (cfg[kDropoutRng] != 0) {  // Philox: the seed is the key, no generator involved
    c->options.dropout_rng = DropoutRng::kPhilox;
    c->options.dropout_seed = c->dropout_seed;
    c->options.dropout_offset = static_cast<uint64_t>(cfg[kDropoutOffset]);
  }
  return c;
}

std::vector<std::string> case_names(const std::string& prefix = "") {
  std::vector<std::string> out;
  std::istringstream in(fx().text("cases"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  }
  return out;
}

// ---- comparison ----------------------------------------------------------------------------------

// Checks `actual` (row-major, `shape`) against "<prefix>/{shape,idx,values}" and, where stored,
// the sum and sum of squares of the whole tensor. With |a_i - e_i| <= atol + rtol |e_i| the sums
// can differ by at most N atol + rtol sum|e| <= N atol + rtol sqrt(N sumsq), and the sums of
// squares by about 2 (atol sqrt(N sumsq) + rtol sumsq).
void expect_matches(const std::string& prefix, const Shape& shape, const std::vector<double>& actual,
                    Tol tol) {
  SCOPED_TRACE(prefix);
  const auto& fxt = fx();
  ASSERT_EQ(shape, shape_of(fxt.at(prefix + "/shape").values));
  ASSERT_EQ(static_cast<int64_t>(actual.size()), shape.numel());
  const auto& idx = fxt.at(prefix + "/idx").values;
  const auto& want = fxt.at(prefix + "/values").values;
  int64_t bad = 0, worst = -1;
  double worst_excess = 0.0;
  for (size_t s = 0; s < idx.size(); ++s) {
    const double a = actual[static_cast<size_t>(idx[s])], e = want[s];
    if (a == e) continue;  // also -inf == -inf (the lse of a fully masked row)
    const double excess = std::abs(a - e) / (tol.atol + tol.rtol * std::abs(e));
    if (!(excess <= 1.0)) {  // NaN counts as bad
      ++bad;
      if (!(excess <= worst_excess)) worst_excess = excess, worst = static_cast<int64_t>(s);
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << idx.size() << " sampled values outside rtol " << tol.rtol
                    << " atol " << tol.atol << "; worst at flat index "
                    << (worst >= 0 ? fmt::format("{}: got {:.17g} want {:.17g}", idx[worst],
                                                 actual[static_cast<size_t>(idx[worst])], want[worst])
                                   : std::string("-"));
  const auto it = fxt.tensors.find(prefix + "/sum");
  if (it == fxt.tensors.end()) return;
  const double want_sum = it->second.values[0];
  const double want_sumsq = fxt.at(prefix + "/sumsq").values[0];
  double got_sum = 0.0, got_sumsq = 0.0;
  for (double a : actual) got_sum += a, got_sumsq += a * a;
  const double n = static_cast<double>(actual.size());
  const double l2 = std::sqrt(n * want_sumsq);
  EXPECT_NEAR(got_sum, want_sum, n * tol.atol + tol.rtol * l2 + 1e-13 * l2) << "sum";
  EXPECT_NEAR(got_sumsq, want_sumsq, 2.0 * (tol.atol * l2 + tol.rtol * want_sumsq) + 1e-13 * want_sumsq)
      << "sum of squares";
}

std::vector<double> to_double(const TensorView& t) {
  const std::vector<float> f = t.to_vector();
  return {f.begin(), f.end()};
}

SdpaResult run_f32(const Case& c, SdpaBackend backend) {
  SdpaOptions o = c.options;
  o.backend = backend;
  Generator gen(c.dropout_seed);
  if (c.default_generator) manual_seed(c.dropout_seed);
  else o.generator = &gen;
  return scaled_dot_product_attention(c.q, c.k, c.v, o);
}

reference::SdpaResultF64 run_f64(const Case& c) {
  SdpaOptions o = c.options;
  Generator gen(c.dropout_seed);
  if (c.default_generator) manual_seed(c.dropout_seed);
  else o.generator = &gen;
  return reference::scaled_dot_product_attention_f64(c.q, c.k, c.v, o);
}

void check_case(const std::string& name) {
  SCOPED_TRACE(name);
  const std::unique_ptr<Case> c = load_case(name);
  const std::string n = name + "/";
  // The reference float32 path: against torch float32 and against the float64 truth.
  const SdpaResult r = run_f32(*c, SdpaBackend::kReference);
  expect_matches(n + "out32", r.output.shape(), to_double(r.output), kF32);
  expect_matches(n + "out64", r.output.shape(), to_double(r.output), kF32);
  if (c->options.need_weights) {
    ASSERT_TRUE(r.attn_weights.defined());
    expect_matches(n + "weights32", r.attn_weights.shape(), to_double(r.attn_weights), kF32);
    expect_matches(n + "weights64", r.attn_weights.shape(), to_double(r.attn_weights), kF32);
  } else {
    EXPECT_FALSE(r.attn_weights.defined());
  }
  if (c->options.need_lse) {
    ASSERT_TRUE(r.lse.defined());
    expect_matches(n + "lse32", r.lse.shape(), to_double(r.lse), kF32);
    expect_matches(n + "lse64", r.lse.shape(), to_double(r.lse), kF32);
  } else {
    EXPECT_FALSE(r.lse.defined());
  }
  // The default backend choice must agree with the float64 truth too.
  const SdpaResult a = run_f32(*c, SdpaBackend::kAuto);
  expect_matches(n + "out64", a.output.shape(), to_double(a.output), kF32);
  if (c->options.need_lse) {
    ASSERT_TRUE(a.lse.defined());
    expect_matches(n + "lse64", a.lse.shape(), to_double(a.lse), kF32);
  }
  // The float64 reference against torch's float64.
  const reference::SdpaResultF64 t = run_f64(*c);
  expect_matches(n + "out64", t.output_shape, t.output, kF64);
  if (c->options.need_weights) {
    expect_matches(n + "weights64", t.weights_shape, t.attn_weights, kF64);
  }
  if (c->options.need_lse) {
    expect_matches(n + "lse64", t.lse_shape, t.lse, kF64);
  } else {
    EXPECT_TRUE(t.lse.empty());
  }
}

void check_cases(const std::string& prefix, size_t at_least) {
  const std::vector<std::string> names = case_names(prefix);
  EXPECT_GE(names.size(), at_least) << prefix;
  for (const std::string& name : names) check_case(name);
}

// ---- the fixture cases, by what they cover ------------------------------------------------------

TEST(SdpaFixtures, EveryCaseBelongsToATest) {
  const char* prefixes[] = {"shapes/", "mask_bool/", "mask_add/", "causal/", "scale/", "dropout/",
                            "gqa/", "causal_br/", "lse/", "philox/"};
  for (const std::string& name : case_names()) {
    bool covered = false;
    for (const char* p : prefixes) covered |= name.rfind(p, 0) == 0;
    EXPECT_TRUE(covered) << name;
  }
}

TEST(SdpaShapes, OddSizesBatchedUnbatchedAndStridedHeads) {
  // L, S in {1, 7, 13, 97, 257} with L != S; E in {1, 3, 16, 64, 80, 128}; Ev != E; 2-D, 3-D
  // and 4-D inputs; heads taken as transpose(1, 2) views of a (B, L, H, E) tensor.
  check_cases("shapes/", 9);
}

TEST(SdpaBoolMask, TrueTakesPartBroadcastOverBatchAndHeads) {
  // Masks of shape (L, S), (1, 1, L, S), (B, 1, L, S); fully masked rows give 0 (attn's policy).
  check_cases("mask_bool/", 6);
}

TEST(SdpaAdditiveMask, AddedToScoresWithNegInfEntries) {
  check_cases("mask_add/", 4);
}

TEST(SdpaCausal, TopLeftAlignedAlsoWhenLDiffersFromS) {
  check_cases("causal/", 5);
}

TEST(SdpaScale, CustomScaleReplacesInverseSqrtE) {
  check_cases("scale/", 3);
}

TEST(SdpaDropout, MatchesTorchDropoutOnTheWeights) {
  // torch.manual_seed(s); F.dropout(weights, p) on the (..., L, S) weights; need_weights returns
  // the post-dropout weights.
  check_cases("dropout/", 5);
}

TEST(SdpaGqa, KeyValueHeadsRepeatInterleavedAsInTorch) {
  // H_q in {4, 6, 8} over H_kv in {1, 2, 3} (and equal heads with the flag on); 4-D, 3-D and
  // strided (B, L, H, E) layouts; with a mask, top-left and bottom-right causal, torch dropout.
  check_cases("gqa/", 7);
}

TEST(SdpaCausalBottomRight, KeyJMaskedWhenJExceedsIPlusSMinusL) {
  // L < S, L == S, L == 1 (decoding) and L > S, where the first L - S rows see no key.
  check_cases("causal_br/", 7);
}

TEST(SdpaLse, LogSumExpOfTheMaskedScaledScores) {
  // Against torch.logsumexp, -inf rows included (bool and additive masks, top-left causal with
  // L > S, custom scale, and computed before dropout).
  check_cases("lse/", 7);
}

TEST(SdpaPhiloxDropout, MatchesAnIndependentPhiloxOfTheDocumentedLayout) {
  // Mask from the script's numpy Philox4x32-10: any differing keep decision would show as a
  // weight that is 0 on one side only. Covers seeds with a high word, offset 2^32 - 1, GQA with
  // bottom-right causal, fully masked rows, 2-D inputs and p = 1.
  check_cases("philox/", 6);
}

// ---- properties and policies ---------------------------------------------------------------------

bool all_zero(const std::vector<float>& v, size_t from, size_t count) {
  for (size_t i = from; i < from + count; ++i) {
    if (v[i] != 0.0f) return false;
  }
  return true;
}

TEST(SdpaFullyMaskedRows, OutputAndWeightsAreZeroNotNaN) {
  const std::unique_ptr<Case> c = load_case("mask_bool/fully_masked_rows_B1LS");
  ASSERT_EQ(fx().at(c->name + "/dead_rows").values[0], 12.0);  // 4 mask rows x 3 heads
  const SdpaResult r = run_f32(*c, SdpaBackend::kReference);
  const reference::SdpaResultF64 t = run_f64(*c);
  const int64_t H = 3, L = 9, S = 11, Ev = 5;
  const std::vector<float> out = r.output.to_vector(), w = r.attn_weights.to_vector();
  for (float x : out) ASSERT_FALSE(std::isnan(x));
  for (float x : w) ASSERT_FALSE(std::isnan(x));
  const std::pair<int64_t, int64_t> dead[] = {{0, 0}, {1, 0}, {0, 5}, {1, 8}};  // (batch, row)
  for (const auto& [b, i] : dead) {
    for (int64_t h = 0; h < H; ++h) {
      const size_t row = static_cast<size_t>((b * H + h) * L + i);
      EXPECT_TRUE(all_zero(out, row * Ev, Ev)) << b << "," << h << "," << i;
      EXPECT_TRUE(all_zero(w, row * S, S)) << b << "," << h << "," << i;
      for (int64_t e = 0; e < Ev; ++e) EXPECT_EQ(t.output[row * Ev + e], 0.0);
      for (int64_t j = 0; j < S; ++j) EXPECT_EQ(t.attn_weights[row * S + j], 0.0);
    }
  }
}

TEST(SdpaFullyMaskedRows, AdditiveAllNegInfAndCausalAreHandledAlike) {
  manual_seed(5);
  const Tensor q = randn({2, 4, 8}), k = randn({2, 6, 8}), v = randn({2, 6, 3});
  Tensor add({4, 6});
  for (int64_t j = 0; j < 6; ++j) add.at({2, j}) = -kInf;  // query row 2 sees nothing
  SdpaOptions o;
  o.attn_mask = AttnMask::additive(add);
  o.need_weights = true;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t e = 0; e < 3; ++e) {
        const float x = r.output.at({b, i, e});
        if (i == 2) {
          EXPECT_EQ(x, 0.0f);
          EXPECT_EQ(t.output[static_cast<size_t>((b * 4 + i) * 3 + e)], 0.0);
        } else {
          EXPECT_TRUE(std::isfinite(x));
        }
      }
    }
  }
}

TEST(SdpaNaN, NanInAnIncludedKeyPropagates) {
  manual_seed(11);
  Tensor q = randn({1, 2, 5, 4}), k = randn({1, 2, 7, 4}), v = randn({1, 2, 7, 3});
  k.at({0, 1, 3, 2}) = std::nanf("");  // head 1, key 3
  SdpaOptions o;
  o.need_weights = true;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t e = 0; e < 3; ++e) {
      EXPECT_TRUE(std::isfinite(r.output.at({0, 0, i, e}))) << "head 0 has no NaN";
      EXPECT_TRUE(std::isnan(r.output.at({0, 1, i, e}))) << "row " << i;
      EXPECT_TRUE(std::isnan(t.output[static_cast<size_t>((5 + i) * 3 + e)])) << "f64 row " << i;
    }
  }
}

TEST(SdpaNaN, NanInAQueryRowPropagatesToThatRowOnly) {
  manual_seed(12);
  Tensor q = randn({6, 8}), k = randn({9, 8}), v = randn({9, 4});
  q.at({4, 0}) = std::nanf("");  // every score of query row 4 is NaN
  SdpaOptions o;
  o.need_weights = true;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t e = 0; e < 4; ++e) {
      const bool nan32 = std::isnan(r.output.at({i, e}));
      const bool nan64 = std::isnan(t.output[static_cast<size_t>(i * 4 + e)]);
      EXPECT_EQ(nan32, i == 4) << "row " << i;
      EXPECT_EQ(nan64, i == 4) << "f64 row " << i;
    }
  }
}

TEST(SdpaNaN, NanInAMaskedOutKeyDoesNotPropagate) {
  // attn's policy: a NaN score at a position the mask excludes is dropped, not propagated.
  manual_seed(13);
  Tensor q = randn({5, 4}), k = randn({5, 4}), v = randn({5, 3});
  k.at({3, 1}) = std::nanf("");  // key 3
  SdpaOptions causal;
  causal.is_causal = true;  // rows 0..2 exclude key 3, rows 3..4 include it
  const SdpaResult r = scaled_dot_product_attention(q, k, v, causal);
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(std::isnan(r.output.at({i, 0})), i >= 3) << "causal row " << i;
  }
  Tensor keep = Tensor::ones({5, 5});
  keep.at({1, 3}) = 0.0f;  // only row 1 excludes key 3
  SdpaOptions masked;
  masked.attn_mask = AttnMask::boolean(keep);
  const SdpaResult m = scaled_dot_product_attention(q, k, v, masked);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(std::isnan(m.output.at({i, 0})), i != 1) << "mask row " << i;
}

TEST(SdpaWeights, RowsSumToOneAndOutputIsWeightsTimesValue) {
  const std::unique_ptr<Case> c = load_case("mask_bool/B1LS_b3h2_l97s13_e64_ev80");
  SdpaOptions o = c->options;
  o.need_weights = true;
  const SdpaResult r = scaled_dot_product_attention(c->q, c->k, c->v, o);
  const Tensor s = sum(r.attn_weights, -1);
  for (float x : s.to_vector()) EXPECT_NEAR(x, 1.0f, 1e-6);
  const std::vector<float> want = matmul(r.attn_weights, c->v).to_vector(), got = r.output.to_vector();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << i;
}

TEST(SdpaWeights, NotReturnedUnlessAsked) {
  const std::unique_ptr<Case> c = load_case("shapes/b2h3_l7s7_e64");
  SdpaOptions o = c->options;
  o.need_weights = false;
  EXPECT_FALSE(scaled_dot_product_attention(c->q, c->k, c->v, o).attn_weights.defined());
}

TEST(SdpaDropout, OutputUsesThePostDropoutWeights) {
  const std::unique_ptr<Case> c = load_case("dropout/p0.3_bool_B1LS_l97s257_e80_ev48");
  const SdpaResult r = run_f32(*c, SdpaBackend::kReference);
  const std::vector<float> want = matmul(r.attn_weights, c->v).to_vector(), got = r.output.to_vector();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << i;
  // Every weight is either dropped or a softmax weight scaled by 1 / (1 - p): the kept fraction
  // among the positions the mask lets through is about 1 - p.
  int64_t kept = 0, open = 0;
  const std::vector<float> w = r.attn_weights.to_vector();
  const std::vector<float> m = c->mask.expand({2, 4, 97, 257}).to_vector();
  for (size_t i = 0; i < w.size(); ++i) {
    if (m[i] != 0.0f) ++open, kept += w[i] != 0.0f;
  }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(open), 0.7, 0.01);
}

TEST(SdpaDropout, SameSeedSameResultAndReferenceLeavesGeneratorAlone) {
  const std::unique_ptr<Case> c = load_case("dropout/p0.1_b2h3_l7s7");
  const SdpaResult a = run_f32(*c, SdpaBackend::kReference), b = run_f32(*c, SdpaBackend::kReference);
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
  // The float64 reference draws from a copy of the generator's state.
  Generator gen(c->dropout_seed), fresh(c->dropout_seed);
  SdpaOptions o = c->options;
  o.generator = &gen;
  reference::scaled_dot_product_attention_f64(c->q, c->k, c->v, o);
  EXPECT_EQ(gen.random(), fresh.random());
}

TEST(SdpaDropout, ZeroProbabilityDrawsNothing) {
  const std::unique_ptr<Case> c = load_case("shapes/b2h3_l7s7_e64");
  Generator gen(3), fresh(3);
  SdpaOptions o = c->options;
  o.generator = &gen;
  o.dropout_p = 0.0f;
  scaled_dot_product_attention(c->q, c->k, c->v, o);
  EXPECT_EQ(gen.random(), fresh.random());
}

TEST(SdpaScale, DefaultIsInverseSqrtE) {
  const std::unique_ptr<Case> c = load_case("shapes/unbatched2d_l13s29_e80_ev3");
  SdpaOptions o = c->options;
  const reference::SdpaResultF64 dflt = reference::scaled_dot_product_attention_f64(c->q, c->k, c->v, o);
  o.scale = 1.0 / std::sqrt(80.0);
  const reference::SdpaResultF64 expl = reference::scaled_dot_product_attention_f64(c->q, c->k, c->v, o);
  for (size_t i = 0; i < dflt.output.size(); ++i) {
    EXPECT_NEAR(dflt.output[i], expl.output[i], 1e-13 * (1 + std::abs(expl.output[i]))) << i;
  }
}

TEST(SdpaArguments, CausalWithMaskAndBadDropoutThrow) {
  const Tensor q = Tensor::ones({2, 3, 4}), mask = Tensor::ones({3, 3});
  SdpaOptions both;
  both.is_causal = true;
  both.attn_mask = AttnMask::boolean(mask);
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, both), ValueError);
  SdpaOptions p1;
  p1.dropout_p = 1.0001f;
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, p1), ValueError);
  SdpaOptions bad_mask;
  bad_mask.attn_mask = AttnMask::boolean(Tensor::ones({3, 4}));  // S is 3
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, bad_mask), ShapeError);
  EXPECT_THROW(scaled_dot_product_attention(q, Tensor::ones({2, 3, 5}), q), ShapeError);
}


// ---- grouped-query attention ---------------------------------------------------------------------

// k.repeat_interleave(group, dim=-3) of a 3-D or 4-D tensor, written out with at().
Tensor repeat_heads(const TensorView& t, int64_t group) {
  const bool four = t.dim() == 4;
  const int64_t B = four ? t.size(0) : 1, H = t.size(-3), S = t.size(-2), D = t.size(-1);
  Tensor out = four ? Tensor({B, H * group, S, D}) : Tensor({H * group, S, D});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H * group; ++h) {
      for (int64_t j = 0; j < S; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          const float x = four ? t.at({b, h / group, j, d}) : t.at({h / group, j, d});
          (four ? out.at({b, h, j, d}) : out.at({h, j, d})) = x;
        }
      }
    }
  }
  return out;
}

// Bitwise equality of two results (NaN-free inputs): the reference paths must take the same
// steps either way.
void expect_same(const SdpaResult& a, const SdpaResult& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.output.shape(), b.output.shape());
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
  EXPECT_EQ(a.attn_weights.defined(), b.attn_weights.defined());
  if (a.attn_weights.defined()) {
    EXPECT_EQ(a.attn_weights.to_vector(), b.attn_weights.to_vector());
  }
  EXPECT_EQ(a.lse.defined(), b.lse.defined());
  if (a.lse.defined()) {
    EXPECT_EQ(a.lse.to_vector(), b.lse.to_vector());
  }
}
void expect_same(const reference::SdpaResultF64& a, const reference::SdpaResultF64& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.output, b.output);
  EXPECT_EQ(a.attn_weights, b.attn_weights);
  EXPECT_EQ(a.lse, b.lse);
}

TEST(SdpaGqa, SameAsRepeatingKeyAndValueHeadsFirst) {
  manual_seed(200);
  const Tensor q4 = randn({2, 6, 5, 8}), k4 = randn({2, 2, 7, 8}), v4 = randn({2, 2, 7, 3});
  const Tensor q3 = randn({6, 5, 8}), k3 = randn({3, 7, 8}), v3 = randn({3, 7, 3});
  struct In { const Tensor *q, *k, *v; int64_t group; } ins[] = {{&q4, &k4, &v4, 3}, {&q3, &k3, &v3, 2}};
  for (const In& in : ins) {
    const Tensor kr = repeat_heads(*in.k, in.group), vr = repeat_heads(*in.v, in.group);
    SdpaOptions o;
    o.backend = SdpaBackend::kReference;
    o.need_weights = o.need_lse = true;
    o.is_causal = true;
    o.causal_alignment = CausalAlignment::kBottomRight;
    o.dropout_p = 0.25f;  // Philox: the mask follows the query head, so it is the same too
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 77;
    SdpaOptions g = o;
    g.enable_gqa = true;
    expect_same(scaled_dot_product_attention(*in.q, *in.k, *in.v, g),
                scaled_dot_product_attention(*in.q, kr, vr, o), "float32");
    expect_same(reference::scaled_dot_product_attention_f64(*in.q, *in.k, *in.v, g),
                reference::scaled_dot_product_attention_f64(*in.q, kr, vr, o), "float64");
  }
}

TEST(SdpaGqa, FlagChangesNothingForEqualHeadsOrTwoDimInputs) {
  manual_seed(201);
  const Tensor q = randn({2, 3, 4, 8}), k = randn({2, 3, 6, 8}), v = randn({2, 3, 6, 5});
  const Tensor q2 = randn({4, 8}), k2 = randn({6, 8}), v2 = randn({6, 5});
  SdpaOptions o;
  o.backend = SdpaBackend::kReference;
  o.need_weights = o.need_lse = true;
  SdpaOptions g = o;
  g.enable_gqa = true;
  expect_same(scaled_dot_product_attention(q, k, v, g), scaled_dot_product_attention(q, k, v, o), "4-D");
  expect_same(scaled_dot_product_attention(q2, k2, v2, g), scaled_dot_product_attention(q2, k2, v2, o), "2-D");
}

// ---- bottom-right causal alignment -------------------------------------------------------------

TEST(SdpaCausalBottomRight, SameAsTheExplicitLowerRightMask) {
  // PyTorch's causal_lower_right(L, S) is ones(L, S).tril(diagonal=S-L) as a "takes part" mask.
  const std::pair<int64_t, int64_t> sizes[] = {{3, 8}, {8, 3}, {5, 5}, {1, 9}, {9, 1}};
  for (const auto& [L, S] : sizes) {
    SCOPED_TRACE(fmt::format("L={} S={}", L, S));
    manual_seed(static_cast<uint64_t>(210 + L * 10 + S));
    const Tensor q = randn({2, 2, L, 8}), k = randn({2, 2, S, 8}), v = randn({2, 2, S, 4});
    Tensor keep({L, S});
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) keep.at({i, j}) = j <= i + (S - L) ? 1.0f : 0.0f;
    }
    SdpaOptions masked;
    masked.backend = SdpaBackend::kReference;
    masked.need_weights = masked.need_lse = true;
    masked.attn_mask = AttnMask::boolean(keep);
    SdpaOptions br = masked;
    br.attn_mask.reset();
    br.is_causal = true;
    br.causal_alignment = CausalAlignment::kBottomRight;
    expect_same(scaled_dot_product_attention(q, k, v, br), scaled_dot_product_attention(q, k, v, masked),
                "float32");
    expect_same(reference::scaled_dot_product_attention_f64(q, k, v, br),
                reference::scaled_dot_product_attention_f64(q, k, v, masked), "float64");
    if (L == S) {  // the diagonal is the same whichever corner it starts from
      SdpaOptions tl = br;
      tl.causal_alignment = CausalAlignment::kTopLeft;
      expect_same(scaled_dot_product_attention(q, k, v, br), scaled_dot_product_attention(q, k, v, tl),
                  "L == S");
    }
  }
}

TEST(SdpaCausalBottomRight, QueriesBeforeTheFirstKeyGetZeroOutputAndLseMinusInf) {
  manual_seed(220);
  const int64_t L = 6, S = 2;  // rows 0..3 see no key, row 4 sees key 0, row 5 both
  const Tensor q = randn({L, 4}), k = randn({S, 4}), v = randn({S, 3});
  SdpaOptions o;
  o.backend = SdpaBackend::kReference;
  o.is_causal = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.need_weights = o.need_lse = true;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t i = 0; i < L; ++i) {
    const bool dead = i < L - S;
    EXPECT_EQ(r.lse.at({i}) == -kInf, dead) << i;
    EXPECT_EQ(t.lse[static_cast<size_t>(i)] == -std::numeric_limits<double>::infinity(), dead) << i;
    for (int64_t e = 0; e < 3; ++e) {
      if (dead) {
        EXPECT_EQ(r.output.at({i, e}), 0.0f) << i;
      } else {
        EXPECT_TRUE(std::isfinite(r.output.at({i, e}))) << i;
      }
    }
  }
  EXPECT_EQ(r.attn_weights.at({4, 0}), 1.0f);
  EXPECT_EQ(r.attn_weights.at({4, 1}), 0.0f);
  EXPECT_GT(r.attn_weights.at({5, 1}), 0.0f);
}

TEST(SdpaCausalBottomRight, IgnoredWithoutIsCausal) {
  // The alignment only places is_causal's diagonal: without is_causal it changes nothing, and
  // it combines with attn_mask without complaint.
  manual_seed(221);
  const Tensor q = randn({2, 5, 8}), k = randn({2, 9, 8}), v = randn({2, 9, 4});
  const Tensor keep = Tensor::ones({5, 9});
  SdpaOptions o;
  o.backend = SdpaBackend::kReference;
  o.need_weights = o.need_lse = true;
  SdpaOptions br = o;
  br.causal_alignment = CausalAlignment::kBottomRight;
  expect_same(scaled_dot_product_attention(q, k, v, br), scaled_dot_product_attention(q, k, v, o), "no mask");
  o.attn_mask = br.attn_mask = AttnMask::boolean(keep);
  expect_same(scaled_dot_product_attention(q, k, v, br), scaled_dot_product_attention(q, k, v, o), "mask");
}

// ---- log-sum-exp ---------------------------------------------------------------------------------

TEST(SdpaLse, IsLogOfTheSoftmaxDenominator) {
  // lse_i = log sum_j exp(s_ij) with s = q.k / sqrt(E), written out here in double; and then
  // weight_ij = exp(s_ij - lse_i).
  manual_seed(230);
  const int64_t L = 7, S = 12, E = 16;
  const Tensor q = randn({L, E}), k = mul(randn({S, E}), 3.0f), v = randn({S, 2});  // peaky rows
  SdpaOptions o;
  o.need_weights = o.need_lse = true;
  o.backend = SdpaBackend::kReference;
  const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (int64_t i = 0; i < L; ++i) {
    std::vector<double> s(S);
    double sum = 0.0;
    for (int64_t j = 0; j < S; ++j) {
      double d = 0.0;
      for (int64_t e = 0; e < E; ++e) d += static_cast<double>(q.at({i, e})) * k.at({j, e});
      s[static_cast<size_t>(j)] = d / std::sqrt(static_cast<double>(E));
      sum += std::exp(s[static_cast<size_t>(j)]);
    }
    const double lse = std::log(sum);
    EXPECT_NEAR(t.lse[static_cast<size_t>(i)], lse, 1e-12 * (1 + std::abs(lse))) << i;
    EXPECT_NEAR(r.lse.at({i}), lse, 1e-5 * (1 + std::abs(lse))) << i;
    for (int64_t j = 0; j < S; ++j) {
      EXPECT_NEAR(t.attn_weights[static_cast<size_t>(i * S + j)], std::exp(s[static_cast<size_t>(j)] - lse), 1e-14);
    }
  }
}

TEST(SdpaLse, ComputedBeforeDropoutAndNaNRowsGiveNaN) {
  manual_seed(231);
  Tensor q = randn({2, 6, 8});
  const Tensor k = randn({2, 9, 8}), v = randn({2, 9, 3});
  q.at({1, 2, 0}) = std::nanf("");
  SdpaOptions o;
  o.backend = SdpaBackend::kReference;
  o.need_lse = true;
  const SdpaResult plain = scaled_dot_product_attention(q, k, v, o);
  const reference::SdpaResultF64 plain64 = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (DropoutRng rng : {DropoutRng::kTorch, DropoutRng::kPhilox}) {
    SdpaOptions d = o;
    d.dropout_p = 0.5f;
    d.dropout_rng = rng;
    const std::vector<float> a = scaled_dot_product_attention(q, k, v, d).lse.to_vector(), b = plain.lse.to_vector();
    const std::vector<double> a64 = reference::scaled_dot_product_attention_f64(q, k, v, d).lse;
    ASSERT_EQ(a.size(), b.size());
    for (size_t x = 0; x < a.size(); ++x) {
      const bool nan = x == 1 * 6 + 2;  // batch 1, row 2
      EXPECT_EQ(std::isnan(a[x]), nan) << x;
      EXPECT_EQ(std::isnan(a64[x]), nan) << x;
      if (!nan) {
        EXPECT_EQ(a[x], b[x]) << x;
        EXPECT_EQ(a64[x], plain64.lse[x]) << x;
      }
    }
  }
}

// ---- Philox dropout ------------------------------------------------------------------------------

struct PhiloxSetup {
  Tensor q, k, v;
  SdpaOptions o;
};

// GQA (4 query heads on 2 key/value heads), no mask, so every undropped weight is positive.
PhiloxSetup philox_setup(float p) {
  PhiloxSetup s;
  manual_seed(240);
  s.q = randn({2, 4, 9, 16});
  s.k = randn({2, 2, 13, 16});
  s.v = randn({2, 2, 13, 5});
  s.o.enable_gqa = true;
  s.o.need_weights = true;
  s.o.dropout_p = p;
  s.o.dropout_rng = DropoutRng::kPhilox;
  s.o.dropout_seed = 0xfeedface12345ULL;
  s.o.dropout_offset = 11;
  return s;
}

TEST(SdpaPhiloxDropout, ZeroWeightsAreExactlyTheDroppedPositions) {
  const float p = 0.3f;
  PhiloxSetup s = philox_setup(p);
  SdpaOptions none = s.o;
  none.dropout_p = 0.0f;
  none.backend = SdpaBackend::kReference;
  const std::vector<float> undropped = scaled_dot_product_attention(s.q, s.k, s.v, none).attn_weights.to_vector();
  for (SdpaBackend backend : {SdpaBackend::kReference, SdpaBackend::kAuto}) {
    s.o.backend = backend;
    const std::vector<float> w = scaled_dot_product_attention(s.q, s.k, s.v, s.o).attn_weights.to_vector();
    const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(s.q, s.k, s.v, s.o);
    ASSERT_EQ(w.size(), static_cast<size_t>(8 * 9 * 13));
    const float inv_keep = 1.0f / (1.0f - p);
    for (int64_t bh = 0; bh < 8; ++bh) {  // query (batch, head), row-major
      for (int64_t i = 0; i < 9; ++i) {
        for (int64_t j = 0; j < 13; ++j) {
          const size_t x = static_cast<size_t>((bh * 9 + i) * 13 + j);
          const bool keep = philox_dropout_keep(s.o.dropout_seed, s.o.dropout_offset, bh, i, j, p);
          EXPECT_EQ(w[x] != 0.0f, keep) << bh << " " << i << " " << j;
          EXPECT_EQ(t.attn_weights[x] != 0.0, keep) << bh << " " << i << " " << j;
          if (backend == SdpaBackend::kReference && keep) {
            EXPECT_EQ(w[x], undropped[x] * inv_keep);  // torch's float32 scaling, exactly
          }
        }
      }
    }
  }
}

TEST(SdpaPhiloxDropout, Float32AndFloat64ReferencesAgree) {
  PhiloxSetup s = philox_setup(0.6f);
  s.o.backend = SdpaBackend::kReference;
  s.o.need_lse = true;
  const SdpaResult r = scaled_dot_product_attention(s.q, s.k, s.v, s.o);
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(s.q, s.k, s.v, s.o);
  const std::vector<float> w = r.attn_weights.to_vector(), out = r.output.to_vector();
  ASSERT_EQ(w.size(), t.attn_weights.size());
  for (size_t x = 0; x < w.size(); ++x) {
    EXPECT_EQ(w[x] == 0.0f, t.attn_weights[x] == 0.0) << x;
    EXPECT_NEAR(w[x], t.attn_weights[x], 1e-5 * (1 + t.attn_weights[x])) << x;
  }
  for (size_t x = 0; x < out.size(); ++x) EXPECT_NEAR(out[x], t.output[x], 1e-5 * (1 + std::abs(t.output[x]))) << x;
}

TEST(SdpaPhiloxDropout, KeepRateIsOneMinusP) {
  const std::unique_ptr<Case> c = load_case("philox/p0.3_bool_B1LS_l97s257_seed_hi_word");
  SdpaOptions o = c->options;
  o.backend = SdpaBackend::kReference;
  o.attn_mask.reset();  // every position open: all zeros are dropout's
  o.need_weights = true;
  const std::vector<float> w = scaled_dot_product_attention(c->q, c->k, c->v, o).attn_weights.to_vector();
  int64_t kept = 0;
  for (float x : w) kept += x != 0.0f;
  const double n = static_cast<double>(w.size()), q = 1.0 - 0.3;  // 2 * 4 * 97 * 257 weights
  EXPECT_NEAR(static_cast<double>(kept) / n, q, 3.0 * std::sqrt(q * (1.0 - q) / n));
}

TEST(SdpaPhiloxDropout, SeedAndOffsetPickTheMaskAndNoGeneratorIsDrawn) {
  PhiloxSetup s = philox_setup(0.5f);
  s.o.backend = SdpaBackend::kReference;
  Generator gen(9), fresh(9);
  s.o.generator = &gen;
  const auto zeros = [&](const SdpaOptions& o) {
    std::vector<bool> z;
    for (float x : scaled_dot_product_attention(s.q, s.k, s.v, o).attn_weights.to_vector()) z.push_back(x == 0.0f);
    return z;
  };
  const std::vector<bool> base = zeros(s.o);
  EXPECT_EQ(zeros(s.o), base);  // deterministic
  SdpaOptions next = s.o;
  next.dropout_offset += 1;
  EXPECT_NE(zeros(next), base);
  SdpaOptions other = s.o;
  other.dropout_seed += 1;
  EXPECT_NE(zeros(other), base);
  reference::scaled_dot_product_attention_f64(s.q, s.k, s.v, s.o);
  EXPECT_EQ(gen.random(), fresh.random()) << "the generator passed is not drawn from";
  s.o.generator = nullptr;
  Generator before = default_generator();  // a copy of its state
  scaled_dot_product_attention(s.q, s.k, s.v, s.o);
  EXPECT_EQ(default_generator().random(), before.random()) << "nor the default generator";
}

// ---- argument checks for the new options ---------------------------------------------------------

// Calls f, expects a ShapeError whose message contains every one of `parts`.
void expect_shape_error(const std::function<void()>& f, std::initializer_list<std::string> parts,
                        const char* what) {
  SCOPED_TRACE(what);
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const ShapeError& e) {
    const std::string msg = e.what();
    for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
  }
}

TEST(SdpaArguments, GqaHeadCountsMustDivideAndMatch) {
  const Tensor q4 = Tensor::ones({2, 6, 4, 8}), k4 = Tensor::ones({2, 4, 5, 8});
  SdpaOptions g;
  g.enable_gqa = true;
  expect_shape_error([&] { scaled_dot_product_attention(q4, k4, k4, g); }, {"enable_gqa", "(6)", "(4)"},
                     "4-D, 6 on 4");
  const Tensor q3 = Tensor::ones({6, 4, 8}), k3 = Tensor::ones({4, 5, 8});
  expect_shape_error([&] { scaled_dot_product_attention(q3, k3, k3, g); }, {"enable_gqa", "(6)", "(4)"},
                     "3-D, 6 on 4");
  const Tensor q2h = Tensor::ones({2, 2, 4, 8}), k4h = Tensor::ones({2, 4, 5, 8});
  expect_shape_error([&] { scaled_dot_product_attention(q2h, k4h, k4h, g); }, {"(2)", "(4)"},
                     "more key heads than query heads");
  // Divisible head counts still need the flag (PyTorch's default is enable_gqa=False).
  const Tensor k2 = Tensor::ones({2, 2, 5, 8});
  expect_shape_error([&] { scaled_dot_product_attention(q4, k2, k2); }, {"leading"}, "no flag");
  EXPECT_NO_THROW(scaled_dot_product_attention(q4, k2, k2, g));
  // Key and value must agree on their heads, and the batch dim is not grouped.
  const Tensor v3 = Tensor::ones({2, 3, 5, 8});
  expect_shape_error([&] { scaled_dot_product_attention(q4, k2, v3, g); }, {"key and value", "heads"},
                     "key vs value heads");
  const Tensor kb = Tensor::ones({1, 2, 5, 8});
  expect_shape_error([&] { scaled_dot_product_attention(q4, kb, kb, g); }, {"leading"}, "batch");
  // The mask broadcasts to query's heads, not key's.
  const Tensor kv_heads_mask = Tensor::ones({2, 2, 4, 5}), q_heads_mask = Tensor::ones({2, 6, 4, 5});
  SdpaOptions gm = g;
  gm.attn_mask = AttnMask::boolean(kv_heads_mask);
  expect_shape_error([&] { scaled_dot_product_attention(q4, k2, k2, gm); }, {"attn_mask"}, "mask on kv heads");
  gm.attn_mask = AttnMask::boolean(q_heads_mask);
  EXPECT_NO_THROW(scaled_dot_product_attention(q4, k2, k2, gm));
}

}  // namespace
}  // namespace attn

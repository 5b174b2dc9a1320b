// Bit-exact comparison of attn's generator with PyTorch 1.13.1 (fixtures from
// tests/fixtures/gen_random.py). Every comparison is on float bit patterns and reports the
// number of mismatching elements.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/random.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("random.txt");
  return f;
}

// Number of elements whose float32 bit patterns differ (the expected values are exact floats).
int64_t count_mismatches(const std::vector<float>& actual, const std::vector<double>& expected,
                         std::string* first = nullptr) {
  if (actual.size() != expected.size()) return -1;
  int64_t bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const float e = static_cast<float>(expected[i]);
    if (std::bit_cast<uint32_t>(actual[i]) != std::bit_cast<uint32_t>(e)) {
      if (bad == 0 && first != nullptr) {
        *first = fmt::format("first at [{}]: got {} want {}", i, actual[i], e);
      }
      ++bad;
    }
  }
  return bad;
}

// Expects `actual` to equal fixture `name` bit for bit (and its shape when one is given).
void expect_fixture(const std::string& name, const TensorView& actual) {
  const test::FixtureTensor& want = fx().at(name);
  EXPECT_EQ(actual.shape(), want.shape) << name << ": shape " << actual.shape().str() << " vs "
                                        << want.shape.str();
  std::string first;
  const int64_t bad = count_mismatches(actual.to_vector(), want.values, &first);
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << want.values.size() << " values differ; "
                    << first;
}

void expect_fixture_values(const std::string& name, const std::vector<float>& actual) {
  const test::FixtureTensor& want = fx().at(name);
  std::string first;
  const int64_t bad = count_mismatches(actual, want.values, &first);
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << want.values.size() << " values differ; "
                    << first;
}

const char* prefix(RngFlavor f) { return f == RngFlavor::kX86Avx2 ? "avx2/" : "scalar/"; }

// ---- Engine ------------------------------------------------------------------------------------

TEST(RandomEngine, U32StreamMatchesTorchAcrossTwists) {
  Generator gen(123);
  const auto& want = fx().at("u32_seed123_2000").values;  // crosses two twists (624 outputs each)
  int64_t bad = 0;
  for (double w : want) bad += gen.random() != static_cast<uint32_t>(w);
  EXPECT_EQ(bad, 0) << bad << " of " << want.size() << " engine outputs differ";
}

TEST(RandomEngine, MatchesStdMt19937) {
  Generator gen(5489);
  std::mt19937 ref(5489);
  int64_t bad = 0;
  for (int i = 0; i < 2000; ++i) bad += gen.random() != ref();
  EXPECT_EQ(bad, 0);
}

TEST(RandomEngine, Random64DrawsHighWordFirst) {
  // torch.randint(0, 2**32) keeps the low word of random64(): the second u32 of each pair.
  Generator gen(123);
  const auto& want = fx().at("u64low_seed123_500").values;
  const auto& u32 = fx().at("u32_seed123_2000").values;
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const uint64_t v = gen.random64();
    bad += static_cast<uint32_t>(v) != static_cast<uint32_t>(want[i]);
    bad += static_cast<uint32_t>(v >> 32) != static_cast<uint32_t>(u32[2 * i]);
  }
  EXPECT_EQ(bad, 0);
}

TEST(RandomEngine, OnlyLow32BitsOfSeedReachTheEngine) {
  Generator a(123), b(123 + (uint64_t{1} << 32));
  EXPECT_EQ(b.initial_seed(), 123 + (uint64_t{1} << 32));
  int64_t bad = 0;
  for (int i = 0; i < 2000; ++i) bad += a.random() != b.random();
  EXPECT_EQ(bad, 0);
  // And the fixture drawn by torch with seed 2**32 + 7:
  Generator c(0);
  c.manual_seed((uint64_t{1} << 32) + 7);
  expect_fixture("rand_1000_seed2p32p7", rand({1000}, c));
}

TEST(RandomEngine, ManualSeedRestartsTheStream) {
  Generator gen(42);
  std::vector<uint32_t> first(700), again(700);
  for (auto& v : first) v = gen.random();
  gen.manual_seed(42);
  for (auto& v : again) v = gen.random();
  EXPECT_EQ(first, again);
}

// ---- Uniform -----------------------------------------------------------------------------------

TEST(RandomUniform, Rand3x2ThreeCallsSeed123) {
  Generator gen(123);
  for (int i = 0; i < 3; ++i) expect_fixture("rand_3x2_seed123_call" + std::to_string(i), rand({3, 2}, gen));
}

TEST(RandomUniform, RandSeveralSeeds) {
  for (uint64_t seed : {0, 42}) {
    Generator gen(seed);
    expect_fixture("rand_1000_seed" + std::to_string(seed), rand({1000}, gen));
  }
}

TEST(RandomUniform, RandIsTheSameInBothFlavours) {
  Generator gen(0, RngFlavor::kScalar);
  expect_fixture("rand_1000_seed0", rand({1000}, gen));
}

TEST(RandomUniform, UniformDoubleHas53Bits) {
  Generator gen(5);
  const auto& want = fx().at("rand_f64_100_seed5").values;
  int64_t bad = 0;
  for (double w : want) bad += gen.uniform_double() != w;
  EXPECT_EQ(bad, 0) << bad << " of " << want.size() << " float64 values differ";
}

TEST(RandomUniform, RangeMinus03To17) {
  // The float range is exactly 2.0, so the fused and unfused kernels agree here.
  for (RngFlavor f : {RngFlavor::kX86Avx2, RngFlavor::kScalar}) {
    Generator gen(123, f);
    Tensor t = Tensor::empty({1000});
    uniform_(t, -0.3, 1.7, gen);
    expect_fixture("uniform_m0.3_1.7_1000_seed123", t);
  }
}

TEST(RandomUniform, RangeUsesFmaOnlyInAvx2Flavour) {
  for (RngFlavor f : {RngFlavor::kX86Avx2, RngFlavor::kScalar}) {
    Generator gen(123, f);
    Tensor t = Tensor::empty({1000});
    uniform_(t, -0.37, 1.1, gen);
    expect_fixture(std::string(prefix(f)) + "uniform_m0.37_1.1_1000_seed123", t);
  }
}

TEST(RandomUniform, TransposedViewIsFilledInMemoryOrder) {
  Generator gen(123);
  Tensor base = Tensor::empty({3, 5});
  TensorView t = base.t();
  uniform_(t, 0.0, 1.0, gen);
  expect_fixture("uniform_empty3x5_t_seed123", t);
  // Memory order means the *storage* holds consecutive draws.
  Generator again(123);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(base.data()[i], again.uniform_float(0.0, 1.0)) << i;
}

TEST(RandomUniform, SlicedViewFillsOnlyItsElements) {
  Generator gen(123);
  Tensor base({4, 8});
  uniform_(base.slice(1, 0, 5), -1.0, 3.0, gen);
  expect_fixture("uniform_m1_3_slice4x8_first5cols_seed123", base);
}

TEST(RandomUniform, RejectsReversedRange) {
  Tensor t({4});
  EXPECT_THROW(uniform_(t, 1.0, 0.0), ValueError);
}

// ---- Normal ------------------------------------------------------------------------------------

TEST(RandomNormal, Randn5UsesScalarPathAndLeavesCachedValue) {
  Generator gen(123);
  expect_fixture("randn_5_seed123", randn({5}, gen));
  // 3 Box-Muller pairs were drawn; the 6th value stays cached (value from RNG_SPEC.md §4.2).
  EXPECT_EQ(gen.normal_double(0.0, 1.0), 0.20926935685808373);
}

TEST(RandomNormal, Randn20VectorPathWithOverlappingTailBlock) {
  Generator gen(123);
  expect_fixture("randn_20_seed123", randn({20}, gen));
}

TEST(RandomNormal, Exactly16AndSeventeen) {
  Generator gen(11);
  expect_fixture("randn_4x4_seed11", randn({4, 4}, gen));
  gen.manual_seed(11);
  expect_fixture("randn_17_seed11", randn({17}, gen));
}

TEST(RandomNormal, MixedSequenceSharesTheCacheAcrossScalarCalls) {
  // randn(5) leaves a cached value that randn(3) starts with (then caches a new one);
  // randn(16) takes the vector path and ignores the cache; randn(1) gets the cached value.
  Generator gen(123);
  const int sizes[] = {5, 3, 16, 1};
  for (int i = 0; i < 4; ++i) {
    expect_fixture("randn_mixed_seed123_call" + std::to_string(i) + "_n" + std::to_string(sizes[i]),
                   randn({sizes[i]}, gen));
  }
}

TEST(RandomNormal, ScalarPathWithMeanAndStd) {
  Generator gen(99);
  Tensor t = Tensor::empty({7});
  normal_(t, 0.5, 2.0, gen);
  expect_fixture("normal_0.5_2_scalar7_seed99", t);
}

TEST(RandomNormal, CachedValueSurvivesAcrossCalls) {
  Generator gen(99);
  Tensor a = Tensor::empty({3}), b = Tensor::empty({4});
  normal_(a, 0.5, 2.0, gen);
  normal_(b, 0.5, 2.0, gen);  // starts with the value cached by the first call
  std::vector<float> both = a.to_vector();
  for (float v : b.to_vector()) both.push_back(v);
  expect_fixture_values("normal_0.5_2_scalar3then4_seed99", both);
}

TEST(RandomNormal, ManualSeedClearsTheCache) {
  Generator gen(123);
  Tensor first = randn({1}, gen);  // leaves a cached value
  gen.manual_seed(123);
  Tensor again = randn({1}, gen);  // must draw fresh, not use the cache
  EXPECT_EQ(std::bit_cast<uint32_t>(first.data()[0]), std::bit_cast<uint32_t>(again.data()[0]));
  expect_fixture("randn_1_after_reseed_seed123", again);
}

TEST(RandomNormal, VectorPathIgnoresTheCache) {
  Generator a(7), b(7);
  randn({1}, a);  // a now holds a cached value, b does not
  for (int i = 0; i < 4; ++i) b.random();  // same engine position
  const Tensor x = randn({32}, a), y = randn({32}, b);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), 32 * sizeof(float)), 0);
}

TEST(RandomNormal, NonContiguousViewUsesScalarPathInMemoryOrder) {
  Generator gen(321);
  Tensor base = Tensor::empty({4, 8});
  TensorView t = base.t();  // 32 elements, but not contiguous
  normal_(t, 0.0, 1.0, gen);
  expect_fixture("normal_empty4x8_t_seed321", t);
}

TEST(RandomNormal, RejectsNegativeStd) {
  Tensor t({4});
  EXPECT_THROW(normal_(t, 0.0, -1.0), ValueError);
}

// ---- Flavour-dependent: AVX2 (Cephes + FMA) vs DEFAULT kernel (libm, no FMA) --------------------

class RandomFlavour : public ::testing::TestWithParam<RngFlavor> {};

TEST_P(RandomFlavour, Randn1000) {
  for (uint64_t seed : {0, 123, 2024}) {
    Generator gen(seed, GetParam());
    expect_fixture(std::string(prefix(GetParam())) + "randn_1000_seed" + std::to_string(seed),
                   randn({1000}, gen));
  }
}

TEST_P(RandomFlavour, LargeRandn) {
  Generator gen(7, GetParam());
  const Tensor big = randn({4, 8, 32, 512}, gen);
  const std::string p = prefix(GetParam());
  const float* d = big.data();
  const int64_t n = big.numel();
  std::vector<float> every, head(d, d + 256), tail(d + n - 256, d + n);
  for (int64_t i = 0; i < n; i += 211) every.push_back(d[i]);
  expect_fixture_values(p + "randn_4x8x32x512_seed7_every211", every);
  expect_fixture_values(p + "randn_4x8x32x512_seed7_head256", head);
  expect_fixture_values(p + "randn_4x8x32x512_seed7_tail256", tail);
}

TEST_P(RandomFlavour, NormalVectorPathWithMeanAndStd) {
  Generator gen(99, GetParam());
  Tensor t = Tensor::empty({1000});
  normal_(t, 0.5, 2.0, gen);
  expect_fixture(std::string(prefix(GetParam())) + "normal_0.5_2_vec1000_seed99", t);
}

TEST_P(RandomFlavour, Linear768x64) {
  Generator gen(1, GetParam());
  Tensor w = Tensor::empty({64, 768}), b = Tensor::empty({64});
  kaiming_uniform_linear_(w, gen);
  uniform_(b, -1.0 / std::sqrt(768.0), 1.0 / std::sqrt(768.0), gen);  // bias drawn after the weight
  const std::string p = prefix(GetParam());
  if (GetParam() == RngFlavor::kX86Avx2) {
    expect_fixture(p + "linear768x64_seed1_weight", w);
  } else {
    expect_fixture(p + "linear768x64_seed1_weight_rows0to31", w.slice(0, 0, 32));
  }
  expect_fixture(p + "linear768x64_seed1_bias", b);
}

INSTANTIATE_TEST_SUITE_P(Flavours, RandomFlavour, ::testing::Values(RngFlavor::kX86Avx2, RngFlavor::kScalar),
                         [](const auto& info) {
                           return std::string(info.param == RngFlavor::kX86Avx2 ? "Avx2" : "Scalar");
                         });

// The flavour tests only mean something if the two kernels' outputs differ.
TEST(RandomFlavourDiscriminates, FixturesAndImplementationsDiffer) {
  for (const char* name : {"randn_1000_seed0", "uniform_m0.37_1.1_1000_seed123", "linear768x64_seed1_bias",
                           "randn_4x8x32x512_seed7_every211"}) {
    const auto& avx2 = fx().at(std::string("avx2/") + name).values;
    const auto& scalar = fx().at(std::string("scalar/") + name).values;
    ASSERT_EQ(avx2.size(), scalar.size());
    int64_t diff = 0;
    for (size_t i = 0; i < avx2.size(); ++i) diff += avx2[i] != scalar[i];
    EXPECT_GT(diff, 0) << name << ": the AVX2 and DEFAULT fixtures are identical";
  }
  // And our kScalar output does not match the AVX2 fixture (nor the reverse).
  for (RngFlavor f : {RngFlavor::kX86Avx2, RngFlavor::kScalar}) {
    Generator gen(0, f);
    const std::string other = f == RngFlavor::kX86Avx2 ? "scalar/" : "avx2/";
    EXPECT_GT(count_mismatches(randn({1000}, gen).to_vector(), fx().at(other + "randn_1000_seed0").values), 0);
  }
}

// ---- nn.Linear / nn.Embedding init --------------------------------------------------------------

TEST(RandomInit, ThreeLinear3x2Seed789) {
  Generator gen(789);
  for (const char* name : {"query", "key", "value"}) {
    Tensor w = Tensor::empty({2, 3});
    kaiming_uniform_linear_(w, gen);
    expect_fixture(std::string("linear3x2_seed789_") + name, w);
  }
}

TEST(RandomInit, KaimingUsesDefaultGenerator) {
  manual_seed(789);
  Tensor w = Tensor::empty({2, 3});
  kaiming_uniform_linear_(w);
  expect_fixture("linear3x2_seed789_query", w);
}

TEST(RandomInit, KaimingRejectsNon2DWeight) {
  Tensor w({2, 3, 4});
  EXPECT_THROW(kaiming_uniform_linear_(w), ShapeError);
  Tensor v({6});
  EXPECT_THROW(kaiming_uniform_linear_(v), ShapeError);
}

TEST(RandomInit, EmbeddingVectorAndScalarPaths) {
  Generator gen(123);
  Tensor e({6, 16});
  normal_(e, 0.0, 1.0, gen);  // 96 >= 16: vector path
  expect_fixture("embedding6x16_seed123", e);
  gen.manual_seed(123);
  Tensor s({3, 5});
  normal_(s, 0.0, 1.0, gen);  // 15 < 16: scalar path
  expect_fixture("embedding3x5_seed123", s);
}

// ---- Bernoulli / dropout -------------------------------------------------------------------------

TEST(RandomBernoulli, DropoutOnOnes6x6Seed123) {
  manual_seed(123);
  const double p = 0.5;
  Tensor noise = Tensor::empty({6, 6});
  bernoulli_(noise, 1.0 - p);
  const float scale = static_cast<float>(1.0 - p);
  Tensor out = Tensor::ones({6, 6});
  for (int64_t i = 0; i < out.numel(); ++i) out.data()[i] *= noise.data()[i] / scale;
  expect_fixture("dropout0.5_ones6x6_seed123", out);
}

TEST(RandomBernoulli, P03On100Elements) {
  Generator gen(123);
  Tensor t = Tensor::empty({100});
  bernoulli_(t, 0.3, gen);
  expect_fixture("bernoulli0.3_100_seed123", t);
}

TEST(RandomBernoulli, TransposedViewInMemoryOrder) {
  Generator gen(4);
  Tensor base = Tensor::empty({10, 10});
  bernoulli_(base.t(), 0.3, gen);
  expect_fixture("bernoulli0.3_empty10x10_t_seed4", base.t());
}

TEST(RandomBernoulli, ProbabilityOutsideUnitIntervalThrows) {
  Tensor t({4});
  for (double p : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      bernoulli_(t, p);
      ADD_FAILURE() << "no exception for p=" << p;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("p="), std::string::npos) << e.what();
    }
  }
}

TEST(RandomBernoulli, EdgeProbabilities) {
  Generator gen(1);
  Tensor t({50});
  bernoulli_(t, 0.0, gen);
  for (float v : t.to_vector()) EXPECT_EQ(v, 0.0f);
  bernoulli_(t, 1.0, gen);
  for (float v : t.to_vector()) EXPECT_EQ(v, 1.0f);
}

// ---- Default generator ---------------------------------------------------------------------------

TEST(RandomDefault, ManualSeedSeedsTheProcessGenerator) {
  manual_seed(123);
  EXPECT_EQ(default_generator().initial_seed(), 123u);
  expect_fixture("rand_3x2_seed123_call0", rand({3, 2}));
  expect_fixture("rand_3x2_seed123_call1", rand({3, 2}));
  EXPECT_EQ(&default_generator(), &default_generator());
}

}  // namespace
}  // namespace attn

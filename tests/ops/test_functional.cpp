// The functional core against PyTorch 1.13.1 (fixtures from tests/fixtures/gen_functional.py).
//
// Inputs are not stored: attn's generator reproduces torch's, so each test re-creates its inputs
// with the seed and the sequence of randn/rand calls the script uses (keep the two in step).
// Exact ops (masks, triangles, dropout, embedding, cat/stack) are compared value for value;
// float arithmetic (matmul, softmax, linear, reductions) within a tight relative tolerance and,
// for products, also against the float64 product of the same float32 inputs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/random.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("functional.txt");
  return f;
}

bool same_value(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// Expects `actual` to have the fixture's shape and values within |a - e| <= atol + rtol * |e|.
// NaN must meet NaN and infinities must be equal; reports the count and the worst element.
void expect_close(const std::string& name, const TensorView& actual, double rtol, double atol) {
  SCOPED_TRACE(name);
  const test::FixtureTensor& want = fx().at(name);
  ASSERT_EQ(actual.shape(), want.shape) << actual.shape().str() << " vs " << want.shape.str();
  const std::vector<float> got = actual.to_vector();
  int64_t bad = 0, worst = -1;
  double worst_excess = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = got[i], e = want.values[i];
    if (std::isnan(e) || std::isinf(e) || std::isnan(a) || std::isinf(a)) {
      if (!same_value(a, e)) {
        ++bad;
        if (worst < 0) worst = static_cast<int64_t>(i);
      }
      continue;
    }
    const double excess = std::abs(a - e) / (atol + rtol * std::abs(e));
    if (excess > 1.0) {
      ++bad;
      if (excess > worst_excess) worst_excess = excess, worst = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << got.size() << " values outside atol " << atol << " rtol "
                    << rtol << "; worst at [" << worst << "]: got "
                    << (worst >= 0 ? fmt::format("{:.9g} want {:.9g}", got[worst], want.values[worst])
                                   : std::string());
}

// Value-for-value equality (-0 == +0, NaN == NaN).
void expect_equal(const std::string& name, const TensorView& actual) {
  SCOPED_TRACE(name);
  const test::FixtureTensor& want = fx().at(name);
  ASSERT_EQ(actual.shape(), want.shape) << actual.shape().str() << " vs " << want.shape.str();
  const std::vector<float> got = actual.to_vector();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!same_value(got[i], static_cast<float>(want.values[i]))) {
      if (bad++ == 0) first = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << got.size() << " values differ; first at [" << first
                    << "]: got " << (first >= 0 ? got[first] : 0.0f) << " want "
                    << (first >= 0 ? want.values[first] : 0.0);
}

// ---- matmul -------------------------------------------------------------------------------------

// Float32 torch.matmul and the float64 product of the same inputs. Against the float64 truth the
// rounding of a length-k sum of N(0,1) products grows like sqrt(k) ulps of the terms, so the
// absolute tolerance does too. Two float32 kernels (PyTorch's MKL, this machine's OpenBLAS core)
// sum in different orders, so they differ by as much: on an Intel Xeon (OpenBLAS's
// SapphireRapids kernel) a k = 128 entry of 0.689 came out 5e-6 away from PyTorch's, which a
// fixed 1e-6 rejected although both are within the float64 bound.
void check_matmul(const std::string& name, const TensorView& a, const TensorView& b) {
  const Tensor out = matmul(a, b);
  const double k = static_cast<double>(a.size(-1));
  expect_close("matmul/" + name, out, 1e-6, 1e-6 + 2e-6 * std::sqrt(k));
  expect_close("matmul/" + name + "/f64", out, 1e-6, 2e-6 * std::sqrt(k));
}

TEST(FunctionalMatmul, VectorDotVectorGivesScalar) {
  manual_seed(100);
  const Tensor a = randn({17}), b = randn({17});
  check_matmul("dot17", a, b);
  EXPECT_EQ(matmul(a, b).dim(), 0);
  EXPECT_EQ(dot(a, b).item(), matmul(a, b).item());
}

TEST(FunctionalMatmul, VectorTimesMatrixAndMatrixTimesVector) {
  manual_seed(101);
  const Tensor a = randn({13}), b = randn({13, 7});
  check_matmul("vec13_mat13x7", a, b);
  manual_seed(102);
  const Tensor c = randn({7, 13}), d = randn({13});
  check_matmul("mat7x13_vec13", c, d);
}

TEST(FunctionalMatmul, MatrixTimesMatrix) {
  manual_seed(103);
  const Tensor a = randn({9, 17}), b = randn({17, 11});
  check_matmul("mat9x17_mat17x11", a, b);
  manual_seed(104);
  const Tensor c = randn({64, 128}), d = randn({128, 96});
  check_matmul("mat64x128_mat128x96", c, d);
}

TEST(FunctionalMatmul, BatchedWithBroadcastBatchDims) {
  manual_seed(105);
  const Tensor a = randn({3, 9, 17}), b = randn({17, 5});
  check_matmul("batch3x9x17_mat17x5", a, b);
  manual_seed(106);
  const Tensor c = randn({9, 17}), d = randn({3, 17, 5});
  check_matmul("mat9x17_batch3x17x5", c, d);
  manual_seed(107);
  const Tensor e = randn({2, 1, 7, 6}), f = randn({3, 6, 5});
  check_matmul("batch2x1x7x6_batch3x6x5", e, f);  // (2,1) x (3) -> (2,3)
  manual_seed(108);
  const Tensor g = randn({1, 4, 5}), h = randn({3, 5, 2});
  check_matmul("batch1x4x5_batch3x5x2", g, h);
}

TEST(FunctionalMatmul, VectorWithBatchedOperand) {
  manual_seed(116);
  const Tensor a = randn({7}), b = randn({2, 3, 7, 4});
  check_matmul("vec7_batch2x3x7x4", a, b);
  manual_seed(117);
  const Tensor c = randn({2, 3, 4, 7}), d = randn({7});
  check_matmul("batch2x3x4x7_vec7", c, d);
}

TEST(FunctionalMatmul, TransposedOperandViews) {
  manual_seed(109);
  const Tensor q = randn({2, 3, 7, 16}), k = randn({2, 3, 9, 16});
  check_matmul("batch2x3x7x16_kT2x3x9x16", q, k.transpose(-2, -1));
  manual_seed(110);
  const Tensor a = randn({13, 7}), b = randn({13, 5});
  check_matmul("aT13x7_mat13x5", a.t(), b);
  manual_seed(111);
  const Tensor c = randn({11, 6}), d = randn({4, 11});
  check_matmul("aT_bT", c.t(), d.t());
}

TEST(FunctionalMatmul, NonBlasLayoutIsCopied) {
  // select() on the last dim leaves neither matrix stride equal to 1.
  manual_seed(112);
  const Tensor a = randn({6, 5, 7}), b = randn({4, 5, 3});
  const TensorView av = a.select(2, 3), bv = b.transpose(0, 1).select(2, 1);
  ASSERT_NE(av.stride(1), 1);
  ASSERT_NE(bv.stride(0), 1);
  ASSERT_NE(bv.stride(1), 1);
  check_matmul("select_last_6x5_by_5x4", av, bv);
}

TEST(FunctionalMatmul, SlicedOperandsUseLeadingDimension) {
  manual_seed(113);
  const Tensor a = randn({10, 20}), b = randn({12, 30});
  check_matmul("sliced6x12_sliced12x9", a.slice(0, 2, 8).slice(1, 3, 15), b.slice(1, 5, 14));
}

TEST(FunctionalMatmul, PermutedBatchDims) {
  manual_seed(114);
  const Tensor a = randn({5, 3, 4}), b = randn({3, 4, 6});
  check_matmul("batchT3x5x4_batch3x4x6", a.transpose(0, 1), b);
  // (B, L, H, E) with one head selected, times the transposed keys of another head.
  manual_seed(115);
  const Tensor q = randn({2, 7, 3, 8}), k = randn({2, 9, 3, 8});
  check_matmul("head_select_transpose", q.select(2, 1), k.select(2, 2).transpose(-2, -1));
}

TEST(FunctionalMatmul, MismatchedInnerDimsThrow) {
  EXPECT_THROW(matmul(Tensor({3, 4}), Tensor({5, 2})), ShapeError);
  EXPECT_THROW(matmul(Tensor({2, 3, 4}), Tensor({3, 4, 2})), ShapeError);  // batch 2 vs 3
}

// ---- softmax ------------------------------------------------------------------------------------

constexpr double kSoftmaxRtol = 1e-6;
constexpr double kSoftmaxAtol = 1e-12;

TEST(FunctionalSoftmax, EveryDimOf3D) {
  manual_seed(200);
  const Tensor x = randn({3, 4, 5});
  for (int d : {0, 1, 2, -1, -2, -3}) {
    expect_close(fmt::format("softmax/3x4x5_seed200/dim{}", d), softmax(x, d), kSoftmaxRtol, kSoftmaxAtol);
  }
}

TEST(FunctionalSoftmax, EveryDimOf4DWithOddLastDim) {
  manual_seed(201);
  const Tensor x = randn({2, 3, 5, 33});
  for (int d : {0, 1, 2, 3}) {
    expect_close(fmt::format("softmax/2x3x5x33_seed201/dim{}", d), softmax(x, d), kSoftmaxRtol, kSoftmaxAtol);
  }
}

TEST(FunctionalSoftmax, TransposedInput) {
  manual_seed(202);
  const Tensor base = randn({19, 6});
  expect_close("softmax/19x6T_seed202/dim-1", softmax(base.t(), -1), kSoftmaxRtol, kSoftmaxAtol);
  expect_close("softmax/19x6T_seed202/dim0", softmax(base.t(), 0), kSoftmaxRtol, kSoftmaxAtol);
}

TEST(FunctionalSoftmax, InfinitiesAndLargeValuesMatchTorch) {
  // Rows: some -inf; +1000 offset; *1000 spread; all -inf (NaN); one +inf (NaN); -1000 offset.
  const Tensor s = fx().at("softmax/special/input").tensor();
  const Tensor y = softmax(s, -1);
  expect_close("softmax/special/dim-1", y, kSoftmaxRtol, kSoftmaxAtol);
  expect_close("softmax/special/dim0", softmax(s, 0), kSoftmaxRtol, kSoftmaxAtol);
  // The -inf entries get exactly 0, the large-value rows are finite.
  EXPECT_EQ(y.at({0, 3}), 0.0f);
  EXPECT_EQ(y.at({0, 30}), 0.0f);
  for (int64_t j = 0; j < s.size(1); ++j) {
    EXPECT_TRUE(std::isfinite(y.at({1, j})) && std::isfinite(y.at({2, j})) && std::isfinite(y.at({5, j})));
    EXPECT_TRUE(std::isnan(y.at({3, j})));  // all -inf: NaN, as torch.softmax
  }
}

TEST(FunctionalSoftmax, RowsSumToOne) {
  manual_seed(210);
  const Tensor x = randn({4, 6, 7, 129});
  const Tensor scaled = mul(x, 30.0f);  // peaked rows too
  for (const TensorView& in : {TensorView(x), TensorView(scaled)}) {
    for (int d : {-1, 1}) {
      const Tensor y = softmax(in, d);
      const Tensor s = sum(y, d);
      double worst = 0.0;
      for (float v : s.to_vector()) worst = std::max(worst, std::abs(static_cast<double>(v) - 1.0));
      EXPECT_LE(worst, 1e-6) << "dim " << d;
    }
  }
}

TEST(FunctionalSoftmax, InvariantToShiftingARow) {
  manual_seed(211);
  const Tensor x = randn({5, 40});
  const Tensor a = softmax(x, -1), b = softmax(add(x, 500.0f), -1);
  const std::vector<float> va = a.to_vector(), vb = b.to_vector();
  // x + 500 rounds x to a coarser grid (ulp(500) = 3e-5): the weights move by about that much.
  for (size_t i = 0; i < va.size(); ++i) EXPECT_NEAR(va[i], vb[i], 1e-4 * va[i] + 1e-9) << i;
}

TEST(FunctionalSoftmaxNaive, EveryDimMatchesTorch) {
  manual_seed(204);
  const Tensor x = randn({4, 5, 23});
  for (int d : {0, 1, 2}) {
    expect_close(fmt::format("softmax_naive/4x5x23_seed204/dim{}", d), softmax_naive(x, d), 1e-6, 1e-12);
  }
}

TEST(FunctionalSoftmaxNaive, OverflowsLikeTorchOnLargeValues) {
  const Tensor s = fx().at("softmax/special/input").tensor();
  const Tensor y = softmax_naive(s, -1);
  expect_close("softmax_naive/special/dim-1", y, 1e-6, 1e-12);
  // Row 1 (+1000): exp overflows to inf, inf / inf = NaN; the stable softmax stays finite.
  EXPECT_TRUE(std::isnan(y.at({1, 0})));
  EXPECT_TRUE(std::isfinite(softmax(s, -1).at({1, 0})));
}

TEST(FunctionalSoftmaxNaive, AgreesWithStableSoftmaxOnSmallInputs) {
  manual_seed(212);
  const Tensor x = randn({8, 31});
  const std::vector<float> a = softmax(x, -1).to_vector(), b = softmax_naive(x, -1).to_vector();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * a[i] + 1e-9) << i;
}

TEST(FunctionalSoftmax, DimOutOfRangeThrows) {
  EXPECT_THROW(softmax(Tensor({2, 3}), 2), IndexError);
  EXPECT_THROW(softmax(Tensor({2, 3}), -3), IndexError);
  EXPECT_THROW(softmax_naive(Tensor({2, 3}), 5), IndexError);
}

// ---- masked_fill --------------------------------------------------------------------------------

// torch's (rand(shape) > 0.5) as a float 0/1 mask.
Tensor rand_mask(Shape shape, float threshold) {
  Tensor m = rand(shape);
  for (int64_t i = 0; i < m.numel(); ++i) m.data()[i] = m.data()[i] > threshold ? 1.0f : 0.0f;
  return m;
}

TEST(FunctionalMaskedFill, BroadcastMasksMatchTorch) {
  manual_seed(300);
  const Tensor x = randn({2, 3, 4, 5});
  const Tensor m1 = rand_mask({4, 5}, 0.5f);
  const Tensor m2 = rand_mask({2, 1, 1, 5}, 0.5f);
  expect_equal("masked_fill/mask4x5_neginf", masked_fill(x, m1, -std::numeric_limits<float>::infinity()));
  expect_equal("masked_fill/mask2x1x1x5_0.25", masked_fill(x, m2, 0.25f));
  expect_equal("masked_fill/xT_mask4x5_7", masked_fill(x.transpose(-2, -1), m1.t(), 7.0f));
}

TEST(FunctionalMaskedFill, InPlaceOnAView) {
  manual_seed(300);
  const Tensor x = randn({2, 3, 4, 5});
  const Tensor m1 = rand_mask({4, 5}, 0.5f);
  Tensor y = x;  // copy
  masked_fill_(y.transpose(-2, -1), m1.t(), 7.0f);  // same cells as masked_fill(x, m1, 7)
  const Tensor want = masked_fill(x, m1, 7.0f);
  EXPECT_EQ(y.to_vector(), want.to_vector());
}

TEST(FunctionalMaskedFill, ChapterCausalMask) {
  manual_seed(301);
  const Tensor sc = randn({6, 6});
  const Tensor causal = triu(Tensor::ones({6, 6}), 1);
  expect_equal("masked_fill/causal6x6", masked_fill(sc, causal, -std::numeric_limits<float>::infinity()));
}

TEST(FunctionalMaskedFill, MaskThatDoesNotBroadcastToSelfThrows) {
  EXPECT_THROW(masked_fill(Tensor({4, 5}), Tensor({3, 4, 5}), 0.0f), ShapeError);
  EXPECT_THROW(masked_fill(Tensor({4, 5}), Tensor({4, 4}), 0.0f), ShapeError);
}

// ---- triu / tril --------------------------------------------------------------------------------

TEST(FunctionalTriangle, TriuTrilDiagonalsOnNonSquare) {
  manual_seed(400);
  const Tensor a = randn({2, 4, 6}), b = randn({6, 4});
  for (int64_t d : {-1, 0, 1, 2}) {
    expect_equal(fmt::format("triu/2x4x6/diag{}", d), triu(a, d));
    expect_equal(fmt::format("tril/2x4x6/diag{}", d), tril(a, d));
    expect_equal(fmt::format("triu/6x4/diag{}", d), triu(b, d));
    expect_equal(fmt::format("tril/6x4/diag{}", d), tril(b, d));
  }
  expect_equal("triu/6x4T/diag1", triu(b.t(), 1));
}

TEST(FunctionalTriangle, TriuPlusStrictTrilIsIdentity) {
  manual_seed(401);
  const Tensor x = randn({3, 5, 8});
  for (int64_t d : {-2, 0, 3}) {
    EXPECT_EQ(add(triu(x, d), tril(x, d - 1)).to_vector(), x.to_vector()) << d;
  }
}

TEST(FunctionalTriangle, LessThan2DThrows) {
  EXPECT_THROW(triu(Tensor({5})), ShapeError);
  EXPECT_THROW(tril(Tensor::scalar(1.0f)), ShapeError);
}

// ---- linear -------------------------------------------------------------------------------------

TEST(FunctionalLinear, OddSizesWithAndWithoutBias) {
  manual_seed(500);
  const Tensor x2 = randn({5, 17}), x3 = randn({2, 3, 17}), w = randn({29, 17}), b = randn({29});
  const Tensor x3t_base = randn({3, 2, 17});
  const TensorView x3t = x3t_base.transpose(0, 1);
  const std::pair<const char*, TensorView> inputs[] = {{"x5x17", x2}, {"x2x3x17", x3}, {"xT2x3x17", x3t}};
  for (const auto& [name, x] : inputs) {
    const Tensor yb = linear(x, w, b), yn = linear(x, w);
    expect_close(fmt::format("linear/{}/bias", name), yb, 1e-6, 1e-6);
    expect_close(fmt::format("linear/{}/nobias", name), yn, 1e-6, 1e-6);
    expect_close(fmt::format("linear/{}/bias/f64", name), yb, 2e-6, 2e-6);
    expect_close(fmt::format("linear/{}/nobias/f64", name), yn, 2e-6, 2e-6);
  }
}

TEST(FunctionalLinear, BadShapesThrow) {
  EXPECT_THROW(linear(Tensor({5, 16}), Tensor({29, 17})), ShapeError);
  EXPECT_THROW(linear(Tensor({5, 17}), Tensor({29, 17}), Tensor({28})), ShapeError);
  EXPECT_THROW(linear(Tensor({5, 17}), Tensor({29, 17, 1})), ShapeError);
}

// ---- dropout ------------------------------------------------------------------------------------

TEST(FunctionalDropout, TrainingMatchesTorchExactly) {
  manual_seed(600);
  const Tensor x = randn({7, 13});
  const std::pair<float, int> cases[] = {{0.3f, 601}, {0.5f, 602}, {0.1f, 603}, {0.75f, 604}};
  for (const auto& [p, seed] : cases) {
    Generator gen(seed);
    expect_equal(fmt::format("dropout/7x13/p{}_seed{}", p, seed), dropout(x, p, true, gen));
  }
}

TEST(FunctionalDropout, FourDimensionalAndDefaultGenerator) {
  manual_seed(610);
  const Tensor x = randn({2, 3, 5, 7});
  manual_seed(611);
  expect_equal("dropout/2x3x5x7/p0.2_seed611", dropout(x, 0.2f));
}

TEST(FunctionalDropout, TransposedInputDrawsInLogicalOrder) {
  manual_seed(620);
  const Tensor base = randn({9, 5});
  Generator gen(621);
  expect_equal("dropout/9x5T/p0.4_seed621", dropout(base.t(), 0.4f, true, gen));
}

TEST(FunctionalDropout, ConsecutiveCallsContinueTheStream) {
  Generator gen(630);
  const Tensor ones = Tensor::ones({4, 4});
  expect_equal("dropout/ones4x4_twice_seed630/call0", dropout(ones, 0.5f, true, gen));
  expect_equal("dropout/ones4x4_twice_seed630/call1", dropout(ones, 0.5f, true, gen));
}

TEST(FunctionalDropout, EvalModeIsIdentityAndDrawsNothing) {
  manual_seed(640);
  const Tensor x = randn({6, 11});
  Generator gen(1), fresh(1);
  const Tensor y = dropout(x, 0.5f, /*training=*/false, gen);
  EXPECT_EQ(y.to_vector(), x.to_vector());
  EXPECT_EQ(gen.random(), fresh.random());  // generator untouched
}

TEST(FunctionalDropout, ZeroProbabilityIsIdentityAndDrawsNothing) {
  manual_seed(641);
  const Tensor x = randn({6, 11});
  Generator gen(2), fresh(2);
  EXPECT_EQ(dropout(x.t(), 0.0f, true, gen).to_vector(), x.t().to_vector());
  EXPECT_EQ(gen.random(), fresh.random());
}

TEST(FunctionalDropout, ProbabilityOneGivesZerosAndDrawsNothing) {
  manual_seed(642);
  const Tensor x = randn({6, 11});
  Generator gen(3), fresh(3);
  const Tensor y = dropout(x, 1.0f, true, gen);
  EXPECT_EQ(y.shape(), x.shape());
  manual_seed(600);
  expect_equal("dropout/7x13/p1", dropout(randn({7, 13}), 1.0f, true, gen));  // torch's x * 0
  for (float v : y.to_vector()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(gen.random(), fresh.random());
}

TEST(FunctionalDropout, KeepsTheExpectation) {
  Generator gen(650);
  const Tensor y = dropout(Tensor::ones({1000, 1000}), 0.3f, true, gen);
  EXPECT_NEAR(mean(y).item(), 1.0, 0.01);
  // Every element is either dropped or scaled by exactly 1 / (1 - p) in float32.
  const float kept = 1.0f / (1.0f - 0.3f);
  int64_t zeros = 0, others = 0;
  for (float v : y.to_vector()) {
    if (v == 0.0f) ++zeros;
    else if (v != kept) ++others;
  }
  EXPECT_EQ(others, 0);
  EXPECT_NEAR(static_cast<double>(zeros) / 1e6, 0.3, 0.01);
}

TEST(FunctionalDropout, ProbabilityOutsideUnitIntervalThrows) {
  EXPECT_THROW(dropout(Tensor({3}), -0.1f), ValueError);
  EXPECT_THROW(dropout(Tensor({3}), 1.5f), ValueError);
  EXPECT_THROW(dropout(Tensor({3}), std::nanf("")), ValueError);
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(FunctionalEmbedding, GathersRowsLikeTorch) {
  manual_seed(700);
  const Tensor w = randn({11, 6});
  std::vector<int64_t> ids;
  for (double v : fx().at("embedding/ids").values) ids.push_back(static_cast<int64_t>(v));
  expect_equal("embedding/11x6_ids2x5", embedding(ids, {2, 5}, w));
  const Tensor wt = randn({6, 11});  // drawn after, used transposed
  expect_equal("embedding/11x6T", embedding(ids, {2, 5}, wt.t()));
}

TEST(FunctionalEmbedding, OutOfRangeIdThrows) {
  const Tensor w({4, 3});
  const std::vector<int64_t> bad = {0, 4};
  EXPECT_THROW(embedding(bad, {2}, w), IndexError);
  const std::vector<int64_t> neg = {-1};
  EXPECT_THROW(embedding(neg, {1}, w), IndexError);
}

// ---- reductions ---------------------------------------------------------------------------------

TEST(FunctionalReduce, SumAllAndAlongEachDim) {
  manual_seed(800);
  const Tensor x = randn({3, 5, 37});
  expect_close("sum/3x5x37", sum(x), 1e-6, 1e-6);
  for (int d : {0, 1, 2, -1}) {
    expect_close(fmt::format("sum/3x5x37/dim{}", d), sum(x, d), 1e-6, 1e-6);
    expect_close(fmt::format("sum/3x5x37/dim{}_keepdim", d), sum(x, d, true), 1e-6, 1e-6);
  }
}

TEST(FunctionalReduce, MeanAndVarianceBothBiases) {
  manual_seed(800);
  const Tensor x = randn({3, 5, 37});
  expect_close("mean/3x5x37", mean(x), 1e-6, 1e-7);
  expect_close("var/3x5x37/unbiased", var(x, true), 1e-6, 0.0);
  expect_close("var/3x5x37/biased", var(x, false), 1e-6, 0.0);
}

TEST(FunctionalReduce, NonContiguousInput) {
  manual_seed(800);
  const Tensor x = randn({3, 5, 37});
  const TensorView xt = x.transpose(0, 2);
  expect_close("sum/3x5x37T", sum(xt), 1e-6, 1e-6);
  expect_close("sum/3x5x37T/dim1", sum(xt, 1), 1e-6, 1e-6);
  expect_close("mean/3x5x37T", mean(xt), 1e-6, 1e-7);
  expect_close("var/3x5x37T/unbiased", var(xt, true), 1e-6, 0.0);
}

TEST(FunctionalReduce, LongVector) {
  manual_seed(801);
  const Tensor big = add(randn({10007}), 3.0f);
  const Tensor s = sum(big);
  expect_close("sum/10007", s, 1e-6, 0.0);
  expect_close("sum/10007/f64", s, 1e-6, 0.0);
  expect_close("mean/10007", mean(big), 1e-6, 0.0);
  expect_close("var/10007/unbiased", var(big, true), 1e-6, 0.0);
  expect_close("var/10007/biased", var(big, false), 1e-6, 0.0);
}

TEST(FunctionalReduce, BadArgumentsThrow) {
  EXPECT_THROW(sum(Tensor({2, 3}), 2), IndexError);
  EXPECT_THROW(var(Tensor({1}), true), ValueError);
  EXPECT_NO_THROW(var(Tensor({1}), false));
}

// ---- cat / stack --------------------------------------------------------------------------------

TEST(FunctionalCatStack, CatAlongEachDim) {
  manual_seed(900);
  const Tensor a = randn({2, 3, 4}), b = randn({2, 5, 4}), c = randn({2, 3, 4}), d = randn({4, 3, 2});
  const TensorView ab[] = {a, b};
  expect_equal("cat/a_b_dim1", cat(ab, 1));
  const TensorView ac[] = {a, c};
  expect_equal("cat/a_c_dim0", cat(ac, 0));
  const TensorView aca[] = {a, c, a};
  expect_equal("cat/a_c_a_dim-1", cat(aca, -1));
  const TensorView adt[] = {a, d.transpose(0, 2)};
  expect_equal("cat/a_dT_dim2", cat(adt, 2));
}

TEST(FunctionalCatStack, StackAlongEachDim) {
  manual_seed(900);
  const Tensor a = randn({2, 3, 4}), b = randn({2, 5, 4}), c = randn({2, 3, 4}), d = randn({4, 3, 2});
  const TensorView ac[] = {a, c};
  for (int dim : {0, 1, 2, 3, -1}) expect_equal(fmt::format("stack/a_c_dim{}", dim), stack(ac, dim));
  const TensorView adc[] = {a, d.transpose(0, 2), c};
  expect_equal("stack/a_dT_c_dim1", stack(adc, 1));
}

TEST(FunctionalCatStack, MismatchedShapesThrow) {
  const Tensor a({2, 3}), b({3, 3});
  const TensorView ab[] = {a, b};
  EXPECT_THROW(cat(ab, 1), ShapeError);
  EXPECT_NO_THROW(cat(ab, 0));
  EXPECT_THROW(stack(ab, 0), ShapeError);
  EXPECT_THROW(cat(std::span<const TensorView>{}, 0), ValueError);
}

}  // namespace
}  // namespace attn

// exp2v, the softmax's 2^x in the fused, backward and decode kernels (flash_kernel.hpp), against
// float64's exp2. The AVX2 build and the generic one compile the same code (a polynomial after a
// round-to-nearest split, the edge cases handled by a clamp rather than compare-and-blend);
// here it is compiled for 4-lane SSE2 vectors, which every x86-64 CPU runs. The AVX-512 build
// has its own (exp2_avx512.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#define ATTN_SIMD_NS exp2_test
#define ATTN_SIMD_WIDTH 4
#include "sdpa/cpu/flash_kernel.hpp"

namespace {

using attn::cpu::exp2_test::exp2v;
using attn::cpu::exp2_test::vf;
constexpr float kInf = std::numeric_limits<float>::infinity();

// exp2v on four lanes, lane by lane results.
std::vector<float> exp2_lanes(float a, float b, float c, float d) {
  const vf r = exp2v(vf{a, b, c, d});
  return {r[0], r[1], r[2], r[3]};
}

// |got - 2^x| in units of the last place of the float32 nearest 2^x.
double ulps(float x, float got) {
  const double exact = std::exp2(static_cast<double>(x));
  const double ulp = std::ldexp(1.0, std::ilogb(exact) - 23);
  return std::fabs(static_cast<double>(got) - exact) / ulp;
}

TEST(Exp2v, WithinTwoUlpsOverTheSoftmaxRange) {
  // Scores minus their max lie in [-126, 0]; every 2^-12 step there, four per call.
  double worst = 0.0;
  float worst_x = 0.0f;
  for (int64_t i = 0; i <= 126 * 4096; i += 4) {
    const float x[4] = {static_cast<float>(-i) / 4096.0f, static_cast<float>(-(i + 1)) / 4096.0f,
                        static_cast<float>(-(i + 2)) / 4096.0f, static_cast<float>(-(i + 3)) / 4096.0f};
    const std::vector<float> r = exp2_lanes(x[0], x[1], x[2], x[3]);
    for (int l = 0; l < 4; ++l) {
      if (x[l] < -126.0f) continue;
      const double u = ulps(x[l], r[static_cast<size_t>(l)]);
      if (u > worst) worst = u, worst_x = x[l];
    }
  }
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
}

TEST(Exp2v, WithinTwoUlpsForPositiveArguments) {
  // The backward's exp2(s - lse) can be a rounding above 0; the domain goes up to 127.
  for (float x = 0.0f; x <= 127.0f; x += 0.0625f) {
    const std::vector<float> r = exp2_lanes(x, x + 0.015625f, x + 0.03125f, x + 0.046875f);
    for (int l = 0; l < 4; ++l) {
      const float xl = x + 0.015625f * static_cast<float>(l);
      if (xl > 127.0f) continue;
      EXPECT_LE(ulps(xl, r[static_cast<size_t>(l)]), 2.0) << "at x = " << xl;
    }
  }
}

TEST(Exp2v, IntegersAreExactPowersOfTwo) {
  for (int n = -126; n <= 127; n += 4) {
    const std::vector<float> r = exp2_lanes(static_cast<float>(n), static_cast<float>(std::min(n + 1, 127)),
                                            static_cast<float>(std::min(n + 2, 127)), static_cast<float>(std::min(n + 3, 127)));
    for (int l = 0; l < 4; ++l) {
      const int k = std::min(n + l, 127);
      EXPECT_EQ(r[static_cast<size_t>(l)], std::ldexp(1.0f, k)) << "at x = " << k;
    }
  }
  // exp2(0) = 1 exactly: the online softmax's rescale factor when the max does not move, which
  // forward_block then skips (a multiplication by 1).
  EXPECT_EQ(exp2_lanes(0.0f, -0.0f, 0.0f, 0.0f), (std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f}));
}

TEST(Exp2v, MaskedScoresGiveExactZero) {
  // -inf (a masked score) and anything at or below -127 give +0, never a tiny positive weight.
  const float lowest = std::numeric_limits<float>::lowest();
  for (const float x : {-kInf, lowest, -1e30f, -1000.0f, -200.0f, -127.5f, -127.0f}) {
    const std::vector<float> r = exp2_lanes(x, x, x, x);
    for (const float y : r) {
      EXPECT_EQ(y, 0.0f) << "at x = " << x;
      EXPECT_FALSE(std::signbit(y)) << "at x = " << x;
    }
  }
  // Between -127 and -126 the result is below the normal range: a subnormal or, under the
  // kernels' flush-to-zero, 0.
  const std::vector<float> r = exp2_lanes(-126.9f, -126.5f, -126.25f, -126.01f);
  for (const float y : r) {
    EXPECT_GE(y, 0.0f);
    EXPECT_LT(y, std::numeric_limits<float>::min());
  }
}

TEST(Exp2v, NaNStaysNaNLaneByLane) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> r = exp2_lanes(nan, -1.0f, -nan, -kInf);
  EXPECT_TRUE(std::isnan(r[0]));
  EXPECT_EQ(r[1], 0.5f);
  EXPECT_TRUE(std::isnan(r[2]));
  EXPECT_EQ(r[3], 0.0f);
}

}  // namespace

// Philox4x32 (attn/philox.hpp) against Random123's known answers, and the dropout mask built on
// it: the documented counter layout, the keep rate, and independence across seeds, offsets and
// coordinates. The SDPA paths that use the mask are tested in test_sdpa.cpp.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attn/philox.hpp"

namespace attn {
namespace {

using Ctr = std::array<uint32_t, 4>;
using Key = std::array<uint32_t, 2>;

struct Kat {
  Ctr ctr;
  Key key;
  Ctr want;
};

// Known-answer vectors of Random123's tests/kat_vectors file (columns: counter[4], key[2],
// expected[4]), as cut and pasted by D. E. Shaw Research into
// DEShawResearch/Random123-Boost, libs/random/test/test_philox.cpp (commit 916db91ae4c6),
// test_kat_philox4x32:
//   philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
//   philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
//   philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
//   philox4x32 7  00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
//   philox4x32 7  ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
//   philox4x32 7  243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
// (the third input is the hex digits of pi).
constexpr Kat kKat10[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};
constexpr Kat kKat7[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a}},
};

TEST(Philox, TenRoundsMatchRandom123KnownAnswers) {
  for (const Kat& k : kKat10) EXPECT_EQ(philox4x32_10(k.ctr, k.key), k.want);
}

TEST(Philox, SevenRoundsMatchRandom123KnownAnswers) {
  // A different round count checks the key schedule (bumped between rounds, not before the
  // first), which the 10-round answers alone could not tell apart from other schedules.
  for (const Kat& k : kKat7) EXPECT_EQ(philox4x32<7>(k.ctr, k.key), k.want);
}

TEST(PhiloxDropout, KeepFollowsTheDocumentedCounterLayout) {
  const uint64_t seed = 0x0123456789abcdefULL, offset = 0x500000007ULL;  // high offset bits unused
  const Key key = {0x89abcdefu, 0x01234567u};
  const float p = 0.5f;
  for (int64_t bh : {0, 3, 70000}) {
    for (int64_t i = 0; i < 9; ++i) {
      for (int64_t j : {0, 1, 1000}) {
        const Ctr ctr = {static_cast<uint32_t>(i >> 2), static_cast<uint32_t>(j),
                         static_cast<uint32_t>(bh), 7u};
        const uint32_t word = philox4x32_10(ctr, key)[static_cast<size_t>(i & 3)];
        EXPECT_EQ(philox_dropout_keep(seed, offset, bh, i, j, p), word >= 0x80000000u)
            << bh << " " << i << " " << j;
      }
    }
  }
}

TEST(PhiloxDropout, ThresholdIsFloorOfPTimes2To32) {
  EXPECT_EQ(philox_dropout_threshold(0.0f), 0u);
  EXPECT_EQ(philox_dropout_threshold(-0.0f), 0u);
  EXPECT_EQ(philox_dropout_threshold(0.5f), 0x80000000u);
  EXPECT_EQ(philox_dropout_threshold(0.25f), 0x40000000u);
  EXPECT_EQ(philox_dropout_threshold(0x1p-33f), 0u);  // floor(0.5)
  EXPECT_EQ(philox_dropout_threshold(0x1p-31f), 2u);
  // float 0.1 is 13421773 * 2^-27, so p * 2^32 = 429496736 exactly.
  EXPECT_EQ(philox_dropout_threshold(0.1f), 429496736u);
  EXPECT_EQ(philox_dropout_threshold(std::nextafter(1.0f, 0.0f)), 0xFFFFFF00u);
  EXPECT_EQ(philox_dropout_threshold(1.0f), 0xFFFFFFFFu);
}

TEST(PhiloxDropout, ZeroKeepsEverythingOneKeepsNothing) {
  std::vector<uint8_t> row(300);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 300; ++j) {
      ASSERT_TRUE(philox_dropout_keep(1, 0, 2, i, j, 0.0f));
      ASSERT_FALSE(philox_dropout_keep(1, 0, 2, i, j, 1.0f));
    }
    philox_dropout_keep_row(1, 0, 2, i, 1.0f, row);
    for (uint8_t k : row) ASSERT_EQ(k, 0);
    philox_dropout_keep_row(1, 0, 2, i, 0.0f, row);
    for (uint8_t k : row) ASSERT_EQ(k, 1);
  }
}

TEST(PhiloxDropout, RowFunctionMatchesPerElementKeep) {
  // The references use the row function, the fused kernel the per-element one.
  std::vector<uint8_t> row(257);
  for (float p : {0.1f, 0.37f, 0.9f}) {
    for (int64_t bh : {0, 5}) {
      for (int64_t i = 0; i < 11; ++i) {
        philox_dropout_keep_row(42, 3, bh, i, p, row);
        for (int64_t j = 0; j < 257; ++j) {
          ASSERT_EQ(row[static_cast<size_t>(j)] != 0, philox_dropout_keep(42, 3, bh, i, j, p))
              << p << " " << bh << " " << i << " " << j;
        }
      }
    }
  }
}

TEST(PhiloxDropout, KeepRateIsOneMinusPWithinThreeSigma) {
  // 10^6 draws over a (bh, i, j) grid shaped like attention weights: 4 x 250 x 1000.
  constexpr int64_t kBH = 4, kL = 250, kS = 1000;
  const double n = static_cast<double>(kBH * kL * kS);
  std::vector<uint8_t> row(kS);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    int64_t kept = 0;
    for (int64_t bh = 0; bh < kBH; ++bh) {
      for (int64_t i = 0; i < kL; ++i) {
        philox_dropout_keep_row(20240601, 0, bh, i, p, row);
        for (uint8_t k : row) kept += k;
      }
    }
    const double q = 1.0 - static_cast<double>(p), sigma = std::sqrt(q * (1.0 - q) / n);
    EXPECT_NEAR(static_cast<double>(kept) / n, q, 3.0 * sigma) << "p = " << p;
  }
}

// Fraction of 64 x 64 positions of batch-head `bh` where two masks differ.
double disagreement(uint64_t seed_a, uint64_t off_a, int64_t bh_a, uint64_t seed_b, uint64_t off_b,
                    int64_t bh_b) {
  int64_t differ = 0;
  for (int64_t i = 0; i < 64; ++i) {
    for (int64_t j = 0; j < 64; ++j) {
      differ += philox_dropout_keep(seed_a, off_a, bh_a, i, j, 0.5f) !=
                philox_dropout_keep(seed_b, off_b, bh_b, i, j, 0.5f);
    }
  }
  return static_cast<double>(differ) / 4096.0;
}

TEST(PhiloxDropout, MasksDifferAcrossSeedsOffsetsAndHeads) {
  // Independent masks at p = 0.5 disagree on half the positions (sigma ~ 0.008 for 4096).
  EXPECT_EQ(disagreement(7, 0, 0, 7, 0, 0), 0.0);                       // same coordinates
  EXPECT_NEAR(disagreement(7, 0, 0, 8, 0, 0), 0.5, 0.05);               // seed, low word
  EXPECT_NEAR(disagreement(7, 0, 0, 7 + (1ULL << 32), 0, 0), 0.5, 0.05);  // seed, high word
  EXPECT_NEAR(disagreement(7, 0, 0, 7, 1, 0), 0.5, 0.05);               // offset
  EXPECT_NEAR(disagreement(7, 0, 0, 7, 0, 1), 0.5, 0.05);               // batch*head
  // Within one mask, rows sharing a Philox call (i, i+1 use different output words) and
  // neighbouring blocks of four rows are not copies of each other.
  int64_t same_lane = 0, same_block = 0;
  for (int64_t j = 0; j < 4096; ++j) {
    same_lane += philox_dropout_keep(7, 0, 0, 0, j, 0.5f) == philox_dropout_keep(7, 0, 0, 1, j, 0.5f);
    same_block += philox_dropout_keep(7, 0, 0, 0, j, 0.5f) == philox_dropout_keep(7, 0, 0, 4, j, 0.5f);
  }
  EXPECT_NEAR(static_cast<double>(same_lane) / 4096.0, 0.5, 0.05);
  EXPECT_NEAR(static_cast<double>(same_block) / 4096.0, 0.5, 0.05);
}

}  // namespace
}  // namespace attn

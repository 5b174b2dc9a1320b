// The reuse cache of large tensor blocks (attn/memory.hpp): reuse, the fit rule, the limit,
// empty_cache, zeros on reused memory, huge-page blocks, and concurrent use. Each test sets the
// limit itself (the sanitizer builds start at 0) and puts back the one it found.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "attn/memory.hpp"
#include "attn/tensor.hpp"

namespace attn {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Floats for a block of `mib` MiB.
int64_t floats(std::size_t mib) { return static_cast<int64_t>(mib * kMiB / sizeof(float)); }

class CacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = cache_stats().limit_bytes;
    set_cache_limit(64 * kMiB);
    empty_cache();
  }
  void TearDown() override {
    empty_cache();
    set_cache_limit(saved_);
  }
  std::size_t saved_ = 0;
};

TEST_F(CacheTest, FreedLargeBlockServesTheNextAllocationOfItsSize) {
  const void* first = nullptr;
  {
    Tensor t = Tensor::empty({floats(4)});
    first = t.raw_data();
  }
  EXPECT_EQ(cache_stats().cached_blocks, 1u);
  EXPECT_EQ(cache_stats().cached_bytes, 4 * kMiB);
  const uint64_t hits = cache_stats().hits;
  Tensor again = Tensor::empty({floats(4)});
  EXPECT_EQ(again.raw_data(), first);
  EXPECT_EQ(cache_stats().hits, hits + 1);
  EXPECT_EQ(cache_stats().cached_bytes, 0u);
}

TEST_F(CacheTest, SmallTensorsAreNotCached) {
  { Tensor t = Tensor::empty({1000}); }
  EXPECT_EQ(cache_stats().cached_blocks, 0u);
}

TEST_F(CacheTest, ABlockOverTwiceTheRequestIsNotHandedOut) {
  { Tensor big = Tensor::empty({floats(8)}); }
  const uint64_t misses = cache_stats().misses;
  Tensor small = Tensor::empty({floats(3)});  // 8 MiB > 2 x 3 MiB
  EXPECT_EQ(cache_stats().misses, misses + 1);
  EXPECT_EQ(cache_stats().cached_bytes, 8 * kMiB);
  Tensor half = Tensor::empty({floats(4)});  // 8 MiB <= 2 x 4 MiB: reused
  EXPECT_EQ(cache_stats().cached_bytes, 0u);
}

TEST_F(CacheTest, TheSmallestFittingBlockIsTaken) {
  {
    Tensor a = Tensor::empty({floats(6)}), b = Tensor::empty({floats(4)}), c = Tensor::empty({floats(5)});
  }
  Tensor t = Tensor::empty({floats(4) - 100});
  EXPECT_EQ(cache_stats().cached_bytes, 12 * kMiB);  // the 4 MiB block went; 5 MiB took a 6 MiB block
}

// Blocks of 4 MiB or more are whole 2 MiB pages on a 2 MiB boundary, so Linux can back them with
// transparent huge pages (allocator.cpp); smaller ones keep the C library's 64-byte blocks.
TEST_F(CacheTest, BlocksOfFourMiBOrMoreAreWholeHugePages) {
  constexpr std::uintptr_t kHuge = 2 * kMiB;
  {
    Tensor big = Tensor::empty({floats(5) + 1});  // 5 MiB + 4 bytes: three 2 MiB pages
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.raw_data()) % kHuge, 0u);
    big.data()[big.numel() - 1] = 1.0f;
  }
  EXPECT_EQ(cache_stats().cached_bytes, 6 * kMiB);
  empty_cache();
  { Tensor small = Tensor::empty({floats(3) + 1}); }  // under 4 MiB: rounded to 64 bytes only
  EXPECT_EQ(cache_stats().cached_bytes, 3 * kMiB + 64);
}

TEST_F(CacheTest, KeptBytesNeverExceedTheLimitAndTheOldestGoFirst) {
  set_cache_limit(10 * kMiB);
  const void* newest = nullptr;
  {
    std::vector<Tensor> ts;
    for (int i = 0; i < 4; ++i) ts.push_back(Tensor::empty({floats(3)}));
    newest = ts.back().raw_data();
  }  // destroyed in order: 4 x 3 MiB offered, 3 kept
  EXPECT_EQ(cache_stats().cached_bytes, 9 * kMiB);
  EXPECT_LE(cache_stats().cached_bytes, cache_stats().limit_bytes);
  { Tensor over = Tensor::empty({floats(11)}); }  // larger than the limit: freed at once
  EXPECT_EQ(cache_stats().cached_bytes, 9 * kMiB);
  set_cache_limit(4 * kMiB);  // shrinking frees the oldest
  EXPECT_EQ(cache_stats().cached_blocks, 1u);
  EXPECT_EQ(cache_stats().cached_bytes, 3 * kMiB);
  Tensor t = Tensor::empty({floats(3)});
  EXPECT_EQ(t.raw_data(), newest);
}

TEST_F(CacheTest, EmptyCacheFreesEverythingAndKeepsTheLimit) {
  { Tensor a = Tensor::empty({floats(2)}), b = Tensor::empty({floats(2)}); }
  EXPECT_EQ(cache_stats().cached_blocks, 2u);
  empty_cache();
  EXPECT_EQ(cache_stats().cached_blocks, 0u);
  EXPECT_EQ(cache_stats().cached_bytes, 0u);
  EXPECT_EQ(cache_stats().limit_bytes, 64 * kMiB);
}

TEST_F(CacheTest, LimitZeroTurnsTheCacheOff) {
  { Tensor a = Tensor::empty({floats(2)}); }
  set_cache_limit(0);
  EXPECT_EQ(cache_stats().cached_blocks, 0u);
  { Tensor b = Tensor::empty({floats(2)}); }
  EXPECT_EQ(cache_stats().cached_blocks, 0u);
}

TEST_F(CacheTest, ZerosOnAReusedBlockAreZeros) {
  { Tensor dirty = Tensor::full({floats(2)}, NAN); }
  const Tensor z = Tensor::zeros({floats(2)});
  EXPECT_EQ(cache_stats().cached_blocks, 0u);  // it was the reused block
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data()[i], 0.0f) << i;
}

TEST_F(CacheTest, ReusedBlocksStayAlignedAndLargeEnough) {
  { Tensor t = Tensor::empty({floats(2) + 3}); }  // 2 MiB + 12 bytes: a block of 2 MiB + 64
  // Exactly 1 MiB asks for less than half the block: not handed out.
  Tensor half = Tensor::empty({floats(2)}, DType::kBFloat16);
  EXPECT_EQ(cache_stats().cached_blocks, 1u);
  // 1 MiB + 2 bytes (1 MiB + 64 rounded) is at least half of it: reused, aligned, all usable.
  Tensor u = Tensor::empty({floats(2) + 1}, DType::kBFloat16);
  EXPECT_EQ(cache_stats().cached_blocks, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(u.raw_data()) % 64, 0u);
  u.data_as<bfloat16>()[u.numel() - 1] = bfloat16{};  // ASan would flag an overrun
}

TEST_F(CacheTest, ConcurrentAllocationsNeverShareABlock) {
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::thread> pool;
  std::vector<int> bad(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([t, &bad] {
      for (int r = 0; r < kRounds; ++r) {
        Tensor x = Tensor::full({floats(1 + (r + t) % 3)}, static_cast<float>(t));
        for (int64_t i = 0; i < x.numel(); i += 4096) bad[static_cast<size_t>(t)] += x.data()[i] != static_cast<float>(t);
      }
    });
  }
  for (std::thread& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(bad[static_cast<size_t>(t)], 0) << "thread " << t;
  EXPECT_LE(cache_stats().cached_bytes, cache_stats().limit_bytes);
}

}  // namespace
}  // namespace attn

// The sequence layouts: which tokens each rank holds, shard() and gather() as inverses, and the
// zigzag's point: with is_causal every rank has the same number of visible (query, key) pairs.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/dist.hpp"

namespace attn::dist {
namespace {

TEST(DistLayout, ContiguousChunksCoverTheSequenceWithTheFirstOnesLonger) {
  // 10 tokens over 4 ranks: 3, 3, 2, 2.
  const std::vector<int64_t> sizes = {3, 3, 2, 2};
  int64_t next = 0;
  for (int r = 0; r < 4; ++r) {
    const auto rs = shard_ranges(10, 4, r, Layout::kContiguous);
    ASSERT_EQ(rs.size(), 1u);
    EXPECT_EQ(rs[0].first, next);
    EXPECT_EQ(rs[0].second - rs[0].first, sizes[static_cast<size_t>(r)]) << "rank " << r;
    next = rs[0].second;
  }
  EXPECT_EQ(next, 10);
}

TEST(DistLayout, ZigzagRankHoldsChunksRAnd2PMinus1MinusR) {
  // 11 tokens, 2 ranks, 4 chunks of 3, 3, 3, 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(shard_ranges(11, 2, 0, Layout::kZigzag), (R{{0, 3}, {9, 11}}));
  EXPECT_EQ(shard_ranges(11, 2, 1, Layout::kZigzag), (R{{3, 6}, {6, 9}}));
  // Every token exactly once, for lengths below, at and above 2P.
  for (int world : {1, 2, 3, 4}) {
    for (int64_t length : {0, 1, 5, 8, 37}) {
      std::vector<int> seen(static_cast<size_t>(length), 0);
      for (int r = 0; r < world; ++r) {
        for (const auto& [b, e] : shard_ranges(length, world, r, Layout::kZigzag)) {
          for (int64_t t = b; t < e; ++t) ++seen[static_cast<size_t>(t)];
        }
      }
      EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << world << " ranks, " << length;
    }
  }
}

TEST(DistLayout, ZigzagBalancesCausalWorkAndContiguousDoesNot) {
  const auto pairs = [](int64_t length, int world, int r, Layout layout) {
    int64_t n = 0;  // visible causal (i, j) pairs of rank r's queries: i + 1 each
    for (const auto& [b, e] : shard_ranges(length, world, r, layout)) {
      for (int64_t i = b; i < e; ++i) n += i + 1;
    }
    return static_cast<double>(n);
  };
  for (int world : {2, 3, 4, 8}) {
    std::vector<double> z, c;
    for (int r = 0; r < world; ++r) z.push_back(pairs(4099, world, r, Layout::kZigzag));
    for (int r = 0; r < world; ++r) c.push_back(pairs(4099, world, r, Layout::kContiguous));
    EXPECT_LE(*std::max_element(z.begin(), z.end()) / *std::min_element(z.begin(), z.end()), 1.01) << world;
    EXPECT_GT(*std::max_element(c.begin(), c.end()) / *std::min_element(c.begin(), c.end()), 2.0) << world;
  }
}

TEST(DistLayout, BadRanksAndLengthsAreValueErrors) {
  EXPECT_THROW(shard_ranges(10, 0, 0, Layout::kContiguous), ValueError);
  EXPECT_THROW(shard_ranges(10, 2, 2, Layout::kZigzag), ValueError);
  EXPECT_THROW(shard_ranges(-1, 2, 0, Layout::kZigzag), ValueError);
  EXPECT_THROW(shard(Tensor::zeros({5}), 2, 0, Layout::kZigzag), ShapeError);
}

TEST(DistLayout, GatherOfEveryRanksShardIsTheGlobalTensor) {
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  manual_seed(9);
  const Tensor global = randn({2, 3, 23, 5});
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag}) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor g = global.to(dt);
      const Tensor back = gather(shard(g, P, r, layout), MPI_COMM_WORLD, layout);
      ASSERT_EQ(back.shape(), g.shape());
      ASSERT_EQ(back.dtype(), dt);
      EXPECT_EQ(back.to(DType::kFloat32).to_vector(), g.to(DType::kFloat32).to_vector());
    }
  }
  // A strided view shards and gathers like its contiguous copy.
  const Tensor tc = global.transpose(1, 2).contiguous();
  const TensorView t = tc.transpose(1, 2);
  EXPECT_EQ(gather(shard(t, P, r, Layout::kZigzag), MPI_COMM_WORLD, Layout::kZigzag).to_vector(), global.to_vector());
}

}  // namespace
}  // namespace attn::dist

// MultiHeadAttention's cached forward (incremental decoding through a KVCacheLayer) and its
// `scale` override. The cached path must give, chunk by chunk, what the full causal forward
// gives for the same rows: the GPT's generation relies on it (tests/models/test_gpt.cpp checks
// it end to end), and here it is pinned at the module, where a misaligned mask or a wrong
// append offset would show first. A refused append must leave the cache as it was, so that a
// caller can catch the error and keep decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/modules.hpp"

namespace attn {
namespace {

using nn::KVCacheLayer;
using nn::MultiHeadAttention;

constexpr int64_t kBatch = 2, kDIn = 12, kDOut = 16, kHeads = 4, kContext = 16;

MultiHeadAttention make_module(Generator& gen) {
  MultiHeadAttention m(kDIn, kDOut, kContext, 0.0f, kHeads, true, gen);
  m.eval();
  return m;
}

// max |got[:, t, :] - want[:, offset + t, :]| over got's rows.
double max_abs_diff_rows(const Tensor& got, const Tensor& want, int64_t offset) {
  double worst = 0.0;
  for (int64_t b = 0; b < got.size(0); ++b)
    for (int64_t t = 0; t < got.size(1); ++t)
      for (int64_t j = 0; j < got.size(2); ++j) {
        worst = std::max(worst, static_cast<double>(std::abs(got.at({b, t, j}) -
                                                             want.at({b, offset + t, j}))));
      }
  return worst;
}

std::vector<float> values_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  return {c.data(), c.data() + c.numel()};
}

// Feeds x in chunks of the given sizes through forward_cached and compares every chunk with
// the full causal forward's rows.
void expect_chunks_equal_full(const MultiHeadAttention& m, const Tensor& x,
                              const std::vector<int64_t>& chunks) {
  const Tensor full = m.forward(x);
  KVCacheLayer cache = m.make_cache(kBatch);
  ASSERT_EQ(cache.capacity(), kContext);
  int64_t start = 0;
  for (int64_t n : chunks) {
    Tensor weights;
    const Tensor out = m.forward_cached(x.slice(1, start, start + n), cache, &weights);
    ASSERT_EQ(out.shape(), (Shape{kBatch, n, kDOut}));
    EXPECT_EQ(weights.shape(), (Shape{kBatch, kHeads, n, start + n}));
    EXPECT_LE(max_abs_diff_rows(out, full, start), 1e-6) << "chunk at position " << start;
    start += n;
    EXPECT_EQ(cache.length, start);
  }
}

TEST(MultiHeadAttentionCache, ChunkedCachedForwardEqualsFullCausalForward) {
  Generator gen(21);
  const MultiHeadAttention m = make_module(gen);
  const Tensor x = randn({kBatch, 10, kDIn}, gen);
  expect_chunks_equal_full(m, x, {5, 1, 1, 3});
  expect_chunks_equal_full(m, x, {10});
  expect_chunks_equal_full(m, x, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
}

TEST(MultiHeadAttentionCache, ScaleZeroAveragesUniformlyCachedAndFull) {
  Generator gen(22);
  MultiHeadAttention m = make_module(gen);
  m.scale = 0.0;
  const Tensor x = randn({kBatch, 7, kDIn}, gen);
  expect_chunks_equal_full(m, x, {4, 2, 1});
  // Every score is 0, so query i weighs each of positions 0..i by 1 / (i + 1).
  KVCacheLayer cache = m.make_cache(kBatch);
  Tensor weights;
  m.forward_cached(x, cache, &weights);
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t i = 0; i < 7; ++i)
      for (int64_t j = 0; j < 7; ++j) {
        const float want = j <= i ? 1.0f / static_cast<float>(i + 1) : 0.0f;
        EXPECT_NEAR(weights.at({1, h, i, j}), want, 1e-7) << "head " << h << " row " << i;
      }
}

TEST(MultiHeadAttentionCache, ScaleZeroGivesQueryAndKeyNoGradient) {
  Generator gen(23);
  MultiHeadAttention m = make_module(gen);
  m.train();
  m.scale = 0.0;
  const Tensor x = randn({kBatch, 6, kDIn}, gen);
  const Tensor out = m.forward(x);
  m.backward(Tensor::ones(out.shape()));
  for (const float g : values_of(m.W_query.grad_weight)) ASSERT_EQ(g, 0.0f);
  for (const float g : values_of(m.W_key.grad_weight)) ASSERT_EQ(g, 0.0f);
  const std::vector<float> gv = values_of(m.W_value.grad_weight);
  EXPECT_TRUE(std::any_of(gv.begin(), gv.end(), [](float g) { return g != 0.0f; }));
}

TEST(MultiHeadAttentionCache, AppendPastCapacityThrowsNamingItAndLeavesCacheUnchanged) {
  Generator gen(24);
  const MultiHeadAttention m = make_module(gen);
  KVCacheLayer cache = m.make_cache(kBatch, 8);
  m.forward_cached(randn({kBatch, 6, kDIn}, gen), cache);
  const std::vector<float> keys = values_of(cache.keys), values = values_of(cache.values);
  const Tensor too_many = randn({kBatch, 3, kDIn}, gen);
  try {
    m.forward_cached(too_many, cache);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("capacity = 8"), std::string::npos) << what;
    EXPECT_NE(what.find("cache.length = 6"), std::string::npos) << what;
  }
  EXPECT_EQ(cache.length, 6);
  EXPECT_EQ(values_of(cache.keys), keys);
  EXPECT_EQ(values_of(cache.values), values);
  // Two more positions still fit.
  EXPECT_NO_THROW(m.forward_cached(too_many.slice(1, 0, 2), cache));
  EXPECT_EQ(cache.length, 8);
}

TEST(MultiHeadAttentionCache, MismatchedCacheOrInputIsAShapeError) {
  Generator gen(25);
  const MultiHeadAttention m = make_module(gen);
  const Tensor x = randn({kBatch, 3, kDIn}, gen);
  KVCacheLayer wrong_heads(kBatch, kHeads / 2, kContext, kDOut / kHeads);
  EXPECT_THROW(m.forward_cached(x, wrong_heads), ShapeError);
  EXPECT_EQ(wrong_heads.length, 0);
  KVCacheLayer wrong_batch = m.make_cache(kBatch + 1);
  EXPECT_THROW(m.forward_cached(x, wrong_batch), ShapeError);
  KVCacheLayer cache = m.make_cache(kBatch);
  EXPECT_THROW(m.forward_cached(randn({kBatch, 3, kDIn + 1}, gen), cache), ShapeError);
  cache.length = kContext + 1;
  EXPECT_THROW(m.forward_cached(x, cache), ShapeError);
  EXPECT_THROW(KVCacheLayer(kBatch, kHeads, 0, 4), ValueError);
}

}  // namespace
}  // namespace attn

// The tiny GPT over the paged KV cache: 64 generated tokens equal full recomputation (logits
// and greedy tokens), a batch of prompts of different lengths gives each prompt's tokens alone,
// long prompts prefill in chunks, refused calls leave every layer unchanged, and 16-bit / int8
// KV stay close to float32 KV.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attn/error.hpp"
#include "attn/gpt.hpp"
#include "models/gpt_fixtures.hpp"

namespace attn {
namespace {

class PagedGPT : public test::OneThread {};

using gpt::GPTConfig;
using gpt::GPTModel;

using test::decode_config;

// A model whose logits differ visibly from step to step (sharper embeddings than the init).
GPTModel& sharp_model() {
  static GPTModel* m = [] {
    Generator gen(3);
    auto* model = new GPTModel(decode_config(), gen);
    normal_(model->tok_emb.weight, 0.0, 1.0, gen);
    model->eval();
    return model;
  }();
  return *m;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double m = 0.0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(double(x[i]) - double(y[i])));
  return m;
}

TEST_F(PagedGPT, SixtyFourStepsEqualFullRecompute) {
  const GPTModel& m = sharp_model();
  const std::vector<int64_t> prompt{3, 14, 15, 9, 2, 6};
  for (int64_t page_size : {1, 4, 16}) {
    gpt::SamplingOptions o;
    o.max_new_tokens = 64;
    o.page_size = page_size;
    std::vector<Tensor> paged, full;
    const std::vector<int64_t> a = gpt::generate(m, prompt, o, &paged);
    o.use_cache = false;
    const std::vector<int64_t> b = gpt::generate(m, prompt, o, &full);
    ASSERT_EQ(a.size(), 64u);
    ASSERT_EQ(paged.size(), 64u);
    EXPECT_EQ(a, b) << "page_size " << page_size;
    for (size_t s = 0; s < 64; ++s) EXPECT_LE(max_abs_diff(paged[s], full[s]), 1e-5) << "step " << s;
  }
}

TEST_F(PagedGPT, BatchGivesEachPromptsTokensAlone) {
  const GPTModel& m = sharp_model();
  const std::vector<std::vector<int64_t>> prompts{{3, 14, 15, 9, 2, 6}, {1}, {7, 7, 0, 19, 4, 4, 4, 11, 12, 13, 5, 8, 8, 1, 2, 3, 9, 10, 17, 18, 2},
                                                  {5, 6}};
  for (float temperature : {0.0f, 0.9f}) {
    gpt::SamplingOptions o;
    o.max_new_tokens = 40;
    o.temperature = temperature;
    o.seed = 5;
    o.page_size = 8;
    std::vector<std::vector<Tensor>> logits;
    const std::vector<std::vector<int64_t>> batch = gpt::generate_batch(m, prompts, o, &logits);
    ASSERT_EQ(batch.size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<Tensor> alone_logits;
      const std::vector<int64_t> alone = gpt::generate(m, prompts[i], o, &alone_logits);
      EXPECT_EQ(batch[i], alone) << "prompt " << i << " temperature " << temperature;
      ASSERT_EQ(logits[i].size(), alone_logits.size());
      for (size_t s = 0; s < alone_logits.size(); ++s) EXPECT_LE(max_abs_diff(logits[i][s], alone_logits[s]), 1e-5);
    }
  }
  // The context ends the longest first: 21 + 40 tokens fit in 80, the others too.
  gpt::SamplingOptions o;
  o.max_new_tokens = 70;
  const auto out = gpt::generate_batch(m, prompts, o);
  EXPECT_EQ(out[2].size(), 80u - 21u + 1u);
  EXPECT_EQ(out[1].size(), 70u);
}

TEST_F(PagedGPT, LongPromptsPrefillInChunksAndEqualTheFullForward) {
  const GPTModel& m = sharp_model();
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < 2 * 37; ++t) ids.push_back((t * 7 + 3) % 20);
  const Tensor full = m.forward(ids, 2, 37);
  gpt::PagedKVCache cache(m.config, 20, 4);
  const std::vector<int64_t> seqs{cache.add_sequence(), cache.add_sequence()};
  // 37 tokens each: chunks of 16, 16, 5; then 0 more would be refused (L > 0).
  const Tensor got = m.forward_paged(ids, 2, 37, cache, seqs);
  EXPECT_EQ(cache.length(0), 37);
  EXPECT_EQ(cache.length(1), 37);
  EXPECT_LE(max_abs_diff(got, full), 1e-5);
}

TEST_F(PagedGPT, RefusedCallsChangeNoLayer) {
  const GPTModel& m = sharp_model();
  gpt::PagedKVCache cache(m.config, 6, 4);
  const int64_t a = cache.add_sequence(), b = cache.add_sequence();
  const std::vector<int64_t> five{1, 2, 3, 4, 5};
  m.forward_paged(five, 1, 5, cache, std::vector<int64_t>{a});
  auto state = [&] {
    std::vector<int64_t> s;
    for (const PagedKvCache& l : cache.layers) {
      s.push_back(l.free_pages());
      for (int64_t id : l.sequences()) s.push_back(l.length(id));
    }
    return s;
  };
  const std::vector<int64_t> before = state();
  const std::vector<int64_t> two{1, 2}, bad_token{1, 99};
  EXPECT_THROW(m.forward_paged(two, 2, 1, cache, std::vector<int64_t>{a, a}), IndexError);
  EXPECT_THROW(m.forward_paged(two, 2, 1, cache, std::vector<int64_t>{a, 7}), IndexError);
  EXPECT_THROW(m.forward_paged(bad_token, 2, 1, cache, std::vector<int64_t>{a, b}), IndexError);
  EXPECT_THROW(m.forward_paged(two, 1, 2, cache, std::vector<int64_t>{a, b}), ShapeError);
  const std::vector<int64_t> many(76, 1);
  EXPECT_THROW(m.forward_paged(many, 1, 76, cache, std::vector<int64_t>{a}), ShapeError);  // past context
  const std::vector<int64_t> twenty(2 * 20, 1);
  // a needs 4 more pages, b 5: 9 > 4 free, although each alone would almost fit.
  EXPECT_THROW(m.forward_paged(twenty, 2, 20, cache, std::vector<int64_t>{a, b}), ValueError);
  EXPECT_EQ(state(), before);
  EXPECT_THROW(cache.free_sequence(9), IndexError);
  cache.free_sequence(a);
  EXPECT_FALSE(cache.contains(a));
  EXPECT_EQ(cache.add_sequence(), a);
}

TEST_F(PagedGPT, LowPrecisionKvStaysCloseToFloat32Kv) {
  const GPTModel& m = sharp_model();
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < 3 * 30; ++t) ids.push_back((t * 11 + 5) % 20);
  const Tensor f32 = gpt::decode_logits(m, ids, 3, 30, DType::kFloat32, 8);
  EXPECT_LE(max_abs_diff(f32, m.forward(ids, 3, 30)), 1e-5);
  // Loose bounds: the measured errors (docs/NUMERICS.md) are far smaller on a trained model.
  const std::pair<DType, double> bounds[] = {{DType::kFloat16, 0.02}, {DType::kBFloat16, 0.2}, {DType::kInt8, 0.3}};
  for (const auto& [dtype, bound] : bounds) {
    const double d = max_abs_diff(gpt::decode_logits(m, ids, 3, 30, dtype, 8), f32);
    EXPECT_GT(d, 0.0) << dtype_name(dtype);
    EXPECT_LE(d, bound) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace attn

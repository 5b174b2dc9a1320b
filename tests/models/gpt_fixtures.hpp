// What the tiny-GPT tests share: the one-thread fixture (with ctest running suites side by side
// on two cores, spinning OpenMP threads would make their thousands of tiny parallel regions
// crawl) and the model shape the decoding tests generate with.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include "attn/gpt.hpp"

namespace attn::test {

class OneThread : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = omp_get_max_threads();
    omp_set_num_threads(1);
  }
  void TearDown() override { omp_set_num_threads(saved_); }

 private:
  int saved_ = 1;
};

// Context 80: room for a prompt and 64 generated tokens.
inline gpt::GPTConfig decode_config() {
  gpt::GPTConfig c;
  c.vocab_size = 20;
  c.context_length = 80;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  return c;
}

}  // namespace attn::test

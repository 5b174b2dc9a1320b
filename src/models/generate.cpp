// Loss and perplexity on the scored positions, and token-by-token generation with or without the
// KV cache (greedy, temperature and top-k sampling).
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <functional>
#include <limits>
#include <optional>

#include "attn/error.hpp"
#include "attn/gpt.hpp"

namespace attn::gpt {

namespace {

// logits as rows (N, V), with the targets checked: -1 (not scored) or a class id.
Tensor rows_of(const TensorView& logits, std::span<const int64_t> targets, const char* what) {
  if (!logits.defined() || logits.dim() < 1 || logits.numel() == 0) {
    throw ShapeError(fmt::format("{}: logits must be (..., V) and non-empty", what));
  }
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  if (static_cast<int64_t>(targets.size()) != N) {
    throw ShapeError(fmt::format("{}: {} targets for {} rows of logits {}", what, targets.size(), N,
                                 logits.shape().str()));
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < -1 || targets[i] >= V) {
      throw IndexError(fmt::format("{}: target {} must be -1 (not scored) or in [0, {}), got {}", what, i,
                                   V, targets[i]));
    }
  }
  Tensor c = logits.contiguous();
  return Tensor(Shape{N, V}, std::span<const float>(c.data(), c.numel()));
}

// log(sum_j exp(row_j)) in float64.
double log_sum_exp(const float* row, int64_t V) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(row[j]));
  double s = 0.0;
  for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(row[j]) - m);
  return m + std::log(s);
}

int64_t argmax(const float* row, int64_t V) {
  return std::max_element(row, row + V) - row;
}

}  // namespace

double LossStats::perplexity() const { return std::exp(mean()); }

LossStats masked_cross_entropy(const TensorView& logits, std::span<const int64_t> targets) {
  // logits (N, V) or (B, T, V), targets N -> sums over the scored rows
  const Tensor x = rows_of(logits, targets, "masked_cross_entropy");
  const int64_t V = x.size(1);
  LossStats s;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0) continue;
    const float* row = x.data() + static_cast<int64_t>(i) * V;
    s.sum_nll += log_sum_exp(row, V) - static_cast<double>(row[targets[i]]);
    s.correct += argmax(row, V) == targets[i] ? 1 : 0;
    ++s.count;
  }
  return s;
}

Tensor masked_cross_entropy_backward(const TensorView& logits, std::span<const int64_t> targets) {
  // logits (..., V), targets N -> d(mean loss)/d(logits), logits' shape
  const Tensor x = rows_of(logits, targets, "masked_cross_entropy_backward");
  const int64_t V = x.size(1);
  const int64_t count = std::count_if(targets.begin(), targets.end(), [](int64_t t) { return t >= 0; });
  Tensor grad(logits.shape());
  if (count == 0) return grad;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0) continue;
    const float* row = x.data() + static_cast<int64_t>(i) * V;
    float* g = grad.data() + static_cast<int64_t>(i) * V;
    const double lse = log_sum_exp(row, V);
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(static_cast<double>(row[j]) - lse) - (j == targets[i] ? 1.0 : 0.0);
      g[j] = static_cast<float>(p / static_cast<double>(count));
    }
  }
  return grad;
}

namespace {

// The next token from one row of logits (V): argmax, or a draw from softmax(logits / T)
// restricted to the top_k largest (ties at the k-th value included).
int64_t choose(const float* row, int64_t V, const SamplingOptions& o, Generator& gen) {
  if (o.temperature <= 0.0f) return argmax(row, V);
  std::vector<double> z(static_cast<size_t>(V));
  for (int64_t j = 0; j < V; ++j) z[static_cast<size_t>(j)] = static_cast<double>(row[j]) / o.temperature;
  if (o.top_k > 0 && o.top_k < V) {
    std::vector<double> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(), std::greater<>());
    const double kth = sorted[static_cast<size_t>(o.top_k - 1)];
    for (double& v : z) {
      if (v < kth) v = -std::numeric_limits<double>::infinity();
    }
  }
  const double m = *std::max_element(z.begin(), z.end());
  double total = 0.0;
  for (double& v : z) total += (v = std::exp(v - m));
  double u = gen.uniform_double() * total;
  for (int64_t j = 0; j < V; ++j) {
    u -= z[static_cast<size_t>(j)];
    if (u < 0.0) return j;
  }
  // Rounding left u >= 0: the last token with nonzero probability.
  for (int64_t j = V - 1; j >= 0; --j) {
    if (z[static_cast<size_t>(j)] > 0.0) return j;
  }
  return 0;
}

}  // namespace

std::vector<int64_t> generate(const GPTModel& model, std::span<const int64_t> prompt,
                              const SamplingOptions& o, std::vector<Tensor>* step_logits) {
  const GPTConfig& c = model.config;
  if (prompt.empty()) throw ValueError("generate: the prompt must have at least one token");
  if (static_cast<int64_t>(prompt.size()) > c.context_length) {
    throw ShapeError(fmt::format("generate: the prompt has {} tokens, more than the model's context "
                                 "length {}", prompt.size(), c.context_length));
  }
  check_ids(prompt, c.vocab_size, "generate: prompt");
  if (o.max_new_tokens < 0) {
    throw ValueError(fmt::format("generate: max_new_tokens must be >= 0, got {}", o.max_new_tokens));
  }
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature)) {
    throw ValueError(fmt::format("generate: temperature must be finite and >= 0, got {}", o.temperature));
  }
  if (o.top_k < 0) throw ValueError(fmt::format("generate: top_k must be >= 0, got {}", o.top_k));
  if (step_logits != nullptr) step_logits->clear();

  Generator gen(o.seed);
  std::vector<int64_t> seq(prompt.begin(), prompt.end()), out;
  const int64_t V = c.vocab_size;
  std::optional<KVCache> cache;
  Tensor logits;
  // Logits of the last position of `seq` (V), from the cache or from the whole sequence.
  auto last_logits = [&](std::span<const int64_t> fresh) {
    const int64_t n = static_cast<int64_t>(seq.size());
    if (o.use_cache) {
      logits = model.forward_cached(fresh, 1, static_cast<int64_t>(fresh.size()), *cache);
    } else {
      logits = model.forward(seq, 1, n);
    }
    const int64_t rows = logits.numel() / V;
    return Tensor(Shape{V}, std::span<const float>(logits.data() + (rows - 1) * V, V));
  };
  if (o.use_cache) cache.emplace(c, 1);
  Tensor row = last_logits(seq);
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    if (step_logits != nullptr) step_logits->push_back(row);
    const int64_t tok = choose(row.data(), V, o, gen);
    out.push_back(tok);
    seq.push_back(tok);
    // The new token has no position left to be fed at: stop at the context length.
    if (i + 1 == o.max_new_tokens || static_cast<int64_t>(seq.size()) > c.context_length) break;
    row = last_logits(std::span<const int64_t>(&seq.back(), 1));
  }
  return out;
}

}  // namespace attn::gpt

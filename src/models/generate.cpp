// Loss and perplexity on the scored positions, and token-by-token generation (greedy, temperature
// and top-k sampling) with the paged KV cache, for one prompt or a batch decoded together, or
// without a cache.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <functional>
#include <limits>
#include <optional>
#include <string>

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

namespace {

// The checks of generate() and generate_batch(), before anything runs; `name` is "the prompt"
// or "prompts[i]".
void check_prompt(const GPTConfig& c, std::span<const int64_t> prompt, const std::string& name) {
  if (prompt.empty()) throw ValueError(fmt::format("generate: {} must have at least one token", name));
  if (static_cast<int64_t>(prompt.size()) > c.context_length) {
    throw ShapeError(fmt::format("generate: {} has {} tokens, more than the model's context length {}", name,
                                 prompt.size(), c.context_length));
  }
  check_ids(prompt, c.vocab_size, fmt::format("generate: {}", name == "the prompt" ? "prompt" : name).c_str());
}

void check_sampling(const SamplingOptions& o) {
  if (o.max_new_tokens < 0) {
    throw ValueError(fmt::format("generate: max_new_tokens must be >= 0, got {}", o.max_new_tokens));
  }
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature)) {
    throw ValueError(fmt::format("generate: temperature must be finite and >= 0, got {}", o.temperature));
  }
  if (o.top_k < 0) throw ValueError(fmt::format("generate: top_k must be >= 0, got {}", o.top_k));
  if (o.page_size <= 0) throw ValueError(fmt::format("generate: page_size must be positive, got {}", o.page_size));
}

// The last row (V) of logits (..., V).
Tensor last_row(const Tensor& logits, int64_t V) {
  const int64_t rows = logits.numel() / V;
  return Tensor(Shape{V}, std::span<const float>(logits.data() + (rows - 1) * V, V));
}

// One prompt's generation in progress.
struct Stream {
  Stream(std::span<const int64_t> prompt, uint64_t seed) : seq(prompt.begin(), prompt.end()), gen(seed) {}
  std::vector<int64_t> seq, out;
  Generator gen;
  Tensor row;  // the logits the next token is chosen from
  int64_t id = -1;
  bool done = false;
};

// Chooses the stream's next token from its row; done when it has max_new_tokens or the new token
// has no position left to be fed at (the context length).
void advance(Stream& s, const SamplingOptions& o, int64_t context_length, std::vector<Tensor>* logits) {
  if (logits != nullptr) logits->push_back(s.row);
  const int64_t tok = choose(s.row.data(), s.row.numel(), o, s.gen);
  s.out.push_back(tok);
  s.seq.push_back(tok);
  s.done = static_cast<int64_t>(s.out.size()) == o.max_new_tokens ||
           static_cast<int64_t>(s.seq.size()) > context_length;
}

// Without a cache: the whole sequence again for every token.
std::vector<int64_t> generate_recomputing(const GPTModel& model, std::span<const int64_t> prompt,
                                          const SamplingOptions& o, std::vector<Tensor>* step_logits) {
  Stream s(prompt, o.seed);
  const int64_t V = model.config.vocab_size;
  while (static_cast<int64_t>(s.out.size()) < o.max_new_tokens && !s.done) {
    s.row = last_row(model.forward(s.seq, 1, static_cast<int64_t>(s.seq.size())), V);
    advance(s, o, model.config.context_length, step_logits);
  }
  return s.out;
}

}  // namespace

std::vector<std::vector<int64_t>> generate_batch(const GPTModel& model,
                                                 std::span<const std::vector<int64_t>> prompts,
                                                 const SamplingOptions& o,
                                                 std::vector<std::vector<Tensor>>* step_logits) {
  const GPTConfig& c = model.config;
  for (size_t i = 0; i < prompts.size(); ++i) {
    check_prompt(c, prompts[i], prompts.size() == 1 ? "the prompt" : fmt::format("prompts[{}]", i));
  }
  check_sampling(o);
  if (step_logits != nullptr) step_logits->assign(prompts.size(), {});
  auto logits_of = [&](size_t i) { return step_logits != nullptr ? &(*step_logits)[i] : nullptr; };
  std::vector<std::vector<int64_t>> outs;
  if (!o.use_cache) {
    for (size_t i = 0; i < prompts.size(); ++i) outs.push_back(generate_recomputing(model, prompts[i], o, logits_of(i)));
    return outs;
  }
  const int64_t V = c.vocab_size;
  // Every sequence feeds at most context_length tokens.
  PagedKVCache cache(c, PagedKVCache::pages_for(static_cast<int64_t>(prompts.size()), c.context_length, o.page_size),
                     o.page_size, o.kv_dtype);
  std::vector<Stream> streams;
  for (const std::vector<int64_t>& p : prompts) {
    Stream& s = streams.emplace_back(p, o.seed);
    s.id = cache.add_sequence();
    s.done = o.max_new_tokens == 0;
    if (s.done) continue;
    // Prefill alone: prompts differ in length.
    s.row = last_row(model.forward_paged(p, 1, static_cast<int64_t>(p.size()), cache, std::span(&s.id, 1)), V);
  }
  while (true) {
    std::vector<int64_t> ids, tokens;
    std::vector<size_t> live;
    for (size_t i = 0; i < streams.size(); ++i) {
      Stream& s = streams[i];
      if (s.done) continue;
      advance(s, o, c.context_length, logits_of(i));
      if (s.done) {
        cache.free_sequence(s.id);
        continue;
      }
      ids.push_back(s.id);
      tokens.push_back(s.seq.back());
      live.push_back(i);
    }
    if (live.empty()) break;
    const int64_t N = static_cast<int64_t>(live.size());
    const Tensor logits = model.forward_paged(tokens, N, 1, cache, ids);  // (N, 1, V)
    for (int64_t j = 0; j < N; ++j) {
      streams[live[static_cast<size_t>(j)]].row = Tensor(Shape{V}, std::span<const float>(logits.data() + j * V, V));
    }
  }
  for (Stream& s : streams) outs.push_back(std::move(s.out));
  return outs;
}

std::vector<int64_t> generate(const GPTModel& model, std::span<const int64_t> prompt,
                              const SamplingOptions& o, std::vector<Tensor>* step_logits) {
  const std::vector<std::vector<int64_t>> prompts{std::vector<int64_t>(prompt.begin(), prompt.end())};
  std::vector<std::vector<Tensor>> logits;
  std::vector<std::vector<int64_t>> out = generate_batch(model, prompts, o, step_logits != nullptr ? &logits : nullptr);
  if (step_logits != nullptr) *step_logits = std::move(logits.front());
  return std::move(out.front());
}

}  // namespace attn::gpt

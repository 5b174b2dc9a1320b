// The tiny GPT over a paged KV cache: one attn::PagedKvCache per block, and the model's forward
// for N sequences' newest tokens, each at its own position, so that prompts of different lengths
// decode together (generate_batch) and every K/V dtype of the cache can be compared on the
// model's own logits (decode_logits, `attn eval`).
#include <algorithm>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/gpt.hpp"
#include "kvcache/batch_checks.hpp"
#include "sdpa/paged_attention.hpp"

namespace attn::gpt {

// ---- PagedKVCache ---------------------------------------------------------------------------------

PagedKVCache::PagedKVCache(const GPTConfig& config, int64_t num_pages, int64_t page_size, DType dtype) {
  config.validate();
  PagedKvCacheOptions o;
  o.num_pages = num_pages;
  o.page_size = page_size;
  o.heads_kv = config.n_heads;
  o.head_dim = config.d_model / config.n_heads;
  o.dtype = dtype;
  layers.reserve(static_cast<size_t>(config.n_layers));
  for (int64_t l = 0; l < config.n_layers; ++l) layers.emplace_back(o);
}

int64_t PagedKVCache::pages_for(int64_t sequences, int64_t tokens, int64_t page_size) {
  if (sequences < 0 || tokens < 0 || page_size <= 0) {
    throw ValueError(fmt::format("PagedKVCache.pages_for: sequences ({}) and tokens ({}) must be >= 0 and "
                                 "page_size ({}) positive", sequences, tokens, page_size));
  }
  return std::max<int64_t>(1, sequences * ((tokens + page_size - 1) / page_size));
}

int64_t PagedKVCache::add_sequence() {
  // Every layer hands out the smallest free id, and they have seen the same calls.
  int64_t id = -1;
  for (PagedKvCache& layer : layers) id = layer.add_sequence();
  return id;
}

void PagedKVCache::free_sequence(int64_t seq) {
  if (!contains(seq)) layers.front().free_sequence(seq);  // throws, naming seq
  for (PagedKvCache& layer : layers) layer.free_sequence(seq);
}

int64_t PagedKVCache::length(int64_t seq) const { return layers.front().length(seq); }
bool PagedKVCache::contains(int64_t seq) const { return layers.front().contains(seq); }

// ---- forward ------------------------------------------------------------------------------------------

Tensor TransformerBlock::forward_paged(const TensorView& x, PagedKvCache& cache,
                                       std::span<const int64_t> seq_ids) const {
  // x (N, L, C) -> (N, L, C)
  const Tensor x1 = add(x, att.forward_paged(norm1.forward(x), cache, seq_ids));
  return add(x1, ff.forward(norm2.forward(x1)));
}

namespace {

// Everything GPTModel::forward_paged could trip over in any layer or chunk, checked first.
void check_paged_call(const GPTConfig& c, std::span<const int64_t> ids, int64_t N, int64_t L,
                      const PagedKVCache& cache, std::span<const int64_t> seq_ids) {
  const char* who = "GPTModel.forward_paged";
  if (N <= 0 || L <= 0 || static_cast<int64_t>(ids.size()) != N * L) {
    throw ShapeError(fmt::format("{}: ids must hold N * L = {} * {} tokens (N, L > 0), got {}", who, N, L,
                                 ids.size()));
  }
  if (static_cast<int64_t>(seq_ids.size()) != N) {
    throw ShapeError(fmt::format("{}: seq_ids must name N = {} sequences, got {}", who, N, seq_ids.size()));
  }
  if (static_cast<int64_t>(cache.layers.size()) != c.n_layers) {
    throw ShapeError(fmt::format("{}: the cache has {} layers, the model {}", who, cache.layers.size(),
                                 c.n_layers));
  }
  check_ids(ids, c.vocab_size, who);
  // Live, distinct ids first (no tokens: no pages), then positions, then pages.
  detail::check_batch_append(cache.layers.front(), seq_ids, 0, who);
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const int64_t start = cache.length(seq_ids[i]);
    for (const PagedKvCache& layer : cache.layers) {
      if (layer.length(seq_ids[i]) != start) {
        throw ValueError(fmt::format("{}: seq {} holds {} tokens in layer 0 but {} in another: the layers "
                                     "were not driven together", who, seq_ids[i], start,
                                     layer.length(seq_ids[i])));
      }
    }
    if (start + L > c.context_length) {
      throw ShapeError(fmt::format("{}: {} tokens at position {} of seq {} exceed context_length = {}", who,
                                   L, start, seq_ids[i], c.context_length));
    }
  }
  for (const PagedKvCache& layer : cache.layers) detail::check_batch_append(layer, seq_ids, L, who);
}

}  // namespace

Tensor GPTModel::forward_paged(std::span<const int64_t> ids, int64_t N, int64_t L, PagedKVCache& cache,
                               std::span<const int64_t> seq_ids) const {
  // ids (N, L) -> logits (N, L, V); each sequence advances by L
  check_paged_call(config, ids, N, L, cache, seq_ids);
  const int64_t V = config.vocab_size;
  Tensor logits({N, L, V});
  for (int64_t t0 = 0; t0 < L; t0 += detail::kMaxPagedQueries) {
    const int64_t n = std::min(detail::kMaxPagedQueries, L - t0);
    std::vector<int64_t> chunk, pos;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t start = cache.length(seq_ids[static_cast<size_t>(i)]);
      for (int64_t t = 0; t < n; ++t) {
        chunk.push_back(ids[static_cast<size_t>(i * L + t0 + t)]);
        pos.push_back(start + t);
      }
    }
    Tensor x = add(tok_emb.forward(chunk, {N, n}), pos_emb.forward(pos, {N, n}));
    for (size_t l = 0; l < blocks.size(); ++l) x = blocks[l].forward_paged(x, cache.layers[l], seq_ids);
    const Tensor out = head(final_norm.forward(x));  // (N, n, V)
    for (int64_t i = 0; i < N; ++i) {
      std::copy_n(out.data() + i * n * V, n * V, logits.data() + (i * L + t0) * V);
    }
  }
  return logits;
}

Tensor decode_logits(const GPTModel& model, std::span<const int64_t> ids, int64_t B, int64_t T,
                     DType kv_dtype, int64_t page_size) {
  if (B <= 0 || T <= 0 || static_cast<int64_t>(ids.size()) != B * T) {
    throw ShapeError(fmt::format("decode_logits: ids must hold B * T = {} * {} tokens (B, T > 0), got {}",
                                 B, T, ids.size()));
  }
  PagedKVCache cache(model.config, PagedKVCache::pages_for(B, T, page_size), page_size, kv_dtype);
  std::vector<int64_t> seq_ids;
  for (int64_t b = 0; b < B; ++b) seq_ids.push_back(cache.add_sequence());
  const int64_t V = model.config.vocab_size;
  Tensor logits({B, T, V});
  std::vector<int64_t> step(static_cast<size_t>(B));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) step[static_cast<size_t>(b)] = ids[static_cast<size_t>(b * T + t)];
    const Tensor out = model.forward_paged(step, B, 1, cache, seq_ids);  // (B, 1, V)
    for (int64_t b = 0; b < B; ++b) std::copy_n(out.data() + b * V, V, logits.data() + (b * T + t) * V);
  }
  return logits;
}

}  // namespace attn::gpt

// MultiHeadAttention over a paged KV cache: the projections of forward_cached, with the keys
// and values appended to each sequence's pages and the attention handed to paged_attention, so
// that a batch of sequences of different lengths decodes in one call per layer.
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "kvcache/batch_checks.hpp"
#include "sdpa/paged_attention.hpp"

namespace attn::nn {

Tensor MultiHeadAttention::forward_paged(const TensorView& x, PagedKvCache& cache,
                                         std::span<const int64_t> seq_ids) const {
  // x (N, L, d_in): the L newest tokens of each sequence -> (N, L, d_out)
  const char* who = "MultiHeadAttention.forward_paged";
  if (!x.defined() || x.dim() != 3 || x.size(2) != d_in || x.numel() == 0) {
    throw ShapeError(fmt::format("{}: x must have shape (N, L, d_in) with N, L > 0 and d_in = {}, got {}",
                                 who, d_in, x.defined() ? x.shape().str() : "undefined"));
  }
  const int64_t N = x.size(0), L = x.size(1);
  if (N != static_cast<int64_t>(seq_ids.size())) {
    throw ShapeError(fmt::format("{}: seq_ids must name one sequence per row of x {}, got {} ids", who,
                                 x.shape().str(), seq_ids.size()));
  }
  if (cache.heads_kv() != num_heads || cache.head_dim() != head_dim || cache.head_dim_v() != head_dim) {
    throw ShapeError(fmt::format("{}: the cache holds {} heads of head_dim {} (head_dim_v {}); this module "
                                 "has {} heads of {}", who, cache.heads_kv(), cache.head_dim(),
                                 cache.head_dim_v(), num_heads, head_dim));
  }
  if (L > attn::detail::kMaxPagedQueries) {
    throw ValueError(fmt::format("{}: at most {} new tokens per call (paged_attention's range), got "
                                 "L = {}: feed them in chunks", who, attn::detail::kMaxPagedQueries, L));
  }
  attn::detail::check_batch_append(cache, seq_ids, L, who);
  const Tensor queries = W_query.forward(x), keys = W_key.forward(x), values = W_value.forward(x);
  // (N, L, d_out) -> (N, L, H, hd): the rows of each sequence are the (T, heads_kv, head_dim)
  // an append takes.
  auto split = [&](const Tensor& t) { return t.view({N, L, num_heads, head_dim}); };
  for (int64_t i = 0; i < N; ++i) {
    cache.append(seq_ids[static_cast<size_t>(i)], split(keys).select(0, i), split(values).select(0, i));
  }
  PagedAttentionOptions o;
  o.scale = scale;
  o.is_causal = true;
  const SdpaResult r = paged_attention(split(queries), cache, seq_ids, o);
  return out_proj.forward(r.output.view({N, L, d_out}));
}

}  // namespace attn::nn

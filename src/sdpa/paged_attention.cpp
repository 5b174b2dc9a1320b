// paged_attention (attn/kv_cache.hpp), the simple version: each sequence's keys and values are
// gathered out of the pages into dense float32 tensors and handed to scaled_dot_product_attention.
// It fixes the semantics and the errors (check_paged_attention, shared with the decode kernel
// that will replace this body and read the pages in place, without the gather copy).
#include "sdpa/paged_attention.hpp"

#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <numbers>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"

namespace attn {

namespace detail {

PagedAttentionShape check_paged_attention(const TensorView& query, const PagedKvCache& cache,
                                          std::span<const int64_t> seq_ids,
                                          const PagedAttentionOptions& options) {
  const char* who = "paged_attention";
  if (!query.defined() || query.dim() != 4) {
    throw ShapeError(fmt::format("{}: query must have 4 dims (N, L_q, H_q, head_dim), got {}", who,
                                 query.defined() ? query.shape().str() : "undefined"));
  }
  const DType dt = query.dtype();
  if (dt != DType::kFloat32 && dt != DType::kBFloat16 && dt != DType::kFloat16) {
    throw DTypeError(fmt::format("{}: query must be float32, bfloat16 or float16, got {}", who,
                                 dtype_name(dt)));
  }
  PagedAttentionShape s;
  s.N = query.size(0), s.L_q = query.size(1), s.H_q = query.size(2), s.E = query.size(3);
  s.Ev = cache.head_dim_v();
  if (s.N != static_cast<int64_t>(seq_ids.size())) {
    throw ShapeError(fmt::format("{}: seq_ids must name one sequence per query row: query {} has N = {}, "
                                 "seq_ids has {}", who, query.shape().str(), s.N, seq_ids.size()));
  }
  if (s.E != cache.head_dim()) {
    throw ShapeError(fmt::format("{}: query's last dim must be the cache's head_dim {}, got query {}", who,
                                 cache.head_dim(), query.shape().str()));
  }
  if (s.H_q <= 0 || s.H_q % cache.heads_kv() != 0) {
    throw ShapeError(fmt::format("{}: query's heads H_q (dim 2) must be a positive multiple of the cache's "
                                 "heads_kv {}, got query {}", who, cache.heads_kv(), query.shape().str()));
  }
  if (s.L_q < 1 || s.L_q > kMaxPagedQueries) {
    throw ValueError(fmt::format("{}: query's L_q (dim 1) must be in [1, {}] (prefill longer prompts with "
                                 "scaled_dot_product_attention), got query {}", who, kMaxPagedQueries,
                                 query.shape().str()));
  }
  if (options.scale) {
    // As scaled_dot_product_attention: the kernels multiply by scale * log2(e) in float32.
    constexpr double kMaxScale = std::numeric_limits<float>::max() / std::numbers::log2e;
    if (!std::isfinite(*options.scale) || std::fabs(*options.scale) > kMaxScale) {
      throw ValueError(fmt::format("{}: options.scale must be finite, at most {:.4g} in magnitude, got {}",
                                   who, kMaxScale, *options.scale));
    }
  }
  s.scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(s.E)));
  if (options.num_threads < 0) {
    throw ValueError(fmt::format("{}: options.num_threads must be >= 0 (0: OpenMP's default), got {}", who,
                                 options.num_threads));
  }
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    if (!cache.contains(seq_ids[i])) {
      throw IndexError(fmt::format("{}: seq_ids[{}] = {} is not a live sequence of the cache", who, i,
                                   seq_ids[i]));
    }
    const int64_t len = cache.length(seq_ids[i]);
    if (len < s.L_q) {
      throw ValueError(fmt::format("{}: seq_ids[{}] = {} holds {} tokens, fewer than L_q = {} (append the "
                                   "new tokens' keys and values first)", who, i, seq_ids[i], len, s.L_q));
    }
  }
  return s;
}

}  // namespace detail

SdpaResult paged_attention(const TensorView& query, const PagedKvCache& cache,
                           std::span<const int64_t> seq_ids, const PagedAttentionOptions& options) {
  const detail::PagedAttentionShape s = detail::check_paged_attention(query, cache, seq_ids, options);
  SdpaResult result;
  if (s.N == 0) {
    result.output = Tensor::empty({0, s.L_q, s.H_q, s.Ev}, query.dtype());
    if (options.need_lse) result.lse = Tensor::empty({0, s.H_q, s.L_q});
    return result;
  }
  SdpaOptions o;
  o.scale = s.scale;
  o.is_causal = options.is_causal;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.enable_gqa = true;
  o.need_lse = options.need_lse;
  o.num_threads = options.num_threads;
  // Gathered K/V are float32 (int8 dequantised): the query follows them, the output goes back to
  // the query's dtype at the end, as the low-precision SDPA paths round theirs.
  const Tensor q32 = query.to(DType::kFloat32);
  std::vector<Tensor> outs, lses;
  for (int64_t i = 0; i < s.N; ++i) {
    const int64_t id = seq_ids[static_cast<size_t>(i)];
    const Tensor k = cache.gather_keys(id), v = cache.gather_values(id);
    // (L_q, H_q, E) -> (1, H_q, L_q, E), the (B, H, L, E) layout of scaled_dot_product_attention.
    const TensorView q = q32.select(0, i).transpose(0, 1).unsqueeze(0);
    SdpaResult r = scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), o);
    outs.push_back(std::move(r.output));
    if (options.need_lse) lses.push_back(std::move(r.lse));
  }
  // (1, H_q, L_q, Ev) each -> (N, L_q, H_q, Ev)
  std::vector<TensorView> views;
  for (const Tensor& t : outs) views.push_back(t.transpose(1, 2));
  result.output = cat(views, 0);
  if (query.dtype() != DType::kFloat32) result.output = result.output.to(query.dtype());
  if (options.need_lse) {
    const std::vector<TensorView> lse_views(lses.begin(), lses.end());
    result.lse = cat(lse_views, 0);
  }
  return result;
}

}  // namespace attn

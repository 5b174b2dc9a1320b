// paged_attention (attn/kv_cache.hpp): the split-KV decode kernel (src/sdpa/cpu/decode.cpp)
// reading each sequence's pages in place, through its block table: no gather copy, K and V read
// once per kv head for the whole GQA group. The argument checks (check_paged_attention) come
// first, so a refused call reads nothing.
#include "sdpa/paged_attention.hpp"

#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <numbers>
#include <vector>

#include <omp.h>

#include "attn/error.hpp"
#include "sdpa/cpu/decode.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/problem.hpp"
#include "sdpa/registry.hpp"

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
  // The default as scaled_dot_product_attention applies it: 1 / float32(sqrt(E)).
  s.scale = options.scale.value_or(1.0 / static_cast<double>(static_cast<float>(std::sqrt(double(s.E)))));
  detail::check_window_size(options.window_size, who, "options.window_size");
  s.softcap = detail::check_softcap(options.softcap, who, "options.softcap");
  if (options.alibi_slopes) {
    detail::check_head_param(*options.alibi_slopes, who, "options.alibi_slopes", {Shape{s.H_q}, Shape{s.N, s.H_q}});
  }
  if (options.sinks) detail::check_head_param(*options.sinks, who, "options.sinks", {Shape{s.H_q}});
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

SdpaResult paged_attention(const TensorView& query_in, const PagedKvCache& cache,
                           std::span<const int64_t> seq_ids, const PagedAttentionOptions& options) {
  const detail::PagedAttentionShape s = detail::check_paged_attention(query_in, cache, seq_ids, options);
  const cpu::DecodeKernel& kernel = detail::select_decode_kernel(options.kernel, "paged_attention");
  SdpaResult result;
  result.output = Tensor::empty({s.N, s.L_q, s.H_q, s.Ev}, query_in.dtype());
  if (options.need_lse) result.lse = Tensor::empty({s.N, s.H_q, s.L_q});
  if (s.N == 0) return result;
  Tensor qs;
  const TensorView q = cpu::rows_contiguous(query_in, qs);

  cpu::DecodeCall c;
  c.N = s.N, c.heads_q = s.H_q, c.heads_kv = cache.heads_kv(), c.L = s.L_q;
  c.params = cpu::make_decode_params(s.E, s.Ev, cache.dtype(), s.scale, options.is_causal,
                                     options.window_size, s.softcap);
  c.q = q.raw_data();
  c.q_dtype = q.dtype();
  c.q_n = q.stride(0), c.q_i = q.stride(1), c.q_h = q.stride(2);
  c.o = result.output.raw_data();
  c.o_dtype = q.dtype();
  c.o_h = s.Ev, c.o_i = s.H_q * s.Ev, c.o_n = s.L_q * s.H_q * s.Ev;
  if (options.need_lse) {
    c.lse = result.lse.data();
    c.lse_i = 1, c.lse_h = s.L_q, c.lse_n = s.H_q * s.L_q;
  }
  if (options.alibi_slopes) {
    const TensorView& a = *options.alibi_slopes;
    c.alibi = a.data();
    c.alibi_n = a.dim() == 2 ? a.stride(0) : 0;
    c.alibi_h = a.stride(-1);
  }
  if (options.sinks) {
    c.sinks = options.sinks->data();
    c.sinks_h = options.sinks->stride(0);
  }

  // Pool layout (kv_cache.hpp): pages (num_pages, heads_kv, page_size, dim), scales
  // (num_pages, heads_kv, page_size).
  const int64_t P = cache.page_size(), Hkv = cache.heads_kv();
  const int64_t esize = dtype_size(cache.dtype());
  const bool int8 = cache.dtype() == DType::kInt8;
  c.kv.resize(static_cast<size_t>(s.N * Hkv));
  for (int64_t n = 0; n < s.N; ++n) {
    const int64_t id = seq_ids[static_cast<size_t>(n)];
    const std::span<const int64_t> table = cache.block_table(id);
    const int64_t S = cache.length(id);
    for (int64_t h = 0; h < Hkv; ++h) {
      cpu::DecodeKv& kv = c.kv[static_cast<size_t>(n * Hkv + h)];
      kv.k = static_cast<const char*>(cache.key_pages().raw_data()) + h * P * s.E * esize;
      kv.v = static_cast<const char*>(cache.value_pages().raw_data()) + h * P * s.Ev * esize;
      kv.k_page = Hkv * P * s.E, kv.v_page = Hkv * P * s.Ev;
      kv.k_row = s.E, kv.v_row = s.Ev;
      if (int8) {
        kv.k_scale = cache.key_scales().data() + h * P;
        kv.v_scale = cache.value_scales().data() + h * P;
        kv.scale_page = Hkv * P;
      }
      kv.pages = table.data();
      kv.page_size = P;
      kv.S = S;
      // Bottom-right: the new tokens are the sequence's last L_q. The driver reads only the
      // pages holding keys inside this band.
      cpu::set_decode_band(c.params, S - s.L_q, kv);
    }
  }
  c.threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  cpu::run_decode(kernel, c);
  return result;
}

}  // namespace attn

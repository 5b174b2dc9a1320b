// The argument checks of paged_attention (attn/kv_cache.hpp), apart from its body (the split-KV
// decode kernel reading the pages in place), so that they read as one list and a refused call
// reads nothing.
#pragma once

#include <cstdint>
#include <span>

#include "attn/kv_cache.hpp"

namespace attn::detail {

// The sizes of a checked call: query (N, L_q, H_q, E), output (N, L_q, H_q, Ev).
struct PagedAttentionShape {
  int64_t N = 0, L_q = 0, H_q = 0, E = 0, Ev = 0;
  double scale = 0.0;  // options.scale, or 1 / float32(sqrt(E)) as scaled_dot_product_attention
  double softcap = 0.0;  // options.softcap, 0 when unset
};

inline constexpr int64_t kMaxPagedQueries = 16;

// ShapeError, DTypeError, IndexError, ValueError as the header documents, each naming the
// argument ("query", "seq_ids[i]", "options.scale", ...).
PagedAttentionShape check_paged_attention(const TensorView& query, const PagedKvCache& cache,
                                          std::span<const int64_t> seq_ids,
                                          const PagedAttentionOptions& options);

}  // namespace attn::detail

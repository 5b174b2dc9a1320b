// Checks for appending `tokens` new tokens to each of several sequences of a PagedKvCache in one
// call (a model layer's step for a batch), made before the first append: PagedKvCache::append
// checks one sequence at a time, so a batch could otherwise fail half-way, with some sequences
// appended and others not.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fmt/format.h>
#include <span>
#include <vector>

#include "attn/error.hpp"
#include "attn/kv_cache.hpp"

namespace attn::detail {

// IndexError for a dead or repeated id, ValueError when the pool has too few free pages for
// all the appends together.
inline void check_batch_append(const PagedKvCache& cache, std::span<const int64_t> seq_ids,
                               int64_t tokens, const char* who) {
  const int64_t P = cache.page_size();
  int64_t needed = 0;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const int64_t id = seq_ids[i];
    if (!cache.contains(id)) {
      throw IndexError(fmt::format("{}: seq_ids[{}] = {} is not a live sequence of the cache", who, i, id));
    }
    if (std::find(seq_ids.begin(), seq_ids.begin() + static_cast<std::ptrdiff_t>(i), id) !=
        seq_ids.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw IndexError(fmt::format("{}: seq_ids[{}] = {} appears twice (each sequence gets one row "
                                   "of new tokens)", who, i, id));
    }
    const int64_t length = cache.length(id);
    needed += (length + tokens + P - 1) / P - static_cast<int64_t>(cache.block_table(id).size());
  }
  if (needed > cache.free_pages()) {
    throw ValueError(fmt::format("{}: {} new tokens for each of {} sequences need {} more pages, {} free "
                                 "of {}", who, tokens, seq_ids.size(), needed, cache.free_pages(),
                                 cache.num_pages()));
  }
}

}  // namespace attn::detail

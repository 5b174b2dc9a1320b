// The bounded cache of freed tensor blocks (attn/memory.hpp).
//
// Few blocks are large (a call holds tens at most), so the cache is a short vector scanned under
// one mutex: the scan costs nanoseconds against the microseconds per MiB that clearing fresh pages
// costs. A request takes the smallest kept block that fits within twice its size; a freed block
// that would push the kept bytes over the limit evicts the longest-kept blocks first.
#include "core/allocator.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <unistd.h>

#include "attn/memory.hpp"

namespace attn {

namespace {

constexpr std::size_t kAlign = 64;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

std::size_t default_limit() {
  if (kSanitized) return 0;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const std::size_t gib = std::size_t{1} << 30;
  if (pages <= 0 || page <= 0) return gib;
  return std::min(gib, static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 8);
}

struct Kept {
  void* ptr;
  std::size_t capacity;
};

struct Cache {
  std::mutex mu;
  std::vector<Kept> kept;  // oldest first
  CacheStats stats;
  Cache() { stats.limit_bytes = default_limit(); }

  // Frees the oldest blocks until at most `bytes` are kept. Holds mu.
  void shrink_to(std::size_t bytes) {
    std::size_t n = 0;
    while (stats.cached_bytes > bytes && n < kept.size()) {
      std::free(kept[n].ptr);
      stats.cached_bytes -= kept[n].capacity;
      ++n;
    }
    kept.erase(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(n));
    stats.cached_blocks = kept.size();
  }
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: tensors may be freed during static destruction
  return *c;
}

}  // namespace

namespace detail {

Block allocate_block(std::size_t bytes) {
  bytes = std::max<std::size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  if (bytes >= kCachedBlockMin) {
    Cache& c = cache();
    std::lock_guard lock(c.mu);
    auto best = c.kept.end();
    for (auto it = c.kept.begin(); it != c.kept.end(); ++it) {
      if (it->capacity >= bytes && it->capacity / 2 <= bytes &&
          (best == c.kept.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best != c.kept.end()) {
      const Block b{best->ptr, best->capacity};
      c.stats.cached_bytes -= best->capacity;
      c.kept.erase(best);
      c.stats.cached_blocks = c.kept.size();
      ++c.stats.hits;
      return b;
    }
    ++c.stats.misses;
  }
  void* p = std::aligned_alloc(kAlign, bytes);
  return p == nullptr ? Block{} : Block{p, bytes};
}

void free_block(void* ptr, std::size_t capacity) {
  if (ptr == nullptr) return;
  if (capacity >= kCachedBlockMin) {
    Cache& c = cache();
    std::lock_guard lock(c.mu);
    if (capacity <= c.stats.limit_bytes) {
      c.shrink_to(c.stats.limit_bytes - capacity);
      c.kept.push_back({ptr, capacity});
      c.stats.cached_bytes += capacity;
      c.stats.cached_blocks = c.kept.size();
      return;
    }
  }
  std::free(ptr);
}

}  // namespace detail

CacheStats cache_stats() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  return c.stats;
}

void set_cache_limit(std::size_t bytes) {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.stats.limit_bytes = bytes;
  c.shrink_to(bytes);
}

void empty_cache() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.shrink_to(0);
}

}  // namespace attn

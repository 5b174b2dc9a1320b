// Tensor storage: the bounded cache of freed blocks (attn/memory.hpp), and huge pages for large ones.
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

#include <sys/mman.h>
#include <unistd.h>

#include "attn/memory.hpp"

namespace attn {

namespace {

constexpr std::size_t kAlign = 64;

// Large blocks start on a 2 MiB boundary, span whole 2 MiB pages and ask Linux for transparent
// huge pages (its default mode, "madvise", gives them only to regions that ask). Decoding reads a
// KV cache of tens or hundreds of MiB once per token, and with 4 KiB pages every 4 KiB of it costs
// a TLB miss and a page walk the prefetches must wait on; a paged cache, whose pages lie anywhere
// in its pool, loses more. Measured on AMD Zen 4 (attn bench, 2 threads, H_q 32, H_kv 8, E 128,
// S 8192, old and new binaries alternating, medians of 4): float32 K/V 2.53 -> 2.31 ms, bf16 K/V
// 1.52 -> 1.31 ms, bf16 in pages of 16 1.65 -> 1.30 ms, float32 in pages of 16 2.67 -> 2.55 ms;
// prefill (forward float32, backward bf16, L 1024) unchanged. The rounding wastes at most 2 MiB
// of address space per block of 4 MiB or more.
constexpr std::size_t kHugePageMin = std::size_t{4} << 20;
constexpr std::size_t kHugePage = std::size_t{2} << 20;

void* allocate_fresh(std::size_t& bytes) {
  if (bytes < kHugePageMin) return std::aligned_alloc(kAlign, bytes);
  bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, bytes);
#ifdef MADV_HUGEPAGE
  if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: a refusal changes nothing
#endif
  return p;
}

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
  void* p = allocate_fresh(bytes);
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

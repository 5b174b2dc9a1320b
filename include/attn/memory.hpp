// Tensor storage reuse: a bounded cache of freed large blocks.
//
// Every attention call allocates its outputs and scratch (copies of strided inputs, gradients)
// afresh. A fresh block of many MiB comes from the operating system as untouched pages, and the
// first write to each 4 KiB page traps to the kernel, which clears it: measured here at a quarter
// of varlen_attn_backward's time, when one call runs a sequence at a time and every sequence's
// buffers were new pages. So a freed block of at least `kCachedBlockMin` bytes is kept, up to a
// limit on the bytes kept, and handed to the next allocation it fits (no more than twice its
// size, so a small tensor never pins a big block). PyTorch's CUDA caching allocator does the same
// for device memory, with torch.cuda.empty_cache() to give it back; on the CPU PyTorch's guides
// recommend jemalloc or tcmalloc for the same reason.
//
// Blocks of 4 MiB or more are whole 2 MiB pages on a 2 MiB boundary, and on Linux ask for
// transparent huge pages (madvise): a KV cache read once per decoded token then costs no TLB miss
// per 4 KiB (measured 10-27 % faster decoding on AMD Zen 4). Such a block's capacity, and so
// cache_stats().cached_bytes, counts the rounded size.
//
// The cache never changes a result: blocks come back uninitialised, as from Tensor::empty, and
// Tensor::zeros clears them. Builds with AddressSanitizer or ThreadSanitizer start with the
// limit at 0, so a use after free is still caught.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn {

// Smallest block the cache keeps: below this the C library's own heap reuses memory.
inline constexpr std::size_t kCachedBlockMin = std::size_t{1} << 20;

struct CacheStats {
  std::size_t limit_bytes = 0;   // at most this many bytes are kept
  std::size_t cached_bytes = 0;  // bytes kept now, ready for reuse
  std::size_t cached_blocks = 0;
  std::uint64_t hits = 0;        // large allocations served from the cache
  std::uint64_t misses = 0;      // large allocations that went to the C library
};

// The cache's state (a snapshot; the counters count since the process started).
CacheStats cache_stats();

// Sets how many bytes of freed blocks may be kept (0 turns the cache off) and frees what is
// kept beyond it. The default is 1 GiB or an eighth of the machine's memory, whichever is less.
void set_cache_limit(std::size_t bytes);

// Frees every kept block (torch.cuda.empty_cache()'s name); the limit stays.
void empty_cache();

}  // namespace attn

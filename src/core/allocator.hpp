// Tensor storage: 64-byte aligned blocks, those of 4 MiB or more 2 MiB aligned on transparent huge
// pages (allocator.cpp), large ones kept for reuse (attn/memory.hpp).
#pragma once

#include <cstddef>

namespace attn::detail {

struct Block {
  void* ptr = nullptr;
  std::size_t capacity = 0;  // bytes usable, >= the bytes asked for; pass back to free_block
};

// A block of at least `bytes` bytes (a multiple of 64), or {nullptr, 0} if memory ran out.
Block allocate_block(std::size_t bytes);
// Returns a block from allocate_block: kept for reuse if large and the cache has room, else freed.
void free_block(void* ptr, std::size_t capacity);

}  // namespace attn::detail

// The per-instruction-set builds of the fused kernel, as a table of functions: the shared driver
// (flash_fwd.cpp, flash_bwd.cpp) runs whichever table the registry hands it.
#pragma once

#include <cstdint>

#include "sdpa/cpu/decode_params.hpp"
#include "sdpa/cpu/flash_params.hpp"

namespace attn::cpu {

struct FlashKernel {
  const char* isa;      // "avx512", "avx2" or "generic"
  int64_t block_q;      // queries per work item
  int64_t (*workspace_floats)(int64_t E, int64_t Ev);
  void (*forward)(const FlashParams&, const FlashBlock&, float* workspace);
  void (*weights)(const FlashParams&, const FlashBlock&, float* workspace);
  int64_t (*backward_workspace_floats)(int64_t L, int64_t E, int64_t Ev);
  void (*backward)(const FlashBwdParams&, const FlashBwdHead&, float* workspace);
};

const FlashKernel& flash_kernel_avx512();
const FlashKernel& flash_kernel_avx2();
const FlashKernel& flash_kernel_generic();

// The split-KV decode kernel of the same builds (decode_kernel.hpp; driver in decode.cpp).
// split runs one item over `heads` kv heads of one sequence: kv[h] and item[h] share the key
// range, the rows and the pages; workspace_floats(R, Ep, Evp, heads) sizes its scratch.
struct DecodeKernel {
  const char* isa;
  int64_t (*workspace_floats)(int64_t R, int64_t Ep, int64_t Evp, int64_t heads);
  void (*split)(const DecodeParams&, const DecodeKv* kv, const DecodeItem* item, int64_t heads, float* workspace);
};
const DecodeKernel& decode_kernel_avx512();
const DecodeKernel& decode_kernel_avx512_bf16();  // decode_avx512_bf16.cpp
const DecodeKernel& decode_kernel_avx2();
const DecodeKernel& decode_kernel_generic();

// Which build runs is the registry's choice (src/sdpa/registry.cpp): each is an entry there,
// with the CPU features its compile flags assume.

}  // namespace attn::cpu

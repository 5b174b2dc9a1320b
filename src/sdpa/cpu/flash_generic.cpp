// The fused attention kernel built for one instruction set (see flash_kernel.hpp); the
// flags come from CMakeLists.txt, the choice at run time from src/sdpa/registry.cpp.
#define ATTN_SIMD_NS generic
#define ATTN_SIMD_WIDTH 4
#include "sdpa/cpu/flash_kernel.hpp"
#include "sdpa/cpu/flash_bwd_kernel.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/decode_kernel.hpp"

namespace attn::cpu {

const FlashKernel& flash_kernel_generic() {
  static const FlashKernel k{"generic", generic::kBQ, generic::workspace_floats, generic::forward_block,
                             generic::weights_block,
                             generic::backward_workspace_floats, generic::backward_head};
  return k;
}

const DecodeKernel& decode_kernel_generic() {
  static const DecodeKernel k{"generic", generic::decode_workspace_floats, generic::decode_split};
  return k;
}

}  // namespace attn::cpu

// The fused attention kernel built for one instruction set (see flash_kernel.hpp); the
// flags come from CMakeLists.txt, the choice at run time from src/sdpa/registry.cpp.
#define ATTN_SIMD_NS avx2
#define ATTN_SIMD_WIDTH 8
#include "sdpa/cpu/flash_kernel.hpp"
#include "sdpa/cpu/flash_bwd_kernel.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/decode_kernel.hpp"

namespace attn::cpu {

const FlashKernel& flash_kernel_avx2() {
  static const FlashKernel k{"avx2", avx2::kBQ, avx2::workspace_floats, avx2::forward_block,
                             avx2::weights_block,
                             avx2::backward_workspace_floats, avx2::backward_head};
  return k;
}

const DecodeKernel& decode_kernel_avx2() {
  static const DecodeKernel k{"avx2", avx2::decode_workspace_floats, avx2::decode_split};
  return k;
}

}  // namespace attn::cpu

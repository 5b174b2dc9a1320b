// The fused attention kernel built for one instruction set (see flash_kernel.hpp); the
// flags come from CMakeLists.txt, the choice at run time from src/sdpa/registry.cpp.
#define ATTN_SIMD_NS avx512
#define ATTN_SIMD_WIDTH 16
#include "sdpa/cpu/flash_kernel.hpp"
#include "sdpa/cpu/flash_bwd_kernel.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/decode_kernel.hpp"

namespace attn::cpu {

const FlashKernel& flash_kernel_avx512() {
  static const FlashKernel k{"avx512", avx512::kBQ, avx512::workspace_floats, avx512::forward_block,
                             avx512::weights_block,
                             avx512::backward_workspace_floats, avx512::backward_head};
  return k;
}

const DecodeKernel& decode_kernel_avx512() {
  static const DecodeKernel k{"avx512", avx512::decode_workspace_floats, avx512::decode_split};
  return k;
}

}  // namespace attn::cpu

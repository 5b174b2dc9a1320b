// One build of the float32 kernels for ab_kernels.cpp, as src/sdpa/cpu/flash_<isa>.cpp makes it:
// ab_kernels.sh compiles this file once per source tree with -I<tree>/src, the ISA's -m flags,
// ATTN_SIMD_WIDTH, a namespace of its own (ATTN_SIMD_NS) and the names of the two accessors.
#include "sdpa/cpu/flash_kernel.hpp"
#include "sdpa/cpu/flash_bwd_kernel.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/decode_kernel.hpp"

namespace attn::cpu {

const FlashKernel& AB_KERNEL() {
  namespace k = ATTN_SIMD_NS;
  static const FlashKernel kernel{"ab", k::kBQ, k::workspace_floats, k::forward_block, k::weights_block,
                                  k::backward_workspace_floats, k::backward_head};
  return kernel;
}

const DecodeKernel& AB_DECODE() {
  static const DecodeKernel kernel{"ab", ATTN_SIMD_NS::decode_workspace_floats, ATTN_SIMD_NS::decode_split};
  return kernel;
}

}  // namespace attn::cpu

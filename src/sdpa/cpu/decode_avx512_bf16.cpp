// The split-KV decode kernel (decode_kernel.hpp) built for AVX-512 with AVX512-BF16: the AVX-512
// build plus vdpbf16ps for bf16 queries against a bf16 cache (decode_bf16_dot.hpp). Its own
// build, so that the plain AVX-512 one assumes no BF16 (registry: cpu.decode.avx512_bf16).
#define ATTN_SIMD_NS avx512_bf16_decode
#define ATTN_SIMD_WIDTH 16
#include "sdpa/cpu/flash_kernel.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/decode_kernel.hpp"

namespace attn::cpu {

const DecodeKernel& decode_kernel_avx512_bf16() {
  static const DecodeKernel k{"avx512_bf16", avx512_bf16_decode::decode_workspace_floats,
                              avx512_bf16_decode::decode_split};
  return k;
}

}  // namespace attn::cpu

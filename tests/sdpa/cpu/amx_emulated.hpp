// The AMX-BF16 forward kernel run on emulated tile registers (amx_emulated.cpp). Its code uses
// AVX512-BF16: call it only where amx_emulation_runs_here().
#pragma once

#include "sdpa/cpu/cpu_features.hpp"
#include "sdpa/cpu/flash_bf16.hpp"

namespace attn::cpu {
// The table for bfloat16, float16, or float32 at `precision` ("high": three terms, "medium":
// one); for bfloat16 with `p_two_terms`, the one that rounds P to two bf16 terms (the registry
// takes it where cpu::bf16_p_two_terms says so).
const Bf16ForwardKernel& amx_kernel_emulated(DType dtype,
                                             Float32MatmulPrecision precision = Float32MatmulPrecision::kHigh,
                                             bool p_two_terms = false);
// True if this CPU has every feature the emulated kernel's AVX-512 code assumes (the AVX512-BF16
// build's set: avx512f/vl/dq/bw, avx512_bf16, fma). Inline here, so that its callers (built
// without AVX-512 flags) compile it, never amx_emulated.cpp.
inline bool amx_emulation_runs_here() {
  return cpu_features().has(kAvx512f | kAvx512vl | kAvx512dq | kAvx512bw | kAvx512Bf16 | kFma);
}
}  // namespace attn::cpu

// SdpaResult::output_residual on 16 float32 lanes, for the AVX-512 kernels that write 16-bit
// outputs (flash_avx512_bf16.cpp, flash_amx_kernel.hpp): x minus hi, the float32 value of its
// 16-bit rounding, and 0 in lanes where hi is Inf or NaN (the rule of docs/NUMERICS.md).
//
// Internal linkage: the files including it are compiled with different -m flags.
#pragma once

#include <immintrin.h>

namespace attn::cpu {
namespace {

inline __m512 residual_of(__m512 x, __m512 hi) {
  const __mmask16 finite = static_cast<__mmask16>(~_mm512_fpclass_ps_mask(hi, 0x99));  // NaN, +-Inf
  return _mm512_maskz_sub_ps(finite, x, hi);
}

}  // namespace
}  // namespace attn::cpu

// 2^x on 16 float32 lanes for the AVX-512 kernels (flash_avx512_bf16.cpp, flash_amx_kernel.hpp,
// and flash_kernel.hpp's exp2v in its AVX-512 build): the degree-7 polynomial of exp2v (~2 ulp),
// exact 0 below -126, NaN kept, in 12 instructions (the portable form takes 18).
//
// Internal linkage: the files including it are compiled with different -m flags, and one shared
// inline copy could be the one the linker keeps for all of them.
#pragma once

#include <immintrin.h>

namespace attn::cpu {
namespace {

inline __m512 exp2_avx512(__m512 x) {
  // max_ps returns its second operand when either is NaN: a NaN x flows through to the result.
  // (The all-ones maskz forms are the same instructions; GCC 12's unmasked ones read an
  // undefined vector and warn that it may be used uninitialized.)
  const __m512 xc = _mm512_maskz_max_ps(0xffff, _mm512_set1_ps(-126.0f), x);
  const __m512 n = _mm512_maskz_roundscale_ps(0xffff, xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  // p * 2^n in one vscalefps (exact) where the exponent-bits construction took four
  // instructions, and exactly 0 below -126 (NaN lanes compare unordered: kept).
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ), p, n);
}

}  // namespace
}  // namespace attn::cpu

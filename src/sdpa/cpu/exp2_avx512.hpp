// 2^x on 16 float32 lanes for the 16-bit kernels (flash_avx512_bf16.cpp, flash_amx_kernel.hpp):
// the float32 kernels' degree-7 polynomial (flash_kernel.hpp's exp2v, ~2 ulp), exact 0 below
// -126, NaN kept. P is rounded to 16 bits afterwards, but the row sums are float32.
//
// Internal linkage: the files including it are compiled with different -m flags, and one shared
// inline copy could be the one the linker keeps for all of them.
#pragma once

#include <immintrin.h>

namespace attn::cpu {
namespace {

inline __m512 exp2_avx512(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ), r, _mm512_setzero_ps());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
}

}  // namespace
}  // namespace attn::cpu

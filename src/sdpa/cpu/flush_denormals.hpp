// Flush-to-zero for the fused kernels' threads, for as long as a kernel runs.
//
// Why: a result below float32's smallest normal (2^-126) makes an Intel core take a microcode
// assist of ~100 cycles per instruction. Attention makes such results on purpose: weights of far
// keys under ALiBi or a window's edge are 2^-100 .. 2^-126, and P * (dP - D) or a first
// accumulation p * v from zero lands below 2^-126. Measured (B=1 H=12 L=4096 E=64, 2 threads):
// the ALiBi backward ran 36 % slower than the plain one without FTZ, 3 % with it. With FTZ such
// a result becomes 0: a change of less than 2^-126 in absolute terms, far below every tolerance
// (the reference, which materialises the scores, keeps gradual underflow), provided no kernel
// scales a value down below 2^-126 and back up (softcap_v never divides a score by the cap and
// multiplies it back for that reason). Subnormal inputs are
// still read as they are (no DAZ). The previous MXCSR is restored on exit, so the calling
// threads see no change.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace attn::cpu {

class FlushDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  FlushDenormals() = default;
#endif
 public:
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace attn::cpu

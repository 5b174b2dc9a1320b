// How fast this CPU's vector units run relative to each other, measured once per process: the
// kernel registry's per-CPU table of which 16-bit kernel kAuto prefers.
//
// Why measure: the same AVX512-BF16 instruction is a win on one CPU and a loss on another. On
// AMD Zen 4 vdpbf16ps does 2x the multiply-adds of a float32 FMA per cycle; on the Intel Xeon
// this project runs on (AVX512-BF16 without AMX exposed), it does half as many as the FMA units
// (measured: 66 vs 126 GFLOP/s on one thread), so widening bf16 to float32 is faster there. A
// CPUID table would have to list every model; a 2 x 3 ms probe, interleaved so that a busy
// machine slows both alike, knows.
#pragma once

namespace attn::cpu {

struct UnitRates {
  double fma_gflops = 0;       // one thread, zmm vfmadd231ps, 2 flops per lane
  double bf16_dot_gflops = 0;  // one thread, zmm vdpbf16ps, 4 flops per lane; 0 without AVX512-BF16
  // bf16_dot_gflops / fma_gflops, 0 without AVX512-BF16 or AVX-512.
  double bf16_dot_speedup() const { return fma_gflops > 0 ? bf16_dot_gflops / fma_gflops : 0.0; }
};

// Measured on first call (about 10 ms, thread-safe), then reused: never per SDPA call.
const UnitRates& unit_rates();

}  // namespace attn::cpu

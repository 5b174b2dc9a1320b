// The machine's sustained single-precision FMA throughput: the roof `attn bench` compares against.
//
// Each thread runs many independent chains of vector fused multiply-adds (acc = acc * a + b) for
// a fixed time, with enough chains to hide the FMA latency on every current x86 core. The best
// supported ISA is chosen at run time (no global -m flags): AVX-512F (16 float lanes), else
// AVX2 + FMA (8 lanes), else a portable 4-lane multiply + add loop. One FMA counts 2 flops per
// lane, as every GFLOP/s figure in this project does. The bf16 kernels' roof is the BF16 dot
// unit's, measured the same way.
#pragma once

#include <optional>
#include <string>

namespace attn::bench {

struct PeakResult {
  double gflops = 0.0;  // best trial: flops of all threads / wall time of the parallel region
  int threads = 0;
  std::string isa;      // "avx512f", "avx2+fma" or "generic"
  int lanes = 0;        // float lanes per vector operation
};

// The ISA the probe uses on this CPU (same names as PeakResult::isa).
std::string fma_isa();

// Runs `trials` trials of `seconds` each on `threads` OpenMP threads at once; returns the best.
PeakResult measure_fma_peak(int threads, double seconds = 0.2, int trials = 3);

// The same for the AVX512-BF16 dot-product unit (vdpbf16ps: two bf16 products summed into each
// float32 lane, 4 flops per lane), the roof of the bf16 kernels; nothing if the CPU lacks it.
std::optional<PeakResult> measure_bf16_dot_peak(int threads, double seconds = 0.2, int trials = 3);

// The same for the AMX-BF16 tiles (tdpbf16ps, 16 x 16 lanes of 32 products), the roof of
// cpu.flash.amx_bf16. Call it only where that kernel runs (AMX present and permitted).
std::optional<PeakResult> measure_amx_bf16_peak(int threads, double seconds = 0.2, int trials = 3);

}  // namespace attn::bench

// The unit-rate probe (see unit_rates.hpp). Each kernel runs independent accumulator chains
// (enough to cover latency x throughput on current cores) for a fixed number of iterations; the
// two probes alternate three times and each keeps its best, so a burst of load elsewhere costs
// both the same. Compiled with target attributes only: this file runs on every x86-64 CPU.
#include "sdpa/cpu/unit_rates.hpp"

#include <chrono>
#include <cstdint>

#include "sdpa/cpu/cpu_features.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attn::cpu {
namespace {

constexpr int kChains = 16;
constexpr int64_t kIterations = 1 << 15;  // 16 x 32768 instructions: ~0.3-1 ms per probe

volatile float g_sink;

#if defined(__x86_64__)
__attribute__((target("avx512f"))) double fma_seconds() {
  const auto start = std::chrono::steady_clock::now();
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * static_cast<float>(c));
  for (int64_t i = 0; i < kIterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  g_sink = lanes[0];
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

__attribute__((target("avx512f,avx512bf16"))) double dot_seconds() {
  const auto start = std::chrono::steady_clock::now();
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x35803580);  // bf16 pairs of 2^-20: stays normal
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * static_cast<float>(c));
  for (int64_t i = 0; i < kIterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  g_sink = lanes[0];
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
#endif

UnitRates measure() {
  UnitRates r;
#if defined(__x86_64__)
  const CpuFeatures& f = cpu_features();
  if (!f.has(kAvx512f)) return r;
  const bool dot = f.has(kAvx512Bf16);
  double fma_best = 1e30, dot_best = 1e30;
  fma_seconds();  // wake the unit (AVX-512 frequency licence) before timing
  for (int trial = 0; trial < 3; ++trial) {
    const double t = fma_seconds();
    if (t < fma_best) fma_best = t;
    if (dot) {
      const double d = dot_seconds();
      if (d < dot_best) dot_best = d;
    }
  }
  const double instructions = static_cast<double>(kIterations) * kChains;
  r.fma_gflops = instructions * 16 * 2 / fma_best * 1e-9;
  if (dot) r.bf16_dot_gflops = instructions * 16 * 4 / dot_best * 1e-9;
#endif
  return r;
}

}  // namespace

const UnitRates& unit_rates() {
  static const UnitRates rates = measure();
  return rates;
}

}  // namespace attn::cpu

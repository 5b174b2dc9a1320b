// FMA peak probe (see peak.hpp).
//
// The kernels are compiled for their ISA with target attributes and chosen with
// __builtin_cpu_supports, so the tool runs on any x86-64 CPU without global -m flags. Each chain
// starts from a different value and every kernel returns the sum of its chains, so the compiler
// can neither merge the chains nor drop the loop.
#include "peak.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATTN_PEAK_X86 1
#endif

namespace attn::bench {
namespace {

using Kernel = float (*)(int64_t iterations);

struct Probe {
  Kernel kernel;
  const char* isa;
  int lanes;
  int chains;  // vector FMAs per loop iteration
  int products_per_lane = 1;  // 2 for a dot-product instruction (two products into one lane)
};

// acc = acc * a + b converges to b / (1 - a) = 1: the values stay normal and finite forever.
constexpr float kMul = 0.999f;
constexpr float kAdd = 0.001f;

#ifdef ATTN_PEAK_X86

// 16 accumulators (of 32 zmm registers): more than latency x throughput on any AVX-512 core.
constexpr int kChains512 = 16;

__attribute__((target("avx512f"))) float fma_avx512(int64_t iterations) {
  const __m512 a = _mm512_set1_ps(kMul), b = _mm512_set1_ps(kAdd);
  __m512 acc[kChains512];
#pragma GCC unroll 16
  for (int c = 0; c < kChains512; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * static_cast<float>(c));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains512; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
#pragma GCC unroll 16
  for (int c = 1; c < kChains512; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12's header warns inside it
  _mm512_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

// 12 accumulators + 2 constants fit the 16 ymm registers without spilling.
constexpr int kChains256 = 12;

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iterations) {
  const __m256 a = _mm256_set1_ps(kMul), b = _mm256_set1_ps(kAdd);
  __m256 acc[kChains256];
#pragma GCC unroll 12
  for (int c = 0; c < kChains256; ++c) acc[c] = _mm256_set1_ps(1.0f + 0.01f * static_cast<float>(c));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains256; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  __m256 sum = acc[0];
#pragma GCC unroll 12
  for (int c = 1; c < kChains256; ++c) sum = _mm256_add_ps(sum, acc[c]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

// The BF16 dot-product unit: vdpbf16ps multiplies 16 x 2 bf16 pairs and adds them into 16
// float32 lanes, 64 flops. acc += a . b with both pairs 2^-20: each step adds 2^-39, so the
// accumulators stay normal (the instruction flushes subnormals) for any run length.
__attribute__((target("avx512f,avx512bf16"))) float dpbf16_avx512(int64_t iterations) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x35803580);  // two bf16 2^-20
  __m512 acc[kChains512];
#pragma GCC unroll 16
  for (int c = 0; c < kChains512; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * static_cast<float>(c));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains512; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
  }
  __m512 sum = acc[0];
#pragma GCC unroll 16
  for (int c = 1; c < kChains512; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

// The AMX-BF16 tiles: one tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16
// float32 (16,384 flops). Four independent accumulators (tiles 0-3) over two A and two B tiles,
// as the attention kernel's 2 x 2 blocking uses them. Callers run it only where the registry's
// cpu.flash.amx_bf16 runs: the CPU has the tiles and Linux granted this process their state.
__attribute__((target("amx-tile,amx-bf16"))) float dpbf16_amx(int64_t iterations) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg = {};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  alignas(64) static const uint32_t ones[256] = {};  // values do not change a tile's timing
  alignas(64) float out[256];
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

#endif  // ATTN_PEAK_X86

// Portable fallback: 4-lane vectors, multiply then add (2 flops per lane, like one FMA).
constexpr int kChainsGeneric = 12;
typedef float V4 __attribute__((vector_size(16)));

float fma_generic(int64_t iterations) {
  const V4 a = {kMul, kMul, kMul, kMul}, b = {kAdd, kAdd, kAdd, kAdd};
  V4 acc[kChainsGeneric];
  for (int c = 0; c < kChainsGeneric; ++c) {
    const float x = 1.0f + 0.01f * static_cast<float>(c);
    acc[c] = V4{x, x, x, x};
  }
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChainsGeneric; ++c) acc[c] = acc[c] * a + b;
  }
  float total = 0.0f;
  for (const V4& v : acc) total += v[0] + v[1] + v[2] + v[3];
  return total;
}

Probe best_probe() {
#ifdef ATTN_PEAK_X86
  if (__builtin_cpu_supports("avx512f")) return {fma_avx512, "avx512f", 16, kChains512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {fma_avx2, "avx2+fma", 8, kChains256};
  }
#endif
  return {fma_generic, "generic", 4, kChainsGeneric};
}

// Loop iterations between two clock reads: ~0.1-1 ms of work on current cores.
constexpr int64_t kChunk = int64_t{1} << 16;

volatile float g_sink;  // where every kernel's result goes, so none can be optimised away

struct Trial {
  double gflops;
  int threads;  // the team OpenMP actually gave
};

// One trial: every thread runs chunks until `seconds` have passed since a common start; returns
// all threads' flops over the wall time of the whole region (the slowest thread included).
Trial run_trial(const Probe& p, int threads, double seconds) {
  using Clock = std::chrono::steady_clock;
  std::vector<int64_t> iterations(static_cast<size_t>(threads), 0);
  Clock::time_point start;
  int team = 1;
  float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp single
    {
      team = omp_get_num_threads();
      start = Clock::now();  // the implicit barrier after `single` releases every thread at once
    }
    const auto deadline = start + std::chrono::duration<double>(seconds);
    int64_t n = 0;
    do {
      sink += p.kernel(kChunk);
      n += kChunk;
    } while (Clock::now() < deadline);
    iterations[static_cast<size_t>(omp_get_thread_num())] = n;
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  g_sink = sink;
  int64_t total = 0;
  for (int64_t n : iterations) total += n;
  const double flops = static_cast<double>(total) * p.chains * p.lanes * 2.0 * p.products_per_lane;
  return {flops / wall * 1e-9, team};
}

}  // namespace

std::string fma_isa() { return best_probe().isa; }

namespace {
PeakResult measure(const Probe& p, int threads, double seconds, int trials) {
  threads = std::max(threads, 1);
  run_trial(p, threads, std::min(seconds, 0.05));  // start the threads and settle the clocks
  PeakResult r;
  r.isa = p.isa;
  r.lanes = p.lanes;
  for (int t = 0; t < std::max(trials, 1); ++t) {
    const Trial trial = run_trial(p, threads, seconds);
    if (trial.gflops > r.gflops) {
      r.gflops = trial.gflops;
      r.threads = trial.threads;
    }
  }
  return r;
}
}  // namespace

PeakResult measure_fma_peak(int threads, double seconds, int trials) {
  return measure(best_probe(), threads, seconds, trials);
}

std::optional<PeakResult> measure_amx_bf16_peak(int threads, double seconds, int trials) {
#ifdef ATTN_PEAK_X86
  // 4 tile products of 256 lanes x 32 products each per iteration.
  return measure({dpbf16_amx, "amx_bf16", 256, 4, 32}, threads, seconds, trials);
#else
  (void)threads, (void)seconds, (void)trials;
  return std::nullopt;
#endif
}

std::optional<PeakResult> measure_bf16_dot_peak(int threads, double seconds, int trials) {
#ifdef ATTN_PEAK_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) {
    return measure({dpbf16_avx512, "avx512_bf16", 16, kChains512, 2}, threads, seconds, trials);
  }
#endif
  (void)threads, (void)seconds, (void)trials;
  return std::nullopt;
}

}  // namespace attn::bench

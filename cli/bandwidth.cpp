// Memory read-bandwidth probe (see bandwidth.hpp).
#include "bandwidth.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "attn/tensor.hpp"
#include "bench.hpp"  // median

#if defined(__x86_64__) || defined(__i386__)
#define ATTN_BANDWIDTH_X86 1
#endif

namespace attn::bench {
namespace {

// Floats summed per loop iteration by every kernel: each thread's share is a multiple of this.
constexpr int64_t kBlock = 128;

// n: a multiple of kBlock. With `next` (n floats too, or null) each step also prefetches the
// same lines of next into L2, the read a thread makes after this one.
using SumKernel = float (*)(const float* p, int64_t n, const float* next);

// Vectors of 16, 8 and 4 floats (GCC vector extensions).
typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

// Sums n floats with 8 accumulators of type V (Lanes floats): 8 independent loads and adds per
// iteration. Written once and inlined into each ISA's entry point below, which compiles it for
// that ISA (a V16 becomes one zmm register under avx512f).
template <typename V, int Lanes>
inline __attribute__((always_inline)) float sum_vectors(const float* p, int64_t n, const float* next) {
  V acc[8] = {};
  const V* v = reinterpret_cast<const V*>(__builtin_assume_aligned(p, 64));
  if (next != nullptr) {
    for (int64_t i = 0; i < n / Lanes; i += 8) {
      for (int64_t b = 0; b < 8 * Lanes; b += 16) __builtin_prefetch(next + i * Lanes + b, 0, 2);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] += v[i + c];
    }
  } else {
    for (int64_t i = 0; i < n / Lanes; i += 8) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] += v[i + c];
    }
  }
  for (int c = 1; c < 8; ++c) acc[0] += acc[c];
  float total = 0.0f;
  for (int lane = 0; lane < Lanes; ++lane) total += acc[0][lane];
  return total;
}

#ifdef ATTN_BANDWIDTH_X86
__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t n, const float* next) {
  return sum_vectors<V16, 16>(p, n, next);
}
__attribute__((target("avx2"))) float sum_avx2(const float* p, int64_t n, const float* next) {
  return sum_vectors<V8, 8>(p, n, next);
}
#endif

float sum_generic(const float* p, int64_t n, const float* next) { return sum_vectors<V4, 4>(p, n, next); }

struct SumProbe {
  SumKernel kernel;
  const char* isa;
};

SumProbe best_sum() {
#ifdef ATTN_BANDWIDTH_X86
  if (__builtin_cpu_supports("avx512f")) return {sum_avx512, "avx512f"};
  if (__builtin_cpu_supports("avx2")) return {sum_avx2, "avx2"};
#endif
  return {sum_generic, "generic"};
}

// "48K", "2048K", "260M" (sysfs cache sizes) in bytes; 0 if unreadable.
int64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const long long n = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || n <= 0) return 0;
  switch (*end) {
    case 'K': return n << 10;
    case 'M': return n << 20;
    case 'G': return n << 30;
    default: return n;
  }
}

volatile float g_sink;

}  // namespace

int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int index = 0; index < 16; ++index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    if (!f) continue;  // the indices need not be dense
    std::string size;
    f >> size;
    best = std::max(best, parse_size(size));
  }
  return best;
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

int64_t bandwidth_array_bytes() {
  constexpr int64_t kMiB = int64_t{1} << 20;
  const int64_t llc = last_level_cache_bytes();
  int64_t bytes = std::max(llc > 0 ? 8 * llc : 1024 * kMiB, 256 * kMiB);  // 8x: as kRotationLlcs (bench.hpp)
  if (const int64_t available = available_memory_bytes(); available > 0) {
    bytes = std::min(bytes, available / 4);
  }
  return std::max<int64_t>(bytes / kMiB, 1) * kMiB;  // whole MiB: a multiple of every share
}

namespace {

// Times read(sum, data, n, t, team), thread t of `team` reading its share of the array's first
// n floats, n a multiple of `unit` floats (the rest is not read, nor counted).
template <typename Read>
BandwidthResult measure(int threads, int passes, int64_t unit, Read read) {
  using Clock = std::chrono::steady_clock;
  threads = std::max(threads, 1);
  const SumProbe probe = best_sum();
  BandwidthResult r;
  r.isa = probe.isa;
  r.llc_bytes = last_level_cache_bytes();
  r.bytes = bandwidth_array_bytes();
  const int64_t floats = r.bytes / static_cast<int64_t>(sizeof(float));
  const int64_t n = floats / unit * unit;
  // A tensor, so the array lies on the pages the library gives the K/V it reads (huge pages for
  // blocks of 4 MiB or more, src/core/allocator.cpp): on 4 KiB pages the probe paid a TLB miss
  // per 4 KiB that the decode kernel did not, and read below it (AMD Zen 4, 2 threads, old and
  // new binaries alternating: 29.0-29.7 GB/s on 4 KiB pages, 35.1-38.6 on huge pages).
  Tensor array = Tensor::empty({floats});
  float* data = array.data();
  r.bytes = n * static_cast<int64_t>(sizeof(float));

  // Thread t of `team` writes floats [share(t), share(t + 1)), whole blocks.
  const auto share = [floats](int t, int team) { return floats / kBlock * t / team * kBlock; };
  std::vector<double> gbps;
  float sink = 0.0f;
  for (int pass = 0; pass <= std::max(passes, 1); ++pass) {  // pass 0 writes, untimed
    Clock::time_point start;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const int team = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t begin = share(t, team), end = share(t + 1, team);
      if (pass == 0) {
        std::fill(data + begin, data + end, 1.0f);
      } else {
#pragma omp barrier
#pragma omp single
        {
          r.threads = team;
          start = Clock::now();  // the implicit barrier after `single` releases every thread
        }
        sink += read(probe.kernel, data, n, t, team);
      }
    }
    if (pass == 0) continue;
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    gbps.push_back(static_cast<double>(r.bytes) / wall * 1e-9);
  }
  g_sink = sink;
  r.passes = static_cast<int>(gbps.size());
  r.gbps = median(gbps);
  r.best_gbps = *std::max_element(gbps.begin(), gbps.end());
  return r;
}

}  // namespace

BandwidthResult measure_read_bandwidth(int threads, int passes) {
  return measure(threads, passes, kBlock, [](SumKernel sum, const float* data, int64_t n, int t, int team) {
    const int64_t begin = n / kBlock * t / team * kBlock, end = n / kBlock * (t + 1) / team * kBlock;
    return sum(data + begin, end - begin, nullptr);
  });
}

BandwidthResult measure_paged_read_bandwidth(int threads, int64_t block_bytes, int64_t streams, int passes) {
  const int64_t block = std::max<int64_t>(1, (block_bytes + 4 * kBlock - 1) / (4 * kBlock)) * kBlock;  // floats
  streams = std::max<int64_t>(1, streams);
  return measure(threads, passes, block * streams, [block, streams](SumKernel sum, const float* data, int64_t n, int t, int team) {
    const int64_t pages = n / (block * streams), blocks = pages * streams;
    const auto at = [&](int64_t i) { return data + (i % pages * streams + i / pages) * block; };  // i = stream * pages + page
    float total = 0.0f;
    const int64_t end = blocks * (t + 1) / team;
    for (int64_t i = blocks * t / team; i < end; ++i) total += sum(at(i), block, i + 1 < end ? at(i + 1) : nullptr);
    return total;
  });
}

}  // namespace attn::bench

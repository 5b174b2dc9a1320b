// Whether the order in which the decode kernel reads a paged cache's pool costs bandwidth: a
// stand-alone read loop (not the library's code) over a bf16 pool of attn::PagedKvCache's layout,
// in three orders, with optional arithmetic between the rows. A benchmark program, not a test.
//
//   g++ -O2 -mavx512f -fopenmp -std=c++20 scripts/paged_read_order.cpp -o /tmp/paged_read_order
//   /tmp/paged_read_order [AHEAD [WORK]]
//
// Shapes: 8 kv heads, S 8192 tokens, E 128, bf16: K and V are pools of 512 pages of 16 tokens,
// each page (8 heads, 16, 128): a head's block of a page is 4 KiB (kv_cache.hpp's layout), the
// sequence's pages in order. Two threads, each half of the tokens. Orders (a row of K and the
// same row of V read together, summed with 512-bit loads; AHEAD rows on, default 16, both rows'
// lines prefetched into L2 with prefetcht1, as the kernel's key rows are):
//   kernel  the kernel's (decode_kernel.hpp's StepOrder, paged_attention): chunks of 64 tokens
//           (4 pages), within a chunk one head's 4 blocks after another's
//   memory  the pool's own order: page after page, a page's heads in turn
//   dense   per-head tensors (8, S, 128), items of 1024 keys dealt to the threads in turn (the
//           dense driver's split)
// WORK: units of FMAs after each row (4 a unit, 2 of them a dependent chain across units), the
// kernel's arithmetic standing in (0: a pure read). Buffers on transparent huge pages, as the library allocates them; 9 copies of the
// 32 MiB pool rotated call by call, so rows come from memory. Prints each order's median rate over
// 27 calls, five rounds. On Zen 4 (2 threads), rounds' medians: WORK 0, the three within ~3 %
// (27.7-28.5, 28.2-30.0, 28.3-29.3 GB/s); WORK 8, AHEAD 16: kernel order 27.4-27.8 GB/s against
// 31.2-31.7 for the others (36.6-39.8 against 42.6-46.1 in a faster state of the host's memory);
// AHEAD 64: 28.6-30.4, the three within ~2 %.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

// GCC 12 reports _mm512_reduce_add_ps's own placeholder operand as uninitialized (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

constexpr int kHeads = 8, kPage = 16, kDim = 128, kSeq = 8192, kPages = kSeq / kPage;
constexpr int64_t kRow = kDim * 2;  // bytes of a bf16 row
constexpr int64_t kBlock = kPage * kRow, kPageBytes = kHeads * kBlock, kPool = int64_t{kPages} * kPageBytes;
constexpr int kCopies = 9, kCalls = 27;

using Rows = std::vector<std::pair<const char*, const char*>>;  // (key row, value row) in read order
using Order = std::vector<Rows>;                                // per thread

__m512 sum_row(const char* r, __m512 a) {
  for (int64_t b = 0; b < kRow; b += 64) a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_loadu_si512(r + b)));
  return a;
}

void prefetch_row(const char* r) {
  for (int64_t b = 0; b < kRow; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
}

double run(const Order& order, int ahead, int work) {
  float sink = 0.0f;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
  {
    const Rows& rows = order[static_cast<size_t>(omp_get_thread_num())];
    __m512 a = _mm512_setzero_ps(), b0 = a, b1 = a, b2 = a, b3 = a, b4 = a;
    const size_t n = rows.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + static_cast<size_t>(ahead) < n) {
        prefetch_row(rows[i + static_cast<size_t>(ahead)].first);
        prefetch_row(rows[i + static_cast<size_t>(ahead)].second);
      }
      a = sum_row(rows[i].second, sum_row(rows[i].first, a));
      for (int k = 0; k < work; ++k) {
        b0 = _mm512_fmadd_ps(b0, b1, b2), b1 = _mm512_fmadd_ps(b1, b0, b2);  // b0, b1: the chain
        b3 = _mm512_fmadd_ps(b3, b1, b2), b4 = _mm512_fmadd_ps(b4, b3, b2);  // off it
      }
    }
    sink += _mm512_reduce_add_ps(a) + _mm512_reduce_add_ps(b4);
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (sink == 1.25f) std::printf(" ");  // keeps the sums
  return std::chrono::duration<double>(t1 - t0).count();
}

char* huge_buffer(int64_t bytes) {
  auto* p = static_cast<char*>(std::aligned_alloc(size_t{2} << 20, static_cast<size_t>(bytes)));
  if (p == nullptr) std::abort();
  madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);
  std::memset(p, 1, static_cast<size_t>(bytes));  // small finite floats when read as float32
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int ahead = argc > 1 ? std::atoi(argv[1]) : 16, work = argc > 2 ? std::atoi(argv[2]) : 0;
  std::vector<Order> kernel, memory, dense;
  for (int c = 0; c < kCopies; ++c) {
    const char *kp = huge_buffer(kPool), *vp = huge_buffer(kPool), *kd = huge_buffer(kPool), *vd = huge_buffer(kPool);
    auto pool_row = [&](int page, int h, int r) { return int64_t{page} * kPageBytes + h * kBlock + r * kRow; };
    Order a(2), b(2), d(2);
    for (int t = 0; t < 2; ++t) {
      const int p0 = t * kPages / 2, p1 = (t + 1) * kPages / 2;
      for (int g = p0; g < p1; g += 4) {
        for (int h = 0; h < kHeads; ++h) {
          for (int page = g; page < g + 4; ++page) {
            for (int r = 0; r < kPage; ++r) a[t].push_back({kp + pool_row(page, h, r), vp + pool_row(page, h, r)});
          }
        }
      }
      for (int page = p0; page < p1; ++page) {
        for (int h = 0; h < kHeads; ++h) {
          for (int r = 0; r < kPage; ++r) b[t].push_back({kp + pool_row(page, h, r), vp + pool_row(page, h, r)});
        }
      }
    }
    int item = 0;
    for (int h = 0; h < kHeads; ++h) {
      for (int j0 = 0; j0 < kSeq; j0 += 1024, ++item) {
        for (int j = j0; j < j0 + 1024; ++j) {
          const int64_t off = (int64_t{h} * kSeq + j) * kRow;
          d[static_cast<size_t>(item % 2)].push_back({kd + off, vd + off});
        }
      }
    }
    kernel.push_back(std::move(a)), memory.push_back(std::move(b)), dense.push_back(std::move(d));
  }
  const double bytes = 2.0 * kPool;
  auto median_rate = [&](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return bytes / t[t.size() / 2] * 1e-9;
  };
  std::printf("bf16 pool, pages of %d tokens, %d heads, E %d, S %d, 2 threads, %d rows ahead, work %d\n", kPage,
              kHeads, kDim, kSeq, ahead, work);
  for (int round = 0; round < 5; ++round) {
    std::vector<double> ta, tb, td;
    for (int i = 0; i < kCalls; ++i) {  // the orders interleaved call by call, each on another copy
      ta.push_back(run(kernel[static_cast<size_t>(i % kCopies)], ahead, work));
      tb.push_back(run(memory[static_cast<size_t>((i + 3) % kCopies)], ahead, work));
      td.push_back(run(dense[static_cast<size_t>((i + 6) % kCopies)], ahead, work));
    }
    std::printf("kernel order %.1f GB/s  memory order %.1f  dense %.1f\n", median_rate(ta), median_rate(tb),
                median_rate(td));
  }
  return 0;
}

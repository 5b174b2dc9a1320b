// How much of a GQA-4 decode's time from DRAM is memory, arithmetic, or the two failing to
// overlap: a stand-alone loop with the shape of attn's AVX2 decode kernel (not the library's
// code), run in variants that remove one part at a time. A benchmark program, not a test.
//
//   g++ -O3 -mavx2 -mfma -fopenmp -std=c++20 scripts/decode_overlap.cpp -o /tmp/decode_overlap
//   /tmp/decode_overlap MODE [--threads N] [--copies C] [--seq S] [--calls N] [--huge]
//                            [--ahead ROWS] [--t0] [--v-with-k | --v-in-order]
//
// Shapes: 8 kv heads x S keys (default 8192), E 128, float32 K and V (each (8, S, 128)); per kv
// head 4 query rows (GQA group 4, one new token). Items of 1024 keys run on N OpenMP threads
// (dynamic schedule, as attn's driver); an item walks chunks of 64 keys: scores three tokens x
// four rows per register tile, the online softmax (vectorised exp2), P.V in 4 x 3 and 4 x 2
// register tiles. Prefetches (prefetcht1; --t0: prefetcht0) as the kernel's: each key row ROWS
// tokens ahead (default 16, spread over the score tile's steps), the next chunk's value rows
// during this chunk's P.V, tile by tile (each tile step the same bytes of the next chunk's row);
// --v-in-order: line after line of the next chunk's rows instead, ~1.7 per tile step (as
// decode_pv.hpp's PvOrder); --v-with-k: each value row with its key row. --huge: 2 MiB pages. The
// calls rotate among C copies of K/V (default 6: 384 MiB, far beyond the LLC). Prints the median
// of the calls and the rate of K/V bytes read.
// MODE:
//   read      read the same bytes in the same order (sums), nothing else
//   kernel    the loop on the real K/V, with its prefetches
//   noprefetch  the loop on the real K/V, no software prefetch
//   compute   the loop's arithmetic on stand-in K/V of one chunk (L1/L2-resident), no prefetch
//   compute+prefetch  the same arithmetic, plus the prefetches of the real K/V stream
//   real-k, real-v    the arithmetic on the real keys (values) only, stand-in values (keys), all prefetches
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kE = 128, kChunk = 64, kRows = 4, kHeads = 8, kItem = 1024;
int g_ahead = 16;  // key rows the score loop prefetches ahead (--ahead)

struct Config {
  bool read_only = false, prefetch = true, stand_in_k = false, stand_in_v = false;
};

struct Partial {
  float m[kRows], l[kRows];
  float acc[kRows * kE];
};

// Stand-in K and V of one chunk (compute modes): the arithmetic reads these instead.
alignas(64) float g_k[kChunk * kE], g_v[kChunk * kE];

void hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

__m256 exp2v(__m256 x) {  // timing only: a degree-5 polynomial, no special cases
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3333558e-3f);
  for (float c : {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

int g_vmode = 0;  // value prefetch: 0 the next chunk tile by tile, 1 with the keys, 2 the next chunk in memory order
bool g_t0 = false;  // prefetcht0 instead of prefetcht1 (--t0)
void prefetch(const void* p) {
  if (g_t0) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  } else {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  }
}

const char* g_vnext = nullptr;  // --v-in-order: the next chunk's values, prefetched line by line
int64_t g_vnext_lines = 0, g_vnext_done = 0;
template <int CV>
void pv_tile(const float* st, const float* v, int nk, int c, float* acc, const float* v_next, int n_next, bool pf) {
  __m256 a[kRows][CV];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < CV; ++j) a[r][j] = _mm256_loadu_ps(acc + r * kE + c + j * 8);
  }
  for (int x = 0; x < nk; ++x) {
    if (pf && g_vmode == 0 && x < n_next) {  // the next chunk's bytes this tile reads, for the same step
      for (int b = 0; b < CV * 8; b += 16) prefetch(v_next + x * kE + c + b);
    }
    if (pf && g_vmode == 2) {  // 4 lines per 3 steps: 512 lines over the 6 tiles' 384 steps
      for (int64_t b = 0; b < 2 && g_vnext_done < g_vnext_lines; ++b) {
        if (b == 1 && (x % 3 == 0)) break;
        prefetch(g_vnext + 64 * g_vnext_done++);
      }
    }
    const float* row = v + x * kE + c;
    __m256 vv[CV];
    for (int j = 0; j < CV; ++j) vv[j] = _mm256_loadu_ps(row + j * 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256 p = _mm256_broadcast_ss(st + r * kChunk + x);
      for (int j = 0; j < CV; ++j) a[r][j] = _mm256_fmadd_ps(p, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < CV; ++j) _mm256_storeu_ps(acc + r * kE + c + j * 8, a[r][j]);
  }
}

void read_item(const float* K, const float* V, int n, Partial& out) {
  __m256 s[4] = {};
  for (const float* X : {K, V}) {
    for (size_t i = 0; i < static_cast<size_t>(n) * kE; i += 32) {
      for (int j = 0; j < 4; ++j) s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(X + i + 8 * j));
    }
  }
  _mm256_storeu_ps(out.acc, _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
}

void item(const Config& cfg, const float* q, const float* K, const float* V, int n, Partial& out) {
  if (cfg.read_only) return read_item(K, V, n, out);
  alignas(32) float st[kRows * kChunk];
  for (int r = 0; r < kRows; ++r) out.m[r] = -INFINITY, out.l[r] = 0.0f;
  std::fill(out.acc, out.acc + kRows * kE, 0.0f);
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int nk = std::min(kChunk, n - c0), n_next = std::max(0, std::min(kChunk, n - c0 - nk));
    const float* k_real = K + static_cast<size_t>(c0) * kE;
    const float* v_real = V + static_cast<size_t>(c0) * kE;
    const float* k = cfg.stand_in_k ? g_k : k_real;
    const float* v = cfg.stand_in_v ? g_v : v_real;
    int u = 0;
    for (; u < nk; u += 3) {  // three tokens per tile (the last tile of a chunk clamps its rows)
      const float* k0 = k + u * kE;
      const float* k1 = k + std::min(u + 1, nk - 1) * kE;
      const float* k2 = k + std::min(u + 2, nk - 1) * kE;
      // the rows g_ahead tokens on (three of them, 24 lines), two per step of E
      const char* ahead = reinterpret_cast<const char*>(k_real + (u + g_ahead) * kE);
      const bool pf = cfg.prefetch && c0 + u + g_ahead + 2 < n;
      const char* ahead_v = reinterpret_cast<const char*>(v_real + (u + g_ahead) * kE);
      __m256 a[3][kRows];
      for (auto& t : a) {
        for (auto& x : t) x = _mm256_setzero_ps();
      }
      for (int e = 0; e < kE; e += 8) {
        if (pf) prefetch(ahead + e * 12), prefetch(ahead + e * 12 + 64);
        if (pf && g_vmode == 1) prefetch(ahead_v + e * 12), prefetch(ahead_v + e * 12 + 64);
        const __m256 x0 = _mm256_loadu_ps(k0 + e), x1 = _mm256_loadu_ps(k1 + e), x2 = _mm256_loadu_ps(k2 + e);
        for (int r = 0; r < kRows; ++r) {
          const __m256 qv = _mm256_loadu_ps(q + r * kE + e);
          a[0][r] = _mm256_fmadd_ps(qv, x0, a[0][r]);
          a[1][r] = _mm256_fmadd_ps(qv, x1, a[1][r]);
          a[2][r] = _mm256_fmadd_ps(qv, x2, a[2][r]);
        }
      }
      for (int t = 0; t < 3 && u + t < nk; ++t) {
        float d[4];
        hsum4(a[t][0], a[t][1], a[t][2], a[t][3], d);
        for (int r = 0; r < kRows; ++r) st[r * kChunk + u + t] = d[r] * 0.127f;
      }
    }
    for (int r = 0; r < kRows; ++r) {  // online softmax
      float* s = st + r * kChunk;
      for (int x = nk; x < kChunk; ++x) s[x] = -INFINITY;
      __m256 mx = _mm256_set1_ps(out.m[r]);
      for (int x = 0; x < kChunk; x += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + x));
      float lanes[8];
      _mm256_storeu_ps(lanes, mx);
      const float m = *std::max_element(lanes, lanes + 8);
      const float alpha = std::exp2(out.m[r] - m);
      __m256 sum = _mm256_setzero_ps();
      for (int x = 0; x < kChunk; x += 8) {
        const __m256 p = exp2v(_mm256_sub_ps(_mm256_loadu_ps(s + x), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + x, p);
        sum = _mm256_add_ps(sum, p);
      }
      _mm256_storeu_ps(lanes, sum);
      float total = 0.0f;
      for (float z : lanes) total += z;
      out.l[r] = out.l[r] * alpha + total, out.m[r] = m;
      if (alpha != 1.0f) {
        for (int c = 0; c < kE; ++c) out.acc[r * kE + c] *= alpha;
      }
    }
    const float* v_next = v_real + kChunk * kE;
    g_vnext = reinterpret_cast<const char*>(v_next), g_vnext_lines = n_next * kE * 4 / 64, g_vnext_done = 0;
    for (int c = 0; c < 96; c += 24) pv_tile<3>(st, v, nk, c, out.acc, v_next, n_next, cfg.prefetch);
    for (int c = 96; c < kE; c += 16) pv_tile<2>(st, v, nk, c, out.acc, v_next, n_next, cfg.prefetch);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s read|kernel|noprefetch|compute|compute+prefetch|real-k|real-v [--threads N] [--copies C] [--seq S] [--calls N] [--huge] [--ahead ROWS] [--t0] [--v-with-k|--v-in-order]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  Config cfg;
  if (mode == "read") {
    cfg.read_only = true;
  } else if (mode == "noprefetch") {
    cfg.prefetch = false;
  } else if (mode == "compute") {
    cfg.stand_in_k = cfg.stand_in_v = true, cfg.prefetch = false;
  } else if (mode == "compute+prefetch") {
    cfg.stand_in_k = cfg.stand_in_v = true;
  } else if (mode == "real-k") {
    cfg.stand_in_v = true;
  } else if (mode == "real-v") {
    cfg.stand_in_k = true;
  } else if (mode != "kernel") {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  int threads = 1, copies = 6, S = 8192, calls = 30;
  bool huge = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--threads") threads = next();
    else if (a == "--copies") copies = next();
    else if (a == "--seq") S = next();
    else if (a == "--calls") calls = next();
    else if (a == "--huge") huge = true;
    else if (a == "--ahead") g_ahead = next();
    else if (a == "--t0") g_t0 = true;
    else if (a == "--v-with-k") g_vmode = 1;
    else if (a == "--v-in-order") g_vmode = 2;
  }
  if (S < kItem || S % kItem != 0 || copies < 1 || calls < 1 || threads < 1) {
    std::fprintf(stderr, "need --seq a multiple of %d, and positive --copies, --calls, --threads\n", kItem);
    return 2;
  }
  const size_t per = static_cast<size_t>(kHeads) * S * kE;
  std::vector<float*> Ks(copies), Vs(copies);
  for (int c = 0; c < copies; ++c) {
    for (float** X : {&Ks[c], &Vs[c]}) {
      *X = static_cast<float*>(std::aligned_alloc(2 << 20, per * sizeof(float)));
      if (huge) madvise(*X, per * sizeof(float), MADV_HUGEPAGE);
      for (size_t i = 0; i < per; ++i) (*X)[i] = static_cast<float>(i % 97) * 0.01f - 0.4f;
    }
  }
  for (int i = 0; i < kChunk * kE; ++i) g_k[i] = g_v[i] = static_cast<float>(i % 89) * 0.01f - 0.4f;
  std::vector<float> q(kHeads * kRows * kE);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 83) * 0.01f - 0.4f;
  const int items = kHeads * (S / kItem);
  std::vector<Partial> parts(items);
  std::vector<double> t;
  for (int call = 0; call < calls; ++call) {
    const int c = call % copies;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < items; ++i) {
      const int h = i / (S / kItem), j0 = (i % (S / kItem)) * kItem;
      const size_t off = static_cast<size_t>(h) * S * kE + static_cast<size_t>(j0) * kE;
      item(cfg, q.data() + h * kRows * kE, Ks[c] + off, Vs[c] + off, kItem, parts[i]);
    }
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const double med = t[t.size() / 2];
  std::printf("%-17s threads %d, S %d, %d copies%s: median %.3f ms, %.2f GB/s of K/V\n", mode.c_str(), threads, S, copies,
              huge ? ", 2 MiB pages" : "", med * 1e3, 2.0 * per * sizeof(float) / med * 1e-9);
  for (int c = 0; c < copies; ++c) std::free(Ks[c]), std::free(Vs[c]);
  return 0;
}

// Two builds of the CPU kernels in one process, called alternately on the same inputs: the
// ratio of each pair's times is immune to the slow drifts of a shared host (its caches' and
// memory's share moves by a third between minutes on the project's VMs, which `attn bench` runs
// in separate processes cannot tell from a kernel change). Built and run by ab_kernels.sh, which
// compiles the kernel headers of two source trees into ab_tu.cpp objects, one per namespace;
// kernel_a()/kernel_b() and decode_a()/decode_b() are theirs.
//
//   fwd    H L E CAUSAL PAIRS [THREADS]   forward_block over H heads of L queries and keys
//   bwd    H L E CAUSAL PAIRS [THREADS]   backward_head over the same (whole key range)
//   fwd16  H L E CAUSAL PAIRS [THREADS]   the AVX512-BF16 forward (flash_avx512_bf16.cpp) on bf16
//          q, k, v: pack_v per head and forward_block over its query blocks (ab_kernels.sh
//          -i avx512_bf16 builds it)
//   bwd16  H L E CAUSAL PAIRS [THREADS]   its backward (flash_bwd_avx512_bf16.cpp) over the same,
//          D given (as from the forward's output_residual, the training path)
//   decode HKV R S E COPIES PAIRS [THREADS [KV [PAGE]]]  decode_split: HKV kv heads of S keys, R query
//          rows each (GQA group x new tokens), K/V rotating among COPIES copies (1: from the
//          caches); KV: f32 (default), bf16 (a bf16 cache, float32 queries) or bf16q (bf16
//          queries too: the dot unit's path, in a build with -mavx512bf16, ab_kernels.sh -i avx512_bf16);
//          PAGE: a paged pool of PAGE-token pages (kv_cache.hpp's layout, the pages in order) read
//          as paged_attention reads it, key ranges with every kv head together (0, the default:
//          dense, a task per kv head and key range, as the driver splits them); PAGE_A:PAGE_B
//          gives each build its own layout, e.g. `16:0` with one tree twice: paged / dense time
//          in one process. K/V on transparent huge pages, as the library allocates them
//
// Prints the median time of each build, A's time over B's (median and quartiles of the per-pair
// ratios: above 1, B is faster) and the largest difference between their outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <omp.h>
#include <sys/mman.h>

#include "attn/dtype.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/flush_denormals.hpp"

namespace attn::cpu {
const FlashKernel& kernel_a();
const FlashKernel& kernel_b();
const DecodeKernel& decode_a();
const DecodeKernel& decode_b();
// The two trees' AVX512-BF16 kernels, linked only in the avx512_bf16 build (weak: absent, null).
[[gnu::weak]] const Bf16ForwardKernel& bf16_kernel_a();
[[gnu::weak]] const Bf16ForwardKernel& bf16_kernel_b();
[[gnu::weak]] const Bf16BackwardKernel& bf16_backward_a();
[[gnu::weak]] const Bf16BackwardKernel& bf16_backward_b();
}  // namespace attn::cpu

using namespace attn::cpu;
using Vec = std::vector<float>;

namespace {

Vec randn(size_t n, std::mt19937& g) {
  std::normal_distribution<float> nd;
  Vec x(n);
  for (float& y : x) y = nd(g);
  return x;
}

double max_diff(const Vec& a, const Vec& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

// Calls call(w) for w = 0 (A) and 1 (B), `pairs` times each, alternating which goes first.
template <class Call>
void time_pairs(int pairs, Call call, double work, const char* unit, double out_diff) {
  std::vector<double> ratio, t[2];
  for (int i = 0; i < pairs; ++i) {
    for (int s = 0; s < 2; ++s) {
      const int w = (i + s) & 1;
      const auto t0 = std::chrono::steady_clock::now();
      call(w);
      t[w].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    ratio.push_back(t[0].back() / t[1].back());
  }
  std::sort(ratio.begin(), ratio.end());
  for (auto& x : t) std::sort(x.begin(), x.end());
  const double ta = t[0][pairs / 2], tb = t[1][pairs / 2];
  std::printf("A %.3f ms (%.2f %s)  B %.3f ms (%.2f %s)  A/B median %.3f, quartiles %.3f-%.3f, %d pairs  |  max |A - B| %.2e\n",
              ta * 1e3, work / ta * 1e-9, unit, tb * 1e3, work / tb * 1e-9, unit, ratio[pairs / 2], ratio[pairs / 4],
              ratio[3 * pairs / 4], pairs, out_diff);
}

// fwd/bwd/fwd16/bwd16's arguments H L E CAUSAL PAIRS [THREADS] and the square problem they give.
struct FlashArgs {
  int H, pairs, T;
  int64_t L, E;
  bool causal;
  FlashBwdParams p;
};
FlashArgs flash_args(int argc, char** argv) {
  FlashArgs a{std::atoi(argv[2]), std::atoi(argv[6]), argc > 7 ? std::atoi(argv[7]) : 1, std::atoll(argv[3]),
              std::atoll(argv[4]), std::atoi(argv[5]) != 0, {}};
  FlashBwdParams& p = a.p;
  p.L = p.S = a.L, p.E = p.Ev = a.E, p.q_row = p.k_row = p.v_row = p.o_row = a.E;
  p.scale = 1.0f / std::sqrt(static_cast<float>(a.E));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.causal = a.causal;
  return a;
}

int flash(bool backward, int argc, char** argv) {
  if (argc < 7) return 2;
  const auto [H, pairs, T, L, E, causal, p] = flash_args(argc, argv);
  std::mt19937 g(1);
  const size_t n = static_cast<size_t>(H * L * E);
  const Vec q = randn(n, g), k = randn(n, g), v = randn(n, g), dout = randn(n, g);
  Vec o[2] = {Vec(n), Vec(n)}, lse[2] = {Vec(H * L), Vec(H * L)};
  Vec dq[2] = {Vec(n), Vec(n)}, dk[2] = {Vec(n), Vec(n)}, dv[2] = {Vec(n), Vec(n)};
  const FlashKernel* K[2] = {&kernel_a(), &kernel_b()};
  const int64_t ws_n = std::max({K[0]->workspace_floats(E, E), K[1]->workspace_floats(E, E),
                                 K[0]->backward_workspace_floats(L, E, E), K[1]->backward_workspace_floats(L, E, E)});
  std::vector<Vec> ws(static_cast<size_t>(T), Vec(static_cast<size_t>(ws_n)));
  auto fwd = [&](int w) {
    const int64_t bq = K[w]->block_q, nb = (L + bq - 1) / bq;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t item = 0; item < H * nb; ++item) {
      const FlushDenormals ftz;  // as the library's drivers run the kernels
      const int64_t h = item / nb, i0 = item % nb * bq;
      FlashBlock b{};
      b.q = q.data() + (h * L + i0) * E, b.k = k.data() + h * L * E, b.v = v.data() + h * L * E;
      b.o = o[w].data() + (h * L + i0) * E, b.lse = lse[w].data() + h * L + i0;
      b.i0 = i0, b.nq = std::min(bq, L - i0), b.bh = h;
      K[w]->forward(p, b, ws[static_cast<size_t>(omp_get_thread_num())].data());
    }
  };
  fwd(0);
  fwd(1);
  const double fwd_diff = std::max(max_diff(o[0], o[1]), max_diff(lse[0], lse[1]));
  Vec lse_e = lse[0];
  for (float& x : lse_e) x *= 0.6931471805599453f;  // the backward takes the natural-log LSE
  auto bwd = [&](int w) {
    std::fill(dk[w].begin(), dk[w].end(), 0.0f);
    std::fill(dv[w].begin(), dv[w].end(), 0.0f);
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t h = 0; h < H; ++h) {
      const FlushDenormals ftz;  // as the library's drivers run the kernels
      FlashBwdHead hd{};
      hd.q = q.data() + h * L * E, hd.k = k.data() + h * L * E, hd.v = v.data() + h * L * E;
      hd.o = o[0].data() + h * L * E, hd.dout = dout.data() + h * L * E, hd.o_row = hd.do_row = E;
      hd.lse = lse_e.data() + h * L;
      hd.dq = dq[w].data() + h * L * E, hd.dk = dk[w].data() + h * L * E, hd.dv = dv[w].data() + h * L * E;
      hd.bh = h, hd.j_begin = 0, hd.j_end = L;
      K[w]->backward(p, hd, ws[static_cast<size_t>(omp_get_thread_num())].data());
    }
  };
  double diff = fwd_diff;
  if (backward) {
    bwd(0);
    bwd(1);
    diff = std::max({max_diff(dq[0], dq[1]), max_diff(dk[0], dk[1]), max_diff(dv[0], dv[1])});
  }
  const double flops = (backward ? 10.0 : 4.0) * H * L * L * E / (causal ? 2.0 : 1.0);
  std::printf("%s H %d L %lld E %lld%s, %d thread(s): ", backward ? "bwd" : "fwd", H, static_cast<long long>(L),
              static_cast<long long>(E), causal ? " causal" : "", T);
  time_pairs(pairs, [&](int w) { backward ? bwd(w) : fwd(w); }, flops, "GFLOP/s", diff);
  return 0;
}

// 64-byte aligned per-thread workspaces, as the library's drivers hand the kernels.
struct Workspaces {
  std::vector<float*> w;
  Workspaces(int threads, int64_t bytes) {
    for (int t = 0; t < threads; ++t) {
      w.push_back(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>((bytes + 127) / 64 * 64))));
    }
  }
  ~Workspaces() {
    for (float* x : w) std::free(x);
  }
  void* mine() const { return w[static_cast<size_t>(omp_get_thread_num())]; }
};

std::vector<uint16_t> to_bf16(const Vec& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = attn::float_to_bf16(x[i]).bits;
  return h;
}

double max_diff_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(attn::bf16_to_float({a[i]}) - attn::bf16_to_float({b[i]}));
    m = std::max(m, d);
  }
  return m;
}

// fwd16 / bwd16: H heads of L bf16 queries and keys, E = Ev, one after the other as the drivers
// run them (flash_fwd_bf16.cpp: V packed per head, then the query blocks; flash_bwd.cpp's bf16
// backward: whole key ranges per head, D given).
int flash16(bool backward, int argc, char** argv) {
  if (argc < 7) return 2;
  if (&bf16_kernel_a == nullptr || &bf16_backward_a == nullptr) {
    std::fprintf(stderr, "ab_kernels: fwd16 and bwd16 need the avx512_bf16 build (ab_kernels.sh -i avx512_bf16)\n");
    return 2;
  }
  const auto [H, pairs, T, L, E, causal, p] = flash_args(argc, argv);
  std::mt19937 g(1);
  const size_t n = static_cast<size_t>(H * L * E);
  const std::vector<uint16_t> q = to_bf16(randn(n, g)), k = to_bf16(randn(n, g)), v = to_bf16(randn(n, g)),
                              dout = to_bf16(randn(n, g));
  const Bf16ForwardKernel* F[2] = {&bf16_kernel_a(), &bf16_kernel_b()};
  const Bf16BackwardKernel* Bk[2] = {&bf16_backward_a(), &bf16_backward_b()};
  int64_t ws_bytes = 0;
  for (int w = 0; w < 2; ++w) {
    ws_bytes = std::max({ws_bytes, F[w]->workspace_bytes(E, E), Bk[w]->backward_workspace_bytes(L, E, E),
                         Bk[w]->row_dots_workspace_bytes(E, E)});
  }
  const Workspaces ws(T, ws_bytes);
  std::vector<uint32_t> vp[2], kp[2];
  std::vector<uint16_t> o[2] = {std::vector<uint16_t>(n), std::vector<uint16_t>(n)};
  Vec lse[2] = {Vec(H * L), Vec(H * L)};
  Vec dq[2] = {Vec(n), Vec(n)}, dk[2] = {Vec(n), Vec(n)}, dv[2] = {Vec(n), Vec(n)};
  for (int w = 0; w < 2; ++w) {
    vp[w].resize(static_cast<size_t>(H * F[w]->packed_v_words(L, E)));
    if (F[w]->pack_k != nullptr) kp[w].resize(static_cast<size_t>(H * F[w]->packed_k_words(L, E)));
  }
  auto fwd = [&](int w) {
    const int64_t vw = F[w]->packed_v_words(L, E), kw = F[w]->pack_k != nullptr ? F[w]->packed_k_words(L, E) : 0;
#pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t h = 0; h < H; ++h) {
      F[w]->pack_v(v.data() + h * L * E, E, L, E, vp[w].data() + h * vw);
      if (kw > 0) F[w]->pack_k(k.data() + h * L * E, E, L, E, kp[w].data() + h * kw);
    }
    const int64_t bq = F[w]->block_q, nb = (L + bq - 1) / bq;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t item = 0; item < H * nb; ++item) {
      const FlushDenormals ftz;
      const int64_t h = item / nb, i0 = item % nb * bq;
      FlashBlock16 b{};
      b.q = q.data() + (h * L + i0) * E, b.k = k.data() + h * L * E;
      b.kp = kw > 0 ? kp[w].data() + h * kw : nullptr, b.vp = vp[w].data() + h * vw;
      b.o = o[w].data() + (h * L + i0) * E, b.lse = lse[w].data() + h * L + i0;
      b.i0 = i0, b.nq = std::min(bq, L - i0), b.bh = h;
      F[w]->forward_block(p, b, ws.mine());
    }
  };
  fwd(0);
  fwd(1);
  double diff = std::max(max_diff_bf16(o[0], o[1]), max_diff(lse[0], lse[1]));
  Vec lse_e = lse[0];
  for (float& x : lse_e) x *= 0.6931471805599453f;  // the backward takes the natural-log LSE
  auto head = [&](int w, int64_t h) {
    FlashBwdHead hd{};
    hd.q = q.data() + h * L * E, hd.k = k.data() + h * L * E, hd.v = v.data() + h * L * E;
    hd.dout = dout.data() + h * L * E, hd.o_row = hd.do_row = E;
    hd.lse = lse_e.data() + h * L;
    hd.dq = dq[w].data() + h * L * E, hd.dk = dk[w].data() + h * L * E, hd.dv = dv[w].data() + h * L * E;
    hd.bh = h, hd.j_begin = 0, hd.j_end = L;
    return hd;
  };
  Vec dd(static_cast<size_t>(H * L)), mass(static_cast<size_t>(Bk[0]->block_q));
  for (int64_t h = 0; h < H; ++h) {  // D once, by A's row_dots, for both
    const FlashBwdHead hd = head(0, h);
    for (int64_t i0 = 0; i0 < L; i0 += Bk[0]->block_q) {
      Bk[0]->row_dots(p, hd, i0, std::min(Bk[0]->block_q, L - i0), dd.data() + h * L + i0, mass.data(), ws.w[0]);
    }
  }
  auto bwd = [&](int w) {
    std::fill(dk[w].begin(), dk[w].end(), 0.0f);
    std::fill(dv[w].begin(), dv[w].end(), 0.0f);
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t h = 0; h < H; ++h) {
      const FlushDenormals ftz;
      FlashBwdHead hd = head(w, h);
      hd.dd = dd.data() + h * L;
      Bk[w]->backward(p, hd, ws.mine());
    }
  };
  if (backward) {
    bwd(0);
    bwd(1);
    diff = std::max({max_diff(dq[0], dq[1]), max_diff(dk[0], dk[1]), max_diff(dv[0], dv[1])});
  }
  // FlashAttention's counts: 4 L S E (halved when causal) forward, 2.5x that backward.
  const double flops = (backward ? 10.0 : 4.0) * H * L * L * E / (causal ? 2.0 : 1.0);
  std::printf("%s H %d L %lld E %lld%s, bf16, %d thread(s): ", backward ? "bwd16" : "fwd16", H,
              static_cast<long long>(L), static_cast<long long>(E), causal ? " causal" : "", T);
  time_pairs(pairs, [&](int w) { backward ? bwd(w) : fwd(w); }, flops, "GFLOP/s", diff);
  return 0;
}

// A buffer of 2 MiB pages with transparent huge pages asked for, as the library's allocator
// gives large tensors (core/allocator.cpp): on 4 KiB pages every 4 KiB of K/V costs a TLB miss
// that the decode kernel's prefetches wait on, so a std::vector's memory times another kernel.
template <typename T>
struct HugeBuf {
  T* p = nullptr;
  explicit HugeBuf(size_t count) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = (count * sizeof(T) + kHuge - 1) / kHuge * kHuge;
    p = static_cast<T*>(std::aligned_alloc(kHuge, bytes));
    if (p == nullptr) std::abort();
    madvise(p, bytes, MADV_HUGEPAGE);
  }
  HugeBuf(HugeBuf&& o) noexcept : p(o.p) { o.p = nullptr; }
  HugeBuf(const HugeBuf&) = delete;
  ~HugeBuf() { std::free(p); }
};

int decode(int argc, char** argv) {
  if (argc < 8) return 2;
  const int64_t Hkv = std::atoll(argv[2]), R = std::atoll(argv[3]), S = std::atoll(argv[4]), E = std::atoll(argv[5]);
  const int copies = std::atoi(argv[6]), pairs = std::atoi(argv[7]), T = argc > 8 ? std::atoi(argv[8]) : 1;
  const std::string kv_kind = argc > 9 ? argv[9] : "f32";
  // PAGE, or PAGE_A:PAGE_B (each build its own layout: A/B is then paged / dense in one process).
  const std::string page_arg = argc > 10 ? argv[10] : "0";
  const size_t colon = page_arg.find(':');
  const int64_t Pw[2] = {std::atoll(page_arg.substr(0, colon).c_str()),
                         std::atoll(colon == std::string::npos ? page_arg.c_str() : page_arg.substr(colon + 1).c_str())};
  if (kv_kind != "f32" && kv_kind != "bf16" && kv_kind != "bf16q") return 2;
  for (const int64_t P : Pw) {
    if (P < 0 || (P > 0 && S % P != 0)) return 2;
  }
  const bool bf16 = kv_kind != "f32";
  const size_t esize = bf16 ? 2 : 4;
  DecodeParams p;
  p.E = p.Ev = E, p.Ep = p.Evp = (E + 15) / 16 * 16;
  p.scale_log2 = 1.4426950408889634f / std::sqrt(static_cast<float>(E));
  p.kv = bf16 ? KvType::kBFloat16 : KvType::kFloat32;
  p.q_bf16 = kv_kind == "bf16q";
  std::mt19937 g(1);
  // Each copy's K and V: dense (Hkv, S, E), or with P a pool (S / P pages, Hkv, P, E) whose
  // block table lists the pages in order, as attn bench's one sequence (kv_cache.hpp's layout).
  std::vector<HugeBuf<char>> K[2], V[2];
  const auto elems = static_cast<size_t>(Hkv * S * E);
  auto place = [&](const Vec& x, int64_t P, char* dst) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t j = 0; j < S; ++j) {
        const int64_t row = P > 0 ? ((j / P) * Hkv + h) * P + j % P : h * S + j;
        const float* src = x.data() + (h * S + j) * E;
        if (bf16) {
          auto* d = reinterpret_cast<uint16_t*>(dst) + row * E;
          for (int64_t e = 0; e < E; ++e) d[e] = attn::float_to_bf16(src[e]).bits;
        } else {
          std::memcpy(reinterpret_cast<float*>(dst) + row * E, src, static_cast<size_t>(E) * sizeof(float));
        }
      }
    }
  };
  const int layouts = Pw[0] == Pw[1] ? 1 : 2;  // build w reads layout w % layouts
  for (int c = 0; c < copies; ++c) {
    const Vec k = randn(elems, g), v = randn(elems, g);
    for (int l = 0; l < layouts; ++l) {
      K[l].emplace_back(elems * esize), V[l].emplace_back(elems * esize);
      place(k, Pw[l], K[l].back().p), place(v, Pw[l], V[l].back().p);
    }
  }
  const int64_t Pmin = std::max<int64_t>(1, std::min(Pw[0] > 0 ? Pw[0] : S, Pw[1] > 0 ? Pw[1] : S));
  std::vector<int64_t> table(static_cast<size_t>(S / Pmin));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int64_t>(i);
  Vec q(static_cast<size_t>(Hkv * R * p.Ep), 0.0f);  // rows zero-padded to Ep, as the driver packs them
  Vec qr = randn(static_cast<size_t>(Hkv * R * E), g);
  if (p.q_bf16) {
    for (float& x : qr) x = attn::bf16_to_float(attn::float_to_bf16(x));  // bf16 queries, as the driver widens them
  }
  for (int64_t r = 0; r < Hkv * R; ++r) std::copy_n(qr.data() + r * E, E, q.data() + r * p.Ep);
  const std::vector<int64_t> pos(static_cast<size_t>(R), 0);
  const std::vector<const float*> mask(static_cast<size_t>(R), nullptr);
  const int64_t part = R * (p.Evp + 2);
  // The driver's tasks (decode.cpp's run_decode, one sequence, about 64 items): key ranges of
  // max(512, S / per) keys rounded to whole chunks, per = 64 with paged pages (every kv head of
  // a range in one task) or ceil(64 / Hkv) dense (a task per kv head and range).
  auto range_len = [&](int64_t P) {
    const int64_t per = P > 0 ? 64 : (64 + Hkv - 1) / Hkv;
    return (std::max<int64_t>(512, (S + per - 1) / per) + 63) / 64 * 64;
  };
  const int64_t shortest = std::min(range_len(Pw[0]), range_len(Pw[1]));
  const int64_t ranges = (S + shortest - 1) / shortest;  // the most ranges of a kv head
  Vec out[2] = {Vec(static_cast<size_t>(Hkv * ranges * part)), Vec(static_cast<size_t>(Hkv * ranges * part))};
  const DecodeKernel* D[2] = {&decode_a(), &decode_b()};
  const int64_t ws_n = std::max(D[0]->workspace_floats(R, p.Ep, p.Evp, Hkv), D[1]->workspace_floats(R, p.Ep, p.Evp, Hkv));
  std::vector<Vec> ws(static_cast<size_t>(T), Vec(static_cast<size_t>(ws_n)));
  int next = 0;  // the copy the next timed call reads
  auto run = [&](int w, int copy) {
    const auto c = static_cast<size_t>(copy);
    const int64_t P = Pw[w];
    const auto& Kl = K[w % layouts];
    const auto& Vl = V[w % layouts];
    const int64_t len = range_len(P), nr = (S + len - 1) / len;
    const int64_t heads = P > 0 ? Hkv : 1, tasks = P > 0 ? nr : Hkv * nr;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const FlushDenormals ftz;  // as the library's drivers run the kernels
      std::vector<DecodeKv> kvs(static_cast<size_t>(heads));
      std::vector<DecodeItem> its;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t h = P > 0 ? hh : t / nr, r = P > 0 ? t : t % nr;
        DecodeKv& kv = kvs[static_cast<size_t>(hh)];
        const int64_t j0 = r * len, j1 = std::min(S, j0 + len);
        if (P > 0) {
          kv.k = Kl[c].p + h * P * E * esize, kv.v = Vl[c].p + h * P * E * esize;
          kv.k_page = kv.v_page = Hkv * P * E, kv.pages = table.data(), kv.page_size = P;
        } else {
          kv.k = Kl[c].p + h * S * E * esize, kv.v = Vl[c].p + h * S * E * esize;
          kv.page_size = S;  // one page: the whole head, as the driver sets it
        }
        kv.k_row = kv.v_row = E, kv.S = S;
        float* o = out[w].data() + (h * ranges + r) * part;
        its.push_back(DecodeItem{q.data() + h * R * p.Ep, pos.data(), mask.data(), nullptr, R, j0, j1, o, o + R, o + 2 * R});
      }
      D[w]->split(p, kvs.data(), its.data(), heads, ws[static_cast<size_t>(omp_get_thread_num())].data());
    }
  };
  run(0, 0);
  run(1, 0);
  auto layout = [&](int64_t P) { return P > 0 ? "pages of " + std::to_string(P) : std::string("dense"); };
  std::printf("decode H_kv %lld, %lld rows each, S %lld, E %lld, %s, %s, %d K/V copies, %d thread(s): ",
              static_cast<long long>(Hkv), static_cast<long long>(R), static_cast<long long>(S),
              static_cast<long long>(E), kv_kind.c_str(),
              (layouts == 1 ? layout(Pw[0]) : "A " + layout(Pw[0]) + ", B " + layout(Pw[1])).c_str(), copies, T);
  // Partials of different layouts split the keys differently: compared only within one.
  const double diff = layouts == 1 ? max_diff(out[0], out[1]) : 0.0;
  auto call = [&](int w) {
    next = (next + 1) % copies;
    run(w, next);
  };
  time_pairs(pairs, call, 2.0 * Hkv * S * E * static_cast<double>(esize), "GB/s of K/V", diff);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int rc = 2;
  if (mode == "fwd" || mode == "bwd") rc = flash(mode == "bwd", argc, argv);
  if (mode == "fwd16" || mode == "bwd16") rc = flash16(mode == "bwd16", argc, argv);
  if (mode == "decode") rc = decode(argc, argv);
  if (rc == 2) {
    std::fprintf(stderr,
                 "usage: ab_kernels fwd|bwd|fwd16|bwd16 H L E CAUSAL PAIRS [THREADS]\n"
                 "       ab_kernels decode H_KV ROWS S E COPIES PAIRS [THREADS [f32|bf16|bf16q [PAGE]]]\n");
  }
  return rc;
}

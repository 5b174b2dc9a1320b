// Split-KV decode kernel (flash-decoding) for one work item: R query rows against one kv head's
// keys [j0, j1), leaving a partial softmax (see decode_params.hpp); from a paged cache, one call
// runs the items of every kv head of a sequence over the same keys, chunk by chunk and head
// after head (decode_split_t).
//
// Included after flash_kernel.hpp by flash_avx512.cpp, flash_avx2.cpp, flash_generic.cpp and
// decode_avx512_bf16.cpp, so it shares their vector type `vf` (W floats), exp2v and per-ISA
// namespace. The last adds vdpbf16ps paths for bf16 caches (decode_bf16_dot.hpp).
//
// Shapes and tiling: the item's rows are few (GQA group x L <= 16 queries), its keys many.
// Keys go by chunks of up to kDecodeChunk tokens (a chunk may span pages; its row addresses are
// gathered once per page run):
//   st    (R, kDecodeChunk)  base-2 scores of the chunk, then its probabilities
//   acc   (R, Evp)           the item's output accumulators (the caller's partial buffer)
//   kwide (Ep), vwide (kDecodeChunk, Evp): widened rows, only for a head dim that is not a
//         multiple of 16 (others are read in place, 16-bit and int8 widened in registers)
// Scores: each key row is loaded once and dotted with four query rows at a time, the four
// sums reduced together (hsum4); with AVX-512 and 4 <= R < 16, four key rows at a time as well,
// so a query vector is loaded once per four tokens and 16 sums share one reduction (hsum16); with
// R >= 16, rows in lanes (scores_lanes); with R < 4, token by token (key rows in memory order).
// One query row per kv head (no GQA, L = 1) takes a straight-line copy of a step
// (single_row_step), dense K/V addressed as base + u * stride, a paged cache's through the
// step's row-address window. P.V: register tiles of up to 4 rows x 4 vectors of Ev over the
// chunk's tokens, so the accumulators stay in registers and each value vector feeds 4 rows.
// Four rows per kv head (GQA group 4, one new token) take a pipelined loop instead of
// decode_step's phases: the next step's scores between this step's P.V tokens (decode_pipeline.hpp).
// Memory traffic: K and V stream through once per kv head, (E + Ev) * S * sizeof(element) bytes
// per item, the whole cost of decoding. One core's demand loads keep too few lines in flight to
// reach the machine's bandwidth, so the score loop prefetches the key row kPrefetchAhead tokens
// on, and the P.V tiles the next step's value rows as they go (PvPrefetch): each phase keeps
// memory busy while it computes (a burst of prefetches at once stalls on the fill buffers
// instead; measured).
//
// Variants: per row and chunk, after the scale and in the fused forward's order, softcap
// (c2 tanh(x / c2), softcap_v) then ALiBi (x -= slope2 |i' - j|, slope2 the row's own: the rows of
// an item belong to several query heads), then the band (is_causal and the window: each row's
// [i + lo_offset, i + hi_offset]) and attn_mask assign -inf. With none of them used the chunk
// loop pays one test per row and chunk, none per element. Keys outside every row's band are
// never loaded: the driver cuts its ranges to the band of the item's rows, so a sliding window
// reads (E + Ev) * (window + L) elements per kv head, not (E + Ev) * S, and this kernel trims the
// ends of an item that straddles the band. Sinks are not the kernel's: the driver adds each
// row's sink once, when it merges the ranges (decode.cpp).
//
// Numerics: as the fused forward's (flash_kernel.hpp): scores are scaled once after the dot
// product, masked positions get -inf (never added), a zero probability never multiplies a
// value (so NaN/Inf in a value whose weight is 0 cannot leak), and a row with no visible key
// keeps l = 0. The driver merges ranges with the same rule.
#include "sdpa/cpu/decode_params.hpp"

#include <algorithm>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// GCC 12 reports the AVX-512 intrinsics' own placeholder operand (__Y, _mm512_undefined_ps) in
// hsum16 and store_scores4x4 as (maybe-)uninitialized (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace attn::cpu::ATTN_SIMD_NS {

constexpr int64_t kDecodeChunk = 64;
constexpr int64_t kPrefetchAhead = 16;  // key rows
// Prefetches go to L2 (prefetcht1), not L1 (prefetcht0): an L1 prefetch holds one of the
// core's few L1 miss buffers until its line arrives from memory, so the stream stalls on them
// while the core computes; L2 tracks many more misses, and the L1's own stream prefetcher
// brings the lines the last step from L2. Measured on AMD Zen 4 (2 threads, H_q 32, H_kv 8,
// E 128, S 8192, 4 KiB pages then): float32 K/V 3.5-3.7 -> 2.6 ms, bf16 K/V 1.93 -> 1.50 ms,
// H_kv 32: 11.1-11.7 -> 9.0-9.6 ms; one thread 6.9-7.0 -> 4.5-4.7 ms. Prefetching 32, 64 or 128
// rows ahead instead of 16, or 8-16 KiB ahead whatever the row size, measured no better; no
// software prefetch at all was 1.2-1.6x slower. Also tried on huge pages and measured no better
// (float32, alternating): a line in every 2, 4 or 8 (1 thread 4.6 -> 5.6-6.5 ms: the hardware
// does not fill the gaps); the next chunk's keys prefetched during P.V instead of 16 rows ahead
// (4.1 -> 4.8 ms); keys and values as one stream 8-48 rows ahead (3.8 -> 4.9-5.1 ms); no value
// prefetch (no faster from contiguous K/V, 2.62 -> 2.94 ms with 16-token pages). Where the time
// went: one thread took about the sum of its arithmetic (~120 cycles per token at H_q/H_kv = 4,
// E 128, a quarter of it on the prefetch instructions) and its memory time, two threads ~75 % of
// the read probe: the score loop prefetched this chunk's values too, so memory was idle while
// P.V computed. The values prefetched a chunk ahead by P.V instead (PvPrefetch), alternating
// with the old binary on Zen 4: float32 2 threads 2.47-2.89 -> 2.14-2.37 ms (73 -> 85 % of a
// 33-37 GB/s probe; a 61-65 GB/s probe, seen in some runs, the kernel reaches at ~55 %), one
// thread 4.0-4.1 -> 3.4-3.5 ms, bf16 1.15-1.27 -> 1.04-1.10 ms. Prefetching the next chunk's
// values in memory order instead (row by row, the same lines per step) was 4 % faster from
// contiguous K/V but 1.16x slower with 16-token pages (1.07x for this order).
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's locality 2 is prefetcht1

// decode_split_t's workspace: the step's scratch, then each head's packed queries.
inline int64_t decode_workspace_floats(int64_t R, int64_t Ep, int64_t Evp, int64_t heads) {
  const int64_t Rp = (R + 15) / 16 * 16;  // rows padded for the lane layout (W divides 16)
  const int64_t per_head = Ep * Rp + Rp * ((Ep + 31) / 32 * 16);  // Q^T; decode_bf16_dot.hpp's q2
  return Rp * kDecodeChunk + Ep + kDecodeChunk * Evp + kDecodeChunk * Ep + heads * per_head;
}

// x's lanes combined by `op` (on vectors and on floats) in a halving tree: lanes l and l + W/2,
// then l + W/4, and so on. hsum4 and hsum16 add in the same order.
template <typename Op>
inline float reduce_lanes(vf x, Op op) {
#if ATTN_SIMD_WIDTH == 16
  using v8 = float __attribute__((vector_size(32)));
  const v8 a = op(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
                  __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#elif ATTN_SIMD_WIDTH == 8
  const vf a = x;
#endif
#if ATTN_SIMD_WIDTH >= 8
  using v4 = float __attribute__((vector_size(16)));
  const v4 b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#else
  const vf b = x;
#endif
  return op(op(b[0], b[2]), op(b[1], b[3]));
}

inline float hsum(vf x) {
  return reduce_lanes(x, [](auto a, auto b) { return a + b; });
}

// The largest lane (no lane may be NaN: the caller tests first).
inline float hmax(vf x) {
  return reduce_lanes(x, [](auto a, auto b) { return a > b ? a : b; });
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

inline float element(const void* row, KvType t, int64_t e) {
  switch (t) {
    case KvType::kFloat32: return static_cast<const float*>(row)[e];
    case KvType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[e]) << 16;
      float r;
      std::memcpy(&r, &bits, sizeof r);
      return r;
    }
    case KvType::kFloat16: return half_to_float(static_cast<const uint16_t*>(row)[e]);
    case KvType::kInt8: return static_cast<float>(static_cast<const int8_t*>(row)[e]);
  }
  return 0.0f;
}

// W elements of a row of type T starting at e, as floats.
template <KvType T>
inline vf load_as_float(const void* row, int64_t e) {
  if constexpr (T == KvType::kFloat32) {
    return load(static_cast<const float*>(row) + e);
  } else if constexpr (T == KvType::kBFloat16) {
    const uint16_t* src = static_cast<const uint16_t*>(row) + e;
#if defined(__AVX512F__)
    if constexpr (W == 16) {  // one vpmovzxwd zmm (the generic form splits it in two halves)
      const __m512i b = _mm512_maskz_slli_epi32(
          0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
      vf out;
      std::memcpy(&out, &b, sizeof out);
      return out;
    }
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) {
      const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16);
      vf out;
      std::memcpy(&out, &b, sizeof out);
      return out;
    }
#endif
    using vu16 = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));
    vu16 h;
    std::memcpy(&h, src, sizeof h);
    using vu32 = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));
    const vu32 bits = __builtin_convertvector(h, vu32) << 16;  // unsigned: no signed overflow
    vf r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  } else if constexpr (T == KvType::kInt8) {
#if defined(__AVX512F__)
    if constexpr (W == 16) {  // vpmovsxbd + vcvtdq2ps (the generic form is scalarised; the maskz forms
                              // keep GCC 12 from warning about _mm512_undefined)
      const __m512 f = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff,
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + e))));
      vf out;
      std::memcpy(&out, &f, sizeof out);
      return out;
    }
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + e))));
      vf out;
      std::memcpy(&out, &f, sizeof out);
      return out;
    }
#endif
    using vi8 = int8_t __attribute__((vector_size(W)));
    vi8 b;
    std::memcpy(&b, static_cast<const int8_t*>(row) + e, sizeof b);
    return __builtin_convertvector(b, vf);
  } else {  // kFloat16
#if defined(__AVX512F__)
    if constexpr (W == 16) {
      const __m512 r = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + e)));
      vf out;
      std::memcpy(&out, &r, sizeof out);
      return out;
    }
#endif
#if defined(__F16C__)
    if constexpr (W == 8) {
      const __m256 r = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + e)));
      vf out;
      std::memcpy(&out, &r, sizeof out);
      return out;
    }
#endif
    vf out;
    for (int l = 0; l < W; ++l) out[l] = half_to_float(static_cast<const uint16_t*>(row)[e + l]);
    return out;
  }
}

// The row as float32, zero-padded to `padded` elements: a pointer into the cache itself when
// it is float32 already and a whole number of vectors, else into buf.
template <KvType T>
inline const float* widen_row(const void* row, int64_t n, int64_t padded, float* buf) {
  if constexpr (T == KvType::kFloat32) {
    if (n == padded && n % W == 0) return static_cast<const float*>(row);
  }
  int64_t e = 0;
  for (; e + W <= n; e += W) store(buf + e, load_as_float<T>(row, e));
  for (; e < n; ++e) buf[e] = element(row, T, e);
  for (; e < padded; ++e) buf[e] = 0.0f;
  return buf;
}

constexpr int64_t elem_size(KvType t) {
  return t == KvType::kFloat32 ? 4 : t == KvType::kInt8 ? 1 : 2;
}

// The chunk's row addresses: rows[u] (and for int8 scales[u], the row's scale; float caches
// leave scales alone) of tokens j0 + u, u in [0, n), walking the pages with one division per
// page run.
template <KvType T>
inline void chunk_rows(const DecodeKv& kv, bool values, int64_t j0, int64_t n, const char** rows,
                       float* scales) {
  const char* base = static_cast<const char*>(values ? kv.v : kv.k);
  const int64_t page_stride = values ? kv.v_page : kv.k_page;
  const int64_t row_bytes = (values ? kv.v_row : kv.k_row) * elem_size(T);
  const float* sc = values ? kv.v_scale : kv.k_scale;
  int64_t u = 0;
  while (u < n) {
    const int64_t j = j0 + u, slot = j / kv.page_size, r0 = j % kv.page_size;
    const int64_t page = kv.pages != nullptr ? kv.pages[slot] : slot;
    const int64_t run = imin(n - u, kv.page_size - r0);
    const char* row = base + page * page_stride * elem_size(T) + r0 * row_bytes;
    for (int64_t t = 0; t < run; ++t) rows[u + t] = row + t * row_bytes;
    if (T == KvType::kInt8) {
      for (int64_t t = 0; t < run; ++t) scales[u + t] = sc[page * kv.scale_page + r0 + t];
    }
    u += run;
  }
}

// The P.V tiles' prefetches. The next chunk's value rows (n of them, none when n = 0) go to L2,
// by the tiles of the first row tile as they go: a tile's step for token u prefetches the bytes
// of next row u that the same step of the next chunk will read. So the values' requests are
// spread over the P.V phase as the keys' are over the scores (see kPrefetchAhead) and memory
// stays busy in both. With l1, a step also brings this chunk's row kL1Ahead tokens on from L2 to
// L1, as the hardware's L1 prefetcher does not for rows read a tile at a time: on Zen 4 (2
// threads, float32, H_q 32, H_kv 8, E 128, S 8192, alternating) 2.18-2.25 -> 2.03-2.12 ms, one
// thread 3.56-3.58 -> 3.1-3.4 ms. With pages shorter than a chunk it had cost time while the
// kernel read one kv head at a time (16-token pages: 2.29-2.35 -> 2.34-2.40 ms); reading a
// page's heads together, it gains there too (paged / contiguous, interleaved in one process:
// float32 1.03-1.05 -> 1.00-1.04, bf16 1.17-1.20 -> 1.12-1.15). None for the keys: their L1
// prefetch 4 or 8 rows on measured no better.
struct PvPrefetch {
  const char* const* rows = nullptr;
  int64_t n = 0;
  bool l1 = false;
};
constexpr int64_t kL1Ahead = 4;  // tokens; 8 measured the same

// The lines of bytes [0, kBytes) from p, into L2 (kLocality 2: prefetcht1) or L1 (3: prefetcht0).
template <int64_t kBytes, int kLocality = kPrefetchLocality>
[[gnu::always_inline]] inline void prefetch_lines(const void* p) {
  for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, kLocality);
}

// The P.V prefetches a row tile starting at r0 makes: the next chunk's rows only by the first.
inline PvPrefetch for_row_tile(const PvPrefetch& pf, int64_t r0) {
  return r0 == 0 ? pf : PvPrefetch{nullptr, 0, pf.l1};
}

// What the P.V tiles call after each token: nothing, or another computation to interleave with
// them (the pipelined loop's ScoreFeed, decode_pipeline.hpp).
struct NoHook {
  void operator()() const {}
};

// acc[r][c0 : c0 + CV*W] += sum_u P[r][u] * v_u[c0 : ...] for RT rows from r0, the tile in
// registers over the chunk's tokens. With kGuard a zero weight is skipped, never multiplied.
template <KvType T, int RT, int CV, bool kGuard, typename Hook = const NoHook>
inline void pv_tile(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t c0,
                    int64_t Evp, float* acc, PvPrefetch pf, Hook& hook = NoHook{}) {
  vf a[RT][CV];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) a[r][c] = load(acc + (r0 + r) * Evp + c0 + c * W);
  }
  for (int64_t u = 0; u < nk; ++u) {
    if (u < pf.n) prefetch_lines<CV * W * elem_size(T)>(pf.rows[u] + c0 * elem_size(T));
    if (pf.l1 && u + kL1Ahead < nk) {
      prefetch_lines<CV * W * elem_size(T), 3>(static_cast<const char*>(vrows[u + kL1Ahead]) + c0 * elem_size(T));
    }
    vf v[CV];
    for (int c = 0; c < CV; ++c) v[c] = load_as_float<T>(vrows[u], c0 + c * W);
    for (int r = 0; r < RT; ++r) {
      const float pr = st[(r0 + r) * kDecodeChunk + u];
      if constexpr (kGuard) {
        if (pr == 0.0f) continue;
      }
      const vf pb = splat(pr);
      for (int c = 0; c < CV; ++c) a[r][c] += pb * v[c];
    }
    hook();
  }
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) store(acc + (r0 + r) * Evp + c0 + c * W, a[r][c]);
  }
}

// Whether a weight among rows [r0, r0 + RT)'s first nk is exactly zero: only then must the tile
// test each weight (a test per row and token was a fifth of a bf16 decode's instructions).
inline bool any_zero_weight(const float* st, int64_t r0, int RT, int64_t nk) {
  for (int r = 0; r < RT; ++r) {
    const float* sr = st + (r0 + r) * kDecodeChunk;
    int64_t u = 0;
    for (; u + W <= nk; u += W) {
      if (count_true(load(sr + u) == 0.0f) != 0) return true;
    }
    for (; u < nk; ++u) {
      if (sr[u] == 0.0f) return true;
    }
  }
  return false;
}

template <KvType T, int RT, bool kGuard, typename Hook>
inline void pv_cols(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t Evp,
                    float* acc, PvPrefetch pf, Hook& hook) {
  constexpr int kCV = W >= 16 ? 4 : 2;
  int64_t c0 = 0;
  // A single row (no GQA: one query row per kv head) reads float32 values in one sweep of 8
  // vectors (E 128: the whole row) per token, not two of 4: rows in memory order, and half the
  // accumulator loads and stores. Its L1 prefetch is off (8 lines at once stalled the fill
  // buffers: 7.5-9.0 -> 10.8-11.3 ms). Zen 4, H_q = H_kv = 32, E 128, S 8192, 2 threads, against
  // the two sweeps in alternating runs of the same memory state: 5-19 % faster in 12 of 13 pairs
  // (3 % slower in one; 8.4-8.8 -> 7.9 ms at a 36 GB/s probe, 7.5-7.7 -> 6.3-6.8 at 60); ggml reads
  // rows in order too, and was 4-15 % faster before. 16-bit values likewise (a sweep of 4 vectors
  // covers 128 bytes of a row, one of 8 the whole 256 of E 128): on Zen 4, in alternating runs of
  // two binaries, 0-5 % slower; on Zen 5, alternating call by call with ggml in one process
  // (scripts/bench_ggml.sh part 3, H 32/32, E 128, S 8192, f16 K/V, 2 threads, 2 x 80 rounds),
  // ggml / attn went from 0.80x to 0.91-0.92x, where a host's state cannot favour either binary.
  // Paged float32 measured the same as two sweeps.
  if constexpr (RT == 1 && W >= 16 && T != KvType::kInt8) {
    const PvPrefetch l2_only{pf.rows, pf.n, false};
    for (; c0 + 8 * W <= Evp; c0 += 8 * W) pv_tile<T, 1, 8, kGuard>(st, vrows, nk, r0, c0, Evp, acc, l2_only, hook);
  }
  for (; c0 + kCV * W <= Evp; c0 += kCV * W) pv_tile<T, RT, kCV, kGuard>(st, vrows, nk, r0, c0, Evp, acc, pf, hook);
  for (; c0 < Evp; c0 += W) pv_tile<T, RT, 1, kGuard>(st, vrows, nk, r0, c0, Evp, acc, pf, hook);
}

template <KvType T, int RT, typename Hook>
inline void pv_rows(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t Evp,
                    float* acc, PvPrefetch pf, Hook& hook) {
  if (any_zero_weight(st, r0, RT, nk)) {
    pv_cols<T, RT, true>(st, vrows, nk, r0, Evp, acc, pf, hook);
  } else {
    pv_cols<T, RT, false>(st, vrows, nk, r0, Evp, acc, pf, hook);
  }
}

// rows(r0) for register tiles of RT = 4, 2 and 1 rows covering [0, R) (rows: a lambda
// templated on RT).
template <typename Rows>
inline void by_row_tiles(int64_t R, Rows rows) {
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) rows.template operator()<4>(r0);
  for (; r0 + 2 <= R; r0 += 2) rows.template operator()<2>(r0);
  for (; r0 < R; ++r0) rows.template operator()<1>(r0);
}

// P.V for all rows of the chunk, hook() after each token of each tile.
template <KvType T, typename Hook = const NoHook>
inline void pv_chunk(const float* st, const void* const* vrows, int64_t nk, int64_t R, int64_t Evp,
                     float* acc, PvPrefetch pf = {}, Hook& hook = NoHook{}) {
  by_row_tiles(R, [&]<int RT>(int64_t r0) { pv_rows<T, RT>(st, vrows, nk, r0, Evp, acc, for_row_tile(pf, r0), hook); });
}

// The sums of four vectors' lanes, as {sum a0, sum a1, sum a2, sum a3}: one transposing
// reduction instead of four horizontal ones.
inline void hsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
#if ATTN_SIMD_WIDTH == 16
  using v8 = float __attribute__((vector_size(32)));
  using v4 = float __attribute__((vector_size(16)));
  const v8 b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a0, a0, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a1, a1, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a2, a2, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a3, a3, 8, 9, 10, 11, 12, 13, 14, 15);
  // c01 = {4 partials of a0, 4 of a1}, c23 likewise
  const v8 c01 = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 c23 = __builtin_shufflevector(b2, b3, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(b2, b3, 4, 5, 6, 7, 12, 13, 14, 15);
  // d = {2 of a0, 2 of a1, 2 of a2, 2 of a3}
  const v8 d = __builtin_shufflevector(c01, c23, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(c01, c23, 2, 3, 6, 7, 10, 11, 14, 15);
  const v4 r = __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
  std::memcpy(out, &r, sizeof r);
#else
  out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
#endif
}

// Four query rows (q, row stride Ep) dotted with one key row: the key is loaded (and widened)
// once for all four.
template <KvType T>
inline void dot_rows4(const float* q, int64_t Ep, const void* k, float* out) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t e = 0; e < Ep; e += W) {
    const vf kv = load_as_float<T>(k, e);
    a0 += load(q + e) * kv;
    a1 += load(q + Ep + e) * kv;
    a2 += load(q + 2 * Ep + e) * kv;
    a3 += load(q + 3 * Ep + e) * kv;
  }
  hsum4(a0, a1, a2, a3, out);
}

// q . k for one query row (float32, Ep) and one key row of type T read in place (E a whole
// number of vectors) or widened (`widened`: float32, Ep).
template <KvType T>
inline float dot_row(const float* q, const void* k, int64_t Ep) {
  vf a0 = {}, a1 = {};
  int64_t e = 0;
  for (; e + 2 * W <= Ep; e += 2 * W) {
    a0 += load(q + e) * load_as_float<T>(k, e);
    a1 += load(q + e + W) * load_as_float<T>(k, e + W);
  }
  if (e < Ep) a0 += load(q + e) * load_as_float<T>(k, e);
  return hsum(a0 + a1);
}

// Many rows (R >= W: a GQA group times several new tokens): scores in the prefill kernel's
// layout instead, rows in lanes. qt (Ep, Rp) is Q^T, packed once per item; per step of E, RV
// loads of qt feed JT key broadcasts (fused into the FMAs), so no horizontal sums are needed.
// E is summed in chunks of kEChunk whose partial sums are added at the end of each chunk, as the
// prefill kernel does for accuracy (one FMA chain over E = 128 loses several bits).
template <int JT, int RV>
inline void scores_lanes(const float* qt, int64_t Rp, const float* const* k, int64_t E, int64_t r0,
                         const float* s, float* st) {
  vf total[JT][RV] = {};
  for (int64_t e0 = 0; e0 < E; e0 += kEChunk) {
    const int64_t e1 = imin(e0 + kEChunk, E);
    vf acc[JT][RV] = {};
    for (int64_t e = e0; e < e1; ++e) {
      vf q[RV];
      for (int v = 0; v < RV; ++v) q[v] = load(qt + e * Rp + r0 + v * W);
      for (int t = 0; t < JT; ++t) {
        const vf kb = splat(k[t][e]);
        for (int v = 0; v < RV; ++v) acc[t][v] += kb * q[v];
      }
    }
    for (int t = 0; t < JT; ++t) {
      for (int v = 0; v < RV; ++v) total[t][v] += acc[t][v];
    }
  }
  for (int t = 0; t < JT; ++t) {  // back to st's (row, token) layout
    for (int v = 0; v < RV; ++v) {
      for (int l = 0; l < W; ++l) st[(r0 + v * W + l) * kDecodeChunk + t] = total[t][v][l] * s[t];
    }
  }
}

// The chunk's scores with rows in lanes; krows are float32 rows (widened if need be), ks the
// per-token scale (times scale_log2). Rows past R are padding and land in st's spare rows.
inline void scores_chunk_lanes(const float* qt, int64_t Rp, const float* const* krows,
                               const float* ks, int64_t nk, int64_t E, float* st) {
  for (int64_t r0 = 0; r0 < Rp; r0 += (Rp - r0 >= 2 * W ? 2 * W : W)) {
    const bool two = Rp - r0 >= 2 * W;
    int64_t u = 0;
    for (; u + 4 <= nk; u += 4) {
      if (two) {
        scores_lanes<4, 2>(qt, Rp, krows + u, E, r0, ks + u, st + u);
      } else {
        scores_lanes<4, 1>(qt, Rp, krows + u, E, r0, ks + u, st + u);
      }
    }
    for (; u < nk; ++u) {
      if (two) {
        scores_lanes<1, 2>(qt, Rp, krows + u, E, r0, ks + u, st + u);
      } else {
        scores_lanes<1, 1>(qt, Rp, krows + u, E, r0, ks + u, st + u);
      }
    }
  }
}

// Scaled scores of all R rows against one key row: st[r * kDecodeChunk] = s * (q_r . k).
template <KvType T>
inline void scores_token(const float* q, int64_t R, int64_t Ep, const void* k, float s, float* st) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    float d[4];
    dot_rows4<T>(q + r * Ep, Ep, k, d);
    for (int i = 0; i < 4; ++i) st[(r + i) * kDecodeChunk] = d[i] * s;
  }
  for (; r < R; ++r) st[r * kDecodeChunk] = dot_row<T>(q + r * Ep, k, Ep) * s;
}

#if defined(__AVX512F__) && ATTN_SIMD_WIDTH == 16
// Few rows (R < W) with AVX-512: the chunk's scores four tokens at a time, so that each vector
// of a query row is loaded once for four key rows (scores_token loads it for every key: with
// E = 128 and four rows that was 32 loads of q per token against 8 of the key). The 16 sums
// (4 rows x 4 tokens) are reduced in one transposing butterfly, adding lanes l and l + 8, then
// l + 4, l + 2, l + 1 as hsum4 does, so each score has the bits dot_rows4 gives it.
// The four key rows are read side by side (a vector of each in turn), not each from its start to
// its end, although memory order is what the hardware prefetchers follow: a synthetic read of
// the same bytes with the same arithmetic took 3.6 ms side by side against 2.1 ms in order
// without software prefetch, but this kernel's prefetches (below) already issue every line in
// order. Token by token, float32, measured on Zen 4 (H_q 32, H_kv 8, E 128, S 8192, 2 threads,
// 6 alternating rounds): 2.43 ms against 2.45 from memory, beyond noise nowhere, while from cache
// (H_q 4, H_kv 1, S 1024, 1 thread) it took 0.052 ms against 0.034 (40 loads per 32 FMAs and a
// reduction per token; with three query rows held in registers, 0.038).
constexpr bool kScoresByFour = true;

inline __m512 to_m512(vf x) {
  __m512 r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}

// Lane 4 r + t of the result is the sum of acc[t][r]'s lanes.
inline __m512 hsum16(const vf (&acc)[4][4]) {
  __m512 b[8], c[4];
  for (int m = 0; m < 8; ++m) {  // sources 2m, 2m + 1 (n = 4 t + r): lanes l + 8
    const __m512 x = to_m512(acc[(2 * m) / 4][(2 * m) % 4]), y = to_m512(acc[(2 * m + 1) / 4][(2 * m + 1) % 4]);
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
  }
  for (int m = 0; m < 4; ++m) {  // lanes l + 4: block j of c[m] belongs to source 4m + j
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xdd));
  }
  // lanes l + 2, then l + 1: block j lane i of the result is source 4 i + j
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xee));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_ps(c[2], c[3], 0x44), _mm512_shuffle_ps(c[2], c[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xdd));
}

// out[r * kDecodeChunk + t] = s[t] * (the sum of acc[t][r]'s lanes), for a tile of 4 rows x 4 tokens.
inline void store_scores4x4(const vf (&acc)[4][4], const float* s, float* out) {
  const __m512 x = _mm512_mul_ps(hsum16(acc), _mm512_broadcast_f32x4(_mm_loadu_ps(s)));  // lane 4 r + t
  _mm_storeu_ps(out, _mm512_extractf32x4_ps(x, 0));
  _mm_storeu_ps(out + kDecodeChunk, _mm512_extractf32x4_ps(x, 1));
  _mm_storeu_ps(out + 2 * kDecodeChunk, _mm512_extractf32x4_ps(x, 2));
  _mm_storeu_ps(out + 3 * kDecodeChunk, _mm512_extractf32x4_ps(x, 3));
}

// st[r * kDecodeChunk + t] = s[t] * (q_r . k_t) for rows [r0, r0 + 4) and four key rows of type T.
template <KvType T>
inline void scores_rows4_tokens4(const float* q, int64_t r0, int64_t Ep, const void* const* k,
                                 const float* s, float* st) {
  vf acc[4][4] = {};
  for (int64_t e = 0; e < Ep; e += W) {
    vf kv[4];
    for (int t = 0; t < 4; ++t) kv[t] = load_as_float<T>(k[t], e);
    for (int r = 0; r < 4; ++r) {
      const vf qv = load(q + (r0 + r) * Ep + e);
      for (int t = 0; t < 4; ++t) acc[t][r] += qv * kv[t];
    }
  }
  store_scores4x4(acc, s, st + r0 * kDecodeChunk);
}

// Four tokens' scores for R < W rows: rows by four, the rest as scores_token does. k[t] are
// rows of type T read in place, s[t] the token's scale (times scale_log2).
template <KvType T>
inline void scores_tokens4(const float* q, int64_t R, int64_t Ep, const void* const* k, const float* s,
                           float* st) {
  const int64_t R4 = R / 4 * 4;
  for (int64_t r0 = 0; r0 < R4; r0 += 4) scores_rows4_tokens4<T>(q, r0, Ep, k, s, st);
  // The other rows (all of them without GQA: R = L): each against the four keys with dot_row's
  // sums (two accumulators, the same order, so the same bits), the four reduced together
  // (hsum4), not one horizontal sum per token. Zen 4, float32, one query per head, K/V in the
  // cache (H 2, S 1024, 1 thread, medians of 6 alternating rounds): E 64 29.2-40.4 -> 26.6-32.1
  // us, E 128 48.1-60.6 -> 43.1-48.2 us; from memory (H 32, S 8192, 2 threads) bandwidth-bound
  // and unchanged.
  for (int64_t r = R4; r < R; ++r) {
    const float* qr = q + r * Ep;
    vf a0[4] = {}, a1[4] = {};
    int64_t e = 0;
    for (; e + 2 * W <= Ep; e += 2 * W) {
      const vf q0 = load(qr + e), q1 = load(qr + e + W);
      for (int t = 0; t < 4; ++t) {
        a0[t] += q0 * load_as_float<T>(k[t], e);
        a1[t] += q1 * load_as_float<T>(k[t], e + W);
      }
    }
    if (e < Ep) {
      const vf q0 = load(qr + e);
      for (int t = 0; t < 4; ++t) a0[t] += q0 * load_as_float<T>(k[t], e);
    }
    float d[4];
    hsum4(a0[0] + a1[0], a0[1] + a1[1], a0[2] + a1[2], a0[3] + a1[3], d);
    for (int t = 0; t < 4; ++t) st[r * kDecodeChunk + t] = d[t] * s[t];
  }
}
#else
constexpr bool kScoresByFour = false;
template <KvType T>
inline void scores_tokens4(const float*, int64_t, int64_t, const void* const*, const float*, float*) {}
#endif

// The score modifiers on one row's chunk of base-2 scores sr[0, nkp), in place and in the fused
// forward's order (flash_kernel.hpp's modify_block): softcap x = c2 tanh(x / c2), then ALiBi
// x -= slope2 |i' - j| with d0 = i' - c0 the distance to the chunk's first key. The padding past
// the chunk's keys is overwritten with -inf afterwards.
inline void modify_row(float softcap2, float slope2, int64_t d0, int64_t nkp, float* sr) {
  if (softcap2 > 0.0f) {
    const SoftcapConst k = softcap_const(softcap2);
    vf t;
    for (int64_t u = 0; u < nkp; u += W) store(sr + u, softcap_v(load(sr + u), k, t));
  }
  if (slope2 != 0.0f) {
    vf lane_u;
    for (int l = 0; l < W; ++l) lane_u[l] = static_cast<float>(l);
    const vf slope = splat(slope2);
    for (int64_t u = 0; u < nkp; u += W) {
      const vf d = splat(static_cast<float>(d0 - u)) - lane_u;  // i' - j, exact (|d| < 2^24)
      const vf dist = d < 0.0f ? -d : d;
      store(sr + u, load(sr + u) - slope * dist);
    }
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

#include "sdpa/cpu/decode_bf16_dot.hpp"

namespace attn::cpu::ATTN_SIMD_NS {

// What the steps of an item share: its paths (see decode_split_t) and scratch.
struct StepShared {
  float *st, *kwide, *vwide, *kchunk;
  int64_t Rp, words, k_bytes, v_bytes;
  bool lanes, k_in_place, v_in_place, modify, dot_k, permuted_v;
};

// One step: head `it`'s chunk of nk keys at c0, their rows (kr, vr) and scales (ks, vs), the
// head's packed queries (qt, q2). The next step's rows, which this step prefetches, follow the
// step's in kr and vr (next_n of them; next_v = vr + nk).
struct Step {
  const float* qt;
  const uint32_t* q2;
  const char* const* kr;
  const char* const* vr;
  const float* ks;
  const float* vs;
  const char* const* next_v;
  int64_t c0, nk, next_n;
  bool first_step;
};

// One row's online softmax over a chunk of base-2 scores sr[0, nkp) (padded with -inf): the new
// running max m (NaN once a score is NaN), the weights exp2(score - m) in place, l and the row's
// accumulators acc[0, Evp) rescaled to the new max.
inline void online_softmax_row(float* sr, int64_t nkp, float& m, float& l, float* acc, int64_t Evp) {
  vf mx = splat(m);
  for (int64_t u = 0; u < nkp; u += W) mx = vmax(mx, load(sr + u));
  float m_new = m;
  if (m_new == m_new && count_true(mx != mx) == 0) {  // mx's lanes include m_new
    m_new = hmax(mx);
  } else {  // a NaN: the first one met, lane by lane
    for (int i = 0; i < W; ++i) m_new = mx[i] > m_new || mx[i] != mx[i] ? mx[i] : m_new;
  }
  const float msafe = m_new == kNegInf ? 0.0f : m_new;  // all hidden so far: exp2 gives 0
  const float alpha = exp2v(splat(m - msafe))[0];
  vf sum = {};
  for (int64_t u = 0; u < nkp; u += W) {
    const vf pu = exp2v(load(sr + u) - msafe);
    store(sr + u, pu);
    sum += pu;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  if (alpha == 0.0f) {  // the old weights underflowed: excluded, as the merge excludes ranges
    zero(acc, Evp);
  } else if (alpha != 1.0f) {
    for (int64_t c = 0; c < Evp; c += W) store(acc + c, load(acc + c) * alpha);
  }
}

// The chunk's scores st (R rows of kDecodeChunk, nk keys from c0) made weights: per row the
// variants (softcap, ALiBi, mask, band, in the fused forward's order), -inf padding to a whole
// vector, the online softmax into the row's (m, l, acc), and int8's value scales vs folded in.
template <KvType T>
inline void finish_scores(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, bool modify, const float* vs,
                          int64_t c0, int64_t nk, float* st) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t nkp = (nk + W - 1) / W * W;
  for (int64_t r = 0; r < it.R; ++r) {
    float* sr = st + r * kDecodeChunk;
    const int64_t i = it.query_pos[r];
    // One test per row and chunk, none per element, when no variant is used.
    if (modify) modify_row(p.softcap2, it.alibi2 != nullptr ? it.alibi2[r] : 0.0f, i + kv.diag_offset - c0, nkp, sr);
    if (it.mask[r] != nullptr) {
      const float* mr = it.mask[r] + c0 * p.mask_col;
      for (int64_t u = 0; u < nk; ++u) {
        const float mv = mr[u * p.mask_col];
        if (p.mask_is_bool) {
          if (mv == 0.0f) sr[u] = kNegInf;
        } else {
          sr[u] += mv * kLog2e;  // additive masks are in natural-log units
        }
      }
    }
    // The band last: a key outside it is hidden whatever an additive mask adds.
    if (p.band_hi) {  // keys j > i + hi_offset
      const int64_t limit = i + kv.hi_offset;
      for (int64_t u = limit + 1 - c0 < 0 ? 0 : limit + 1 - c0; u < nk; ++u) sr[u] = kNegInf;
    }
    if (p.band_lo) {  // keys j < i + lo_offset
      const int64_t limit = imin(i + kv.lo_offset - c0, nk);
      for (int64_t u = 0; u < limit; ++u) sr[u] = kNegInf;
    }
    for (int64_t u = nk; u < nkp; ++u) sr[u] = kNegInf;

    online_softmax_row(sr, nkp, it.m[r], it.l[r], it.acc + r * p.Evp, p.Evp);
    if (T == KvType::kInt8) {  // the value rows' scales fold into the weights (l is unscaled)
      for (int64_t u = 0; u < nk; ++u) sr[u] *= vs[u];
    }
  }
}

// The score loop's prefetches for token u (see kPrefetchAhead): the key row kPrefetchAhead tokens
// on, if there is one among the n rows of kr (the step's, then the next step's), and `v_row` when
// the values were not prefetched by the last step's P.V (null: none). Always inlined: GCC finds a
// function whose only effect is a prefetch pure, and drops its calls (a plain inline one vanished
// from decode_step).
[[gnu::always_inline]] inline void prefetch_token(const char* const* kr, int64_t n, int64_t u, int64_t k_bytes,
                                                  const char* v_row, int64_t v_bytes) {
  if (u + kPrefetchAhead < n) {
    const char* ahead = kr[u + kPrefetchAhead];
    for (int64_t b = 0; b < k_bytes; b += 64) __builtin_prefetch(ahead + b, 0, kPrefetchLocality);
  }
  if (v_row != nullptr) {
    for (int64_t b = 0; b < v_bytes; b += 64) __builtin_prefetch(v_row + b, 0, kPrefetchLocality);
  }
}

// The scores of the step's chunk, its online softmax into the head's partial (m, l, acc), and
// P.V. Not inlined into decode_split_t: one call per chunk costs nothing, and inlined, the
// function outgrew GCC's inlining limits, which then left hsum16, the score tiles and the P.V
// tiles as calls inside the per-token loops.
template <KvType T>
[[gnu::noinline]] void decode_step(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, const StepShared& x,
                                   const Step& sp) {
  const auto& [st, kwide, vwide, kchunk, Rp, words, k_bytes, v_bytes, lanes, k_in_place, v_in_place, modify, dot_k,
               permuted_v] = x;
  const auto& [qt, q2, kr, vr, ks, vs, next_v, c0, nk, next_n, first_step] = sp;
  const float* kf[kDecodeChunk];
  float kscale[kDecodeChunk];
  const void* vrow[kDecodeChunk];
  // Prefetch as the scores go: the key row kPrefetchAhead tokens on (into the next chunk at
  // the end), so memory keeps many lines in flight while the core computes; a burst of
  // prefetches at once would stall on the fill buffers instead. The values were prefetched
  // by the last step's P.V (PvPrefetch), except the first step's and widened ones.
  // The tokens' scales, all before the loop: written one by one inside it, each group of four
  // was read back as one vector (store_scores4x4) right after its scalar stores, which no x86
  // forwards to a wider load: the load waited for them to reach the cache, a stall per four
  // tokens (~9 % of the score loop's samples, bf16 K/V).
  for (int64_t u = 0; u < nk; ++u) kscale[u] = T == KvType::kInt8 ? ks[u] * p.scale_log2 : p.scale_log2;
  // One to three rows (no GQA: R = L query rows of one head) are scored token by token, each key
  // row read whole and in memory order as it arrives: four key rows side by side (below) cost
  // these rows more than they share. Zen 5, L 1, S 8192, 2 threads, each call alternating with
  // the four-token order in one process (100-200 pairs, K/V rotating among copies larger than
  // the LLC), median time ratios: float32 H 32/32 E 64 0.91-0.92, E 128 0.93-0.96; bf16 K/V
  // (float32 queries) 0.97-0.99; K/V in the cache (H 2, S 4096, 1 thread) 0.92-0.96; H 32/8
  // (R = 4, not this path) 1.00.
  const bool token_by_token = it.R < 4 && k_in_place && !dot_k && !lanes;
  const bool prefetch_v = !v_in_place || first_step;  // else the last step's P.V prefetched them
  if (token_by_token) {
    for (int64_t u = 0; u < nk; ++u) {
      prefetch_token(kr, nk + next_n, u, k_bytes, prefetch_v ? vr[u] : nullptr, v_bytes);
      for (int64_t r = 0; r < it.R; ++r) st[r * kDecodeChunk + u] = dot_row<T>(it.q + r * p.Ep, kr[u], p.Ep) * kscale[u];
    }
  }
  for (int64_t u = 0; u < (token_by_token ? 0 : nk); ++u) {
    prefetch_token(kr, nk + next_n, u, k_bytes, prefetch_v ? vr[u] : nullptr, v_bytes);
    const float s = kscale[u];
    if (dot_k) {
      if (u % 4 == 3) dot_scores_tokens4(q2, words, it.R, p.E, reinterpret_cast<const void* const*>(kr + u - 3), kscale + u - 3, st + u - 3);
    } else if (lanes) {  // gather the chunk's rows; the scores follow, all at once
      kf[u] = T == KvType::kFloat32 && k_in_place ? reinterpret_cast<const float*>(kr[u])
                                                  : widen_row<T>(kr[u], p.E, p.Ep, kchunk + u * p.Ep);
    } else if (kScoresByFour) {  // by four tokens, as their rows arrive
      if (k_in_place) {
        if (u % 4 == 3) scores_tokens4<T>(it.q, it.R, p.Ep, reinterpret_cast<const void* const*>(kr + u - 3), kscale + u - 3, st + u - 3);
      } else {
        kf[u] = widen_row<T>(kr[u], p.E, p.Ep, kchunk + u * p.Ep);
        if (u % 4 == 3) {
          scores_tokens4<KvType::kFloat32>(it.q, it.R, p.Ep, reinterpret_cast<const void* const*>(kf + u - 3),
                                           kscale + u - 3, st + u - 3);
        }
      }
    } else if (k_in_place) {
      scores_token<T>(it.q, it.R, p.Ep, kr[u], s, st + u);
    } else {
      scores_token<KvType::kFloat32>(it.q, it.R, p.Ep, widen_row<T>(kr[u], p.E, p.Ep, kwide), s, st + u);
    }
  }

  if (token_by_token) {  // scored above
  } else if (dot_k) {  // the last nk % 4 tokens
    for (int64_t u = nk / 4 * 4; u < nk; ++u) dot_scores_token(q2, words, it.R, p.E, kr[u], kscale[u], st + u);
  } else if (lanes) {
    scores_chunk_lanes(qt, Rp, kf, kscale, nk, p.E, st);
  } else if (kScoresByFour) {  // the last nk % 4 tokens
    for (int64_t u = nk / 4 * 4; u < nk; ++u) {
      if (k_in_place) {
        scores_token<T>(it.q, it.R, p.Ep, kr[u], kscale[u], st + u);
      } else {
        scores_token<KvType::kFloat32>(it.q, it.R, p.Ep, kf[u], kscale[u], st + u);
      }
    }
  }

  finish_scores<T>(p, kv, it, modify, vs, c0, nk, st);

  const PvPrefetch pf{next_v, next_n, true};  // values read in place: the L2 and the L1 prefetch
  if (permuted_v) {
    pv_chunk_permuted(st, reinterpret_cast<const void* const*>(vr), nk, it.R, p.Evp, it.acc, pf);
  } else if (v_in_place) {
    pv_chunk<T>(st, reinterpret_cast<const void* const*>(vr), nk, it.R, p.Evp, it.acc, pf);
  } else {
    for (int64_t u = 0; u < nk; ++u) vrow[u] = widen_row<T>(vr[u], p.Ev, p.Evp, vwide + u * p.Evp);
    pv_chunk<KvType::kFloat32>(st, vrow, nk, it.R, p.Evp, it.acc);
  }
}

// A single query row read in place, no GQA (one query row per kv head, R = 1: the decoding of a
// model without GQA, L = 1): one step (a chunk of nk keys) of decode_step's loop in a straight
// line, acc held in CV registers over the chunk's P.V. Scores, softmax and P.V in the same order
// as decode_step's, so the same bits. `rows` gives the step's key and value rows u in [0, nk) and
// the next step's in [nk, nk + next_n), which this step prefetches: DenseRows (base + u * stride)
// or WindowRows (a paged cache's row addresses, gathered by chunk_rows). The general path cost
// this case its speed: Zen 5, H 32/32, E 64, S 8192, float32, 2 threads, alternating call by call
// with ggml on the same K/V (scripts/bench_ggml.sh part 3): ggml / attn 0.83-0.87x through
// decode_step, 0.98-1.01x here; a copy of the general path with its pieces put back one at a time
// lost 8-13 % to the score loop's prefetch_token (which looks up the row ahead in one of two
// arrays, a branch per token) and ~8 % to pv_chunk. From a paged cache (WindowRows) it measured
// no faster than decode_step: paged / contiguous stays 1.2-1.4 for H 32/32 float32 (Zen 5, E 64
// and 128, S 8192, pages of 16 to 8192 tokens; 1.04 for H 32/8), a gap outside the loop: with
// pages as long as the sequence (the dense layout) it was still 1.14. The driver's tasks take every
// kv head of one 512-token range there, against the dense path's 4096-token range of one head;
// ranges of 4096 tokens measured 1.26 instead of 1.36 (16-token pages) but leave 2 tasks for any
// number of threads, and blocks of 8 heads per task 1.41: not kept.
struct DenseRows {
  const char *k, *v;  // the step's first key and value rows
  int64_t k_stride, v_stride;
  const char* key(int64_t u) const { return k + u * k_stride; }
  const char* value(int64_t u) const { return v + u * v_stride; }
};
struct WindowRows {
  const char* const* k;  // (nk + next_n): the step's row addresses, then the next step's
  const char* const* v;
  const char* key(int64_t u) const { return k[u]; }
  const char* value(int64_t u) const { return v[u]; }
};

template <KvType T, int CV, typename Rows>
[[gnu::always_inline]] inline void single_row_step(const DecodeParams& p, const DecodeItem& it, const Rows& rows,
                                                   int64_t nk, int64_t next_n, float* st) {
  const int64_t k_bytes = p.E * elem_size(T);
  constexpr int64_t kVBytes = CV * W * elem_size(T);
  const int64_t nkp = (nk + W - 1) / W * W;
  for (int64_t u = 0; u < nk; ++u) {
    if (u + kPrefetchAhead < nk + next_n) {
      const char* ahead = rows.key(u + kPrefetchAhead);
      for (int64_t b = 0; b < k_bytes; b += 64) __builtin_prefetch(ahead + b, 0, kPrefetchLocality);
    }
    st[u] = dot_row<T>(it.q, rows.key(u), p.Ep) * p.scale_log2;
  }
  for (int64_t u = nk; u < nkp; ++u) st[u] = kNegInf;
  online_softmax_row(st, nkp, it.m[0], it.l[0], it.acc, p.Evp);
  // P.V, the next step's value rows prefetched as this one's are read (PvPrefetch's order).
  const bool guard = any_zero_weight(st, 0, 1, nk);  // a zero weight never multiplies a value
  vf a[CV];
  for (int c = 0; c < CV; ++c) a[c] = load(it.acc + c * W);
  for (int64_t u = 0; u < nk; ++u) {
    if (u < next_n) prefetch_lines<kVBytes>(rows.value(nk + u));
    if (guard && st[u] == 0.0f) continue;
    const char* row = rows.value(u);
    const vf pb = splat(st[u]);
    for (int c = 0; c < CV; ++c) a[c] += pb * load_as_float<T>(row, c * W);
  }
  for (int c = 0; c < CV; ++c) store(it.acc + c * W, a[c]);
}

// Dense K/V: the item's chunks in order.
template <KvType T, int CV>
void decode_single_row(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, int64_t j_begin,
                       int64_t j_end, float* st) {
  const int64_t k_stride = kv.k_row * elem_size(T), v_stride = kv.v_row * elem_size(T);
  for (int64_t c0 = j_begin; c0 < j_end; c0 += kDecodeChunk) {
    const int64_t nk = imin(kDecodeChunk, j_end - c0), next_n = imin(kDecodeChunk, j_end - c0 - nk);
    const DenseRows rows{static_cast<const char*>(kv.k) + c0 * k_stride, static_cast<const char*>(kv.v) + c0 * v_stride,
                         k_stride, v_stride};
    single_row_step<T, CV>(p, it, rows, nk, next_n, st);
  }
}

// The order of an item's steps (a chunk of one head): by groups of `group` keys (whole pages, at
// least a chunk), a group's chunks head after head: for a pool page of every head's rows that is
// memory order.
struct StepOrder {
  int64_t j_begin, j_end, group, heads;
  struct Pos {
    int64_t h, c0, nk;  // nk = 0: past the last step
  };
  Pos first() const { return {0, j_begin, imin(kDecodeChunk, imin(j_begin + group, j_end) - j_begin)}; }
  // This head's next chunk of the group, else the next head's first, else the next group's first
  // head's.
  Pos next(const Pos& s) const {
    const int64_t g0 = j_begin + (s.c0 - j_begin) / group * group, g1 = imin(g0 + group, j_end);
    if (s.c0 + kDecodeChunk < g1) return {s.h, s.c0 + kDecodeChunk, imin(kDecodeChunk, g1 - s.c0 - kDecodeChunk)};
    if (s.h + 1 < heads) return {s.h + 1, g0, imin(kDecodeChunk, g1 - g0)};
    if (g1 < j_end) return {0, g1, imin(kDecodeChunk, imin(g1 + group, j_end) - g1)};
    return {0, j_end, 0};
  }
};

}  // namespace attn::cpu::ATTN_SIMD_NS

#include "sdpa/cpu/decode_pipeline.hpp"

namespace attn::cpu::ATTN_SIMD_NS {

// An item of `heads` kv heads of one sequence (kvs[h], its[h]: the same key range, rows, band and
// pages, each head its own queries and partial) walks the range chunk by chunk and, within a
// chunk, head by head. For a paged cache that is the pool's memory order: a page holds every
// head's rows of its tokens, head after head, so the heads of one chunk read consecutive
// blocks where one head at a time reads one block per page, at a stride of the whole page (see
// the driver's note in decode.cpp for the measurement). A dense cache comes one head per item.
// Still not quite the pool's order for pages shorter than a chunk: a head reads its blocks of
// the chunk's pages, then the next head its blocks of the same pages. Strict memory order was
// tried (each page run's heads in turn, scores then P.V, the softmax still per chunk). A plain
// read probe of the same bytes (2 threads, bf16 rows, 8 heads, 16-token pages shuffled, 64 lines
// prefetched ahead in reading order; 6 interleaved rounds on Zen 4, medians) read 26.8 GB/s in
// this order, 27.7 in memory order and 28.5 from dense per-head rows: the order is worth ~3 %.
// The kernel lost more than that to its 16-token blocks (each reloads its accumulators, restarts
// its L1 prefetch): bf16 paged / contiguous 1.17-1.30 against 1.10-1.20 in the same runs, and
// 20 % slower with K/V in the cache.
template <KvType T>
inline void decode_split_t(const DecodeParams& p, const DecodeKv* kvs, const DecodeItem* its, int64_t heads, float* ws) {
  const DecodeItem& it0 = its[0];
  const DecodeKv& kv0 = kvs[0];
  float* st = ws;
  const bool lanes = it0.R >= W;                  // many rows: scores with rows in lanes
  const int64_t Rp = (it0.R + 15) / 16 * 16;
  float* kwide = st + Rp * kDecodeChunk;          // (Ep): a widened key row
  float* vwide = kwide + p.Ep;                    // (kDecodeChunk, Evp): widened value rows
  float* kchunk = vwide + kDecodeChunk * p.Evp;   // lanes: (kDecodeChunk, Ep) widened key rows
  float* per_head = kchunk + kDecodeChunk * p.Ep;
  const int64_t words = q_words(p.Ep);
  const int64_t head_floats = p.Ep * Rp + Rp * words;
  // Head h's lanes: (Ep, Rp) Q^T at per_head + h * head_floats; bf16 dot: (Rp, words) pairs after it.
  auto qt_of = [&](int64_t h) { return per_head + h * head_floats; };
  auto q2_of = [&](int64_t h) { return reinterpret_cast<uint32_t*>(per_head + h * head_floats + p.Ep * Rp); };
  // The step's K and V row addresses and int8 scales at [0, nk), the next step's after them.
  const char* krows[2 * kDecodeChunk];
  const char* vrows[2 * kDecodeChunk];
  float kscales[2 * kDecodeChunk], vscales[2 * kDecodeChunk];
  // Rows that are a whole number of vectors are read in place (widened in registers); others
  // are widened into a zero-padded buffer first.
  // (Ep, Evp are padded to 16 for every ISA: a row shorter than that would be read past its end.)
  const bool k_in_place = p.E == p.Ep, v_in_place = p.Ev == p.Evp;
  const int64_t k_bytes = p.E * elem_size(T), v_bytes = p.Ev * elem_size(T);
  const bool modify = p.softcap2 > 0.0f || it0.alibi2 != nullptr;
  // The AVX512-BF16 build's paths (decode_bf16_dot.hpp): bf16 queries dot bf16 keys read in
  // place; bf16 values read in place in 32-element blocks accumulate in a permuted order (float32
  // P, by FMA).
  constexpr bool kDotType = kBf16Dot && T == KvType::kBFloat16;
  const bool dot_k = kDotType && p.q_bf16 && k_in_place && !lanes;
  const bool permuted_v = kDotType && v_in_place && p.Evp % 32 == 0;

  // Keys outside every row's band are read by no row: past the last row's upper limit, before
  // the first row's lower one. (The driver cuts its ranges to the band already; this trims the
  // ends of an item that straddles them.)
  int64_t j_begin = it0.j0, j_end = it0.j1;
  if (p.band_lo || p.band_hi) {
    int64_t first = it0.query_pos[0], last = it0.query_pos[0];
    for (int64_t r = 1; r < it0.R; ++r) {
      first = it0.query_pos[r] < first ? it0.query_pos[r] : first;
      last = it0.query_pos[r] > last ? it0.query_pos[r] : last;
    }
    if (p.band_hi) j_end = imin(j_end, last + kv0.hi_offset + 1);
    if (p.band_lo && first + kv0.lo_offset > j_begin) j_begin = first + kv0.lo_offset;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const DecodeItem& it = its[h];
    for (int64_t r = 0; r < it.R; ++r) {
      it.m[r] = kNegInf;
      it.l[r] = 0.0f;
      zero(it.acc + r * p.Evp, p.Evp);
    }
  }
  if (j_begin >= j_end) return;
  // One query row per head, read in place, no variant on the scores: single_row_step.
  bool single_row = W == 16 && T != KvType::kInt8 && it0.R == 1 && k_in_place && v_in_place && !modify && !dot_k &&
                    !permuted_v && (p.Evp == 4 * W || p.Evp == 8 * W);
  for (int64_t h = 0; h < heads; ++h) single_row = single_row && its[h].mask[0] == nullptr;
  if constexpr (W == 16 && T != KvType::kInt8) {
    if (single_row && heads == 1 && kv0.pages == nullptr) {
      if (p.Evp == 4 * W) {
        decode_single_row<T, 4>(p, kv0, it0, j_begin, j_end, st);
      } else {
        decode_single_row<T, 8>(p, kv0, it0, j_begin, j_end, st);
      }
      return;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const DecodeItem& it = its[h];
    if (dot_k) pack_query_pairs(it.q, it.R, p.Ep, q2_of(h));
    if (lanes) {
      float* qt = qt_of(h);
      for (int64_t e = 0; e < p.Ep; ++e) {
        for (int64_t r = 0; r < Rp; ++r) qt[e * Rp + r] = r < it.R ? it.q[r * p.Ep + e] : 0.0f;
      }
    }
  }

  const StepShared x{st, kwide, vwide, kchunk, Rp, words, k_bytes, v_bytes, lanes, k_in_place, v_in_place,
                     modify, dot_k, permuted_v};

  // Steps: a chunk of one head, in StepOrder. krows and vrows hold the step's rows, then the next
  // step's, which the step prefetches.
  const int64_t group = heads > 1 && kv0.page_size > kDecodeChunk
                            ? (kv0.page_size + kDecodeChunk - 1) / kDecodeChunk * kDecodeChunk : kDecodeChunk;
  const StepOrder order{j_begin, j_end, group, heads};
  // Four rows read in place (GQA group 4, one new token): the next step's scores during this
  // one's P.V (decode_pipeline.hpp); 16-bit rows only from E 128 (E 64 measured slower).
  if constexpr (W == 16 && T != KvType::kInt8) {
    if (it0.R == 4 && k_in_place && v_in_place && !dot_k && (T == KvType::kFloat32 || p.Evp >= 128)) {
      decode_pipelined<T>(p, kvs, its, order, modify, permuted_v, st, kchunk);  // kchunk: unused by these rows
      if (permuted_v) {
        for (int64_t h = 0; h < heads; ++h) unpermute_rows(its[h].acc, its[h].R, p.Evp);
      }
      return;
    }
  }
  StepOrder::Pos s = order.first();
  chunk_rows<T>(kvs[s.h], false, s.c0, s.nk, krows, kscales);
  chunk_rows<T>(kvs[s.h], true, s.c0, s.nk, vrows, vscales);
  for (; s.nk > 0;) {
    const StepOrder::Pos s1 = order.next(s);
    const int64_t nk = s.nk, next_n = s1.nk;
    if (next_n > 0) {
      chunk_rows<T>(kvs[s1.h], false, s1.c0, next_n, krows + nk, kscales + nk);
      chunk_rows<T>(kvs[s1.h], true, s1.c0, next_n, vrows + nk, vscales + nk);
    }
    if constexpr (W == 16 && T != KvType::kInt8) {
      if (single_row && p.Evp == 4 * W) {
        single_row_step<T, 4>(p, its[s.h], WindowRows{krows, vrows}, nk, next_n, st);
      } else if (single_row) {
        single_row_step<T, 8>(p, its[s.h], WindowRows{krows, vrows}, nk, next_n, st);
      }
    }
    if (!single_row) {
      const Step sp{qt_of(s.h), q2_of(s.h), krows, vrows, kscales, vscales, vrows + nk, s.c0, nk, next_n,
                    s.c0 == j_begin && s.h == 0};
      decode_step<T>(p, kvs[s.h], its[s.h], x, sp);
    }
    // The next step's rows become the step's.
    std::copy_n(krows + nk, next_n, krows);
    std::copy_n(vrows + nk, next_n, vrows);
    if (T == KvType::kInt8) {
      std::copy_n(kscales + nk, next_n, kscales);
      std::copy_n(vscales + nk, next_n, vscales);
    }
    s = s1;
  }
  if (permuted_v) {
    for (int64_t h = 0; h < heads; ++h) unpermute_rows(its[h].acc, its[h].R, p.Evp);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

inline void decode_split(const DecodeParams& p, const DecodeKv* kvs, const DecodeItem* its, int64_t heads, float* ws) {
  switch (p.kv) {
    case KvType::kFloat32: return decode_split_t<KvType::kFloat32>(p, kvs, its, heads, ws);
    case KvType::kBFloat16: return decode_split_t<KvType::kBFloat16>(p, kvs, its, heads, ws);
    case KvType::kFloat16: return decode_split_t<KvType::kFloat16>(p, kvs, its, heads, ws);
    case KvType::kInt8: return decode_split_t<KvType::kInt8>(p, kvs, its, heads, ws);
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

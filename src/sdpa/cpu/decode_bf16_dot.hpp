// The split-KV decode kernel's bf16 paths (decode_kernel.hpp), compiled in its AVX512-BF16 build
// (decode_avx512_bf16.cpp) and stubbed out in the others.
//
// Why: decoding from a bf16 cache halves the bytes of a float32 one, but widening each key and
// value element to float32 (vpmovzxwd + vpslld per 16) and one FMA per product made the kernel
// compute-bound: measured on AMD Zen 5, 0.098 ms warm for H_q 32, H_kv 8, S 1024, E 128, the
// same as float32's 0.096, so a bf16 cache from memory ran at 1.4x float32 instead of ~2x.
//
// Shapes (per work item of R rows; u32 words hold two bf16, the lower one first):
//   q2  (R, q_words(Ep)) u32   the query rows as bf16 pairs (exact: taken only when the queries
//                              are bf16), zero-padded to a whole number of 32-element blocks
// Scores (q_bf16, keys read in place): per 32 elements of E one vdpbf16ps per (row, token) on
// the key row as it is in the cache; 4 rows x 4 tokens per register tile, reduced by hsum16 as
// the float32 path's tiles. P.V with values read in place and Ev a multiple of 32: the
// accumulators hold each 32-element block of Ev permuted, lanes 0-15 the elements {0-3, 8-11,
// 16-19, 24-27} and lanes 16-31 {4-7, 12-15, 20-23, 28-31}: the order in which vpunpck{l,h}wd
// widens a row to float32 (zero low halves, one instruction per 16 elements), for float32
// weights and FMAs. The order is restored once at the end of the item (unpermute_rows).
//
// Numerics: products of two bf16 are exact in float32. P stays float32 in P.V. It was rounded
// to bf16 for vdpbf16ps on token pairs (bf16 queries) until a paged test of one query row per kv
// head (H 4/4, E 64, bf16 queries and cache) measured the output at 2.2x the rule's reference
// error (float32 attention rounded once to bf16; the rule allows 2x); float32 P measures within
// it, and alternating call by call on Zen 5 (2 threads, S 8192, bf16 queries and K/V) was no
// slower: 0.96-0.99x the time of the bf16 P (H 32/8 E 128, H 32/32 E 64): decoding waits on
// memory, not on P.V. vdpbf16ps reads bf16 subnormals (below 2^-126) as zero.

namespace attn::cpu::ATTN_SIMD_NS {

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && ATTN_SIMD_WIDTH == 16
constexpr bool kBf16Dot = true;

inline int64_t q_words(int64_t Ep) { return (Ep + 31) / 32 * 16; }

inline vf to_vf(__m512 x) {
  vf r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}

// q2's rows from the float32 rows q (R, Ep); Ep is a multiple of 16.
inline void pack_query_pairs(const float* q, int64_t R, int64_t Ep, uint32_t* q2) {
  const int64_t words = q_words(Ep);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < words; w += 16) {
      const int64_t e = 2 * w;
      const __m512 a = e < Ep ? _mm512_loadu_ps(q + r * Ep + e) : _mm512_setzero_ps();
      const __m512 b = e + 16 < Ep ? _mm512_loadu_ps(q + r * Ep + e + 16) : _mm512_setzero_ps();
      _mm512_storeu_si512(q2 + r * words + w, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// The key row's elements [e, e + 32) as pairs; past E (a multiple of 16) they are zero.
inline __m512bh key_block(const void* k, int64_t e, int64_t E) {
  const __mmask32 m = E - e >= 32 ? 0xffffffffu : 0xffffu;
  return (__m512bh)_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(k) + e);
}

inline __m512bh query_block(const uint32_t* q2row, int64_t e) {
  return (__m512bh)_mm512_loadu_si512(q2row + e / 2);
}

// q . k for one packed query row and one bf16 key row.
inline float dot_row_bf16(const uint32_t* q2row, const void* k, int64_t E) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 64 <= E; e += 64) {
    a0 = _mm512_dpbf16_ps(a0, query_block(q2row, e), key_block(k, e, E));
    a1 = _mm512_dpbf16_ps(a1, query_block(q2row, e + 32), key_block(k, e + 32, E));
  }
  if (e < E) a0 = _mm512_dpbf16_ps(a0, query_block(q2row, e), key_block(k, e, E));
  return hsum(to_vf(_mm512_add_ps(a0, a1)));
}

// st[r * kDecodeChunk + t] = s[t] * (q_r . k_t) for rows [r0, r0 + 4) and four key rows.
inline void dot_scores_rows4_tokens4(const uint32_t* q2, int64_t words, int64_t r0, int64_t E,
                                     const void* const* k, const float* s, float* st) {
  vf acc[4][4];
  __m512 a[4][4];
  for (int t = 0; t < 4; ++t) {
    for (int r = 0; r < 4; ++r) a[t][r] = _mm512_setzero_ps();
  }
  for (int64_t e = 0; e < E; e += 32) {
    __m512bh kv[4];
    for (int t = 0; t < 4; ++t) kv[t] = key_block(k[t], e, E);
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = query_block(q2 + (r0 + r) * words, e);
      for (int t = 0; t < 4; ++t) a[t][r] = _mm512_dpbf16_ps(a[t][r], qv, kv[t]);
    }
  }
  for (int t = 0; t < 4; ++t) {
    for (int r = 0; r < 4; ++r) acc[t][r] = to_vf(a[t][r]);
  }
  store_scores4x4(acc, s, st + r0 * kDecodeChunk);
}

// Four tokens' scores for all R rows: rows by four, the rest one by one.
inline void dot_scores_tokens4(const uint32_t* q2, int64_t words, int64_t R, int64_t E,
                               const void* const* k, const float* s, float* st) {
  const int64_t R4 = R / 4 * 4;
  for (int64_t r0 = 0; r0 < R4; r0 += 4) dot_scores_rows4_tokens4(q2, words, r0, E, k, s, st);
  // The other rows: dot_row_bf16's sums (same order, same bits) for the four keys, reduced
  // together, as scores_group does.
  for (int64_t r = R4; r < R; ++r) {
    const uint32_t* qr = q2 + r * words;
    __m512 a0[4], a1[4];
    for (int t = 0; t < 4; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t e = 0;
    for (; e + 64 <= E; e += 64) {
      const __m512bh q0 = query_block(qr, e), q1 = query_block(qr, e + 32);
      for (int t = 0; t < 4; ++t) {
        a0[t] = _mm512_dpbf16_ps(a0[t], q0, key_block(k[t], e, E));
        a1[t] = _mm512_dpbf16_ps(a1[t], q1, key_block(k[t], e + 32, E));
      }
    }
    if (e < E) {
      const __m512bh q0 = query_block(qr, e);
      for (int t = 0; t < 4; ++t) a0[t] = _mm512_dpbf16_ps(a0[t], q0, key_block(k[t], e, E));
    }
    float d[4];
    hsum4(to_vf(_mm512_add_ps(a0[0], a1[0])), to_vf(_mm512_add_ps(a0[1], a1[1])), to_vf(_mm512_add_ps(a0[2], a1[2])),
          to_vf(_mm512_add_ps(a0[3], a1[3])), d);
    for (int t = 0; t < 4; ++t) st[r * kDecodeChunk + t] = d[t] * s[t];
  }
}

// Four packed query rows (q2, `words` apart) dotted with NT bf16 key rows: out[t][r], each with
// the bits dot_scores_tokens4 gives it (hsum4 adds in hsum16's order); each query block is loaded
// once for the NT rows. Always inlined: the pipelined loop (decode_pipeline.hpp) scores two rows
// with it inside a P.V tile, whose 16 accumulators it must not spill (out of line it measured
// 1.34x the time with K/V in L2).
template <int NT>
[[gnu::always_inline]] inline void dot_rows4_tokens_bf16(const uint32_t* q2, int64_t words, int64_t E,
                                                         const void* const (&k)[NT], float (&out)[NT][4]) {
  __m512 a[NT][4];
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < 4; ++r) a[t][r] = _mm512_setzero_ps();
  }
  for (int64_t e = 0; e < E; e += 32) {
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = key_block(k[t], e, E);
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = query_block(q2 + r * words, e);
      for (int t = 0; t < NT; ++t) a[t][r] = _mm512_dpbf16_ps(a[t][r], qv, kv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) hsum4(to_vf(a[t][0]), to_vf(a[t][1]), to_vf(a[t][2]), to_vf(a[t][3]), out[t]);
}

// One token's scores for all R rows, each with the bits dot_scores_tokens4 gives it.
inline void dot_scores_token(const uint32_t* q2, int64_t words, int64_t R, int64_t E, const void* k,
                             float s, float* st) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    float d[1][4];
    const void* const kt[1] = {k};
    dot_rows4_tokens_bf16<1>(q2 + r * words, words, E, kt, d);
    for (int i = 0; i < 4; ++i) st[(r + i) * kDecodeChunk] = d[0][i] * s;
  }
  for (; r < R; ++r) st[r * kDecodeChunk] = dot_row_bf16(q2 + r * words, k, E) * s;
}

// NB blocks of 32 bf16 values from x as 2 NB float32 vectors in the permuted order (the one
// permutation the accumulators carry until unpermute_rows): per block, vpunpck{l,h}wd against
// zero put each value in the high half of a float32 lane, no shift or permute needed.
template <int NB>
[[gnu::always_inline]] inline void widen_blocks_permuted(const uint16_t* x, __m512 (&v)[2 * NB]) {
  const __m512i z = _mm512_setzero_si512();
  for (int b = 0; b < NB; ++b) {
    const __m512i w = _mm512_loadu_si512(x + 32 * b);
    v[2 * b] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w));
    v[2 * b + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w));
  }
}

// acc's permuted blocks [c0, c0 + 32 NB) += P[rows] . V over the chunk's tokens: float32 weights
// and FMAs, each bf16 value row widened into the permuted order. With kGuard a zero weight is
// skipped, never multiplied.
// This tile and its callers down to pv_chunk_permuted are always inlined into the step loops. Left
// to GCC (12), the tile went out of line once PvPrefetch grew a field (c0e79ce), and there, with
// the pipelined loop's bf16 feed inline in it, it stored its 16 accumulators to the stack on every
// token: bf16 queries against a bf16 cache (H 32/8, E 128, S 8192, 2 threads) took 0.95-1.80 ms
// (mostly ~1.7) in `attn bench` where the inlined form takes 0.79-1.15 (alternating binaries); with K/V in L2 (one
// thread, scripts/ab_kernels.sh -i avx512_bf16 ... bf16q) 1.53x the time, E 64 1.21x, group 8
// 1.04x; float32 queries against the cache 1.0-1.03x.
template <int RT, int NB, bool kGuard, typename Hook>
[[gnu::always_inline]] inline void pv_tile_widened(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t c0,
                            int64_t Evp, float* acc, PvPrefetch pf, Hook& hook) {
  __m512 a[RT][2 * NB];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < 2 * NB; ++c) a[r][c] = _mm512_loadu_ps(acc + (r0 + r) * Evp + c0 + 16 * c);
  }
  for (int64_t u = 0; u < nk; ++u) {
    if (u < pf.n) prefetch_lines<64 * NB>(pf.rows[u] + 2 * c0);
    if (pf.l1 && u + kL1Ahead < nk) prefetch_lines<64 * NB, 3>(static_cast<const uint16_t*>(vrows[u + kL1Ahead]) + c0);
    __m512 v[2 * NB];
    widen_blocks_permuted<NB>(static_cast<const uint16_t*>(vrows[u]) + c0, v);
    for (int r = 0; r < RT; ++r) {
      const float pr = st[(r0 + r) * kDecodeChunk + u];
      if constexpr (kGuard) {
        if (pr == 0.0f) continue;
      }
      const __m512 pb = _mm512_set1_ps(pr);
      for (int c = 0; c < 2 * NB; ++c) a[r][c] = _mm512_fmadd_ps(pb, v[c], a[r][c]);
    }
    hook();
  }
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < 2 * NB; ++c) _mm512_storeu_ps(acc + (r0 + r) * Evp + c0 + 16 * c, a[r][c]);
  }
}

// The permuted P.V's column tiles (by_col_tiles' counterpart): NB = 2 blocks of 32 per tile, and
// one block for a last 32 columns.
template <typename Tile>
[[gnu::always_inline]] inline void by_permuted_col_tiles(int64_t Evp, Tile&& tile) {
  int64_t c0 = 0;
  for (; c0 + 64 <= Evp; c0 += 64) tile.template operator()<2>(c0);
  if (c0 < Evp) tile.template operator()<1>(c0);
}

template <int RT, typename Hook>
[[gnu::always_inline]] inline void pv_rows_permuted(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t Evp, float* acc,
                             PvPrefetch pf, Hook& hook) {
  const bool guard = any_zero_weight(st, r0, RT, nk);
  by_permuted_col_tiles(Evp, [&]<int NB>(int64_t c0) __attribute__((always_inline)) {
    if (guard) {
      pv_tile_widened<RT, NB, true>(st, vrows, nk, r0, c0, Evp, acc, pf, hook);
    } else {
      pv_tile_widened<RT, NB, false>(st, vrows, nk, r0, c0, Evp, acc, pf, hook);
    }
  });
}

// The tiles pv_chunk_permuted runs for R rows (the hook's calls per token), as pv_tile_count
// counts pv_chunk's.
inline int64_t pv_permuted_tile_count(int64_t R, int64_t Evp) {
  int64_t n = 0;
  by_row_tiles(R, [&]<int RT>(int64_t) { by_permuted_col_tiles(Evp, [&]<int NB>(int64_t) { ++n; }); });
  return n;
}

// The CV vectors of a bf16 value row (16 CV elements) in the permuted order, as the P.V tiles
// widen them (single_row_step's form, on vf).
template <int CV>
[[gnu::always_inline]] inline void widen_permuted(const void* row, vf (&v)[CV]) {
  static_assert(CV % 2 == 0, "whole 32-element blocks");
  __m512 w[CV];
  widen_blocks_permuted<CV / 2>(static_cast<const uint16_t*>(row), w);
  for (int c = 0; c < CV; ++c) v[c] = to_vf(w[c]);
}

// P.V of a bf16 chunk into the permuted accumulators (Evp a multiple of 32), hook() after each
// token of each tile.
template <typename Hook = const NoHook>
[[gnu::always_inline]] inline void pv_chunk_permuted(const float* st, const void* const* vrows, int64_t nk, int64_t R, int64_t Evp, float* acc,
                              PvPrefetch pf, Hook& hook = NoHook{}) {
  by_row_tiles(R, [&]<int RT>(int64_t r0) __attribute__((always_inline)) { pv_rows_permuted<RT>(st, vrows, nk, r0, Evp, acc, for_row_tile(pf, r0), hook); });
}

// The accumulators back in element order: block lane 4k + i of lanes 0-15 is element 8k + i,
// of lanes 16-31 element 8k + 4 + i.
inline void unpermute_rows(float* acc, int64_t R, int64_t Evp) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < Evp; c += 32) {
      float* a = acc + r * Evp + c;
      const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, i0, hi));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
  }
}

#else
constexpr bool kBf16Dot = false;
inline int64_t q_words(int64_t) { return 0; }
inline void pack_query_pairs(const float*, int64_t, int64_t, uint32_t*) {}
inline void dot_scores_tokens4(const uint32_t*, int64_t, int64_t, int64_t, const void* const*, const float*, float*) {}
inline void dot_scores_token(const uint32_t*, int64_t, int64_t, int64_t, const void*, float, float*) {}
template <int NT>
inline void dot_rows4_tokens_bf16(const uint32_t*, int64_t, int64_t, const void* const (&)[NT], float (&)[NT][4]) {}
template <typename Hook = const NoHook>
inline void pv_chunk_permuted(const float*, const void* const*, int64_t, int64_t, int64_t, float*, PvPrefetch,
                              Hook& = NoHook{}) {}
inline void unpermute_rows(float*, int64_t, int64_t) {}
inline int64_t pv_permuted_tile_count(int64_t, int64_t) { return 1; }
inline float dot_row_bf16(const uint32_t*, const void*, int64_t) { return 0.0f; }
template <int CV>
inline void widen_permuted(const void*, vf (&)[CV]) {}
#endif

}  // namespace attn::cpu::ATTN_SIMD_NS

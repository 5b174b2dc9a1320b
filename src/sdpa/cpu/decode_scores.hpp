// The split-KV decode kernel's scores (decode_kernel.hpp): st[r * kDecodeChunk + u] = s_u * (q_r .
// k_u) for an item's R query rows (float32, (R, Ep)) and a chunk's key rows of the cache's type,
// and the score modifiers (softcap, ALiBi). Which form a step takes depends on R (decode_step):
// token by token for R < 4 (dot_row), four rows x kScoreGroup tokens per register tile for
// 4 <= R < W (scores_group: four tokens on AVX-512, three on AVX2), rows in lanes for R >= W
// (scores_chunk_lanes). Each form sums E in the same order per row (two accumulators, then a
// halving tree of lanes), so a row's score has the same bits whichever form computed it.
// Included by decode_kernel.hpp inside its per-ISA namespace.
#pragma once

namespace attn::cpu::ATTN_SIMD_NS {

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
#elif ATTN_SIMD_WIDTH == 8
  using v4 = float __attribute__((vector_size(16)));
  const v4 b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
  const v4 b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
  const v4 b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
  const v4 b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
  // c01 = {b0[0] + b0[2], b0[1] + b0[3], b1[0] + b1[2], b1[1] + b1[3]}, c23 likewise
  const v4 c01 = __builtin_shufflevector(b0, b1, 0, 1, 4, 5) + __builtin_shufflevector(b0, b1, 2, 3, 6, 7);
  const v4 c23 = __builtin_shufflevector(b2, b3, 0, 1, 4, 5) + __builtin_shufflevector(b2, b3, 2, 3, 6, 7);
  const v4 r = __builtin_shufflevector(c01, c23, 0, 2, 4, 6) + __builtin_shufflevector(c01, c23, 1, 3, 5, 7);
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
  auto step = [&](int64_t e) {
    const vf kv = load_as_float<T>(k, e);
    a0 += load(q + e) * kv;
    a1 += load(q + Ep + e) * kv;
    a2 += load(q + 2 * Ep + e) * kv;
    a3 += load(q + 3 * Ep + e) * kv;
  };
  if constexpr (T == KvType::kFloat32) {
    // Unrolled (E 128: the whole row): the pipelined loop's feed, float32 E 128, Zen 5, measured
    // 0.96-0.98x the time with K/V in L2 (one thread) and 0.97-0.99x from memory (two threads).
    // 16-bit rows, widened in the loop, stay rolled (unrolled, bf16 measured no faster).
#pragma GCC unroll 8
    for (int64_t e = 0; e < Ep; e += W) step(e);
  } else {
    for (int64_t e = 0; e < Ep; e += W) step(e);
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

// Four tokens' scores of W rows (a vector per token, rows in lanes) into st's (row, token)
// layout: st[l * kDecodeChunk + t] = a_t[l]. A 4 x 4 transpose in each 128-bit group of lanes,
// then one 16-byte store per row. Lane by lane (W scalar extracts and stores per token) this was
// a quarter of the scores' time: a stand-alone loop of the 4-token x 32-row tile (Zen 5, E 128,
// K in L1, one thread) ran at 152 GFLOP/s that way, 200 this way, 197 with no write-back at all.
#if ATTN_SIMD_WIDTH == 16
inline void store_tokens4(vf a0, vf a1, vf a2, vf a3, float* st) {
  using v4 = float __attribute__((vector_size(16)));
  const vf lo01 = __builtin_shufflevector(a0, a1, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
  const vf hi01 = __builtin_shufflevector(a0, a1, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  const vf lo23 = __builtin_shufflevector(a2, a3, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
  const vf hi23 = __builtin_shufflevector(a2, a3, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  // r[i], lanes 4k..4k+3: row 4k + i's four tokens
  const vf r[4] = {
      __builtin_shufflevector(lo01, lo23, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(lo01, lo23, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
      __builtin_shufflevector(hi01, hi23, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(hi01, hi23, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)};
  for (int i = 0; i < 4; ++i) {
    const v4 g0 = __builtin_shufflevector(r[i], r[i], 0, 1, 2, 3), g1 = __builtin_shufflevector(r[i], r[i], 4, 5, 6, 7);
    const v4 g2 = __builtin_shufflevector(r[i], r[i], 8, 9, 10, 11), g3 = __builtin_shufflevector(r[i], r[i], 12, 13, 14, 15);
    std::memcpy(st + (0 + i) * kDecodeChunk, &g0, sizeof g0);
    std::memcpy(st + (4 + i) * kDecodeChunk, &g1, sizeof g1);
    std::memcpy(st + (8 + i) * kDecodeChunk, &g2, sizeof g2);
    std::memcpy(st + (12 + i) * kDecodeChunk, &g3, sizeof g3);
  }
}
#elif ATTN_SIMD_WIDTH == 8
inline void store_tokens4(vf a0, vf a1, vf a2, vf a3, float* st) {
  using v4 = float __attribute__((vector_size(16)));
  const vf lo01 = __builtin_shufflevector(a0, a1, 0, 8, 1, 9, 4, 12, 5, 13);
  const vf hi01 = __builtin_shufflevector(a0, a1, 2, 10, 3, 11, 6, 14, 7, 15);
  const vf lo23 = __builtin_shufflevector(a2, a3, 0, 8, 1, 9, 4, 12, 5, 13);
  const vf hi23 = __builtin_shufflevector(a2, a3, 2, 10, 3, 11, 6, 14, 7, 15);
  const vf r[4] = {__builtin_shufflevector(lo01, lo23, 0, 1, 8, 9, 4, 5, 12, 13),
                   __builtin_shufflevector(lo01, lo23, 2, 3, 10, 11, 6, 7, 14, 15),
                   __builtin_shufflevector(hi01, hi23, 0, 1, 8, 9, 4, 5, 12, 13),
                   __builtin_shufflevector(hi01, hi23, 2, 3, 10, 11, 6, 7, 14, 15)};
  for (int i = 0; i < 4; ++i) {
    const v4 g0 = __builtin_shufflevector(r[i], r[i], 0, 1, 2, 3), g1 = __builtin_shufflevector(r[i], r[i], 4, 5, 6, 7);
    std::memcpy(st + (0 + i) * kDecodeChunk, &g0, sizeof g0);
    std::memcpy(st + (4 + i) * kDecodeChunk, &g1, sizeof g1);
  }
}
#else
inline void store_tokens4(vf, vf, vf, vf, float*) {}  // W < 8: scores_lanes stores lane by lane
#endif

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
  // Back to st's (row, token) layout.
  if constexpr (JT == 4 && W >= 8) {
    for (int v = 0; v < RV; ++v) {
      store_tokens4(total[0][v] * s[0], total[1][v] * s[1], total[2][v] * s[2], total[3][v] * s[3],
                    st + (r0 + v * W) * kDecodeChunk);
    }
  } else {
    for (int t = 0; t < JT; ++t) {
      for (int v = 0; v < RV; ++v) {
        for (int l = 0; l < W; ++l) st[(r0 + v * W + l) * kDecodeChunk + t] = total[t][v][l] * s[t];
      }
    }
  }
}

// Key rows for the scores to prefetch as they go: n rows of `bytes` (the next chunk's). With
// rows in lanes the gather loop had prefetched them kPrefetchAhead tokens ahead, all within
// its few instructions, so a chunk's scores started on keys still in flight: spreading them
// over the score tiles, four rows per tile, made 64 rows (16 tokens x GQA 4) 1.12-1.14x faster
// from memory, 16 rows 1.30x (AVX-512, E 128) and AVX2's 8 rows 1.41x (ab_kernels.sh, Zen 5,
// H_kv 8, S 8192, 2 threads; same bits; K/V in L2: 1.00).
struct KeyPrefetch {
  const char* const* rows = nullptr;
  int64_t n = 0, bytes = 0;
};

// The chunk's tokens against rows [r0, r0 + RV * W): by fours, then one by one; tile u
// prefetches rows [u, u + 4) of pf.
template <int RV>
inline void scores_lanes_rows(const float* qt, int64_t Rp, const float* const* krows, const float* ks, int64_t nk,
                              int64_t E, int64_t r0, float* st, KeyPrefetch pf) {
  int64_t u = 0;
  for (; u + 4 <= nk; u += 4) {
    for (int64_t i = u; i < u + 4 && i < pf.n; ++i) prefetch_bytes(pf.rows[i], pf.bytes);
    scores_lanes<4, RV>(qt, Rp, krows + u, E, r0, ks + u, st + u);
  }
  for (; u < nk; ++u) scores_lanes<1, RV>(qt, Rp, krows + u, E, r0, ks + u, st + u);
  for (int64_t i = u; i < pf.n; ++i) prefetch_bytes(pf.rows[i], pf.bytes);
}

// The chunk's scores with rows in lanes; krows are float32 rows (widened if need be), ks the
// per-token scale (times scale_log2). Rows past R are padding and land in st's spare rows.
// Tiles of four vectors of rows where AVX-512's 32 registers hold their 16 accumulators (64
// rows, Zen 5, E 128: 1.04x two vectors with K in L1, 1.09x from memory), then two, then one.
// Out of line: inlined into decode_step, GCC gave the step's values the registers and moved a
// wider tile's query vectors through the stack on every FMA (seen at 7 tokens x 2 vectors).
[[gnu::noinline]] inline void scores_chunk_lanes(const float* qt, int64_t Rp, const float* const* krows,
                                                 const float* ks, int64_t nk, int64_t E, float* st, KeyPrefetch pf) {
  int64_t r0 = 0;
  if constexpr (W >= 16) {
    for (; Rp - r0 >= 4 * W; r0 += 4 * W, pf.n = 0) scores_lanes_rows<4>(qt, Rp, krows, ks, nk, E, r0, st, pf);
  }
  for (; Rp - r0 >= 2 * W; r0 += 2 * W, pf.n = 0) scores_lanes_rows<2>(qt, Rp, krows, ks, nk, E, r0, st, pf);
  for (; r0 < Rp; r0 += W, pf.n = 0) scores_lanes_rows<1>(qt, Rp, krows, ks, nk, E, r0, st, pf);
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
constexpr bool kScoresByGroup = true;
constexpr int kScoreGroup = 4;  // tokens per call of scores_group

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
inline void scores_rows4_group(const float* q, int64_t r0, int64_t Ep, const void* const* k, const float* s,
                               float* st) {
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

#elif ATTN_SIMD_WIDTH == 8
// AVX2, 4 <= R: three tokens x four rows per register tile, 12 accumulators beside three key
// vectors and one query vector (all 16 registers): per step of E 3 key and 4 query loads feed
// 12 FMAs. Four tokens x four rows would need 16 accumulators alone; two pairs of tokens (the
// form before) load each query vector once per pair (6 loads per 8 FMAs, 10 once GCC folded each
// query load into both FMAs), and the loads, not the FMAs, bound them. Zen 3, float32, 4 rows, K/V in L2 (H_kv 1, S 256-512, 1 thread,
// scripts/ab_kernels.sh, 4 link layouts of 501 pairs, identical outputs), time ratios three /
// two-pair: E 128 0.85 (decode_step's path: 1.18x faster), E 64 0.91; from memory (H_kv 8,
// S 8192, 2 threads) 1.00 at E 64, where the read bounds both. Each score is one accumulator
// over E reduced by hsum4, so it has the bits dot_rows4 gives it.
constexpr bool kScoresByGroup = true;
constexpr int kScoreGroup = 3;

template <KvType T>
inline void scores_rows4_group(const float* q, int64_t r0, int64_t Ep, const void* const* k, const float* s,
                               float* st) {
  vf acc[3][4] = {};
  for (int64_t e = 0; e < Ep; e += W) {
    const vf k0 = load_as_float<T>(k[0], e), k1 = load_as_float<T>(k[1], e), k2 = load_as_float<T>(k[2], e);
    for (int r = 0; r < 4; ++r) {
      const vf qv = load(q + (r0 + r) * Ep + e);
      acc[0][r] += qv * k0;
      acc[1][r] += qv * k1;
      acc[2][r] += qv * k2;
    }
  }
  for (int t = 0; t < 3; ++t) {
    float d[4];
    hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3], d);
    for (int r = 0; r < 4; ++r) st[(r0 + r) * kDecodeChunk + t] = d[r] * s[t];
  }
}
#endif

#if ATTN_SIMD_WIDTH >= 8
// kScoreGroup tokens' scores for R < W rows: rows by four, the rest as scores_token does. k[t]
// are rows of type T read in place, s[t] the token's scale (times scale_log2).
template <KvType T>
inline void scores_group(const float* q, int64_t R, int64_t Ep, const void* const* k, const float* s, float* st) {
  const int64_t R4 = R / 4 * 4;
  for (int64_t r0 = 0; r0 < R4; r0 += 4) scores_rows4_group<T>(q, r0, Ep, k, s, st);
  // The other rows (all of them without GQA: R = L): each against the group's keys with dot_row's
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
      for (int t = 0; t < kScoreGroup; ++t) {
        a0[t] += q0 * load_as_float<T>(k[t], e);
        a1[t] += q1 * load_as_float<T>(k[t], e + W);
      }
    }
    if (e < Ep) {
      const vf q0 = load(qr + e);
      for (int t = 0; t < kScoreGroup; ++t) a0[t] += q0 * load_as_float<T>(k[t], e);
    }
    float d[4];
    hsum4(a0[0] + a1[0], a0[1] + a1[1], a0[2] + a1[2], a0[3] + a1[3], d);
    for (int t = 0; t < kScoreGroup; ++t) st[r * kDecodeChunk + t] = d[t] * s[t];
  }
}
#else
constexpr bool kScoresByGroup = false;
constexpr int kScoreGroup = 4;
template <KvType T>
inline void scores_group(const float*, int64_t, int64_t, const void* const*, const float*, float*) {}
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

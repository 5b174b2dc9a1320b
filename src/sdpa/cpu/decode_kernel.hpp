// Split-KV decode kernel (flash-decoding) for one work item: R query rows against one kv head's
// keys [j0, j1), leaving a partial softmax (see decode_params.hpp); from a paged cache, one call
// runs the items of every kv head of a sequence over the same keys, chunk by chunk and head
// after head (decode_split_t).
//
// Included after flash_kernel.hpp by flash_avx512.cpp, flash_avx2.cpp, flash_generic.cpp and
// decode_avx512_bf16.cpp, so it shares their vector type `vf` (W floats), exp2v and per-ISA
// namespace. The last adds vdpbf16ps paths for bf16 caches (decode_bf16_dot.hpp).
//
// The kernel's parts, each included here inside the per-ISA namespace: decode_rows.hpp (finding,
// prefetching and widening K/V rows), decode_scores.hpp (the forms of Q.K^T), decode_pv.hpp (the
// P.V register tiles), decode_bf16_dot.hpp (vdpbf16ps), decode_pipeline.hpp (the pipelined step
// loop). This file: a step (scores, variants, online softmax, P.V) and an item's loop over steps.
//
// Shapes and tiling: the item's rows are few (GQA group x L <= 16 queries), its keys many.
// Keys go by chunks of up to kDecodeChunk tokens (a chunk may span pages; its row addresses are
// gathered once per page run):
//   st    (R, kDecodeChunk)  base-2 scores of the chunk, then its probabilities
//   acc   (R, Evp)           the item's output accumulators (the caller's partial buffer)
//   kwide (Ep), vwide (kDecodeChunk, Evp): widened rows, only for a head dim that is not a
//         multiple of 16 (others are read in place, 16-bit and int8 widened in registers)
// Scores: each key row is loaded once and dotted with four query rows at a time, the four
// sums reduced together (hsum4); with 4 <= R < W, kScoreGroup key rows at a time as well, so a
// query vector is loaded once per group (AVX-512: four tokens, 16 sums share one reduction,
// hsum16; AVX2: three tokens, 12 accumulators); with R >= W, rows in lanes (scores_lanes); with
// R < 4, token by token (key rows in memory order).
// One query row per kv head (no GQA, L = 1) takes a straight-line copy of a step
// (single_row_step), its rows addressed as base + u * stride: a paged cache's by steps that never
// cross a page (decode_single_row_paged). P.V: register tiles of up to 4 rows x 4 vectors of Ev over the
// chunk's tokens, so the accumulators stay in registers and each value vector feeds 4 rows.
// Four rows per kv head (GQA group 4, one new token) take a pipelined loop instead of
// decode_step's phases: the next step's scores between this step's P.V tokens (decode_pipeline.hpp).
// Memory traffic: K and V stream through once per kv head, (E + Ev) * S * sizeof(element) bytes
// per item, the whole cost of decoding. One core's demand loads keep too few lines in flight to
// reach the machine's bandwidth, so the score loop prefetches the key row kPrefetchAhead tokens
// on (rows in lanes: the score tiles the next step's key rows, four per tile, KeyPrefetch), and
// the P.V tiles the next step's value rows as they go (PvPrefetch; AVX2: in memory order, spread
// evenly over the tiles' steps, PvOrder): each phase keeps memory busy while it computes (a
// burst of prefetches at once stalls on the fill buffers instead; measured).
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

#include "sdpa/cpu/decode_rows.hpp"
#include "sdpa/cpu/decode_pv.hpp"
#include "sdpa/cpu/decode_scores.hpp"

namespace attn::cpu::ATTN_SIMD_NS {

// decode_split_t's workspace: the step's scratch, then each head's packed queries.
inline int64_t decode_workspace_floats(int64_t R, int64_t Ep, int64_t Evp, int64_t heads) {
  const int64_t Rp = (R + 15) / 16 * 16;  // rows padded for the lane layout (W divides 16)
  const int64_t per_head = Ep * Rp + Rp * ((Ep + 31) / 32 * 16);  // Q^T; decode_bf16_dot.hpp's q2
  return Rp * kDecodeChunk + Ep + kDecodeChunk * Evp + kDecodeChunk * Ep + heads * per_head;
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
  prefetch_key_ahead(kr, n, u, k_bytes);
  if (v_row != nullptr) prefetch_bytes(v_row, v_bytes);
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
  // With rows in lanes the scores prefetch the next chunk's keys as they go; here only the first
  // step's own.
  const int64_t k_ahead = lanes ? (first_step ? nk : 0) : nk + next_n;
  for (int64_t u = 0; u < (token_by_token ? 0 : nk); ++u) {
    prefetch_token(kr, k_ahead, u, k_bytes, prefetch_v ? vr[u] : nullptr, v_bytes);
    const float s = kscale[u];
    if (dot_k) {
      if (u % 4 == 3) dot_scores_tokens4(q2, words, it.R, p.E, reinterpret_cast<const void* const*>(kr + u - 3), kscale + u - 3, st + u - 3);
    } else if (lanes) {  // gather the chunk's rows; the scores follow, all at once
      kf[u] = T == KvType::kFloat32 && k_in_place ? reinterpret_cast<const float*>(kr[u])
                                                  : widen_row<T>(kr[u], p.E, p.Ep, kchunk + u * p.Ep);
    } else if (kScoresByGroup) {  // by kScoreGroup tokens, as their rows arrive
      constexpr int64_t g = kScoreGroup - 1;  // the group's first token is u - g
      if (k_in_place) {
        if (u % kScoreGroup == g) scores_group<T>(it.q, it.R, p.Ep, reinterpret_cast<const void* const*>(kr + u - g), kscale + u - g, st + u - g);
      } else {
        kf[u] = widen_row<T>(kr[u], p.E, p.Ep, kchunk + u * p.Ep);
        if (u % kScoreGroup == g) {
          scores_group<KvType::kFloat32>(it.q, it.R, p.Ep, reinterpret_cast<const void* const*>(kf + u - g),
                                         kscale + u - g, st + u - g);
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
    scores_chunk_lanes(qt, Rp, kf, kscale, nk, p.E, st, KeyPrefetch{kr + nk, next_n, k_bytes});
  } else if (kScoresByGroup) {  // the last nk % kScoreGroup tokens
    for (int64_t u = nk / kScoreGroup * kScoreGroup; u < nk; ++u) {
      if (k_in_place) {
        scores_token<T>(it.q, it.R, p.Ep, kr[u], kscale[u], st + u);
      } else {
        scores_token<KvType::kFloat32>(it.q, it.R, p.Ep, kf[u], kscale[u], st + u);
      }
    }
  }

  finish_scores<T>(p, kv, it, modify, vs, c0, nk, st);

  // Values read in place: the L2 prefetch of the next step's rows (in memory order on AVX2) and
  // the L1 one of this step's.
  PvOrder v_order;
  const PvPrefetch pf = plan_value_prefetch(v_order, next_v, next_n, v_bytes, nk, pv_tile_count<T>(it.R, p.Evp),
                                            kPvInOrder && !permuted_v);
  if (permuted_v) {
    pv_chunk_permuted(st, reinterpret_cast<const void* const*>(vr), nk, it.R, p.Evp, it.acc, pf);
  } else if (v_in_place) {
    pv_chunk<T>(st, reinterpret_cast<const void* const*>(vr), nk, it.R, p.Evp, it.acc, pf);
  } else {
    for (int64_t u = 0; u < nk; ++u) vrow[u] = widen_row<T>(vr[u], p.Ev, p.Evp, vwide + u * p.Evp);
    pv_chunk<KvType::kFloat32>(st, vrow, nk, it.R, p.Evp, it.acc);
  }
}

// The order of an item's steps (a chunk of one head): by groups of `group` keys (whole pages, at
// least a chunk), a group's chunks head after head: for a pool page of every head's rows that is
// memory order. Groups start at j_begin, or with `aligned` at multiples of `group` (pages: no
// step then crosses a page; the first and last groups are clipped to [j_begin, j_end)).
struct StepOrder {
  int64_t j_begin, j_end, group, heads;
  bool aligned = false;
  struct Pos {
    int64_t h, c0, nk;  // nk = 0: past the last step
  };
  int64_t group_begin(int64_t c0) const {
    if (aligned) return c0 / group * group > j_begin ? c0 / group * group : j_begin;
    return j_begin + (c0 - j_begin) / group * group;
  }
  int64_t group_end(int64_t g0) const { return imin(j_end, aligned ? (g0 / group + 1) * group : g0 + group); }
  Pos first() const { return {0, j_begin, imin(kDecodeChunk, group_end(j_begin) - j_begin)}; }
  // This head's next chunk of the group, else the next head's first, else the next group's first
  // head's.
  Pos next(const Pos& s) const {
    const int64_t g0 = group_begin(s.c0), g1 = group_end(g0);
    if (s.c0 + kDecodeChunk < g1) return {s.h, s.c0 + kDecodeChunk, imin(kDecodeChunk, g1 - s.c0 - kDecodeChunk)};
    if (s.h + 1 < heads) return {s.h + 1, g0, imin(kDecodeChunk, g1 - g0)};
    if (g1 < j_end) return {0, g1, imin(kDecodeChunk, group_end(g1) - g1)};
    return {0, j_end, 0};
  }
};

// A single query row read in place, no GQA (one query row per kv head, R = 1: the decoding of a
// model without GQA, L = 1): one step (a chunk of nk keys) of decode_step's loop in a straight
// line, acc held in CV registers over the chunk's P.V. Scores, softmax and P.V in the same order
// as decode_step's, so the same bits for the same chunks. The step's rows are `cur`, the next
// step's (next_n of them, which this step prefetches) `next`: each a base and a stride, so rows
// never cross a page within a step. The general path cost this case its speed: Zen 5, H 32/32,
// E 64, S 8192, float32, 2 threads, alternating call by call with ggml on the same K/V
// (scripts/bench_ggml.sh part 3): ggml / attn 0.83-0.87x through decode_step, 0.98-1.01x here; a
// copy of the general path with its pieces put back one at a time lost 8-13 % to the score
// loop's prefetch_token (which looks up the row ahead in one of two arrays, a branch per token)
// and ~8 % to pv_chunk. Row addresses from arrays (decode_split_t's krows, vrows, filled by
// chunk_rows and shifted each step) instead of base + u * stride cost a paged cache 8-12 % more
// (pages as long as the sequence, one kv head per task: the dense layout; 2.63-2.65 against
// 2.83-3.06 ms, the dense call 2.63-2.66, alternating in one process), the gathering and shifting
// ~3 % of it. bf16 queries and cache in the AVX512-BF16 build (vdpbf16ps scores, the permuted
// P.V) and float32 queries against a bf16 cache took the general path too, until: Zen 5, H 32/32,
// S 8192, 2 threads, alternating call by call with it in one process (40-60 pairs a run), time
// ratios at a read probe of ~48 / ~82 GB/s: bf16 queries E 64 0.93-0.96 / 0.78, E 128 0.78-0.82 /
// 0.72, float32 queries E 64 0.86-0.92; K/V in the cache (S 1024) 0.76-0.81; pages of 16 and 64
// tokens 0.72-0.88 (paged / contiguous 0.91-1.05, from 1.11-1.31). AVX2 took the general path
// until: Zen 3, H 32/32, S 8192, 2 threads, against ggml call by call (bench_ggml.sh part 3, 60
// pairs), ggml / attn from 0.88 / 0.86 (float32 E 128 / 64) and 0.93 / 1.18 (float16) to 1.06 /
// 1.13 and 1.09 / 1.41; attn's own time ratio new / old (`attn bench`, alternating binaries, 5
// pairs) 0.77 / 0.74 float32, 0.89 / 0.87 bf16; pages of 16 tokens (float32, E 128) 0.80-0.88,
// the dense calls gaining more (paged / contiguous 1.10-1.13, from 1.01).
struct DenseRows {
  const char *k, *v;  // the first key and value rows
  int64_t k_stride, v_stride;
  const char* key(int64_t u) const { return k + u * k_stride; }
  const char* value(int64_t u) const { return v + u * v_stride; }
};

// The single row's query: float32 (it.q), or with kDot its bf16 pairs (q2) for vdpbf16ps.
// Values: bf16 ones in the AVX512-BF16 build are widened in decode_bf16_dot.hpp's permuted
// order (kPermutedV), as the general path's P.V does; the caller unpermutes acc at the end.
template <KvType T>
constexpr bool kPermutedV = kBf16Dot && T == KvType::kBFloat16;

template <KvType T, int CV, bool kDot>
[[gnu::always_inline]] inline void single_row_step(const DecodeParams& p, const DecodeItem& it, const uint32_t* q2,
                                                   const DenseRows& cur, const DenseRows& next, int64_t nk,
                                                   int64_t next_n, float* st) {
  const int64_t k_bytes = p.E * elem_size(T);
  constexpr int64_t kVBytes = CV * W * elem_size(T);
  const int64_t nkp = (nk + W - 1) / W * W;
  for (int64_t u = 0; u < nk; ++u) {
    const int64_t a = u + kPrefetchAhead;
    if (a < nk) {
      prefetch_bytes(cur.key(a), k_bytes);
    } else if (a < nk + next_n) {
      prefetch_bytes(next.key(a - nk), k_bytes);
    }
    if constexpr (kDot) {
      st[u] = dot_row_bf16(q2, cur.key(u), p.E) * p.scale_log2;
    } else {
      st[u] = dot_row<T>(it.q, cur.key(u), p.Ep) * p.scale_log2;
    }
  }
  for (int64_t u = nk; u < nkp; ++u) st[u] = kNegInf;
  online_softmax_row(st, nkp, it.m[0], it.l[0], it.acc, p.Evp);
  // P.V, the next step's value rows prefetched as this one's are read (PvPrefetch's order), in
  // passes of CV vectors of Ev (one pass with AVX-512; AVX2's 16 registers hold 8 accumulators, so
  // Ev 128 takes two, the second reading its half rows from L2, where the step's prefetch put them).
  const bool guard = any_zero_weight(st, 0, 1, nk);  // a zero weight never multiplies a value
  for (int64_t c0 = 0; c0 < p.Evp; c0 += CV * W) {
    const int64_t b0 = c0 * elem_size(T);
    vf acc[CV];
    for (int c = 0; c < CV; ++c) acc[c] = load(it.acc + c0 + c * W);
    for (int64_t u = 0; u < nk; ++u) {
      if (u < next_n) prefetch_lines<kVBytes>(next.value(u) + b0);
      if (guard && st[u] == 0.0f) continue;
      const char* row = cur.value(u) + b0;
      const vf pb = splat(st[u]);
      if constexpr (kPermutedV<T>) {
        vf v[CV];
        widen_permuted<CV>(row, v);
        for (int c = 0; c < CV; ++c) acc[c] += pb * v[c];
      } else {
        for (int c = 0; c < CV; ++c) acc[c] += pb * load_as_float<T>(row, c * W);
      }
    }
    for (int c = 0; c < CV; ++c) store(it.acc + c0 + c * W, acc[c]);
  }
}

// Dense K/V: the item's chunks in order.
template <KvType T, int CV, bool kDot>
void decode_single_row(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, const uint32_t* q2,
                       int64_t j_begin, int64_t j_end, float* st) {
  const int64_t k_stride = kv.k_row * elem_size(T), v_stride = kv.v_row * elem_size(T);
  auto rows = [&](int64_t c0) {
    return DenseRows{static_cast<const char*>(kv.k) + c0 * k_stride, static_cast<const char*>(kv.v) + c0 * v_stride,
                     k_stride, v_stride};
  };
  for (int64_t c0 = j_begin; c0 < j_end; c0 += kDecodeChunk) {
    const int64_t nk = imin(kDecodeChunk, j_end - c0), next_n = imin(kDecodeChunk, j_end - c0 - nk);
    single_row_step<T, CV, kDot>(p, it, q2, rows(c0), rows(c0 + nk), nk, next_n, st);
  }
}

// A paged cache's single rows: steps that never cross a page (pages clipped to [j_begin, j_end)),
// a page's chunks head after head (the pool's memory order, as StepOrder's), each step's rows
// from its page's base.
template <KvType T, int CV, bool kDot, typename Q2>
void decode_single_row_paged(const DecodeParams& p, const DecodeKv* kvs, const DecodeItem* its, Q2 q2_of,
                             int64_t heads, int64_t j_begin, int64_t j_end, float* st) {
  const int64_t P = kvs[0].page_size;
  const StepOrder order{j_begin, j_end, P, heads, true};
  auto rows = [&](const StepOrder::Pos& s) {  // a step never crosses a page: its rows are evenly spaced
    const DecodeKv& kv = kvs[s.h];
    return DenseRows{row_address<T>(kv, false, s.c0), row_address<T>(kv, true, s.c0), kv.k_row * elem_size(T),
                     kv.v_row * elem_size(T)};
  };
  StepOrder::Pos s = order.first();
  DenseRows cur = rows(s);
  while (s.nk > 0) {
    const StepOrder::Pos s1 = order.next(s);
    const DenseRows next = s1.nk > 0 ? rows(s1) : cur;
    single_row_step<T, CV, kDot>(p, its[s.h], q2_of(s.h), cur, next, s.nk, s1.nk, st);
    s = s1, cur = next;
  }
}

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
// 20 % slower with K/V in the cache. Paired in one process (scripts/ab_kernels.sh -i avx512_bf16
// HEAD HEAD -- decode 8 4 8192 128 9 40 T bf16 16:0, Zen 4): paged / dense 1.06-1.10 on one
// thread, 1.10-1.12 on two, so most of the cost is a thread's, not the memory's. Tried and not
// kept (time ratios old / new, 16-token pages and dense): key rows prefetched 64 tokens ahead,
// not 16 (1.00 and 0.97-0.99); key rows also into L1 kL1Ahead on (1.02 and 0.97), or only the
// first two rows after each jump between blocks (0.99-1.00 and 0.98); chunk_rows with one
// division per chunk (1.00). perf (one thread): the extra time is in the pipelined P.V loop, at
// the widening of the key rows its inline scores load. A plain read loop in this order with
// arithmetic between the rows (scripts/paged_read_order.cpp) lost 11-15 % to memory order at 16
// rows ahead and nothing at 64; the kernel, whose values go a chunk ahead already, did not follow.
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
  // One query row per head, read in place, no variant on the scores: single_row_step. (Ev 64 or
  // 128 is a whole number of 32-element blocks, so permuted_v is kPermutedV<T> there.)
  // AVX2 (W 8): Ev 64 in one pass of 8 vectors, Ev 128 in two (single_row_step).
  constexpr bool kSingleRowBuild = (W == 16 || W == 8) && T != KvType::kInt8;
  bool single_row = kSingleRowBuild && it0.R == 1 && k_in_place && v_in_place && !modify &&
                    (W == 16 ? p.Evp == 4 * W || p.Evp == 8 * W : p.Evp == 8 * W || p.Evp == 16 * W) &&
                    permuted_v == kPermutedV<T>;
  for (int64_t h = 0; h < heads; ++h) single_row = single_row && its[h].mask[0] == nullptr;
  if constexpr (kSingleRowBuild) {
    if (single_row) {
      if (dot_k) {
        for (int64_t h = 0; h < heads; ++h) pack_query_pairs(its[h].q, 1, p.Ep, q2_of(h));
      }
      auto run = [&]<int CV, bool kDot>() {
        if (heads == 1 && kv0.pages == nullptr) {
          decode_single_row<T, CV, kDot>(p, kv0, it0, q2_of(0), j_begin, j_end, st);
        } else {
          decode_single_row_paged<T, CV, kDot>(p, kvs, its, q2_of, heads, j_begin, j_end, st);
        }
      };
      auto by_cv = [&]<bool kDot>() {
        if (W == 16 && p.Evp == 4 * W) {
          run.template operator()<4, kDot>();
        } else {
          run.template operator()<8, kDot>();
        }
      };
      if constexpr (kDotType) {
        if (dot_k) {
          by_cv.template operator()<true>();
        } else {
          by_cv.template operator()<false>();
        }
      } else {
        by_cv.template operator()<false>();
      }
      if constexpr (kPermutedV<T>) {
        for (int64_t h = 0; h < heads; ++h) unpermute_rows(its[h].acc, 1, p.Evp);
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
  // one's P.V (decode_pipeline.hpp); 16-bit rows widened to float32 only from E 128 (E 64
  // measured slower); bf16 queries on a bf16 cache (the dot unit) at every E (measured faster at
  // 64 and 128). AVX2: float32 rows from E 128 (kPipelinedBuild; E 64 measured slower).
  if constexpr (kPipelinedBuild<T>) {
    if (it0.R == kPipelinedRows && k_in_place && v_in_place &&
        (W == 8 ? p.Evp >= 128 : T == KvType::kFloat32 || dot_k || p.Evp >= 128)) {
      if (dot_k) {  // kchunk: unused by these rows
        if constexpr (kDotType) decode_pipelined<T, true>(p, kvs, its, order, modify, permuted_v, st, kchunk, q2_of);
      } else {
        decode_pipelined<T, false>(p, kvs, its, order, modify, permuted_v, st, kchunk, q2_of);
      }
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
    const Step sp{qt_of(s.h), q2_of(s.h), krows, vrows, kscales, vscales, vrows + nk, s.c0, nk, next_n,
                  s.c0 == j_begin && s.h == 0};
    decode_step<T>(p, kvs[s.h], its[s.h], x, sp);
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

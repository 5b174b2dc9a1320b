// The decode kernel's step loop with the next step's scores computed during this step's P.V
// (software pipelining), for four rows per kv head (GQA group 4 and one new token, the shape of
// Mistral-7B's and the issue-14 headline), keys and values read in place: float32 rows, 16-bit
// ones from E 128, and bf16 queries against a bf16 cache on the dot unit (decode_kernel.hpp's
// decode_split_t picks it). Included by decode_kernel.hpp, inside its per-ISA namespace.
//
// Why: in decode_step a step reads its chunk's keys (scores), then its values (P.V), and each
// phase computes while only its own stream is in flight. Decoding is bound by memory, but on
// AMD Zen 5 (H_q 32, H_kv 8, E 128, S 8192) its time was about its memory time plus its
// arithmetic: a thread computes a token of four rows in ~64-72 cycles with K/V in L2 and its
// kilobyte of float32 K/V takes ~160 cycles to arrive at a thread's share of the bandwidth, yet
// the two together took ~230. Here, after every `every` tokens of the P.V tiles, one key row of
// the next step (two on the bf16 dot unit) is scored (ScoreFeed), so the keys' and the values'
// streams are read together and one's arithmetic covers the other's misses.
//
// Measured alternating call by call with decode_step in one process (S 8192, rotating copies of
// K/V larger than the LLC, medians of 120 pairs, 2 threads), time ratios: float32 E 128 0.87-0.90,
// E 64 0.88-0.96, one thread E 128 0.91; bf16 and f16 K/V E 128 0.93 and 0.95 with their scores four
// tokens at a time (a query vector loaded once for four keys), but E 64 1.12 and 1.17 (left to
// decode_step). Other groups measured slower token by token (8 rows 1.09, 2 rows 1.03) and stay on
// decode_step.
// How a key row is scored (ScoreFeed::score): a call out of line costs a spill and reload of the
// P.V tile's 16 accumulators around it; inline, the tile's 16 and the score's 4 accumulators fit
// AVX-512's 32 registers. Inline and token by token, against four tokens per call, alternating in
// one process on Zen 5 (H_q 32, H_kv 8, E 128, S 8192, 2 threads, 40 pairs per run, ~300 runs, the
// host's read probe moving between ~40 and ~77 GB/s; most runs' medians): bf16 0.96-0.98 at a
// probe under 51 GB/s, 0.90-0.93 over 54; f16 0.93-0.96 and 0.83-0.86 (one thread, K/V in the
// LLC: bf16 0.79). Float32 inline against in a call (scripts/ab_kernels.sh -i avx512, Zen 5, K/V
// rotating among 4 copies, 30-40 pairs per layout, the probe read before each): E 128 2 threads
// 0.82-0.90 at a probe of 81-87 GB/s, where the call form reached only ~55 % of it, but 0.98-1.07
// (median 1.04) at 47-52 GB/s (the cause of that small loss is not found); E 64 0.88-0.99 and one thread
// 0.78-0.89 at ~48 GB/s; K/V in the LLC (S 1024, one copy) 0.73. So every cache type is scored
// inline on AVX-512. AVX2's 16 registers hold the P.V tile's 12 accumulators but not a score's
// beside them: its float32 rows are scored in a call (kScoreInline). Two float32 key rows per
// feed (a query vector loaded once for both) measured 1.02-1.06x slower inline, as it did in a
// call (0.89-0.94 in the LLC, 1.07-1.09 from memory). 16-bit E 64 with float32 queries stays
// on decode_step (pipelined and inline, 1.20-1.24x there with K/V in the LLC).
// The arithmetic and its order are decode_step's (dot_rows4 gives the bits scores_group does),
// so the results are the same bits (compared against decode_step's on 10 shapes, float32 and
// 16-bit, windows included; and byte for byte against the four-token form on 3264 decode calls).
// The cost: a second (R, kDecodeChunk) score buffer.
//
// bf16 queries against a bf16 cache (kDot; decode_bf16_dot.hpp) are scored on the dot unit two
// key rows per feed (dot_rows4_tokens_bf16<2>: each query block loaded once for both), inline.
// Alternating call by call with decode_step's dot path in one process on Zen 5 (S 8192, K/V
// rotating among copies larger than the LLC, medians of 40-80 rounds), time ratios: H 32/8 E 128
// 0.945-0.949 on 2 threads (a read probe of ~40 GB/s), 0.83 on one; E 64 0.90 and 0.92; with
// K/V in the LLC (S 2048, one copy) 1.00-1.02, one thread 1.04-1.05. Token by token (one key
// row per feed, its query blocks loaded for each) was 0.90-0.95 from memory but 1.13-1.22 in
// the LLC. Same bits as decode_step's (dot_rows4_tokens_bf16 and dot_scores_tokens4 add in one
// order): byte-identical outputs on 7 shapes, E 64-256, S 5-8191.
//
// Rows: kwin holds the row addresses of the next step's keys, then those of the step after it
// (the prefetch reads kPrefetchAhead rows ahead of the scoring across the two); vrows[v] the
// step's value rows, vrows[1 - v] the next step's (prefetched by the P.V tiles).
#pragma once

namespace attn::cpu::ATTN_SIMD_NS {

// The rows of an item this loop takes (decode_split_t tests it0.R against it): ScoreFeed scores
// them with dot_rows4 (dot_rows4_tokens_bf16<2> with kDot).
constexpr int64_t kPipelinedRows = 4;

// The builds and caches this loop serves: AVX-512's but int8 (dequantised keys), and AVX2's
// float32 from E 128 (its 16 registers hold a P.V tile's 12 accumulators, not a score's beside
// them, so its rows are scored in a call). AVX2 on AMD Zen 3
// (H_q 32, H_kv 8, S 8192, 2 threads, K/V from memory; `attn bench` alternating against the
// unpipelined binary, medians of 12-16 pairs; identical outputs), time ratios pipelined / not:
// E 128 0.85-0.95 (one thread, S 1024 rotating: 0.85-0.95; with K/V in the cache 1.01-1.20),
// E 256 0.83 (in the cache 0.73); E 64 1.01 from memory but 1.16-1.6 in the cache, so E 64 stays
// on decode_step.
template <KvType T>
constexpr bool kPipelinedBuild = (W == 16 && T != KvType::kInt8) || (W == 8 && T == KvType::kFloat32);

// Whether ScoreFeed scores a key row inline (AVX-512, and AVX2's 16-bit rows) or in a call
// (AVX2's float32 rows): see above.
template <KvType T>
constexpr bool kScoreInline = W == 16 || T != KvType::kFloat32;

// The next step's query rows as ScoreFeed reads them: float32 rows (q, Ep) for dot_rows4, or
// with kDot bf16 pairs (q2, words) for the bf16 dot unit (bf16 queries against a bf16 cache).
struct FeedQuery {
  const float* q;
  const uint32_t* q2;
};

// Scores the next step's key rows into st, one (two with kDot) every `every` calls; rest()
// scores those left when the P.V is done. The rows are the item's kPipelinedRows: dot_rows4, or
// with kDot dot_rows4_tokens_bf16<2> (the bits decode_step's dot_scores_tokens4 gives).
// Float32 stays one row per feed: two measured 1.07-1.09x slower from memory in a call (H 32/8,
// E 128, S 8192, 2 threads, a probe of ~40 GB/s; one thread 1.05-1.07), with the second row's
// prefetch issued with the first's or half a feed later, and 1.02-1.06x slower inline (above).
template <KvType T, bool kDot>
struct ScoreFeed {
  static_assert(kPipelinedRows == 4, "dot_rows4 scores four rows");
  FeedQuery q;  // the next step's head's rows
  int64_t Ep, E, words;
  const char* const* kr;  // n rows to score, then more (n_ahead in all) to prefetch
  int64_t n, n_ahead, k_bytes;
  float scale;
  float* st;
  int64_t every, countdown;
  int64_t t = 0;

  [[gnu::always_inline]] void score_here() {
    prefetch_key_ahead(kr, n_ahead, t, k_bytes);
    if constexpr (kDot) {
      // Two key rows per call (the query blocks loaded once for both); a last odd row is
      // scored twice, its second copy dropped.
      const bool two = t + 1 < n;
      prefetch_key_ahead(kr, n_ahead, t + 1, k_bytes);
      float d2[2][4];
      const void* const kt[2] = {kr[t], kr[two ? t + 1 : t]};
      dot_rows4_tokens_bf16<2>(q.q2, words, E, kt, d2);
      for (int r = 0; r < 4; ++r) st[r * kDecodeChunk + t] = d2[0][r] * scale;
      if (two) {
        for (int r = 0; r < 4; ++r) st[r * kDecodeChunk + t + 1] = d2[1][r] * scale;
      }
      t += two ? 2 : 1;
    } else {
      float d[4];
      dot_rows4<T>(q.q, Ep, kr[t], d);
      for (int r = 0; r < 4; ++r) st[r * kDecodeChunk + t] = d[r] * scale;
      ++t;
    }
  }
  [[gnu::noinline]] void score_call() { score_here(); }
  [[gnu::always_inline]] void score() {
    if constexpr (kScoreInline<T>) {
      score_here();
    } else {
      score_call();
    }
  }
  [[gnu::always_inline]] void operator()() {
    if (--countdown == 0) {
      countdown = every;
      if (t < n) score();
    }
  }
  void rest() {
    while (t < n) score();
  }
};

// The item's steps in `order`, pipelined. st_a and st_b: two (R, kDecodeChunk) score buffers.
// With kDot the queries are bf16: q2_of(h) is head h's rows as pairs (q_words(Ep) per row).
template <KvType T, bool kDot, typename Q2>
void decode_pipelined(const DecodeParams& p, const DecodeKv* kvs, const DecodeItem* its, const StepOrder& order,
                      bool modify, bool permuted_v, float* st_a, float* st_b, Q2 q2_of) {
  const char* kwin[2 * kDecodeChunk];
  const char* vrows[2][kDecodeChunk];
  float no_scales[kDecodeChunk];  // chunk_rows leaves them alone for float caches
  constexpr int64_t R = kPipelinedRows;
  const int64_t k_bytes = p.E * elem_size(T), v_bytes = p.Ev * elem_size(T);
  const int64_t tiles = permuted_v ? pv_permuted_tile_count(R, p.Evp) : pv_tile_count<T>(R, p.Evp);
  const int64_t words = q_words(p.Ep);
  auto keys = [&](const StepOrder::Pos& s, const char** out) {
    if (s.nk > 0) chunk_rows<T>(kvs[s.h], false, s.c0, s.nk, out, no_scales);
  };
  auto values = [&](const StepOrder::Pos& s, const char** out) {
    if (s.nk > 0) chunk_rows<T>(kvs[s.h], true, s.c0, s.nk, out, no_scales);
  };

  // The first step's scores, as decode_step scores a first step (its values prefetched too).
  StepOrder::Pos s = order.first(), s1 = order.next(s);
  keys(s, kwin);
  keys(s1, kwin + s.nk);
  values(s, vrows[0]);
  float* cur = st_a;
  float* nxt = st_b;
  for (int64_t u = 0; u < s.nk; ++u) {
    prefetch_token(kwin, s.nk + s1.nk, u, k_bytes, vrows[0][u], v_bytes);
    if constexpr (kDot) {
      dot_scores_token(q2_of(s.h), words, R, p.E, kwin[u], p.scale_log2, cur + u);
    } else {
      scores_token<T>(its[s.h].q, R, p.Ep, kwin[u], p.scale_log2, cur + u);
    }
  }
  finish_scores<T>(p, kvs[s.h], its[s.h], modify, nullptr, s.c0, s.nk, cur);
  std::copy_n(kwin + s.nk, s1.nk, kwin);
  StepOrder::Pos s2 = order.next(s1);
  keys(s2, kwin + s1.nk);
  values(s1, vrows[1]);

  for (int v = 0;; v = 1 - v) {
    // Step s: its P.V, the scores of s1 fed in between its tokens.
    const FeedQuery fq{its[s1.h].q, kDot ? q2_of(s1.h) : nullptr};
    ScoreFeed<T, kDot> feed{fq, p.Ep, p.E, words, kwin, s1.nk, s1.nk + s2.nk, k_bytes, p.scale_log2, nxt, 1, 1};
    // The hook runs s.nk * tiles times; with kDot each feed scores two rows.
    if (s1.nk > 0) feed.every = feed.countdown = std::max<int64_t>(1, (kDot ? 2 : 1) * s.nk * tiles / s1.nk);
    PvOrder v_order;
    const PvPrefetch pf = plan_value_prefetch(v_order, vrows[1 - v], s1.nk, v_bytes, s.nk, tiles, kPvInOrder && !permuted_v);
    const auto* vr = reinterpret_cast<const void* const*>(vrows[v]);
    if (permuted_v) {
      pv_chunk_permuted(cur, vr, s.nk, R, p.Evp, its[s.h].acc, pf, feed);
    } else {
      pv_chunk<T>(cur, vr, s.nk, R, p.Evp, its[s.h].acc, pf, feed);
    }
    feed.rest();
    if (s1.nk == 0) break;
    finish_scores<T>(p, kvs[s1.h], its[s1.h], modify, nullptr, s1.c0, s1.nk, nxt);
    std::swap(cur, nxt);
    s = s1, s1 = s2;
    std::copy_n(kwin + s.nk, s1.nk, kwin);
    s2 = s1.nk > 0 ? order.next(s1) : s1;
    keys(s2, kwin + s1.nk);
    values(s1, vrows[v]);  // the buffer step s read
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

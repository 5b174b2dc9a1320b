// The decode kernel's step loop with the next step's scores computed during this step's P.V
// (software pipelining), for four rows per kv head (GQA group 4 and one new token, the shape of
// Mistral-7B's and the issue-14 headline), keys and values read in place: float32 rows, and 16-bit
// ones from E 128 (decode_kernel.hpp's decode_split_t picks it). Included by decode_kernel.hpp,
// inside its per-ISA namespace.
//
// Why: in decode_step a step reads its chunk's keys (scores), then its values (P.V), and each
// phase computes while only its own stream is in flight. Decoding is bound by memory, but on
// AMD Zen 5 (H_q 32, H_kv 8, E 128, S 8192) its time was about its memory time plus its
// arithmetic: a thread computes a token of four rows in ~64-72 cycles with K/V in L2 and its
// kilobyte of float32 K/V takes ~160 cycles to arrive at a thread's share of the bandwidth, yet
// the two together took ~230. Here, after every `every` tokens of the P.V tiles, one key row of
// the next step is scored (ScoreFeed), so the keys' and the values' streams are read together
// and one's arithmetic covers the other's misses.
//
// Measured alternating call by call with decode_step in one process (S 8192, rotating copies of
// K/V larger than the LLC, medians of 120 pairs, 2 threads), time ratios: float32 E 128 0.87-0.90,
// E 64 0.88-0.96, one thread E 128 0.91; bf16 and f16 K/V E 128 0.93 and 0.95 with their scores four
// tokens at a time (score4: a query vector loaded once for four keys; token by token they were
// 1.2x slower, the 16-bit rows' arithmetic being twice float32's per byte), but E 64 1.12 and 1.17
// (left to decode_step). Other groups measured slower token by token (8 rows 1.09, 2 rows 1.03) and
// stay on decode_step. score() and score4() are kept out of line: inlined into the P.V tiles,
// float32 E 128 measured 0.96 (in other runs than the figures above).
// The arithmetic and its order are decode_step's (scores_token gives the bits scores_tokens4
// does), so the results are the same bits (compared against decode_step's on 10 shapes, float32
// and 16-bit, windows included). The cost: a second (R, kDecodeChunk) score buffer.
//
// Rows: kwin holds the row addresses of the next step's keys, then those of the step after it
// (the prefetch reads kPrefetchAhead rows ahead of the scoring across the two); vrows[v] the
// step's value rows, vrows[1 - v] the next step's (prefetched by the P.V tiles).
#pragma once

namespace attn::cpu::ATTN_SIMD_NS {

// Scores the next step's key rows into st, one (or with by4 four) every `every` calls; rest()
// scores those left when the P.V is done.
template <KvType T>
struct ScoreFeed {
  const float* q;  // (R, Ep) the next step's head's query rows
  int64_t R, Ep;
  const char* const* kr;  // n rows to score, then more (n_ahead in all) to prefetch
  int64_t n, n_ahead, k_bytes;
  float scale;
  float* st;
  int64_t every, countdown;
  bool by4 = false;
  int64_t t = 0;

  [[gnu::noinline]] void score() {
    prefetch_key_ahead(kr, n_ahead, t, k_bytes);
    scores_token<T>(q, R, Ep, kr[t], scale, st + t);
    ++t;
  }
  // Four key rows at once (a query vector loaded once for the four): scores_tokens4.
  [[gnu::noinline]] void score4() {
    for (int64_t i = 0; i < 4; ++i) prefetch_key_ahead(kr, n_ahead, t + i, k_bytes);
    const float s4[4] = {scale, scale, scale, scale};
    scores_tokens4<T>(q, R, Ep, reinterpret_cast<const void* const*>(kr + t), s4, st + t);
    t += 4;
  }
  [[gnu::always_inline]] void operator()() {
    if (--countdown == 0) {
      countdown = every;
      if (by4 && t + 4 <= n) {
        score4();
      } else if (t < n) {
        score();
      }
    }
  }
  void rest() {
    while (by4 && t + 4 <= n) score4();
    while (t < n) score();
  }
};

// The item's steps in `order`, pipelined. st_a and st_b: two (R, kDecodeChunk) score buffers.
template <KvType T>
void decode_pipelined(const DecodeParams& p, const DecodeKv* kvs, const DecodeItem* its, const StepOrder& order,
                      bool modify, bool permuted_v, float* st_a, float* st_b) {
  const char* kwin[2 * kDecodeChunk];
  const char* vrows[2][kDecodeChunk];
  float no_scales[kDecodeChunk];  // chunk_rows leaves them alone for float caches
  const int64_t R = its[0].R, k_bytes = p.E * elem_size(T), v_bytes = p.Ev * elem_size(T);
  const int64_t tiles = pv_tile_count<T>(R, p.Evp);
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
    scores_token<T>(its[s.h].q, R, p.Ep, kwin[u], p.scale_log2, cur + u);
  }
  finish_scores<T>(p, kvs[s.h], its[s.h], modify, nullptr, s.c0, s.nk, cur);
  std::copy_n(kwin + s.nk, s1.nk, kwin);
  StepOrder::Pos s2 = order.next(s1);
  keys(s2, kwin + s1.nk);
  values(s1, vrows[1]);

  for (int v = 0;; v = 1 - v) {
    // Step s: its P.V, the scores of s1 fed in between its tokens.
    ScoreFeed<T> feed{its[s1.h].q, R, p.Ep, kwin, s1.nk, s1.nk + s2.nk, k_bytes, p.scale_log2, nxt, 1, 1};
    feed.by4 = T != KvType::kFloat32;
    if (s1.nk > 0) feed.every = feed.countdown = std::max<int64_t>(1, s.nk * tiles / (feed.by4 ? (s1.nk + 3) / 4 : s1.nk));
    const PvPrefetch pf{vrows[1 - v], s1.nk, true};
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

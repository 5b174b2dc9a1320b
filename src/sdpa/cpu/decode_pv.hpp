// The split-KV decode kernel's P.V (decode_kernel.hpp): acc (R, Evp) += P (R, nk) . V (nk, Evp)
// over a chunk's value rows, read in place (widened in registers) through their addresses.
// Tiling: register tiles of RT = 4, 2 or 1 rows x CV vectors of Ev (by_row_tiles, by_col_tiles),
// the tile's accumulators in registers over the chunk's tokens, so each value vector loaded
// feeds RT rows and acc is read and written once per chunk. Memory: the chunk's value rows once
// per column tile (from L1 after the first), the next step's rows prefetched as the tiles go
// (PvPrefetch). A hook runs after each token of each tile: the pipelined loop's next scores
// (decode_pipeline.hpp). Included by decode_kernel.hpp inside its per-ISA namespace.
#pragma once

namespace attn::cpu::ATTN_SIMD_NS {

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
//
// AVX2 builds (kPvInOrder) prefetch the next chunk's values in memory order instead, row after row
// and line after line, spread evenly over every step of every tile (PvOrder): on AMD Zen 3 the
// tile order (the same few lines of each of the chunk's rows, then the next few) left the values
// late. A stand-alone loop of the kernel's shape (scripts/decode_overlap.cpp: float32, 4 rows,
// E 128, one thread, 2 MiB pages) ran in 5.8-6.2 ms on the real keys with stand-in values,
// 9.2-9.9 on the real values as well, against 5.0 to read the same bytes alone; with the values
// in memory order, 6.4-6.7 against 8.7-8.8. The kernel, scripts/ab_kernels.sh (4 link layouts,
// identical outputs), 4 rows (the pipelined loop), time ratios old / new: from memory (H_kv 8,
// S 8192, 2 threads) E 128 1.24, E 64 1.13; one thread 1.33; 8 rows (decode_step) 1.07; S 2048
// x 2 copies (about the LLC) 1.13; but with K/V in the cache 0.86 (S 1024: in L3) and 0.85 (L2):
// the schedule's bookkeeping in the tile loop, not the prefetches (0.85 with them removed).
// Decoding reads each layer's cache once per token, from memory. AVX-512 builds keep the tile
// order: a float32 row of E 128 is two tiles there (four on AVX2), and on AMD Zen 5 (the same
// ab_kernels.sh runs, -i avx512, 2 threads from memory, read probe ~46 GB/s) memory order
// measured 0.98-1.04 at 4 rows E 128 (1.01 between two identical builds), 1.03-1.08 on one
// thread, 1.05-1.07 at 8 rows: within the noise where decoding runs.
struct PvOrder;
struct PvPrefetch {
  const char* const* rows = nullptr;
  int64_t n = 0;
  bool l1 = false;
  PvOrder* order = nullptr;  // set: the next chunk's rows in memory order, not tile by tile
};
constexpr int64_t kL1Ahead = 4;  // tokens; 8 measured the same
constexpr bool kPvInOrder = W == 8;

// The next chunk's value rows (n rows of `row_lines` lines) as a list of line addresses in memory
// order, for pv_tile to prefetch evenly over `steps` tile steps: q lines per step and one more on
// rem of them (Bresenham), so the last step issues the last line. Even matters: two lines per step
// (done two thirds of the way through the P.V at E 128) was 1.21x slower from memory
// (ab_kernels.sh, H_kv 8, S 8192, 2 threads), memory idle in the last third.
struct PvOrder {
  static constexpr int64_t kMaxLines = 1024;  // a chunk of float32 rows up to E 256
  const char* line[kMaxLines];
  int64_t total = 0, steps = 1, q = 0, rem = 0;
  int64_t i = 0, err = 0;  // the next line, the Bresenham error term
};

// The prefetch of the next chunk's value rows (n rows of row_bytes at `rows`) for the P.V of this
// chunk's nk tokens in `tiles` tiles: in memory order through `order` where `in_order`, the
// tiles are more than one (one tile's order is memory order already: the list only costs time,
// 0.93-0.95x in an AVX-512 build given it, Zen 5, E 64, 4 rows) and the list can hold the rows;
// else tile by tile.
inline PvPrefetch plan_value_prefetch(PvOrder& order, const char* const* rows, int64_t n, int64_t row_bytes,
                                      int64_t nk, int64_t tiles, bool in_order) {
  const PvPrefetch by_tiles{rows, n, true, nullptr};
  const int64_t row_lines = (row_bytes + 63) / 64;
  if (!in_order || tiles < 2 || n * row_lines > PvOrder::kMaxLines) return by_tiles;
  order.steps = nk * tiles > 0 ? nk * tiles : 1;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t l = 0; l < row_lines; ++l) order.line[order.total++] = rows[r] + 64 * l;
  }
  order.q = order.total / order.steps, order.rem = order.total % order.steps;
  return PvPrefetch{rows, n, true, &order};
}

// The P.V prefetches a row tile starting at r0 makes: the next chunk's rows tile by tile only by
// the first; in memory order by every tile (each tile step takes PvOrder's next lines).
inline PvPrefetch for_row_tile(const PvPrefetch& pf, int64_t r0) {
  return r0 == 0 ? pf : PvPrefetch{nullptr, 0, pf.l1, pf.order};
}

// What the P.V tiles call after each token: nothing, or another computation to interleave with
// them (the pipelined loop's ScoreFeed, decode_pipeline.hpp).
struct NoHook {
  void operator()() const {}
};

// acc[r][c0 : c0 + CV*W] += sum_u P[r][u] * v_u[c0 : ...] for RT rows from r0, the tile in
// registers over the chunk's tokens. With kGuard a zero weight is skipped, never multiplied.
// No zero-trip path in the loop (nk = 0 returns first): as in the backward's rank_tile
// (flash_bwd_kernel.hpp), GCC otherwise moved the AVX2 tile's accumulators through the stack.
template <KvType T, int RT, int CV, bool kGuard, typename Hook = const NoHook>
inline void pv_tile(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t c0,
                    int64_t Evp, float* acc, PvPrefetch pf, Hook& hook = NoHook{}) {
  if (nk <= 0) return;
  vf a[RT][CV];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) a[r][c] = load(acc + (r0 + r) * Evp + c0 + c * W);
  }
  auto token = [&](int64_t u) __attribute__((always_inline)) {  // ([[gnu::]] here: clang ignores it)
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
  };
  int64_t u = 0;
  if (pf.order != nullptr) {
    // PvOrder's lines for this tile's steps. Its `steps` counts every tile step of the chunk
    // (pv_tile_count), so i ends at total with the last one and never passes it.
    PvOrder& o = *pf.order;
    int64_t i = o.i, err = o.err;  // locals, so that they can live in registers
    const int64_t q = o.q, rem = o.rem, steps = o.steps;
    do {
      token(u);
      for (int64_t k = 0; k < q; ++k) __builtin_prefetch(o.line[i++], 0, kPrefetchLocality);
      err += rem;
      if (err >= steps) {
        err -= steps;
        __builtin_prefetch(o.line[i++], 0, kPrefetchLocality);
      }
    } while (++u < nk);
    o.i = i, o.err = err;
  } else {
    do {
      if (u < pf.n) prefetch_lines<CV * W * elem_size(T)>(pf.rows[u] + c0 * elem_size(T));
      token(u);
    } while (++u < nk);
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

// tile.template operator()<CV>(c0, l1) for the column tiles of CV vectors that cover [0, Evp) for
// RT rows, l1: whether the tile makes PvPrefetch's L1 prefetches.
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
template <KvType T, int RT, typename Tile>
[[gnu::always_inline]] inline void by_col_tiles(int64_t Evp, Tile&& tile) {
  int64_t c0 = 0;
  if constexpr (RT == 1 && W >= 16 && T != KvType::kInt8) {
    for (; c0 + 8 * W <= Evp; c0 += 8 * W) tile.template operator()<8>(c0, false);
  }
  // The rest as the prefill kernel cuts its P.V (4 x 4 tiles, AVX2's 4 x 3, then 2 and 1).
  for_col_chunks(c0, Evp, [&]<int CV>(int64_t c) { tile.template operator()<CV>(c, true); });
}

template <KvType T, int RT, bool kGuard, typename Hook>
inline void pv_cols(const float* st, const void* const* vrows, int64_t nk, int64_t r0, int64_t Evp,
                    float* acc, PvPrefetch pf, Hook& hook) {
  by_col_tiles<T, RT>(Evp, [&]<int CV>(int64_t c0, bool l1) {
    pv_tile<T, RT, CV, kGuard>(st, vrows, nk, r0, c0, Evp, acc, PvPrefetch{pf.rows, pf.n, pf.l1 && l1, pf.order}, hook);
  });
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

// The tiles pv_chunk runs over its tokens (each token of the chunk once per tile): the rows'
// tiles times their column tiles, as by_row_tiles and by_col_tiles cut them.
template <KvType T>
inline int64_t pv_tile_count(int64_t R, int64_t Evp) {
  int64_t n = 0;
  by_row_tiles(R, [&]<int RT>(int64_t) { by_col_tiles<T, RT>(Evp, [&]<int CV>(int64_t, bool) { ++n; }); });
  return n;
}

}  // namespace attn::cpu::ATTN_SIMD_NS

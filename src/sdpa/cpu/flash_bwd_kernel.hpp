// Fused attention backward for one query head over one key range (FlashAttention-2's backward
// on a CPU); the driver (flash_bwd.cpp) picks the ranges (flash_bwd_split.hpp) and sums their dQ.
//
// Included after flash_kernel.hpp by the per-ISA files (same W, vf, scores_block, mask_block,
// exp2v). Given the forward's output O and LSE, and dO:
//   D_i  = rowsum(dO_i * O_i)                         once per head
//   for each key block (kBK keys) of the range, for each query block (kBQ queries) that sees it:
//     S^T  = K_blk Q_blk^T           (kBK, kBQ)   scores_block, as the forward
//     P^T  = exp2(S^T * scale log2 e - lse2)        lse2 = the forward's LSE in base 2
//     dP^T = V_blk dO_blk^T          (kBK, kBQ)   scores_block again, with dO^T for Q^T
//     dV_blk += P_d^T dO_blk,  dS^T = P^T (dP^T - D) scale
//     dK_blk += dS^T Q_blk,    dQ_blk += dS K_blk
// Five products per (key, query) pair, counted as FlashAttention does (2.5x the forward).
// Keys are the outer loop (groups of kKeyGroup blocks), so dK and dV of a group stay in a small
// accumulator and are written once; dQ is accumulated across the range's key groups in a
// per-head buffer and written whole (L rows: the range's partial dQ). Nothing L x S is stored
// unless the mask's gradient is asked for (h.dmask: each visible dS, before scale and tanh's
// chain, written once into the head's (L, S) rows, 4 bytes per score): the only O(L) state per
// head is Q^T and dO^T packed by query block, dQ's accumulator, lse2 and D (plus padded row
// copies of Q and dO when E or Ev is not a multiple of W), rebuilt for each range.
//
// The rank updates (dV, dK, dQ) run in register tiles of kRT rows x CV vectors: per reduction
// step CV loads of a B row, kRT broadcasts of A and kRT*CV FMAs, like the forward's P @ V.
//
// Determinism: one thread runs a whole (head, key range) in a fixed order, and the ranges depend
// only on the problem, so the sums are the same for any thread count. A range starts on a key
// group boundary, so each key row's dK, dV are the same bits however the keys are split.
// Numerics as the forward: dS is exactly 0 where P is 0 (masked keys, fully masked rows), and
// with guard (a non-finite input) a zero A never multiplies a B row, so NaN/Inf at excluded
// positions never reach a gradient.
#include <cstring>

#include "sdpa/cpu/flash_bwd_split.hpp"

namespace attn::cpu::ATTN_SIMD_NS {

inline int64_t round_up(int64_t x) { return (x + W - 1) / W * W; }

// Key blocks per pass over the queries: each pass streams the head's packed Q^T, dO^T, Q, dO
// and dQ rows once (5 L x E floats, far beyond L2 at long L), so a group of 4 key blocks cuts
// that traffic 4x while the group's dK, dV accumulators (4 x 64 rows) stay in L2.
constexpr int64_t kKeyGroup = 4;
constexpr int64_t kBwdEChunk = 64;
// The driver splits keys on these boundaries without seeing this ISA namespace.
static_assert(kKeyGroup * kBK == kFlashBwdKeyGroup);

inline int64_t backward_workspace_floats(int64_t L, int64_t E, int64_t Ev) {
  const int64_t lp = (L + kBQ - 1) / kBQ * kBQ, ep = round_up(E), evp = round_up(Ev);
  return lp * (E + Ev)              // Q^T, dO^T packed per query block
         + lp * ep                  // dQ accumulator
         + 2 * lp                   // lse2, D
         + (E % W ? lp * ep : 0)    // padded Q rows
         + (Ev % W ? lp * evp : 0)  // padded dO rows
         + 4 * kBK * kBQ            // S^T / P^T / dS^T, dP^T, P_d^T, softcap's derivative
         + kKeyGroup * kBK * (ep + evp)  // dK, dV accumulators of a key group
         + kKeyGroup * kBK * ep;         // padded K rows
}

// out[r][c] += sum_{t < T} A(r, t) * b[t][c] for r in [0, R), c in [0, n) (n a multiple of W),
// A(r, t) = a[r * a_r + t * a_t]. With kGuard a zero A(r, t) skips row t of b.
// The loop has no zero-trip path (T = 0 returns first): with one, GCC 12 carried the AVX2
// tile's 12 accumulators around the loop through the stack, 12 stores, 12 loads and 12 moves per
// tile of 16 steps. Without: Zen 3, `attn bench --backward`, L 1024, H 4, one thread, 7 rounds
// alternating the binaries, time ratios old / new 1.035 (E 64), 1.053 (E 128), 1.043 and 1.008
// causal; the same bits.
template <int RT, int CV, bool kGuard>
inline void rank_tile(const float* a, int64_t a_r, int64_t a_t, const float* b, int64_t ldb,
                      int64_t T, float* out, int64_t ldo) {
  if (T <= 0) return;
  vf acc[RT][CV];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) acc[r][c] = load(out + r * ldo + c * W);
  }
  int64_t t = 0;
  do {
    vf bt[CV];
    for (int c = 0; c < CV; ++c) bt[c] = load(b + t * ldb + c * W);
    for (int r = 0; r < RT; ++r) {
      const float x = a[r * a_r + t * a_t];
      if constexpr (kGuard) {
        if (x == 0.0f) continue;
      }
      const vf xb = splat(x);
      for (int c = 0; c < CV; ++c) acc[r][c] += xb * bt[c];
    }
  } while (++t < T);
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) store(out + r * ldo + c * W, acc[r][c]);
  }
}

template <int RT, bool kGuard>
inline void rank_rows(const float* a, int64_t a_r, int64_t a_t, const float* b, int64_t ldb,
                      int64_t T, int64_t n, float* out, int64_t ldo) {
  for_col_chunks(0, n, [&]<int CV>(int64_t c) { rank_tile<RT, CV, kGuard>(a, a_r, a_t, b + c, ldb, T, out + c, ldo); });
}

// out (R x n) += A (R x T) @ b (T x n): rows in tiles of 4, then one at a time.
template <bool kGuard>
inline void rank_update(const float* a, int64_t a_r, int64_t a_t, const float* b, int64_t ldb,
                        int64_t T, int64_t R, int64_t n, float* out, int64_t ldo) {
  constexpr int kRT = 4;
  const int64_t tiled = R / kRT * kRT;
  for (int64_t r = 0; r < tiled; r += kRT) {
    rank_rows<kRT, kGuard>(a + r * a_r, a_r, a_t, b, ldb, T, n, out + r * ldo, ldo);
  }
  for (int64_t r = tiled; r < R; ++r) rank_rows<1, kGuard>(a + r * a_r, a_r, a_t, b, ldb, T, n, out + r * ldo, ldo);
}

// Rows [0, n) of src (row stride ld, `cols` valid columns) as (n, width) rows padded with zeros.
inline void pack_rows(const float* src, int64_t ld, int64_t n, int64_t cols, int64_t width, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(dst + r * width, src + r * ld, static_cast<size_t>(cols) * sizeof(float));
    zero(dst + r * width + cols, width - cols);
  }
}

// X^T of every query block: block qb holds (cols, kBQ) with lane q = row qb * kBQ + q (zero
// beyond L), the layout scores_block reads as its "Q^T".
inline void pack_transposed(const float* src, int64_t ld, int64_t L, int64_t cols, float* dst) {
  for (int64_t i0 = 0; i0 < L; i0 += kBQ) {
    float* blk = dst + i0 * cols;
    pack_block_transposed(src + i0 * ld, ld, imin(kBQ, L - i0), cols, blk);
  }
}

// dP^T of dropped weights is 0 (their P_d does not depend on P); kept ones scale by 1/(1-p).
inline void dropout_grad_block(const FlashParams& p, const FlashBlock& b, int64_t j0, int64_t nk, float* dpt) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t q = 0; q < b.nq; ++q) {
      float& x = dpt[jj * kBQ + q];
      x = dropout_keep(p, b.bh, b.i0 + q, j0 + jj) ? x * inv_keep : 0.0f;
    }
  }
}

template <bool kGuard>
inline void backward_head_impl(const FlashBwdParams& p, const FlashBwdHead& h, float* ws) {
  const int64_t L = p.L, E = p.E, Ev = p.Ev;
  const auto* hq = static_cast<const float*>(h.q);
  const auto* hk = static_cast<const float*>(h.k);
  const auto* hv = static_cast<const float*>(h.v);
  const auto* ho = static_cast<const float*>(h.o);
  const auto* hdout = static_cast<const float*>(h.dout);
  const int64_t lp = (L + kBQ - 1) / kBQ * kBQ, ep = round_up(E), evp = round_up(Ev);
  float* qt = ws;                    // lp * E
  float* dot = qt + lp * E;          // lp * Ev
  float* dq = dot + lp * Ev;         // lp * ep
  float* lse2 = dq + lp * ep;        // lp
  float* dd = lse2 + lp;             // lp
  float* tail = dd + lp;
  const float* qrows = hq;
  int64_t q_ld = p.q_row;
  if (E % W != 0) {
    pack_rows(hq, p.q_row, L, E, ep, tail);
    qrows = tail, q_ld = ep, tail += lp * ep;
  }
  const float* dorows = hdout;
  int64_t do_ld = h.do_row;
  if (Ev % W != 0) {
    pack_rows(hdout, h.do_row, L, Ev, evp, tail);
    dorows = tail, do_ld = evp, tail += lp * evp;
  }
  float* st = tail;                  // kBK * kBQ: S^T, then P^T, then dS^T
  float* dpt = st + kBK * kBQ;       // dP^T
  float* pdt = dpt + kBK * kBQ;      // P_d^T (dropout only)
  float* capg = pdt + kBK * kBQ;     // d(capped)/d(score) (softcap only)
  float* dkb = capg + kBK * kBQ;             // kKeyGroup * kBK * ep
  float* dvb = dkb + kKeyGroup * kBK * ep;   // kKeyGroup * kBK * evp
  float* kpack = dvb + kKeyGroup * kBK * evp;  // kKeyGroup * kBK * ep

  pack_transposed(hq, p.q_row, L, E, qt);
  pack_transposed(hdout, h.do_row, L, Ev, dot);
  zero(dq, lp * ep);
  for (int64_t i = 0; i < lp; ++i) {
    if (i >= L) {
      lse2[i] = std::numeric_limits<float>::infinity();  // padding lanes: P = 0
      dd[i] = 0.0f;
      continue;
    }
    const float l = h.lse[i];
    lse2[i] = l == kNegInf ? std::numeric_limits<float>::infinity()
                           : static_cast<float>(static_cast<double>(l) * std::numbers::log2e);
    float d = 0.0f;
    for (int64_t e = 0; e < Ev; ++e) d += hdout[i * h.do_row + e] * ho[i * h.o_row + e];
    dd[i] = d;
  }

  const float scale = p.scale;
  constexpr int64_t kGK = kKeyGroup * kBK;
  for (int64_t g0 = h.j_begin; g0 < h.j_end; g0 += kGK) {
    const int64_t ng = imin(kGK, h.j_end - g0);
    // Causal: query i sees key j iff j <= i + offset, so the group is seen from row g0 - offset;
    // a window's left side: iff j >= i + lo_offset, so up to row g0 + ng - 1 - lo_offset.
    int64_t i_first = 0, i_end = L;
    if (p.causal) {
      i_first = g0 - p.causal_offset;
      if (i_first >= L) break;  // later keys are hidden from every query
      if (i_first < 0) i_first = 0;
      i_first = i_first / kBQ * kBQ;
    }
    if (p.band_lo) i_end = imin(L, g0 + ng - p.lo_offset);
    if (i_end <= i_first) continue;  // the band misses this group
    zero(dkb, kGK * ep);
    zero(dvb, kGK * evp);
    const float* krows = hk + g0 * p.k_row;
    int64_t k_ld = p.k_row;
    if (E % W != 0) {
      pack_rows(krows, p.k_row, ng, E, ep, kpack);
      krows = kpack, k_ld = ep;
    }
    for (int64_t i0 = i_first; i0 < i_end; i0 += kBQ) {
      FlashBlock b{};
      b.i0 = i0;
      b.nq = imin(kBQ, L - i0);
      b.bh = h.bh;
      b.alibi2 = h.alibi2;
      if (h.mask != nullptr) b.mask = h.mask + i0 * p.mask_row;
      const float* qtb = qt + i0 * E;
      const float* dotb = dot + i0 * Ev;
      const vf l0 = load(lse2 + i0), l1 = load(lse2 + i0 + W);
      const vf d0 = load(dd + i0), d1 = load(dd + i0 + W);
      for (int64_t j0 = g0; j0 < g0 + ng; j0 += kBK) {
        if (p.causal && j0 > i0 + b.nq - 1 + p.causal_offset) break;  // hidden from the block
        int64_t nk = imin(kBK, g0 + ng - j0);
        const int64_t kk = j0 - g0;
        // Keys past the block's last visible one are hidden from all its rows: on the diagonal a
        // 64-key block seen by 32 queries is half such keys (3 % of a causal backward at L = 1024).
        if (p.causal) nk = imin(nk, i0 + b.nq + p.causal_offset - j0);
        if (p.band_lo && j0 + nk - 1 < i0 + p.lo_offset) continue;  // below the block's band

        scores_block(qtb, hk, p.k_row, E, j0, nk, p.scale_log2, st, kBwdEChunk);
        modify_block(p, b, j0, nk, st, p.softcap2 > 0.0f ? capg : nullptr);
        mask_block(p, b, j0, nk, st);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const vf x0 = load(st + jj * kBQ) - l0, x1 = load(st + jj * kBQ + W) - l1;
          store(st + jj * kBQ, exp2v(x0 > 0.0f ? splat(0.0f) : x0));
          store(st + jj * kBQ + W, exp2v(x1 > 0.0f ? splat(0.0f) : x1));
        }
        scores_block(dotb, hv, p.v_row, Ev, j0, nk, 1.0f, dpt, kBwdEChunk);
        const float* pd = st;
        if (p.dropout_p > 0.0f) {
          std::memcpy(pdt, st, static_cast<size_t>(nk * kBQ) * sizeof(float));
          dropout_block(p, b, j0, nk, pdt);
          dropout_grad_block(p, b, j0, nk, dpt);
          pd = pdt;
        }
        // dV_blk (nk x Ev) += P_d^T (nk x nq) @ dO rows (nq x Ev)
        rank_update<kGuard>(pd, kBQ, 1, dorows + i0 * do_ld, do_ld, b.nq, nk, evp, dvb + kk * evp, evp);
        for (int64_t jj = 0; jj < nk; ++jj) {
          for (int hh = 0; hh < 2; ++hh) {
            const vf pv = load(st + jj * kBQ + hh * W), dp = load(dpt + jj * kBQ + hh * W);
            vf ds = pv * (dp - (hh == 0 ? d0 : d1));
            if (h.dmask != nullptr) store(dpt + jj * kBQ + hh * W, pv == 0.0f ? splat(0.0f) : ds);
            ds *= scale;
            if (p.softcap2 > 0.0f) ds *= load(capg + jj * kBQ + hh * W);
            store(st + jj * kBQ + hh * W, pv == 0.0f ? splat(0.0f) : ds);
          }
        }
        // The mask's gradient is dS of the final scores (before scale and tanh's chain), stored
        // over dP^T, which is spent: transposed into the head's rows, each element written once.
        if (h.dmask != nullptr) {
          for (int64_t q = 0; q < b.nq; ++q) {
            float* row = h.dmask + (i0 + q) * p.S + j0;
            for (int64_t jj = 0; jj < nk; ++jj) row[jj] = dpt[jj * kBQ + q];
          }
        }
        // dK_blk (nk x E) += dS^T (nk x nq) @ Q rows (nq x E)
        rank_update<kGuard>(st, kBQ, 1, qrows + i0 * q_ld, q_ld, b.nq, nk, ep, dkb + kk * ep, ep);
        // dQ rows (kBQ x E) += dS (kBQ x nk) @ K rows (nk x E)
        rank_update<kGuard>(st, 1, kBQ, krows + kk * k_ld, k_ld, nk, kBQ, ep, dq + i0 * ep, ep);
      }
    }
    for (int64_t jj = 0; jj < ng; ++jj) {
      float* dk = h.dk + (g0 + jj) * E;
      float* dv = h.dv + (g0 + jj) * Ev;
      for (int64_t e = 0; e < E; ++e) dk[e] += dkb[jj * ep + e];
      for (int64_t e = 0; e < Ev; ++e) dv[e] += dvb[jj * evp + e];
    }
  }
  for (int64_t i = 0; i < L; ++i) std::memcpy(h.dq + i * E, dq + i * ep, static_cast<size_t>(E) * sizeof(float));
}

inline void backward_head(const FlashBwdParams& p, const FlashBwdHead& h, float* ws) {
  if (p.guard_v) {
    backward_head_impl<true>(p, h, ws);
  } else {
    backward_head_impl<false>(p, h, ws);
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

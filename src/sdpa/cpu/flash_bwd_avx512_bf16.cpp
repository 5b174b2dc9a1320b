// Fused attention backward for bfloat16 q, k, v and dO on AVX512-BF16 (vdpbf16ps): FlashAttention-2's
// backward (flash_bwd_kernel.hpp is the float32 one, same loop order and key ranges) with all five
// products on bf16 pairs and float32 accumulation; the softmax, dS and every accumulator stay
// float32, and the driver (flash_bwd.cpp) rounds dQ, dK, dV to bf16 once at the end.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma, run only on a CPU
// with all of them.
//
// D = rowsum(dO * O) must be the float32 one (D from the bf16-rounded output breaks the error bound
// of docs/NUMERICS.md: measured, 2-4x the rounded float32 reference's dQ error). Given the
// forward's output_residual the driver forms it from O + residual; else row_dots computes it
// before the key loop as D_i = sum_j P_ij dP_ij over the row's keys, the same two products
// (Q K^T, dO V^T) the loop does: 7 products then, 5 with the residual.
//
// Shapes, for one query head of L queries (blocks of BQ = 32) against one key range, walked in
// groups of 4 key blocks of BK = 64:
//   qt2  (L/32, E2, 32) u32  Q^T per query block, pairs along E     (S^T = K Q^T, scores_tile)
//   dot2 (L/32, Ev2, 32)     dO^T likewise                         (dP^T = V dO^T)
//   qp   (L/2, Ep) u32       Q as pairs of query rows              (dK += dS^T Q)
//   dop  (L/2, Evp)          dO likewise                           (dV += P^T dO)
//   kp   (256/2, Ep)         the group's K as pairs of key rows    (dQ += dS K)
//   st, dpt (64, 32) f32     S^T -> P^T -> dS^T, and dP^T of one key block, one lane per query
//   ppq, ppl (64, 16) u32    P^T rows as query pairs, hi and lo terms (the A of dV)
//   dsq, dsql (64, 16) u32   dS^T rows as query pairs, hi and lo terms (the A of dK)
//   dsk, dskl (32, 32) u32   dS^T as key pairs per query lane, hi and lo (the A of dQ)
//   dkb, dvb (256, Ep/Evp)   float32 dK, dV of the key group, written once per group
//   dq   (L, Ep) f32         dQ of the range, written whole at the end
// Ep, Evp: E, Ev rounded up to 16; E2, Ev2: halves rounded up. Padded queries have P = 0 and zero
// rows in qp/dop, padded columns are zero: they add nothing.
// Memory traffic per key group: Q, dO (packed twice each, bf16) and the float32 dQ rows stream
// once, as in the float32 kernel, at half its bytes for the inputs. With the mask's gradient
// asked for (h.dmask), each visible score's float32 dS is also written once into (L, S) rows
// (h.dmask_bf16: rounded to bf16 as written, for a bf16 mask with an element per score).
//
// Numerics: S and dP are products of bf16 inputs, exact in float32. P (for dV) and dS (for dQ and
// dK) enter their products as two bf16 terms (hi + lo, 16 significant bits or more; two vdpbf16ps
// on the same loads of the other operand), where FlashAttention's bf16 backward rounds all three
// to one. One term for all three put dQ and dV at 2.1-2.3x the error of the float32 reference
// rounded to bf16 on the accuracy sweep (tests/sdpa/test_low_precision.cpp), over the 2x the rule
// allows; with two terms every gradient is at 1.0x (the output rounding dominates). One term for
// dK alone measured 1.74x on that sweep, but 2.1x and 2.95x on two cases of the AMX sweep
// (tests/sdpa/cpu/test_flash_amx.cpp: few queries per key, under GQA, so the dS terms of a key
// cancel and bf16(dS)'s 2^-9 rounding is large against their sum) and 1.4-1.9x on causal L = 256
// to 512: the rule needs two there too. The key loop so runs 8 product passes; dK's second term
// costs 12-18 % of the time (AMD Zen 4, L = 1024, 2 threads: E 64 32.7 -> 36.5 ms, E 128 61.2 ->
// 68.1 ms). With SdpaOptions::allow_fp16_bf16_reduction (FlashParams::reduction) all three are
// one term, bf16(x) to nearest, as FlashAttention's: 5 passes, 1.34-1.46x faster (AMD Zen 5, L
// 1024-4096, E 64-128, 2 threads), within 2x a bf16 math reference's error instead
// (tests/sdpa/test_reduced_precision.cpp).
// The registry sends NaN/Inf inputs to the float32 kernel (widened), so no guard is needed here.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/bf16_dot_avx512.hpp"
#include "sdpa/cpu/exp2_avx512.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_bwd_split.hpp"

// GCC 12 reports the AVX-512 intrinsics' own placeholder operand (__Y, _mm512_undefined_ps) as
// maybe-uninitialized once the block loops are inlined into backward (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace attn::cpu::avx512_bf16 {
namespace {

constexpr int64_t kKeyGroup = 4;
constexpr int64_t kGK = kKeyGroup * kBK;
static_assert(kGK == kFlashBwdKeyGroup);

inline int64_t r16(int64_t x) { return (x + 15) / 16 * 16; }
inline int64_t padded_rows(int64_t L) { return (L + kBQ - 1) / kBQ * kBQ; }

// Rows [0, n) of x^T as pairs along the row's elements, per block of 32 rows: block i0 / 32 at
// dst + i0 * C2 holds (C2, 32), zero beyond n.
void pack_transposed(const uint16_t* x, int64_t ld, int64_t n, int64_t cols, uint32_t* dst) {
  const int64_t c2n = (cols + 1) / 2;
  for (int64_t i0 = 0; i0 < n; i0 += kBQ) {
    uint32_t* blk = dst + i0 * c2n;
    const int64_t nq = imin(kBQ, n - i0);
    for (int64_t c2 = 0; c2 < c2n; ++c2) {
      for (int64_t q = 0; q < kBQ; ++q) blk[c2 * kBQ + q] = q < nq ? pair_at(x + (i0 + q) * ld, c2, cols) : 0u;
    }
  }
}

// Rows [0, n) as pairs of rows, (lp/2, r16(cols)), the pair rows past n zero.
void pack_row_pairs(const uint16_t* x, int64_t ld, int64_t n, int64_t cols, int64_t lp, uint32_t* dst) {
  pack_pairs(x, ld, n, cols, dst);
  const int64_t w = r16(cols), done = (n + 1) / 2;
  std::memset(dst + done * w, 0, static_cast<size_t>((lp / 2 - done) * w) * sizeof(uint32_t));
}

// st (nk, 32) = X_blk Y^T for the nk rows of x (row stride ld) against the block's packed y^T.
void scores(const uint32_t* yt2, const uint16_t* x, int64_t ld, int64_t cols, int64_t nk, float* st) {
  int64_t jj = 0;
  for (; jj + kJT <= nk; jj += kJT) scores_tile<kJT>(yt2, x + jj * ld, ld, cols, st + jj * kBQ);
  for (; jj < nk; ++jj) scores_tile<1>(yt2, x + jj * ld, ld, cols, st + jj * kBQ);
}

// P^T = exp2(S^T * scale - lse2) over the key block, after the masks: lanes a mask hides or past
// the block's queries (lse2 = +inf) are 0. min(., 0) keeps P <= 1 where rounding puts a score
// above its row's LSE.
void probabilities(const FlashParams& p, const QueryBlock& qb, int64_t j0, int64_t nk, const float* lse2, float* st) {
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  // A block no mask touches is scaled in the exponent's pass (one pass over S^T, not two).
  const bool masked = block_masked(p, qb, j0, nk);
  if (masked) {
    for (int64_t i = 0; i < nk * kBQ; i += 16) _mm512_storeu_ps(st + i, _mm512_mul_ps(_mm512_loadu_ps(st + i), scale));
    mask_block(p, qb, j0, nk, st);
  }
  const __m512 s = masked ? _mm512_set1_ps(1.0f) : scale;
  const __m512 l0 = _mm512_loadu_ps(lse2), l1 = _mm512_loadu_ps(lse2 + 16);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(st + jj * kBQ + h * 16), s), h == 0 ? l0 : l1);
      // min(0, x): a NaN x (a NaN additive mask) stays NaN, as in the float32 kernel.
      _mm512_storeu_ps(st + jj * kBQ + h * 16, exp2_avx512(_mm512_min_ps(_mm512_setzero_ps(), x)));
    }
  }
}

// dL/dP^T: a dropped weight's is 0, a kept one's is dP / (1 - p).
void dropout_grad(const FlashParams& p, const QueryBlock& qb, int64_t j0, int64_t nk, float* dpt) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t q = 0; q < qb.nq; ++q) {
      float& x = dpt[jj * kBQ + q];
      x = dropout_keep(p, qb.bh, qb.i0 + q, j0 + jj) ? x * inv_keep : 0.0f;
    }
  }
}

// The bf16 operands of a key block's three gradient products, written in one pass over P^T and
// dP^T (a single read of each, no float32 dS^T stored in between):
//   pq, pl  (nk, 16)       P_d^T rows as query pairs, two terms          (A of dV += P_d^T dO)
//   sq, sql (nk, 16)       dS^T rows as query pairs, two terms           (A of dK += dS^T Q)
//   sk, sl  (nk2, 32)      dS^T as key pairs per query lane, two terms   (A of dQ += dS K)
// dS = P (dP - D) scale, P the undropped weights; an odd nk pairs its last key with a zero key.
// Two terms: hi = x with its low 16 bits cleared (truncation: exact, and a NaN stays NaN as
// arithmetic NaNs are quiet, bit 22 set) and lo = bf16(x - hi), nearest even: 16 significant bits
// or more, x - hi - lo within 2^-16 |x|. One term (FlashParams::reduction): bf16(x), nearest
// even, and pl, sql, sl are not written.
struct BlockOperands {
  uint32_t *pq, *pl, *sq, *sql, *sk, *sl;
};

inline __m512 high_half(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The 32 query lanes of x0 (0..15), x1 (16..31) as 16 query pairs: their high halves, in order.
inline __m512i high_words(__m512 x0, __m512 x1) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23,
                                       21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(_mm512_castps_si512(x0), odd, _mm512_castps_si512(x1));
}

// One key row's 32 query lanes (x0: 0..15, x1: 16..31) as 16 query pairs in two terms: hi's
// pairs to hi_row, lo's to lo_row; in one term (kOne), bf16(x) to hi_row. The lanes' order is
// the pairs' order, so one cvtne2ps_pbh forms them.
template <bool kOne>
inline void store_query_pairs(__m512 x0, __m512 x1, uint32_t* hi_row, uint32_t* lo_row) {
  if constexpr (kOne) {
    _mm512_storeu_si512(hi_row, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
  } else {
    const __m512 r0 = _mm512_sub_ps(x0, high_half(x0)), r1 = _mm512_sub_ps(x1, high_half(x1));
    _mm512_storeu_si512(hi_row, high_words(x0, x1));
    _mm512_storeu_si512(lo_row, (__m512i)_mm512_cvtne2ps_pbh(r1, r0));
  }
}

template <bool kOne>
void block_operands(const float* st, const float* pd, const float* dpt, int64_t nk, __m512 d0, __m512 d1, __m512 scale,
                    const BlockOperands& o) {
  for (int64_t j2 = 0; j2 < (nk + 1) / 2; ++j2) {
    __m512 ds[2][2];  // [key of the pair][half of the query lanes]
    for (int64_t t = 0; t < 2; ++t) {
      const int64_t jj = 2 * j2 + t;
      if (jj >= nk) {
        ds[t][0] = ds[t][1] = _mm512_setzero_ps();
        continue;
      }
      __m512 pv[2];
      for (int hh = 0; hh < 2; ++hh) {
        const __m512 p = _mm512_loadu_ps(st + jj * kBQ + hh * 16);
        const __m512 dp = _mm512_sub_ps(_mm512_loadu_ps(dpt + jj * kBQ + hh * 16), hh == 0 ? d0 : d1);
        ds[t][hh] = _mm512_mul_ps(_mm512_mul_ps(p, dp), scale);
        pv[hh] = pd == st ? p : _mm512_loadu_ps(pd + jj * kBQ + hh * 16);
      }
      store_query_pairs<kOne>(pv[0], pv[1], o.pq + jj * 16, o.pl + jj * 16);
      store_query_pairs<kOne>(ds[t][0], ds[t][1], o.sq + jj * 16, o.sql + jj * 16);
    }
    for (int hh = 0; hh < 2; ++hh) {
      const __m512 e = ds[0][hh], od = ds[1][hh];
      if constexpr (kOne) {  // (bf16(e), bf16(od)) per lane, key 2 j2 in the low word
        _mm512_storeu_si512(o.sk + j2 * kBQ + hh * 16, interleave_words((__m512i)_mm512_cvtne2ps_pbh(od, e)));
        continue;
      }
      const __m512 eh = high_half(e), oh = high_half(od);
      // (e >> 16) | high(od): the pair of high halves, key 2 j2 in the low word
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(e), 16), _mm512_castps_si512(oh));
      const __m512i lo = interleave_words((__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(od, oh), _mm512_sub_ps(e, eh)));
      _mm512_storeu_si512(o.sk + j2 * kBQ + hh * 16, hi);
      _mm512_storeu_si512(o.sl + j2 * kBQ + hh * 16, lo);
    }
  }
}

// r[i] lane l <- r[l] lane i: a 16 x 16 transpose in registers (32-bit, then 64-bit interleaves
// within 128-bit blocks, then the blocks).
inline void transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + m], block k: element 4k + m of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    for (int m = 0; m < 2; ++m) {
      const __m512d x = _mm512_castps_pd(a[4 * i + m]), y = _mm512_castps_pd(a[4 * i + m + 2]);
      b[4 * i + 2 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      b[4 * i + 2 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 c0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44), c1 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE);
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44), c3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(c0, c2, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(c1, c3, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
  }
}

inline void store_row(float* row, __mmask16 keys, __m512 x) { _mm512_mask_storeu_ps(row, keys, x); }
inline void store_row(uint16_t* row, __mmask16 keys, __m512 x) {  // bf16, nearest even
  _mm256_mask_storeu_epi16(row, keys, (__m256i)_mm512_cvtneps_pbh(x));
}

// The mask's gradient of a key block, dS = P (dP - D) before the scale (exactly 0 where P is 0),
// from P^T, dP^T (nk x 32, one lane per query) into the head's rows (row stride S) at the
// block's first key: tiles of 16 keys x 16 queries transposed in registers and stored a row of
// 16 keys at a time (masked at the block's end). Element by element, with two strided loads per
// score, this was most of the mask gradient's cost: AMD Zen 4, B 1, H 12, L = S 1024, E 64, 2
// threads, backward 63.7 -> 81.2 ms with it.
template <typename Out>
void write_mask_grad(const float* st, const float* dpt, int64_t nk, int64_t nq, __m512 d0, __m512 d1, Out* rows,
                     int64_t S) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; j += 16) {
    const int64_t nj = imin(16, nk - j);
    const auto keys = static_cast<__mmask16>((1u << nj) - 1u);
    for (int hh = 0; hh < 2 && hh * 16 < nq; ++hh) {
      const __m512 d = hh == 0 ? d0 : d1;
      __m512 r[16];
      for (int t = 0; t < 16; ++t) {
        if (t >= nj) {
          r[t] = zero;
          continue;
        }
        const __m512 pv = _mm512_loadu_ps(st + (j + t) * kBQ + hh * 16);
        const __m512 dp = _mm512_sub_ps(_mm512_loadu_ps(dpt + (j + t) * kBQ + hh * 16), d);
        r[t] = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(pv, zero, _CMP_NEQ_UQ), pv, dp);
      }
      transpose16(r);
      const int64_t nr = imin(16, nq - hh * 16);
      for (int64_t q = 0; q < nr; ++q) store_row(rows + (hh * 16 + q) * S + j, keys, r[q]);
    }
  }
}

void lse_base2(const float* lse, int64_t i0, int64_t n, float* lse2) {
  for (int64_t q = 0; q < kBQ; ++q) {
    const float l = q < n ? lse[i0 + q] : kNegInf;
    lse2[q] = l == kNegInf ? std::numeric_limits<float>::infinity()
                           : static_cast<float>(static_cast<double>(l) * std::numbers::log2e);
  }
}

int64_t backward_workspace_bytes(int64_t L, int64_t E, int64_t Ev) {
  const int64_t lp = padded_rows(L), ep = r16(E), evp = r16(Ev), e2 = (E + 1) / 2, ev2 = (Ev + 1) / 2;
  const int64_t words = lp * (e2 + ev2) + lp / 2 * (ep + evp) + kGK / 2 * ep + 4 * kBK * 16 + 2 * (kBK / 2 * kBQ);
  const int64_t floats = lp * ep + 2 * lp + 3 * kBK * kBQ + kGK * (ep + evp);
  return 4 * (words + floats) + 64;
}

// The head's q, k, v and dO as bf16 bits (FlashBwdHead holds them untyped for every kernel).
struct Bf16Rows {
  const uint16_t *q, *k, *v, *dout;
};
inline Bf16Rows bf16_rows(const FlashBwdHead& h) {
  return {static_cast<const uint16_t*>(h.q), static_cast<const uint16_t*>(h.k), static_cast<const uint16_t*>(h.v),
          static_cast<const uint16_t*>(h.dout)};
}

// D_i and sum_j P_ij for rows [i0, i0 + nq) of the head, over every key the rows see.
void row_dots(const FlashBwdParams& p, const FlashBwdHead& h, int64_t i0, int64_t nq, float* d, float* mass, void* ws) {
  const int64_t e2 = (p.E + 1) / 2, ev2 = (p.Ev + 1) / 2;
  const auto [q, k, v, dout] = bf16_rows(h);
  auto* qt2 = static_cast<uint32_t*>(ws);
  uint32_t* dot2 = qt2 + e2 * kBQ;
  auto* st = reinterpret_cast<float*>(dot2 + ev2 * kBQ);
  float* dpt = st + kBK * kBQ;
  float* lse2 = dpt + kBK * kBQ;
  pack_transposed(q + i0 * p.q_row, p.q_row, nq, p.E, qt2);
  pack_transposed(dout + i0 * h.do_row, h.do_row, nq, p.Ev, dot2);
  lse_base2(h.lse, i0, nq, lse2);
  const QueryBlock qb{i0, nq, h.bh, h.mask != nullptr ? h.mask + i0 * p.mask_row : nullptr};
  int64_t s_end = p.S;
  if (p.causal) s_end = imin(i0 + nq + p.causal_offset, p.S);
  // The mass is summed in float32 within a key block and in float64 across blocks: on a row of
  // 32k keys a float32 sum drifts past the whole-row tolerance of the driver.
  __m512 dd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512d pm[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  for (int64_t j0 = 0; j0 < s_end; j0 += kBK) {
    const int64_t nk = imin(kBK, s_end - j0);
    scores(qt2, k + j0 * p.k_row, p.k_row, p.E, nk, st);
    probabilities(p, qb, j0, nk, lse2, st);
    scores(dot2, v + j0 * p.v_row, p.v_row, p.Ev, nk, dpt);
    if (p.dropout_p > 0.0f) dropout_grad(p, qb, j0, nk, dpt);
    __m512 pb[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t jj = 0; jj < nk; ++jj) {
      for (int hh = 0; hh < 2; ++hh) {
        const __m512 pv = _mm512_loadu_ps(st + jj * kBQ + hh * 16);
        dd[hh] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(dpt + jj * kBQ + hh * 16), dd[hh]);
        pb[hh] = _mm512_add_ps(pb[hh], pv);
      }
    }
    for (int hh = 0; hh < 2; ++hh) {
      pm[2 * hh] = _mm512_add_pd(pm[2 * hh], _mm512_cvtps_pd(_mm512_castps512_ps256(pb[hh])));
      pm[2 * hh + 1] = _mm512_add_pd(pm[2 * hh + 1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(pb[hh], 1)));
    }
  }
  alignas(64) float dv[kBQ];
  alignas(64) double mv[kBQ];
  _mm512_store_ps(dv, dd[0]);
  _mm512_store_ps(dv + 16, dd[1]);
  for (int i = 0; i < 4; ++i) _mm512_store_pd(mv + 8 * i, pm[i]);
  for (int64_t r = 0; r < nq; ++r) d[r] = dv[r], mass[r] = static_cast<float>(mv[r]);
}

void backward(const FlashBwdParams& p, const FlashBwdHead& h, void* ws) {
  const int64_t L = p.L, E = p.E, Ev = p.Ev;
  const int64_t lp = padded_rows(L), ep = r16(E), evp = r16(Ev), e2 = (E + 1) / 2, ev2 = (Ev + 1) / 2;
  const auto [q, k, v, dout] = bf16_rows(h);
  auto* qt2 = static_cast<uint32_t*>(ws);
  uint32_t* dot2 = qt2 + lp * e2;
  uint32_t* qp = dot2 + lp * ev2;
  uint32_t* dop = qp + lp / 2 * ep;
  uint32_t* kp = dop + lp / 2 * evp;
  uint32_t* ppq = kp + kGK / 2 * ep;
  uint32_t* dsq = ppq + kBK * 16;
  uint32_t* dsk = dsq + kBK * 16;
  uint32_t* ppl = dsk + kBK / 2 * kBQ;
  uint32_t* dskl = ppl + kBK * 16;
  uint32_t* dsql = dskl + kBK / 2 * kBQ;
  auto* dq = reinterpret_cast<float*>(dsql + kBK * 16);
  float* lse2 = dq + lp * ep;
  float* dd = lse2 + lp;
  float* st = dd + lp;
  float* dpt = st + kBK * kBQ;
  float* pdt = dpt + kBK * kBQ;
  float* dkb = pdt + kBK * kBQ;
  float* dvb = dkb + kGK * ep;

  pack_transposed(q, p.q_row, L, E, qt2);
  pack_transposed(dout, h.do_row, L, Ev, dot2);
  pack_row_pairs(q, p.q_row, L, E, lp, qp);
  pack_row_pairs(dout, h.do_row, L, Ev, lp, dop);
  std::memset(dq, 0, static_cast<size_t>(lp * ep) * sizeof(float));
  for (int64_t i0 = 0; i0 < lp; i0 += kBQ) lse_base2(h.lse, i0, imin(kBQ, L - i0), lse2 + i0);
  for (int64_t i = 0; i < lp; ++i) dd[i] = i < L ? h.dd[i] : 0.0f;

  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t g0 = h.j_begin; g0 < h.j_end; g0 += kGK) {
    const int64_t ng = imin(kGK, h.j_end - g0);
    int64_t i_first = 0;
    if (p.causal) {  // query i sees key j iff j <= i + offset
      i_first = g0 - p.causal_offset;
      if (i_first >= L) break;
      if (i_first < 0) i_first = 0;
      i_first = i_first / kBQ * kBQ;
    }
    pack_pairs(k + g0 * p.k_row, p.k_row, ng, E, kp);
    std::memset(dkb, 0, static_cast<size_t>(kGK * ep) * sizeof(float));
    std::memset(dvb, 0, static_cast<size_t>(kGK * evp) * sizeof(float));
    for (int64_t i0 = i_first; i0 < L; i0 += kBQ) {
      const QueryBlock qb{i0, imin(kBQ, L - i0), h.bh, h.mask != nullptr ? h.mask + i0 * p.mask_row : nullptr};
      const __m512 d0 = _mm512_loadu_ps(dd + i0), d1 = _mm512_loadu_ps(dd + i0 + 16);
      for (int64_t j0 = g0; j0 < g0 + ng; j0 += kBK) {
        if (p.causal && j0 > i0 + qb.nq - 1 + p.causal_offset) break;  // hidden from the block
        int64_t nk = imin(kBK, g0 + ng - j0);
        const int64_t kk = j0 - g0;
        if (p.causal) nk = imin(nk, i0 + qb.nq + p.causal_offset - j0);  // as the float32 kernel
        scores(qt2 + i0 * e2, k + j0 * p.k_row, p.k_row, E, nk, st);
        probabilities(p, qb, j0, nk, lse2 + i0, st);
        scores(dot2 + i0 * ev2, v + j0 * p.v_row, p.v_row, Ev, nk, dpt);
        const float* pd = st;
        if (p.dropout_p > 0.0f) {
          std::memcpy(pdt, st, static_cast<size_t>(nk * kBQ) * sizeof(float));
          dropout_block(p, qb, j0, nk, pdt);
          dropout_grad(p, qb, j0, nk, dpt);
          pd = pdt;
        }
        const BlockOperands ops{ppq, ppl, dsq, dsql, dsk, dskl};
        if (p.reduction) {
          block_operands<true>(st, pd, dpt, nk, d0, d1, scale, ops);
        } else {
          block_operands<false>(st, pd, dpt, nk, d0, d1, scale, ops);
        }
        // The mask's gradient (h.dmask, h.dmask_bf16): dS before the scale, in float32 as the
        // float32 kernels form it, written once into the head's (L, S) rows (rounded to bf16 as
        // it is written, for a bf16 mask: the bits a float32 row rounded afterwards would have).
        if (h.dmask != nullptr) write_mask_grad(st, dpt, nk, qb.nq, d0, d1, h.dmask + i0 * p.S + j0, p.S);
        if (h.dmask_bf16 != nullptr) write_mask_grad(st, dpt, nk, qb.nq, d0, d1, h.dmask_bf16 + i0 * p.S + j0, p.S);
        // The second terms, or none (pairs_update then does one product per pair).
        const uint32_t* pl = p.reduction ? nullptr : ppl;
        const uint32_t* sql = p.reduction ? nullptr : dsql;
        const uint32_t* skl = p.reduction ? nullptr : dskl;
        // dV_blk (nk x Ev) += P_d^T (nk x 32) @ dO rows (32 x Ev)
        pairs_update(ppq, 16, 1, dop + i0 / 2 * evp, evp, kBQ / 2, nk, evp, dvb + kk * evp, evp, pl);
        // dK_blk (nk x E) += dS^T (nk x 32) @ Q rows (32 x E)
        pairs_update(dsq, 16, 1, qp + i0 / 2 * ep, ep, kBQ / 2, nk, ep, dkb + kk * ep, ep, sql);
        // dQ rows (32 x E) += dS (32 x nk) @ K rows (nk x E)
        pairs_update(dsk, 1, kBQ, kp + kk / 2 * ep, ep, (nk + 1) / 2, kBQ, ep, dq + i0 * ep, ep, skl);
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

int64_t row_dots_workspace_bytes(int64_t E, int64_t Ev) {
  return 4 * (((E + 1) / 2 + (Ev + 1) / 2) * kBQ + 2 * kBK * kBQ + kBQ);
}

}  // namespace
}  // namespace attn::cpu::avx512_bf16

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace attn::cpu {
const Bf16BackwardKernel& bf16_backward_avx512() {
  using namespace avx512_bf16;
  static const Bf16BackwardKernel k{kBQ, row_dots_workspace_bytes, row_dots, backward_workspace_bytes, backward};
  return k;
}
}  // namespace attn::cpu

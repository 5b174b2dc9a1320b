// Fused attention forward for one block of queries (FlashAttention-2's algorithm on a CPU).
//
// Included by flash_avx512.cpp, flash_avx2.cpp and flash_generic.cpp, each compiling it with
// its own -m flags, vector width W (16, 8, 4 floats) and namespace; the registry picks one at
// run time. Written with GCC vector extensions: `vf` is one SIMD register of W floats, and
// `acc += a * b` becomes an FMA (these files build with -ffp-contract=fast).
//
// Shapes and tiling, for a block of BQ = 2W queries of one (batch, head):
//   qt  (E, BQ)    Q^T of the block, packed once per block
//   st  (BK, BQ)   scores S^T of one key block: one row per key, one lane per query, so the
//                  softmax's max and sum over keys are vertical (lane-wise) operations and
//                  the causal mask is a per-row lane comparison
//   ob  (BQ, Evp)  output accumulator; rescaled by exp2(m_old - m_new) when the max grows
// S^T is computed in register tiles of JT keys x 2 vectors of queries: per step of E, two
// loads of qt, JT broadcasts of k[j][e] and 2*JT FMAs. P @ V runs in tiles of RT query rows x
// CV vectors of Ev: per key, CV loads of v[j], RT broadcasts of p and RT*CV FMAs.
// Memory traffic per block: K and V of the head stream through once; nothing of size L x S
// is ever stored (except the weights a caller asked for in the second pass).
//
// Variants (SdpaOptions' window_size, softcap, alibi_slopes, sinks): softcap and ALiBi act on
// each S^T tile after the scale (modify_block), the band of is_causal and the window is a lane
// comparison per key row (mask_block), and key blocks wholly outside a query block's band are
// never visited, so a sliding window costs L * window, not L * S. A sink starts the running max
// at s_h with sum 1: one more logit with no value.
//
// Numerics: scores are base-2 (exp2 of scaled scores); a row with no visible key ends with
// l = 0 and gets output 0 and LSE -inf; masked positions are assigned -inf (never added), so
// NaN/Inf in an excluded key cannot leak; with guard_v a zero weight never multiplies V.
//
// This header is compiled with different -m flags in several files, so it defines only
// functions inside its per-ISA namespace and calls no std:: template: the linker keeps one copy
// of each inline template, and an AVX-512 copy must never serve the other builds.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/flash_params.hpp"

#if defined(__AVX512DQ__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && ATTN_SIMD_WIDTH == 16
#include "sdpa/cpu/exp2_avx512.hpp"
#endif

namespace attn::cpu::ATTN_SIMD_NS {

constexpr int W = ATTN_SIMD_WIDTH;
using vf = float __attribute__((vector_size(W * sizeof(float))));
using vi = int32_t __attribute__((vector_size(W * sizeof(float))));
using vu = uint32_t __attribute__((vector_size(W * sizeof(float))));

// Register tiling per build, measured (docs/PERFORMANCE*.md): the FMA units need latency x
// throughput = 8 independent accumulators on every x86 core seen (Zen 3/4/5, Sapphire Rapids),
// which AVX-512's 32 registers hold with room for running totals; AVX2's 16 do not. The
// generic build (W = 4, no FMA) keeps the tiling it was written with.
constexpr int64_t kBQ = 2 * W;       // queries per block (two vectors)
constexpr int64_t kBK = 64;          // keys per key block
constexpr int kJT = W >= 16 ? 8 : 4; // keys per S^T register tile (2*kJT accumulators)
// When E spans several chunks (scores_block): keys per tile, and whether the running totals
// stay in registers (AVX-512: 7 keys, 14 accumulators + 14 totals) or in S^T itself (16
// registers: totals in registers would leave 3 keys, 6 accumulators; Zen 3 measured 1.04-1.13x
// faster with 4 keys and a load-add-store per chunk of 16; 5 or 6 keys that way, 10 or 12
// accumulators, measured no faster in two sessions: at best 1.03x, at worst 1.4x slower).
constexpr int kJTSum = W >= 16 ? 7 : W == 8 ? 4 : 3;
constexpr bool kTotalsInSt = W == 8;
// Vectors of Ev (P @ V) or of a rank update's columns per register tile of 4 rows: 4 x 4 or
// 4 x 3 accumulators (AVX2: 12 of 16 registers; 1.06-1.08x over 4 x 2 on Zen 3).
constexpr int kCV = W >= 16 ? 4 : W == 8 ? 3 : 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// Broadcast. Written `x - 0` because subtracting +0 is an identity (so it compiles to one
// vbroadcastss); `x + 0` is not (for x = -0) and a lane-by-lane loop becomes masked inserts.
inline vf splat(float x) { return x - vf{}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline void zero(float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
}

// 2^x for x <= 127, accurate to ~1 ulp on [-126, 0]; exactly 0 below -126.5 (so -inf -> 0;
// results between are subnormal, which the kernels' flush-to-zero makes 0 too); NaN stays NaN.
inline vf exp2v(vf x) {
#if defined(__AVX512F__) && ATTN_SIMD_WIDTH == 16
  __m512 xi;
  std::memcpy(&xi, &x, sizeof xi);
  const __m512 ri = exp2_avx512(xi);  // the same polynomial with vscalefps (exp2_avx512.hpp)
  vf r;
  std::memcpy(&r, &ri, sizeof r);
  return r;
#else
  // max(x, -127) that keeps a NaN x (the comparison is false for NaN): NaN then flows through
  // every step below and comes out NaN, and -inf (or anything below -127) gives n = -127, whose
  // scale has exponent field 0, i.e. exactly 0. No compare-and-blend per edge case: they were
  // a third of this function's instructions, and softmax calls it once per score.
  const vf xc = x < -127.0f ? splat(-127.0f) : x;
  // Round to nearest by the 1.5 * 2^23 trick; t's low mantissa bits then hold n itself.
  const vf t = xc + 12582912.0f;
  const vf n = t - 12582912.0f;
  const vf f = xc - n;  // in [-0.5, 0.5]
  // 2^f = 1 + f g(f), g a degree-5 fit of (2^f - 1) / f with relative error < 2e-9 on
  // [-0.5, 0.5] (scripts/exp2_fit.py), one multiply-add fewer than the degree-7 Taylor series
  // it replaced; exactly 1 at f = 0. 2^x is within 1.13 ulp on [-126, 0] (tests/sdpa/cpu/
  // test_exp2.cpp checks 2). Measured against the Taylor form with its compare-and-blends, in
  // one process (scripts/ab_kernels.sh, Zen 3, 1 thread, L 1024, the host quiet): forward
  // 1.03-1.08x faster.
  vf g = splat(1.535335904918611e-04f);
  g = g * f + 1.3398876180872321e-03f;
  g = g * f + 9.6184369176626205e-03f;
  g = g * f + 5.5503323674201965e-02f;
  g = g * f + 2.4022647738456726e-01f;
  g = g * f + 6.9314718246459961e-01f;
  const vf p = g * f + 1.0f;
  // 2^n: t's bits are 0x4B400000 + n; shifted left by 23 only n's bits remain (mod 2^32, in
  // unsigned lanes so that the wrap-around, and a NaN's bits, are defined).
  vu tbits;
  std::memcpy(&tbits, &t, sizeof tbits);
  const vu bits = (tbits << 23) + (127u << 23);
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
#endif
}

// Softcapping, x -> c tanh(x / c), to a few ulp: below |y| = |x / c| = 0.5 as x * (tanh(y) / y)
// with tanh(y) / y an even Taylor polynomial (degree 16: truncation < 1e-9 relative), so that the
// score is never divided by c and multiplied back (with a huge c, x / c is below float32's normal
// range and the kernels flush it to zero: x * 1 is then exact, c * tanh(0) would be 0); above,
// c (1 - e) / (1 + e) with e = exp(-2|y|), where no cancellation can occur (e <= 0.37). NaN stays
// NaN. A vector whose lanes all fall on one side computes that side only: with a typical cap
// (Gemma 2's 50) nearly every score is in the polynomial's range, and the exp and the division
// are the expensive half.
inline vf tanh_ratio_small(vf y2) {  // tanh(y) / y for |y| < 0.5, from y^2
  vf p = splat(-2.3912911424355248e-04f);
  p = p * y2 + 5.9002744094558600e-04f;
  p = p * y2 - 1.4558343870513183e-03f;
  p = p * y2 + 3.5921280365724810e-03f;
  p = p * y2 - 8.8632355299021966e-03f;
  p = p * y2 + 2.1869488536155203e-02f;
  p = p * y2 - 5.3968253968253968e-02f;
  p = p * y2 + 1.3333333333333333e-01f;
  p = p * y2 - 3.3333333333333333e-01f;
  return 1.0f + y2 * p;
}
inline vf tanh_big(vf y, vf a) {
  const vf e = exp2v(a * (-2.0f * std::numbers::log2e_v<float>));
  const vf big = (1.0f - e) / (1.0f + e);
  return y < 0.0f ? -big : big;
}
// How many lanes of a comparison's result (0 or -1 per lane) are true: one mask move where the
// ISA has it (a lane-by-lane sum costs W extracts, more than the polynomial it would save).
inline int count_true(vi m) {
#if defined(__AVX512DQ__) && ATTN_SIMD_WIDTH == 16
  __m512i x;
  std::memcpy(&x, &m, sizeof x);
  return __builtin_popcount(static_cast<unsigned>(_mm512_movepi32_mask(x)));
#elif defined(__AVX__) && ATTN_SIMD_WIDTH == 8
  __m256 x;
  std::memcpy(&x, &m, sizeof x);
  return __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(x)));
#elif defined(__SSE2__) && ATTN_SIMD_WIDTH == 4
  __m128 x;
  std::memcpy(&x, &m, sizeof x);
  return __builtin_popcount(static_cast<unsigned>(_mm_movemask_ps(x)));
#else
  int n = 0;
  for (int l = 0; l < W; ++l) n -= m[l];
  return n;
#endif
}

// The constants of softcap_v for a cap c: y = x / c is computed as (x * pre) * inv_c. Under the
// kernels' flush-to-zero a cap above 2^126 has a denormal 1 / c that would flush to 0 (then an
// infinite score gives inf * 0 = NaN instead of -c or c), so such caps pre-scale x by 2^-32
// and keep inv_c = 2^32 / c normal. A finite x that the pre-scale flushes is far below c, where
// c tanh(x / c) = x, which the small-|y| branch returns.
struct SoftcapConst {
  float c, pre, inv_c;
};
inline SoftcapConst softcap_const(float c) {
  const double pre = c > 0x1p100f ? 0x1p-32 : 1.0;
  return {c, static_cast<float>(pre), static_cast<float>(1.0 / (static_cast<double>(c) * pre))};
}

// Returns c tanh(x / c) and sets t = tanh(x / c) (the backward's 1 - t^2).
inline vf softcap_v(vf x, const SoftcapConst& k, vf& t) {
  const vf y = (x * k.pre) * k.inv_c;
  const vf a = y < 0.0f ? -y : y;
  const vi small = a < 0.5f;
  const int n_small = count_true(small);
  if (n_small == W) {
    const vf r = tanh_ratio_small(y * y);
    t = y * r;
    return x * r;
  }
  const vf big = tanh_big(y, a);
  if (n_small == 0) {
    t = big;
    return big * k.c;
  }
  const vf r = tanh_ratio_small(y * y);
  t = small ? y * r : big;
  return small ? x * r : big * k.c;
}

inline int64_t workspace_floats(int64_t E, int64_t Ev) {
  const int64_t evp = (Ev + W - 1) / W * W;
  return E * kBQ + kBK * kBQ + kBQ * evp + kBK * evp + 4 * kBQ;
}

// X^T of one block of rows: xt[e][r] = x[r * ld + e] for r < n, 0 in the padding lanes r >= n;
// (cols, kBQ), the layout scores_block reads as its "Q^T". Rows outer, so the reads are
// contiguous (an AVX-512 16 x 16 register transpose measured no faster).
inline void pack_block_transposed(const float* x, int64_t ld, int64_t n, int64_t cols, float* xt) {
  for (int64_t r = 0; r < kBQ; ++r) {
    for (int64_t e = 0; e < cols; ++e) xt[e * kBQ + r] = r < n ? x[r * ld + e] : 0.0f;
  }
}

// S^T[jj][lane] = scale * sum_e k[j0 + jj][e] * qt[e][lane] for jj in [0, nk).
// E is summed in chunks of kEChunk whose partial sums are then added: one long FMA chain over
// E = 128 loses up to ~6x the accuracy of BLAS's blocked sums on large scores, which the
// softmax then amplifies; chunking keeps the error at the reference's level. The running totals
// stay in registers beside the chunk's accumulators (a tile of kJTSum keys then fills the
// register file); kept in st and re-read per chunk they cost ~20 % of the scores' time at E = 64.
// The scale (times log2 e) is applied to each finished score, once, as the reference does:
// folding it into Q instead rounds every product q_e * k_e, an error that grows with the sum of
// |q_e k_e| rather than with the score.
constexpr int64_t kEChunk = 16;

// acc[t][h] = sum over e in [e0, e1) of kr[t][e] * qt[e][h half], from zero.
template <int JT>
inline void chunk_sums(const float* qt, const float* kr, int64_t k_row, int64_t e0, int64_t e1,
                       vf (&acc)[JT][2]) {
  for (int t = 0; t < JT; ++t) acc[t][0] = acc[t][1] = vf{};
  for (int64_t e = e0; e < e1; ++e) {
    const vf q0 = load(qt + e * kBQ), q1 = load(qt + e * kBQ + W);
    for (int t = 0; t < JT; ++t) {
      const vf kb = splat(kr[t * k_row + e]);
      acc[t][0] += kb * q0;
      acc[t][1] += kb * q1;
    }
  }
}

template <int JT>
inline void scores_tile(const float* qt, const float* kr, int64_t k_row, int64_t E, int64_t chunk,
                        float scale, float* st) {
  vf tot[JT][2];
  chunk_sums<JT>(qt, kr, k_row, 0, imin(chunk, E), tot);
  for (int64_t e0 = chunk; e0 < E; e0 += chunk) {
    vf acc[JT][2];
    chunk_sums<JT>(qt, kr, k_row, e0, imin(e0 + chunk, E), acc);
    for (int t = 0; t < JT; ++t) {
      tot[t][0] += acc[t][0];
      tot[t][1] += acc[t][1];
    }
  }
  for (int t = 0; t < JT; ++t) {
    store(st + t * kBQ, tot[t][0] * scale);
    store(st + t * kBQ + W, tot[t][1] * scale);
  }
}

// scores_tile with the running totals kept in st (kTotalsInSt): the same additions in the
// same order, so the same bits.
template <int JT>
inline void scores_tile_st(const float* qt, const float* kr, int64_t k_row, int64_t E, int64_t chunk,
                            float scale, float* st) {
  for (int64_t e0 = 0; e0 < E; e0 += chunk) {
    vf acc[JT][2];
    chunk_sums<JT>(qt, kr, k_row, e0, imin(e0 + chunk, E), acc);
    const bool last = e0 + chunk >= E;
    for (int t = 0; t < JT; ++t) {
      for (int h = 0; h < 2; ++h) {
        float* out = st + t * kBQ + h * W;
        vf x = e0 == 0 ? acc[t][h] : load(out) + acc[t][h];
        store(out, last ? x * scale : x);
      }
    }
  }
}

template <int JT>
inline void scores_tiles(const float* qt, const float* k, int64_t k_row, int64_t E, int64_t nk,
                         int64_t chunk, float scale, float* st) {
  // A tile of one or two keys is a chain of dependent FMAs, several times slower per key than
  // a full tile; a remainder of 1-3 keys therefore borrows one full tile, and the rest goes by
  // fours (64 keys in tiles of 7: 8 x 7 + 4 + 4, not 9 x 7 + 1). Each key's sum is the same
  // in any tile, so the bits do not depend on the split.
  int64_t full = nk / JT;
  if (JT > 4 && full > 0 && nk % JT != 0 && nk % JT < 4) --full;
  int64_t jj = 0;
  if (kTotalsInSt && E > chunk) {
    for (; jj < full * JT; jj += JT) scores_tile_st<JT>(qt, k + jj * k_row, k_row, E, chunk, scale, st + jj * kBQ);
  }
  for (; jj < full * JT; jj += JT) scores_tile<JT>(qt, k + jj * k_row, k_row, E, chunk, scale, st + jj * kBQ);
  if constexpr (JT > 4) {
    for (; jj + 4 <= nk; jj += 4) scores_tile<4>(qt, k + jj * k_row, k_row, E, chunk, scale, st + jj * kBQ);
  }
  for (; jj + 2 <= nk; jj += 2) scores_tile<2>(qt, k + jj * k_row, k_row, E, chunk, scale, st + jj * kBQ);
  for (; jj < nk; ++jj) scores_tile<1>(qt, k + jj * k_row, k_row, E, chunk, scale, st + jj * kBQ);
}

inline void scores_block(const float* qt, const float* k, int64_t k_row, int64_t E, int64_t j0,
                         int64_t nk, float scale_log2, float* st, int64_t chunk = kEChunk) {
  if (E <= chunk) {
    scores_tiles<kJT>(qt, k + j0 * k_row, k_row, E, nk, chunk, scale_log2, st);
  } else {
    scores_tiles<kJTSum>(qt, k + j0 * k_row, k_row, E, nk, chunk, scale_log2, st);
  }
}

// The variants on S^T (base-2 scaled scores), in place and in FlashAttention's order: softcap
// x = c2 tanh(x / c2), then ALiBi x -= slope2 |i + diag_offset - j|. With `cap_grad`, the
// softcap's derivative 1 - tanh^2 per element goes there (the backward's chain through tanh).
inline void modify_block(const FlashParams& p, const FlashBlock& b, int64_t j0, int64_t nk, float* st,
                         float* cap_grad = nullptr) {
  if (p.softcap2 > 0.0f) {
    const SoftcapConst k = softcap_const(p.softcap2);
    for (int64_t x = 0; x < nk * kBQ; x += W) {
      vf t;
      store(st + x, softcap_v(load(st + x), k, t));
      if (cap_grad != nullptr) store(cap_grad + x, 1.0f - t * t);
    }
  }
  if (p.alibi && b.alibi2 != 0.0f) {
    vf lane_i;
    for (int l = 0; l < W; ++l) lane_i[l] = static_cast<float>(l);
    const vf slope = splat(b.alibi2);
    for (int64_t jj = 0; jj < nk; ++jj) {
      const float base = static_cast<float>(b.i0 + p.diag_offset - (j0 + jj));  // lane 0's i' - j
      for (int h = 0; h < 2; ++h) {
        const vf d = lane_i + (base + static_cast<float>(h * W));
        const vf dist = d < 0.0f ? -d : d;
        store(st + jj * kBQ + h * W, load(st + jj * kBQ + h * W) - slope * dist);
      }
    }
  }
}

// Applies the band (is_causal, window) and explicit masks to S^T (assigning -inf), in place.
inline void mask_block(const FlashParams& p, const FlashBlock& b, int64_t j0, int64_t nk, float* st) {
  if (b.mask != nullptr) {
    for (int64_t jj = 0; jj < nk; ++jj) {
      for (int64_t q = 0; q < b.nq; ++q) {
        const float m = b.mask[q * p.mask_row + (j0 + jj) * p.mask_col];
        float& s = st[jj * kBQ + q];
        if (p.mask_is_bool) {
          if (m == 0.0f) s = kNegInf;
        } else {
          s += m * std::numbers::log2e_v<float>;  // additive masks are in natural-log units
        }
      }
    }
  }
  // The band last: a key outside it is hidden whatever an additive mask adds (NaN, +inf).
  if (p.band_lo && j0 < b.i0 + kBQ - 1 + p.lo_offset) {
    // Key j is hidden from query i when j < i + lo_offset: lane q when q > j - lo_offset - i0.
    vf lane_i;
    for (int l = 0; l < W; ++l) lane_i[l] = static_cast<float>(l);
    for (int64_t jj = 0; jj < nk; ++jj) {
      const float limit = static_cast<float>(j0 + jj - p.lo_offset - b.i0);
      for (int h = 0; h < 2; ++h) {
        const vf qidx = lane_i + static_cast<float>(h * W);
        const vf s = load(st + jj * kBQ + h * W);
        store(st + jj * kBQ + h * W, qidx > limit ? splat(kNegInf) : s);
      }
    }
  }
  if (p.causal) {
    // Key j is hidden from query i when j > i + offset; only blocks crossing the diagonal need it.
    const int64_t first_hidden_row = b.i0 + p.causal_offset + 1;  // smallest j hidden from row i0
    if (j0 + nk > first_hidden_row) {
      vf lane_i;
      for (int l = 0; l < W; ++l) lane_i[l] = static_cast<float>(l);
      for (int64_t jj = 0; jj < nk; ++jj) {
        const int64_t j = j0 + jj;
        // Lane q (query i0 + q) is hidden when q < j - offset - i0.
        const float limit = static_cast<float>(j - p.causal_offset - b.i0);
        for (int h = 0; h < 2; ++h) {
          const vf qidx = lane_i + static_cast<float>(h * W);
          const vf s = load(st + jj * kBQ + h * W);
          store(st + jj * kBQ + h * W, qidx < limit ? splat(kNegInf) : s);
        }
      }
    }
  }
}

// Philox dropout on the probabilities P^T (already used for the row sums): dropped -> p * 0,
// kept -> p / (1 - dropout_p). Multiplying by 0 (as PyTorch's dropout does) keeps a NaN
// probability NaN, so a row with a NaN score is NaN whichever of its keys are dropped.
inline void dropout_block(const FlashParams& p, const FlashBlock& b, int64_t j0, int64_t nk, float* st) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t q = 0; q < b.nq; ++q) {
      float& x = st[jj * kBQ + q];
      x = dropout_keep(p, b.bh, b.i0 + q, j0 + jj) ? x * inv_keep : x * 0.0f;
    }
  }
}

// ob[q][c0 : c0 + CV*W] += sum_jj P^T[jj][q] * v[j0 + jj][c0 : c0 + CV*W] for the block's rows.
// CV is a compile-time constant so the RT x CV accumulators live in registers.
template <int CV, bool kGuard>
inline void pv_chunk(const float* st, const float* v, int64_t v_row, int64_t nk, int64_t evp,
                     int64_t c0, float* ob) {
  constexpr int kRT = 4;  // query rows per tile
  for (int64_t r0 = 0; r0 < kBQ; r0 += kRT) {
    vf acc[kRT][CV];
    for (int r = 0; r < kRT; ++r) {
      for (int c = 0; c < CV; ++c) acc[r][c] = load(ob + (r0 + r) * evp + c0 + c * W);
    }
    for (int64_t jj = 0; jj < nk; ++jj) {
      vf vj[CV];
      for (int c = 0; c < CV; ++c) vj[c] = load(v + jj * v_row + c0 + c * W);
      for (int r = 0; r < kRT; ++r) {
        const float pr = st[jj * kBQ + r0 + r];
        if constexpr (kGuard) {
          if (pr == 0.0f) continue;  // a zero weight must not turn a NaN/Inf value into NaN
        }
        const vf pb = splat(pr);
        for (int c = 0; c < CV; ++c) acc[r][c] += pb * vj[c];
      }
    }
    for (int r = 0; r < kRT; ++r) {
      for (int c = 0; c < CV; ++c) store(ob + (r0 + r) * evp + c0 + c * W, acc[r][c]);
    }
  }
}

// Calls f.operator()<CV>(c0) over columns [c, n) (n - c a multiple of W) in chunks of CV
// vectors: kCV, then 2, then 1; with kCV = 3 a remainder of 4 vectors goes as 2 + 2 (a tile of
// one vector has too few accumulators in flight). Each column's sums do not depend on the split.
// The decode kernel's P.V cuts its tiles with it too (decode_pv.hpp's by_col_tiles).
template <class F>
[[gnu::always_inline]] inline void for_col_chunks(int64_t c, int64_t n, F&& f) {
  for (; c + kCV * W <= n && !(kCV == 3 && n - c == 4 * W); c += kCV * W) f.template operator()<kCV>(c);
  for (; c + 2 * W <= n; c += 2 * W) f.template operator()<2>(c);
  for (; c < n; c += W) f.template operator()<1>(c);
}

// ob[q][:] += sum_jj P^T[jj][q] * v[j0 + jj][:] over Ev (padded to evp), in chunks of vectors.
template <bool kGuard>
inline void pv_block(const float* st, const float* v, int64_t v_row, int64_t nk, int64_t evp,
                     float* ob) {
  for_col_chunks(0, evp, [&]<int CV>(int64_t c0) { pv_chunk<CV, kGuard>(st, v, v_row, nk, evp, c0, ob); });
}

// Forward pass over one block of queries: writes b.o (nq x Ev) and, if asked, b.lse.
inline void forward_block(const FlashParams& p, const FlashBlock& b, float* ws) {
  const int64_t evp = (p.Ev + W - 1) / W * W;
  float* qt = ws;
  float* st = qt + p.E * kBQ;
  float* ob = st + kBK * kBQ;
  float* vpack = ob + kBQ * evp;

  pack_block_transposed(b.q, p.q_row, b.nq, p.E, qt);
  zero(ob, kBQ * evp);
  // A sink is one more logit with no value: the running max starts at it with sum exp2(0) = 1.
  const bool sink = b.sink2 != kNegInf;
  vf m[2] = {splat(b.sink2), splat(b.sink2)};
  vf l[2] = {splat(sink ? 1.0f : 0.0f), splat(sink ? 1.0f : 0.0f)};

  // Keys outside the band of every query of the block (beyond the last query's upper limit,
  // before the first query's lower one) are skipped: the cost grows with the band, not S.
  int64_t s_end = p.S, s_begin = 0;
  if (p.causal) {
    s_end = imin(b.i0 + b.nq + p.causal_offset, p.S);
    if (s_end < 0) s_end = 0;
  }
  if (p.band_lo && b.i0 + p.lo_offset > 0) s_begin = b.i0 + p.lo_offset;
  const bool pack_v = p.Ev % W != 0;

  for (int64_t j0 = s_begin; j0 < s_end; j0 += kBK) {
    const int64_t nk = imin(kBK, s_end - j0);
    scores_block(qt, b.k, p.k_row, p.E, j0, nk, p.scale_log2, st);
    modify_block(p, b, j0, nk, st);
    mask_block(p, b, j0, nk, st);

    // Online softmax, lane-wise: new max, rescale factor, probabilities, row sums.
    for (int h = 0; h < 2; ++h) {
      vf mx = m[h];
      for (int64_t jj = 0; jj < nk; ++jj) mx = vmax(mx, load(st + jj * kBQ + h * W));
      // A lane whose keys are all hidden so far keeps max -inf; use 0 so exp2 gives 0, not NaN.
      const vf msafe = mx == kNegInf ? splat(0.0f) : mx;
      const vf alpha = exp2v(m[h] - msafe);
      vf sum = {};
      for (int64_t jj = 0; jj < nk; ++jj) {
        const vf pj = exp2v(load(st + jj * kBQ + h * W) - msafe);
        store(st + jj * kBQ + h * W, pj);
        sum += pj;
      }
      l[h] = l[h] * alpha + sum;
      m[h] = mx;
      // Once the running max settles (most key blocks of a long row), alpha is exactly 1 in
      // every lane: rescaling by 1 changes no bit, so the pass over the accumulators is skipped.
      if (count_true(alpha == 1.0f) == W) continue;
      for (int q = 0; q < W; ++q) {
        float* row = ob + (h * W + q) * evp;
        if (alpha[q] == 0.0f) {  // the old weights underflowed: excluded, so an Inf value met
          zero(row, evp);        // before cannot turn into NaN here (docs/NUMERICS.md)
          continue;
        }
        const vf a = splat(alpha[q]);
        for (int64_t c = 0; c < evp; c += W) store(row + c, load(row + c) * a);
      }
    }
    if (p.dropout_p > 0.0f) dropout_block(p, b, j0, nk, st);

    const float* vb = b.v + j0 * p.v_row;
    int64_t v_row = p.v_row;
    if (pack_v) {  // pad rows to a whole number of vectors so loads stay in bounds
      for (int64_t jj = 0; jj < nk; ++jj) {
        std::memcpy(vpack + jj * evp, vb + jj * p.v_row, p.Ev * sizeof(float));
        zero(vpack + jj * evp + p.Ev, evp - p.Ev);
      }
      vb = vpack;
      v_row = evp;
    }
    if (p.guard_v) {
      pv_block<true>(st, vb, v_row, nk, evp, ob);
    } else {
      pv_block<false>(st, vb, v_row, nk, evp, ob);
    }
  }

  // Normalise; a row with no visible key (l == 0) is 0 with LSE -inf.
  for (int64_t q = 0; q < b.nq; ++q) {
    const float lq = l[q / W][q % W], mq = m[q / W][q % W];
    const float inv = lq > 0.0f ? 1.0f / lq : 0.0f;
    float* out = b.o + q * p.o_row;
    for (int64_t e = 0; e < p.Ev; ++e) out[e] = ob[q * evp + e] * inv;
    if (b.lse != nullptr) {  // base 2; flash_forward converts to natural log at the very end
      b.lse[q] = lq > 0.0f ? mq + __builtin_log2f(lq) : kNegInf;
      if (lq != lq) b.lse[q] = lq;  // NaN propagates
    }
    if (b.stats != nullptr) {  // a row with no visible key gets max 0, 1/sum 0: weights 0
      b.stats[2 * q] = lq > 0.0f ? mq : 0.0f;
      b.stats[2 * q + 1] = lq != lq ? lq : inv;
    }
  }
}

// Second pass: attention weights exp2(s - max) / sum for the block's rows, from the max and
// 1/sum the forward pass saved, as a softmax computes them. Not exp(s - lse): the LSE's rounding
// grows with its magnitude (at |lse| ~ 1e30 its ulp dwarfs log(sum), and every weight became 1).
// The scores are recomputed; where a compiler rounds the two passes' tilings differently (clang
// does not contract every product of both into the same FMAs) a score can exceed the max by a
// few ulps, so s - max is capped at 0: a weight is never above 1 (NaN stays NaN).
inline void weights_block(const FlashParams& p, const FlashBlock& b, float* ws) {
  float* qt = ws;
  float* st = qt + p.E * kBQ;
  pack_block_transposed(b.q, p.q_row, b.nq, p.E, qt);
  vf mx[2] = {}, inv[2] = {};  // padding lanes (q >= nq) get weights 0, never stored
  for (int64_t q = 0; q < kBQ; ++q) {
    mx[q / W][q % W] = q < b.nq ? b.stats[2 * q] : 0.0f;
    inv[q / W][q % W] = q < b.nq ? b.stats[2 * q + 1] : 0.0f;
  }
  for (int64_t j0 = 0; j0 < p.S; j0 += kBK) {
    const int64_t nk = imin(kBK, p.S - j0);
    scores_block(qt, b.k, p.k_row, p.E, j0, nk, p.scale_log2, st);
    modify_block(p, b, j0, nk, st);
    mask_block(p, b, j0, nk, st);
    for (int64_t jj = 0; jj < nk; ++jj) {
      for (int h = 0; h < 2; ++h) {
        const vf x = load(st + jj * kBQ + h * W) - mx[h];
        store(st + jj * kBQ + h * W, exp2v(x > 0.0f ? splat(0.0f) : x) * inv[h]);
      }
    }
    if (p.dropout_p > 0.0f) dropout_block(p, b, j0, nk, st);
    for (int64_t q = 0; q < b.nq; ++q) {
      for (int64_t jj = 0; jj < nk; ++jj) b.weights[q * p.S + j0 + jj] = st[jj * kBQ + q];
    }
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

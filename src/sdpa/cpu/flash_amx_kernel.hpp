// Fused attention forward for bfloat16, float16 and (float32_matmul_precision "high" or "medium")
// float32 q, k, v on a matrix-tile engine (AMX-BF16's tdpbf16ps), written once over a `Tiles`
// type that provides the tile instructions:
// flash_amx_bf16.cpp runs it on the hardware's tiles, and a test runs the same code on an
// emulation of them, so that the layouts, tails and masks are checked on CPUs without AMX too.
//
// The tiles multiply bf16 only. A bf16 input is one term (T = 1). An fp16 input (11 significant
// bits) is exactly the sum of two bf16 terms, hi + lo (split_row), and so is P to 16 bits: each
// product runs as hi.hi + hi.lo + lo.hi (T = 2: three tile products, lo.lo dropped, 2^-16 of
// the product), still far above the float32 FMA rate, with the fp16 output's rounding (2^-11)
// dominating the error. A float32 input (24 significant bits) is exactly hi + mid + lo (T = 3,
// "high", torch's bf16x3): the six products whose terms' ranks add to at most 2 run (hi.hi,
// hi.mid, mid.hi, hi.lo, mid.mid, lo.hi); the three dropped are below 2^-24 of the product, the
// float32 rounding's size. "medium" is T = 1 on float32 inputs: plain bf16 products.
// P's terms (TP) follow T, except for a bf16 call asked for SdpaResult::output_residual (its
// float32 output must be the float32 attention's: the backward takes D = rowsum(dO * O) from
// it; docs/NUMERICS.md) or with Ev under 32 (one term broke the accuracy rule there;
// bf16_p_two_terms in flash_bf16.hpp): P enters P.V as two terms, hi + lo, while Q, K and V stay
// one (two tile products for P.V instead of one: hi.V, lo.V).
//
// Shapes and tiling, for a block of BQ = 32 queries (two tiles of 16 rows) of one (batch, head)
// and BK = 64 keys at a time; Ep = E rounded up to 32, Evp = Ev rounded up to 16, Sp = S rounded
// up to 64 (padding is zero); every buffer holds T planes, one per term:
//   qa (T, 32, Ep)   bf16  Q rows, split once per block: the A operand of Q.K^T
//   kp               u32   K of the head, packed once per head by the driver (pack_k): for each
//                          tile of 16 keys, Ep/2 rows of 16 (k[n][2e2], k[n][2e2+1]) pairs, the
//                          B operand's layout (rows = pairs of the reduced dim E, columns = keys)
//   st (32, 64)      f32   scores, row-major (the tiles' C layout): the softmax is row-wise
//   pb (TP, 32, 64)  bf16  P's terms, row-major: the A operand of P.V
//   vp (T, Sp/2, Evp) u32  V as key pairs (v[2j2][c], v[2j2+1][c]), packed once per head: the
//                          B operand of P.V, loaded straight from it (stride Evp words)
//   ob (32, Evp)     f32   output accumulator; its 16x16 tiles are loaded into C tiles,
//                          multiplied into and stored back once per key block, after the
//                          AVX-512 rescale
// Tiles: every one 16 rows x 64 bytes. Q.K^T: C0-C3 = 2 query tiles x 2 key tiles (32 keys),
// A0-A1 the query tiles, B0-B1 the key tiles, one tdpbf16ps per (C, 32 elements of E, pair of
// terms). P.V the same over (2 query tiles x 2 column tiles of 16) per 32 keys.
// Memory traffic per block: K and V of the head stream once (T x 2 bytes per element) from the
// packed copies (L2-resident for S up to a few thousand); ob stays in L1 (32 x Evp x 4 bytes).
//
// Numerics as the AVX512-BF16 kernel (flash_avx512_bf16.cpp): exact bf16 products, float32
// accumulation (the tiles flush bf16 subnormals to zero), P split into its terms for P.V while
// the row sums use the float32 P, output rounded to the input dtype once, LSE float32. The
// registry keeps a V holding NaN/Inf from this kernel (a zero weight times Inf would be NaN), and
// for T >= 2 NaN/Inf in q or k (Inf times another value's zero term would be NaN;
// tiles_take_values).
//
// Everything here has internal linkage, and it instantiates no standard-library template: this
// header is compiled under different -m flags in different files, and a shared inline function
// (std::vector's members included) could be the copy the linker keeps for all of them.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/exp2_avx512.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/residual_avx512.hpp"

// GCC 12 reports the AVX-512 intrinsics' own placeholder operand (__Y, _mm512_undefined_ps) as
// maybe-uninitialized once softmax_row is inlined into the tile loop (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace attn::cpu {
namespace {
namespace amx_kernel {

constexpr int64_t kBQ = 32;
constexpr int64_t kBK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline __mmask16 first_lanes(int64_t live) {  // lanes [0, live) of 16
  return live >= 16 ? __mmask16(0xffff) : live <= 0 ? __mmask16(0) : __mmask16((1u << live) - 1u);
}

// bf16 of 16 floats (nearest even), and the floats they stand for.
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline __m512 from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// 16 floats as T bf16 terms, plane t at out + t * plane: hi = bf16(x), then each next term the
// bf16 of what is left (exact differences); left-overs are 0 where x is not finite, so that Inf
// and NaN stay in hi alone.
template <int T>
inline void split16(__m512 x, uint16_t* out, int64_t plane) {
  __m256i h = to_bf16(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  if constexpr (T > 1) {
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);
    for (int t = 1; t < T; ++t) {
      x = _mm512_maskz_sub_ps(finite, x, from_bf16(h));
      h = to_bf16(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * plane), h);
    }
  }
}

// What the kernel reads and writes: bf16 (always one term), fp16 (two) or float32 (three for
// "high", one for "medium").
enum class Src { kBf16, kFp16, kFp32 };

// A row of n inputs as T bf16 planes (plane t at out + t * plane), zero padded to n_pad (a
// multiple of 16). For fp16, hi + lo is the value exactly: hi keeps 8 of its 11 significant bits
// (rounded to nearest), lo the at most 4 signed bits left; for float32 the three terms likewise.
template <Src In, int T>
inline void split_row(const void* src, int64_t n, int64_t n_pad, uint16_t* out, int64_t plane) {
  for (int64_t c = 0; c < n_pad; c += 16) {
    if constexpr (In == Src::kFp32) {
      split16<T>(_mm512_maskz_loadu_ps(first_lanes(n - c), static_cast<const float*>(src) + c), out + c, plane);
    } else {
      const __m256i raw = _mm256_maskz_loadu_epi16(first_lanes(n - c), static_cast<const uint16_t*>(src) + c);
      if constexpr (In == Src::kBf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), raw);
      } else {
        split16<T>(_mm512_cvtph_ps(raw), out + c, plane);
      }
    }
  }
}

// Bytes of one input element.
template <Src In>
constexpr int64_t kInBytes = In == Src::kFp32 ? 4 : 2;

template <int T>
inline int64_t packed_k_words(int64_t S, int64_t E) { return T * round_up(S, kBK) * round_up(E, 32) / 2; }
template <int T>
inline int64_t packed_v_words(int64_t S, int64_t Ev) { return T * round_up(S, kBK) / 2 * round_up(Ev, 16); }

// K as T planes of the B operand's layout: in plane t, key tile kt (16 keys) and pair row e2
// hold (k_t[n][2e2], k_t[n][2e2+1]) for the tile's keys n; keys past S are zero.
template <Src In, int T>
inline void pack_k(const void* k, int64_t k_row, int64_t S, int64_t E, uint32_t* out) {
  const int64_t ep = round_up(E, 32), e2n = ep / 2, sp = round_up(S, kBK), plane = sp * e2n;
  uint16_t* const terms = new uint16_t[static_cast<size_t>(T * ep)];
  for (int64_t key = 0; key < sp; ++key) {
    uint32_t* dst = out + (key / 16) * e2n * 16 + key % 16;
    if (key < S) {
      split_row<In, T>(static_cast<const char*>(k) + key * k_row * kInBytes<In>, E, ep, terms, ep);
    } else {
      for (int64_t i = 0; i < T * ep; ++i) terms[i] = 0;
    }
    for (int t = 0; t < T; ++t) {
      const uint16_t* row = terms + t * ep;
      for (int64_t e2 = 0; e2 < e2n; ++e2) {
        dst[t * plane + e2 * 16] = row[2 * e2] | static_cast<uint32_t>(row[2 * e2 + 1]) << 16;
      }
    }
  }
  delete[] terms;
}

// V as T planes of key pairs (v_t[2j2][c], v_t[2j2+1][c]) over Evp columns; zero past S and Ev.
template <Src In, int T>
inline void pack_v(const void* v, int64_t v_row, int64_t S, int64_t Ev, uint32_t* out) {
  const int64_t evp = round_up(Ev, 16), s2 = round_up(S, kBK) / 2, plane = s2 * evp;
  uint16_t* const rows = new uint16_t[static_cast<size_t>(2 * T * evp)];  // [key of the pair][term][evp]
  for (int64_t j2 = 0; j2 < s2; ++j2) {
    for (int r = 0; r < 2; ++r) {
      uint16_t* dst = rows + r * T * evp;
      if (2 * j2 + r < S) {
        split_row<In, T>(static_cast<const char*>(v) + (2 * j2 + r) * v_row * kInBytes<In>, Ev, evp, dst, evp);
      } else {
        for (int64_t i = 0; i < T * evp; ++i) dst[i] = 0;
      }
    }
    for (int t = 0; t < T; ++t) {
      const uint16_t* even = rows + t * evp;
      const uint16_t* odd = rows + (T + t) * evp;
      uint32_t* dst = out + t * plane + j2 * evp;
      for (int64_t c = 0; c < evp; ++c) dst[c] = even[c] | static_cast<uint32_t>(odd[c]) << 16;
    }
  }
  delete[] rows;
}

// T = 3 accumulates each key block's P.V in fresh tiles (pvt below), so one more output-sized
// buffer.
template <int T, int TP>
inline int64_t workspace_bytes(int64_t E, int64_t Ev) {
  return T * kBQ * round_up(E, 32) * 2 + kBQ * kBK * 4 + TP * kBQ * kBK * 2 + (T == 3 ? 2 : 1) * kBQ * round_up(Ev, 16) * 4;
}

// One row of the block's scores (base 2 after scaling) through the online softmax: masks, the
// running max m and sum l, P's TP bf16 terms into pb_row (plane stride kBQ * kBK; zero past the
// block's keys), and the rescale of the row's output accumulator. `hi`: keys [0, hi) of the
// block may be visible.
template <int TP>
inline void softmax_row(const FlashParams& p, const FlashBlock16& b, int64_t q, int64_t j0, int64_t nk,
                        int64_t hi, const float* st_row, uint16_t* pb_row, float& m, float& l, float* ob_row,
                        int64_t evp) {
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  __m512 x[4];
  for (int v = 0; v < 4; ++v) {
    x[v] = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), first_lanes(hi - 16 * v), _mm512_loadu_ps(st_row + 16 * v),
                              scale);
  }
  if (b.mask != nullptr) {
    alignas(64) float xs[kBK];
    for (int v = 0; v < 4; ++v) _mm512_store_ps(xs + 16 * v, x[v]);
    const float* mrow = b.mask + q * p.mask_row;
    for (int64_t jj = 0; jj < imin(hi, nk); ++jj) {
      const float mk = mrow[(j0 + jj) * p.mask_col];
      if (p.mask_is_bool) {
        if (mk == 0.0f) xs[jj] = kNegInf;
      } else {
        xs[jj] += mk * std::numbers::log2e_v<float>;
      }
    }
    for (int v = 0; v < 4; ++v) x[v] = _mm512_load_ps(xs + 16 * v);
  }
  const __m512 mxv = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
  bool nan = m != m;  // a NaN score makes the row NaN
  for (int v = 0; v < 4; ++v) nan = nan || _mm512_cmp_ps_mask(x[v], x[v], _CMP_UNORD_Q) != 0;
  float mx = _mm512_reduce_max_ps(mxv);
  if (m > mx) mx = m;
  if (nan) mx = __builtin_nanf("");
  const float msafe = mx == kNegInf ? 0.0f : mx;
  const float alpha = __builtin_exp2f(m - msafe);  // 0 for m = -inf, NaN kept
  __m512 sum = _mm512_setzero_ps();
  alignas(64) float pr[kBK];
  for (int v = 0; v < 4; ++v) {
    const __m512 pv = exp2_avx512(_mm512_sub_ps(x[v], _mm512_set1_ps(msafe)));
    sum = _mm512_add_ps(sum, pv);
    _mm512_store_ps(pr + 16 * v, pv);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mx;
  if (p.dropout_p > 0.0f) {
    const float inv_keep = 1.0f / (1.0f - p.dropout_p);
    for (int64_t jj = 0; jj < nk; ++jj) {
      pr[jj] = dropout_keep(p, b.bh, b.i0 + q, j0 + jj) ? pr[jj] * inv_keep : pr[jj] * 0.0f;
    }
  }
  for (int v = 0; v < 4; ++v) split16<TP>(_mm512_load_ps(pr + 16 * v), pb_row + 16 * v, kBQ * kBK);
  // Once a row's max settles alpha is 1 and the rescale would change no bit (x * 1 is x; a NaN
  // alpha compares unequal): skipped, as the float32 and AVX512-BF16 kernels skip it.
  if (alpha == 1.0f) return;
  const __m512 av = _mm512_set1_ps(alpha);
  for (int64_t c = 0; c < evp; c += 16) _mm512_storeu_ps(ob_row + c, _mm512_mul_ps(_mm512_loadu_ps(ob_row + c), av));
}

// Tile register roles: C0-C3 accumulators, A0-A1 the row operands, B0-B1 the column operands.
enum : int { kC0 = 0, kC1 = 1, kC2 = 2, kC3 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7 };

// The pairs of terms (of A, of B) whose products are summed: those whose ranks add to at most
// T - 1 (T = 2: all but lo.lo; T = 3: six of nine), largest first. They are summed in reverse,
// so that the small products accumulate among themselves before hi.hi's pass adds to them: in
// the other order each of them would be rounded against the large sum, and T = 3's score error
// measured 3-6x float32's instead of within 2x.
constexpr int kTermPairs[6][2] = {{0, 0}, {0, 1}, {1, 0}, {0, 2}, {1, 1}, {2, 0}};
template <int T>
constexpr int kNumPairs = T == 1 ? 1 : T == 2 ? 3 : 6;

// st[0:32, 32*h : 32*h + 32] = qa . K^T over the 32 keys starting at key tile kt.
template <class Tiles, int T>
inline void scores_32(Tiles& t, const uint16_t* qa, int64_t ep, const uint32_t* kp, int64_t k_plane, int64_t kt,
                      float* st, int64_t h) {
  const int64_t e2n = ep / 2;
  t.template zero<kC0>();
  t.template zero<kC1>();
  t.template zero<kC2>();
  t.template zero<kC3>();
  for (int pair = kNumPairs<T> - 1; pair >= 0; --pair) {  // smallest first: see kTermPairs
    const uint16_t* qt = qa + kTermPairs[pair][0] * kBQ * ep;
    const uint32_t* kpt = kp + kTermPairs[pair][1] * k_plane;
    for (int64_t s = 0; s < ep / 32; ++s) {
      t.template load<kA0>(qt + 32 * s, ep * 2);
      t.template load<kA1>(qt + 16 * ep + 32 * s, ep * 2);
      t.template load<kB0>(kpt + (kt * e2n + 16 * s) * 16, 64);
      t.template load<kB1>(kpt + ((kt + 1) * e2n + 16 * s) * 16, 64);
      t.template dp<kC0, kA0, kB0>();
      t.template dp<kC1, kA0, kB1>();
      t.template dp<kC2, kA1, kB0>();
      t.template dp<kC3, kA1, kB1>();
    }
  }
  float* base = st + 32 * h;
  t.template store<kC0>(base, kBK * 4);
  t.template store<kC1>(base + 16, kBK * 4);
  t.template store<kC2>(base + 16 * kBK, kBK * 4);
  t.template store<kC3>(base + 16 * kBK + 16, kBK * 4);
}

// ob[0:32, c0 : c0 + 16*NC] += pb[:, 0 : 32*ns] . V[j0 : j0 + 32*ns, c0 : ...], NC = 1 or 2, over the
// pairs of P's TP terms and V's T terms that kTermPairs lists for max(T, TP) (T = 1, TP = 2:
// hi.V and lo.V).
// T = 3 (float32 "high") starts from zeroed tiles instead (`ob` is then the block's own
// buffer): the six passes' small products are not rounded against the running output, which the
// driver adds the block to afterwards.
template <class Tiles, int T, int TP, int NC>
inline void pv_cols(Tiles& t, const uint16_t* pb, const uint32_t* vp, int64_t v_plane, int64_t evp, int64_t ns,
                    int64_t c0, float* ob) {
  if constexpr (T == 3) {
    t.template zero<kC0>();
    t.template zero<kC2>();
    if constexpr (NC == 2) {
      t.template zero<kC1>();
      t.template zero<kC3>();
    }
  } else {
    t.template load<kC0>(ob + c0, evp * 4);
    t.template load<kC2>(ob + 16 * evp + c0, evp * 4);
    if constexpr (NC == 2) {
      t.template load<kC1>(ob + c0 + 16, evp * 4);
      t.template load<kC3>(ob + 16 * evp + c0 + 16, evp * 4);
    }
  }
  for (int pair = kNumPairs<(T > TP ? T : TP)> - 1; pair >= 0; --pair) {  // smallest first: see kTermPairs
    if (kTermPairs[pair][0] >= TP || kTermPairs[pair][1] >= T) continue;
    const uint16_t* pt = pb + kTermPairs[pair][0] * kBQ * kBK;
    const uint32_t* vt = vp + kTermPairs[pair][1] * v_plane;
    for (int64_t s = 0; s < ns; ++s) {
      t.template load<kA0>(pt + 32 * s, kBK * 2);
      t.template load<kA1>(pt + 16 * kBK + 32 * s, kBK * 2);
      t.template load<kB0>(vt + 16 * s * evp + c0, evp * 4);
      t.template dp<kC0, kA0, kB0>();
      t.template dp<kC2, kA1, kB0>();
      if constexpr (NC == 2) {
        t.template load<kB1>(vt + 16 * s * evp + c0 + 16, evp * 4);
        t.template dp<kC1, kA0, kB1>();
        t.template dp<kC3, kA1, kB1>();
      }
    }
  }
  t.template store<kC0>(ob + c0, evp * 4);
  t.template store<kC2>(ob + 16 * evp + c0, evp * 4);
  if constexpr (NC == 2) {
    t.template store<kC1>(ob + c0 + 16, evp * 4);
    t.template store<kC3>(ob + 16 * evp + c0 + 16, evp * 4);
  }
}

// In and out in the same dtype; T terms per value, TP per probability.
template <class Tiles, Src In, int T, int TP>
void forward_block(const FlashParams& p, const FlashBlock16& b, void* workspace) {
  const int64_t ep = round_up(p.E, 32), evp = round_up(p.Ev, 16);
  auto* qa = static_cast<uint16_t*>(workspace);
  auto* st = reinterpret_cast<float*>(qa + T * kBQ * ep);
  auto* pb = reinterpret_cast<uint16_t*>(st + kBQ * kBK);
  auto* ob = reinterpret_cast<float*>(pb + TP * kBQ * kBK);
  float* const pvt = T == 3 ? ob + kBQ * evp : ob;  // where P.V of a key block lands (pv_cols)
  const int64_t k_plane = packed_k_words<1>(p.S, p.E), v_plane = packed_v_words<1>(p.S, p.Ev);

  for (int64_t q = 0; q < kBQ; ++q) {
    const bool live = q < b.nq;  // rows past nq are zero
    const char* row = static_cast<const char*>(b.q) + (live ? q * p.q_row * kInBytes<In> : 0);
    split_row<In, T>(row, live ? p.E : 0, ep, qa + q * ep, kBQ * ep);
  }
  std::memset(ob, 0, static_cast<size_t>(kBQ * evp) * sizeof(float));
  // Rows past nq are never softmaxed: their P stays 0.
  for (int t = 0; t < TP; ++t) {
    std::memset(pb + (t * kBQ + b.nq) * kBK, 0, static_cast<size_t>((kBQ - b.nq) * kBK) * 2);
  }
  float m[kBQ], l[kBQ];
  for (int64_t q = 0; q < kBQ; ++q) m[q] = kNegInf, l[q] = 0.0f;

  int64_t s_end = p.S;
  if (p.causal) s_end = imin(b.i0 + b.nq + p.causal_offset, p.S);
  if (s_end < 0) s_end = 0;

  Tiles t;
  t.configure();
  for (int64_t j0 = 0; j0 < s_end; j0 += kBK) {
    const int64_t nk = imin(kBK, s_end - j0), ns = (nk + 31) / 32;
    for (int64_t h = 0; h < ns; ++h) scores_32<Tiles, T>(t, qa, ep, b.kp, k_plane, j0 / 16 + 2 * h, st, h);
    for (int64_t q = 0; q < b.nq; ++q) {
      int64_t hi = nk;
      if (p.causal) hi = imin(hi, b.i0 + q + p.causal_offset + 1 - j0);
      softmax_row<TP>(p, b, q, j0, nk, hi, st + q * kBK, pb + q * kBK, m[q], l[q], ob + q * evp, evp);
    }
    const uint32_t* vp = b.vp + j0 / 2 * evp;
    int64_t c0 = 0;
    for (; c0 + 32 <= evp; c0 += 32) pv_cols<Tiles, T, TP, 2>(t, pb, vp, v_plane, evp, ns, c0, pvt);
    if (c0 < evp) pv_cols<Tiles, T, TP, 1>(t, pb, vp, v_plane, evp, ns, c0, pvt);
    if constexpr (T == 3) {
      for (int64_t i = 0; i < b.nq * evp; i += 16) {
        _mm512_storeu_ps(ob + i, _mm512_add_ps(_mm512_loadu_ps(ob + i), _mm512_loadu_ps(pvt + i)));
      }
    }
  }
  t.release();

  auto to_16 = [](__m512 x) {
    return In == Src::kBf16 ? to_bf16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  };
  for (int64_t q = 0; q < b.nq; ++q) {
    const __m512 inv = _mm512_set1_ps(l[q] > 0.0f ? 1.0f / l[q] : 0.0f);
    const float* row = ob + q * evp;  // evp columns: the last vector's load stays in the row
    for (int64_t c = 0; c < p.Ev; c += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + c), inv);
      if constexpr (In == Src::kFp32) {
        _mm512_mask_storeu_ps(static_cast<float*>(b.o) + q * p.o_row + c, first_lanes(p.Ev - c), x);
      } else {
        const __m256i h = to_16(x);  // NaN stays NaN in both conversions
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(b.o) + q * p.o_row + c, first_lanes(p.Ev - c), h);
        if (b.o_lo != nullptr) {  // SdpaResult::output_residual: x - h, 0 where h is Inf or NaN
          const __m512 hi = In == Src::kBf16 ? from_bf16(h) : _mm512_cvtph_ps(h);
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(b.o_lo) + q * p.o_row + c, first_lanes(p.Ev - c),
                                   to_16(residual_of(x, hi)));
        }
      }
    }
    if (b.lse != nullptr) {  // base 2, as the float32 kernel's
      b.lse[q] = l[q] > 0.0f ? m[q] + __builtin_log2f(l[q]) : kNegInf;
      if (l[q] != l[q]) b.lse[q] = l[q];
    }
  }
}

// The driver's table for one Tiles type, input and number of terms: bfloat16 (T = 1; TP = 2 for
// a call that asks for output_residual), float16 (T = 2), float32 "high" (T = 3) or "medium"
// (T = 1). A float32 output of P to 16 bits or more (TP >= 2) is the float32 attention's.
template <class Tiles, Src In, int T, int TP = T>
const Bf16ForwardKernel& kernel_table() {
  static const Bf16ForwardKernel k{kBQ, workspace_bytes<T, TP>, packed_k_words<T>, pack_k<In, T>,
                                   packed_v_words<T>, pack_v<In, T>, forward_block<Tiles, In, T, TP>,
                                   /*residual_ok=*/TP >= 2};
  return k;
}

}  // namespace amx_kernel
}  // namespace
}  // namespace attn::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

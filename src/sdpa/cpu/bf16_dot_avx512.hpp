// The AVX512-BF16 (vdpbf16ps) building blocks shared by the bf16 forward
// (flash_avx512_bf16.cpp) and backward (flash_bwd_avx512_bf16.cpp): bf16 rounding and pairing,
// the S^T score tile over a block of 32 queries, masks and dropout on it, and the key-pair
// packing of a head's rows.
//
// Layouts (u32 = two bf16, the low half first, as vdpbf16ps multiplies them):
//   qt2 (E2, 32)     X^T of a block of 32 rows as pairs along E: qt2[e2][q] = (x[q][2e2], x[q][2e2+1])
//   st  (keys, 32)   float32 scores S^T, one lane per query
//   pairs (S2, W)    rows as pairs along the row index: out[j2][c] = (x[2j2][c], x[2j2+1][c])
//
// Internal linkage, compiled only by files built with -mavx512{f,vl,dq,bw,bf16}: an inline
// function of a shared header compiled with AVX-512 flags could be the copy the linker keeps
// for every other build.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/flash_params.hpp"
#include "sdpa/cpu/residual_avx512.hpp"

// GCC 12 reports the AVX-512 intrinsics' own placeholder operand (__Y, _mm512_undefined_*) in
// these helpers as maybe-uninitialized (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace attn::cpu::avx512_bf16 {
namespace {

// The rows of S^T a mask or dropout applies to: queries [i0, i0 + nq) of flat head bh.
struct QueryBlock {
  int64_t i0, nq, bh;
  const float* mask;  // the (i0, 0) element of this head's mask, or nullptr
};

constexpr int64_t kBQ = 32;
constexpr int64_t kBK = 64;
constexpr int kJT = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Only functions of this file's own namespace run here: an inline function from a shared header
// (float_to_bf16, std::log2, ...) compiled with AVX-512 flags could be the copy the linker keeps
// for every other build.
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// float32 -> bf16 bits, nearest even (as float_to_bf16, for non-NaN x).
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x minus its bf16 rounding r (residual_avx512.hpp).
inline __m512 residual_of_bf16(__m512 x, __m256bh r) {
  return residual_of(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)r), 16)));
}

// The pair (row[2*i], row[2*i+1]) as one 32-bit lane; an odd tail keeps only row[2*i] (the
// element past the row is neither read nor multiplied: it could be NaN or out of bounds).
inline uint32_t pair_at(const uint16_t* row, int64_t i, int64_t n) {
  const uint32_t lo = row[2 * i];
  const uint32_t hi = 2 * i + 1 < n ? row[2 * i + 1] : 0u;
  return lo | (hi << 16);
}

// Words (a0, a1, ..., a15, b0, ..., b15) -> pairs (a0, b0), (a1, b1), ... as 32-bit lanes.
inline __m512i interleave_words(__m512i ab) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                       20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, ab);
}

// Two float32 vectors (keys 2j2 and 2j2+1 of 16 queries) rounded to bf16 and interleaved as
// one pair per query lane. vcvtne2ps2bf16 rounds to nearest even, as float_to_bf16 does; one
// conversion of both and one word permute, where converting each and widening took six
// instructions.
inline __m512i pair_rows(__m512 even, __m512 odd) {
  return interleave_words((__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

inline uint32_t load_u32(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// st (JT keys x 32 queries) = K_rows Q^T, times `scale` when kScaled (the forward's base-2
// scale, applied as the tile is stored rather than in a pass of its own over st).
template <int JT, bool kScaled = false>
inline void scores_tile(const uint32_t* qt2, const uint16_t* kr, int64_t k_row, int64_t E, float* st,
                        __m512 scale = _mm512_set1_ps(1.0f)) {
  __m512 acc[JT][2];
  for (int t = 0; t < JT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const int64_t whole = E / 2;  // pairs read as one 32-bit broadcast from the key row
  for (int64_t e2 = 0; e2 < whole; ++e2) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt2 + e2 * kBQ);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qt2 + e2 * kBQ + 16);
    for (int t = 0; t < JT; ++t) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_u32(kr + t * k_row + 2 * e2)));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], kb, q0);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], kb, q1);
    }
  }
  if (E % 2 != 0) {  // the odd last element pairs with 0
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt2 + whole * kBQ);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qt2 + whole * kBQ + 16);
    for (int t = 0; t < JT; ++t) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(kr[t * k_row + E - 1]));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], kb, q0);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], kb, q1);
    }
  }
  for (int t = 0; t < JT; ++t) {
    if constexpr (kScaled) {
      acc[t][0] = _mm512_mul_ps(acc[t][0], scale);
      acc[t][1] = _mm512_mul_ps(acc[t][1], scale);
    }
    _mm512_storeu_ps(st + t * kBQ, acc[t][0]);
    _mm512_storeu_ps(st + t * kBQ + 16, acc[t][1]);
  }
}

// Whether the causal diagonal crosses keys [j0, j0 + nk) of query block b.
inline bool causal_cuts_block(const FlashParams& p, const QueryBlock& b, int64_t j0, int64_t nk) {
  return p.causal && j0 + nk > b.i0 + p.causal_offset + 1;
}

// Whether mask_block changes anything in the block.
inline bool block_masked(const FlashParams& p, const QueryBlock& b, int64_t j0, int64_t nk) {
  return causal_cuts_block(p, b, j0, nk) || b.mask != nullptr;
}

// Causal and explicit masks on S^T, assigning -inf (the float32 kernel's rules).
inline void mask_block(const FlashParams& p, const QueryBlock& b, int64_t j0, int64_t nk, float* st) {
  if (causal_cuts_block(p, b, j0, nk)) {
    for (int64_t jj = 0; jj < nk; ++jj) {
      const int64_t first_visible_q = j0 + jj - p.causal_offset - b.i0;  // lanes below are hidden
      for (int64_t q = 0; q < imin(first_visible_q, kBQ); ++q) st[jj * kBQ + q] = kNegInf;
    }
  }
  if (b.mask != nullptr) {
    for (int64_t jj = 0; jj < nk; ++jj) {
      for (int64_t q = 0; q < b.nq; ++q) {
        const float m = b.mask[q * p.mask_row + (j0 + jj) * p.mask_col];
        float& s = st[jj * kBQ + q];
        if (p.mask_is_bool) {
          if (m == 0.0f) s = kNegInf;
        } else {
          s += m * std::numbers::log2e_v<float>;
        }
      }
    }
  }
}

inline void dropout_block(const FlashParams& p, const QueryBlock& b, int64_t j0, int64_t nk, float* st) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t q = 0; q < b.nq; ++q) {
      float& x = st[jj * kBQ + q];
      x = dropout_keep(p, b.bh, b.i0 + q, j0 + jj) ? x * inv_keep : x * 0.0f;
    }
  }
}

// S rows of Ev bf16 (row stride v_row) as pairs of rows for vdpbf16ps (V or K of a head):
// out[j2 * Evp + c] = v[2 j2][c] | v[2 j2 + 1][c] << 16, Evp = Ev rounded up to 16, zero padded.
inline void pack_pairs(const void* v_bits, int64_t v_row, int64_t S, int64_t Ev, uint32_t* out) {
  const int64_t evp = (Ev + 15) / 16 * 16;
  const auto* v = static_cast<const uint16_t*>(v_bits);
  for (int64_t j2 = 0; j2 < (S + 1) / 2; ++j2) {
    const uint16_t* v0 = v + 2 * j2 * v_row;
    const bool odd_tail = 2 * j2 + 1 >= S;
    const uint16_t* v1 = odd_tail ? nullptr : v0 + v_row;
    uint32_t* dst = out + j2 * evp;
    int64_t c = 0;
    for (; c + 16 <= Ev; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c)));
      const __m512i hi = odd_tail ? _mm512_setzero_si512()
                                  : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c)));
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; c < Ev; ++c) dst[c] = v0[c] | (odd_tail ? 0u : static_cast<uint32_t>(v1[c]) << 16);
    for (; c < evp; ++c) dst[c] = 0u;
  }
}

// out[r][c] += sum_{t < T} A(r, t) . b[t][c] for r < R, c < n (n a multiple of 16; float32
// rows of stride ldo), A(r, t) = a[r * a_r + t * a_t] and b[t] rows of ldb, all bf16 pairs: one
// vdpbf16ps adds two products. With a2 (not null), A2 likewise on the same b (a value's
// rounding error, split off as a second bf16 term), sharing the loads of b and out.
// Register tiles of RT rows x CV vectors: per step CV loads of b, RT (or 2 RT) broadcasts of A,
// RT * CV (or twice) dot products.
template <int RT, int CV, bool kTwo>
inline void pairs_tile(const uint32_t* a, const uint32_t* a2, int64_t a_r, int64_t a_t, const uint32_t* b, int64_t ldb,
                       int64_t T, float* out, int64_t ldo) {
  __m512 acc[RT][CV];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_loadu_ps(out + r * ldo + c * 16);
  }
  for (int64_t t = 0; t < T; ++t) {
    __m512bh bt[CV];
    for (int c = 0; c < CV; ++c) bt[c] = (__m512bh)_mm512_loadu_si512(b + t * ldb + c * 16);
    for (int r = 0; r < RT; ++r) {
      const __m512bh ab = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * a_r + t * a_t]));
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ab, bt[c]);
      if constexpr (kTwo) {
        const __m512bh ab2 = (__m512bh)_mm512_set1_epi32(static_cast<int>(a2[r * a_r + t * a_t]));
        for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ab2, bt[c]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(out + r * ldo + c * 16, acc[r][c]);
  }
}

template <int RT, bool kTwo>
inline void pairs_rows(const uint32_t* a, const uint32_t* a2, int64_t a_r, int64_t a_t, const uint32_t* b, int64_t ldb,
                       int64_t T, int64_t n, float* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) pairs_tile<RT, 4, kTwo>(a, a2, a_r, a_t, b + c, ldb, T, out + c, ldo);
  for (; c < n; c += 16) pairs_tile<RT, 1, kTwo>(a, a2, a_r, a_t, b + c, ldb, T, out + c, ldo);
}

template <bool kTwo>
inline void pairs_update_impl(const uint32_t* a, const uint32_t* a2, int64_t a_r, int64_t a_t, const uint32_t* b,
                              int64_t ldb, int64_t T, int64_t R, int64_t n, float* out, int64_t ldo) {
  const int64_t tiled = R / 4 * 4;
  for (int64_t r = 0; r < tiled; r += 4) {
    pairs_rows<4, kTwo>(a + r * a_r, kTwo ? a2 + r * a_r : nullptr, a_r, a_t, b, ldb, T, n, out + r * ldo, ldo);
  }
  for (int64_t r = tiled; r < R; ++r) {
    pairs_rows<1, kTwo>(a + r * a_r, kTwo ? a2 + r * a_r : nullptr, a_r, a_t, b, ldb, T, n, out + r * ldo, ldo);
  }
}

// out (R x n) += A (R x T pairs) @ b (T pairs x n), plus A2 @ b when a2 is not null.
inline void pairs_update(const uint32_t* a, int64_t a_r, int64_t a_t, const uint32_t* b, int64_t ldb, int64_t T,
                         int64_t R, int64_t n, float* out, int64_t ldo, const uint32_t* a2 = nullptr) {
  if (a2 != nullptr) {
    pairs_update_impl<true>(a, a2, a_r, a_t, b, ldb, T, R, n, out, ldo);
  } else {
    pairs_update_impl<false>(a, nullptr, a_r, a_t, b, ldb, T, R, n, out, ldo);
  }
}

}  // namespace
}  // namespace attn::cpu::avx512_bf16

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

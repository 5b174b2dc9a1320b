// Fused attention forward for bfloat16 q, k, v on AVX512-BF16 (vdpbf16ps): the products run on
// bf16 pairs with float32 accumulation, the softmax in float32, the output is rounded to bf16
// once at the end and the LSE stays float32 (PyTorch's semantics for low-precision SDPA).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma; the registry
// runs it only on a CPU with all of them (Intel Cooper Lake / Sapphire Rapids on, AMD Zen 4 on).
//
// Shapes and tiling, for a block of BQ = 32 queries (two zmm of 16 lanes) of one (batch, head):
//   qt2 (E2, 32) u32   Q^T as bf16 pairs: qt2[e2][q] = (q[q][2e2], q[q][2e2 + 1]); E2 = ceil(E/2),
//                      an odd E's last pair has a zero high half. Packed once per block.
//   st  (BK, 32) f32   scores S^T of one block of BK = 64 keys, one lane per query, so the
//                      online softmax is lane-wise (as in the float32 kernel, flash_kernel.hpp)
//   pp  (BK/2, 32) u32 P^T rounded to bf16, as key pairs: pp[j2][q] = (p[2j2][q], p[2j2+1][q])
//   vp  (S2, Evp) u32  V of the head as key pairs: vp[j2][c] = (v[2j2][c], v[2j2+1][c]), an odd
//                      S's last pair has a zero high half; packed once per head by the driver
//                      (pack_pairs, bf16_dot_avx512.hpp) before any query block runs, and shared by all of them
//   ob  (32, Evp) f32  output accumulator, rescaled when a row's max grows
// S^T tiles: 8 keys x 2 vectors of queries, per pair of E one broadcast of k's pair and two
// vdpbf16ps (2 products each) per key, scaled as they are stored. P.V tiles: 4 query rows x 4
// vectors of Ev, per key pair one load of vp per vector, one broadcast of pp per row, 16 vdpbf16ps.
// Between them, per half of the block's queries: one pass for the max, then one that takes each
// pair of keys through the exponent into pp (st is read once and not written back; with dropout
// P^T is stored, dropped, then paired), and ob's rows are rescaled only where the max moved.
// The element-wise work between the products (scale, max, exponent, pairing, rescale) took ~30 %
// of the forward's time when each was a pass of its own (perf, one thread, L 2048, E 64, causal,
// AMD Zen 4; the products ~70 %); as above, 1.05-1.07x faster, the same bits (Zen 4, 2 threads,
// scripts/ab_kernels.sh -i avx512_bf16 ... fwd16).
// Memory traffic per block: K and V of the head stream once in bf16 (half of float32's bytes).
//
// Numerics: products of two bf16 are exact in float32; vdpbf16ps treats bf16 subnormals as zero
// (values below 1.2e-38, far under any attention input's resolution). P is rounded to bf16
// before P.V (as PyTorch's and FlashAttention's bf16 kernels do); the row sums use the float32
// P. With SdpaOptions::need_output_residual P enters as two terms (16 significant bits), so that
// output + output_residual is the float32 attention's output: from the one-term output the
// backward's D = rowsum(dO * O) measured up to 2.1x the rule's dQ error (E = 1). So it does for
// Ev under 32, where one term broke the rule on the output itself (bf16_p_two_terms). The registry
// keeps problems whose V holds NaN/Inf away from this kernel (a dropped or masked weight of 0
// times Inf would be NaN here), and the float32 kernel takes them widened.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/bf16_dot_avx512.hpp"
#include "sdpa/cpu/exp2_avx512.hpp"
#include "sdpa/cpu/flash_bf16.hpp"

// GCC 12 reports the AVX-512 intrinsics' own placeholder operand (__Y, _mm512_undefined_*) as
// maybe-uninitialized once the helpers are inlined into forward_block (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace attn::cpu::avx512_bf16 {
namespace {

int64_t workspace_bytes(int64_t E, int64_t Ev) {
  const int64_t evp = (Ev + 15) / 16 * 16, e2 = (E + 1) / 2;
  return 4 * (e2 * kBQ + kBK * kBQ + kBK * kBQ + kBQ * evp);  // qt2, st, pp and pp2, ob
}

int64_t packed_v_words(int64_t S, int64_t Ev) { return (S + 1) / 2 * ((Ev + 15) / 16 * 16); }

// Keys 2j2 and 2j2 + 1 of P^T (16 query lanes) as bf16 pairs into pp; with two_terms their
// rounding errors likewise into pp2.
inline void store_p_pairs(__m512 even, __m512 odd, bool two_terms, uint32_t* pp, uint32_t* pp2) {
  _mm512_storeu_si512(pp, pair_rows(even, odd));
  if (two_terms) {
    _mm512_storeu_si512(pp2, pair_rows(residual_of_bf16(even, _mm512_cvtneps_pbh(even)),
                                       residual_of_bf16(odd, _mm512_cvtneps_pbh(odd))));
  }
}

void forward_block(const FlashParams& p, const FlashBlock16& b, void* workspace) {
  const int64_t evp = (p.Ev + 15) / 16 * 16, e2n = (p.E + 1) / 2;
  const auto* bq = static_cast<const uint16_t*>(b.q);
  const auto* bk = static_cast<const uint16_t*>(b.k);
  auto* qt2 = static_cast<uint32_t*>(workspace);
  auto* st = reinterpret_cast<float*>(qt2 + e2n * kBQ);
  auto* pp = reinterpret_cast<uint32_t*>(st + kBK * kBQ);
  auto* pp2 = pp + kBK / 2 * kBQ;  // P^T - bf16(P^T) likewise, when two_terms
  auto* ob = reinterpret_cast<float*>(pp2 + kBK / 2 * kBQ);
  // With output_residual asked, the float32 output must be that of float32 P (the backward takes
  // D = rowsum(dO * O) from it): P enters P.V as two bf16 terms, hi + lo, one more product.
  const bool two_terms = bf16_p_two_terms(p.Ev, b.o_lo != nullptr && !p.reduction);

  for (int64_t e2 = 0; e2 < e2n; ++e2) {
    for (int64_t q = 0; q < kBQ; ++q) qt2[e2 * kBQ + q] = q < b.nq ? pair_at(bq + q * p.q_row, e2, p.E) : 0u;
  }
  std::memset(ob, 0, static_cast<size_t>(kBQ * evp) * sizeof(float));
  const QueryBlock qb{b.i0, b.nq, b.bh, b.mask};
  __m512 m[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
  __m512 l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};

  int64_t s_end = p.S;
  if (p.causal) s_end = imin(b.i0 + b.nq + p.causal_offset, p.S);
  if (s_end < 0) s_end = 0;
  const __m512 scale = _mm512_set1_ps(p.scale_log2);

  for (int64_t j0 = 0; j0 < s_end; j0 += kBK) {
    const int64_t nk = imin(kBK, s_end - j0), nk2 = (nk + 1) / 2;
    int64_t jj = 0;
    for (; jj + kJT <= nk; jj += kJT) {
      scores_tile<kJT, true>(qt2, bk + (j0 + jj) * p.k_row, p.k_row, p.E, st + jj * kBQ, scale);
    }
    for (; jj < nk; ++jj) scores_tile<1, true>(qt2, bk + (j0 + jj) * p.k_row, p.k_row, p.E, st + jj * kBQ, scale);
    mask_block(p, qb, j0, nk, st);
    // Without dropout P^T goes from the exponent straight into its key pairs (one pass over S^T);
    // dropout needs the undropped P^T in st for the row sums first.
    const bool fused = p.dropout_p <= 0.0f;

    for (int h = 0; h < 2; ++h) {
      __m512 mx = m[h];
      for (int64_t j = 0; j < nk; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + j * kBQ + h * 16));
      // NaN scores: max_ps drops a NaN in its first operand, so carry NaN explicitly.
      for (int64_t j = 0; j < nk; ++j) {
        const __m512 s = _mm512_loadu_ps(st + j * kBQ + h * 16);
        mx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q), mx, s);
      }
      const __m512 msafe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ), mx,
                                                _mm512_setzero_ps());
      const __m512 alpha = exp2_avx512(_mm512_sub_ps(m[h], msafe));
      __m512 sum = _mm512_setzero_ps();
      if (fused) {
        // P^T as key pairs; an odd last key pairs with a zero weight (and, in vp, a zero value
        // row, or the next block's first key: kBK is even, so only the head's last key is odd).
        for (int64_t j2 = 0; j2 < nk2; ++j2) {
          const __m512 even = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + 2 * j2 * kBQ + h * 16), msafe));
          sum = _mm512_add_ps(sum, even);
          __m512 odd = _mm512_setzero_ps();
          if (2 * j2 + 1 < nk) {
            odd = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + (2 * j2 + 1) * kBQ + h * 16), msafe));
            sum = _mm512_add_ps(sum, odd);
          }
          store_p_pairs(even, odd, two_terms, pp + j2 * kBQ + h * 16, pp2 + j2 * kBQ + h * 16);
        }
      } else {
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 pj = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + j * kBQ + h * 16), msafe));
          _mm512_storeu_ps(st + j * kBQ + h * 16, pj);
          sum = _mm512_add_ps(sum, pj);
        }
      }
      l[h] = _mm512_fmadd_ps(l[h], alpha, sum);
      m[h] = mx;
      // Only rows whose max moved are rescaled (x * 1 is x: the same bits); NaN compares unequal.
      __mmask16 moved = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
      alignas(64) float a[16];
      _mm512_store_ps(a, alpha);
      for (; moved != 0; moved = static_cast<__mmask16>(moved & (moved - 1))) {
        const int q = __builtin_ctz(moved);
        float* row = ob + (h * 16 + q) * evp;
        const __m512 av = _mm512_set1_ps(a[q]);
        for (int64_t c = 0; c < evp; c += 16) _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), av));
      }
    }
    if (!fused) {
      dropout_block(p, qb, j0, nk, st);
      if (nk % 2 != 0) std::memset(st + nk * kBQ, 0, kBQ * sizeof(float));
      for (int64_t j2 = 0; j2 < nk2; ++j2) {
        for (int h = 0; h < 2; ++h) {
          store_p_pairs(_mm512_loadu_ps(st + 2 * j2 * kBQ + h * 16), _mm512_loadu_ps(st + (2 * j2 + 1) * kBQ + h * 16),
                        two_terms, pp + j2 * kBQ + h * 16, pp2 + j2 * kBQ + h * 16);
        }
      }
    }
    // ob (32 x Evp) += P (32 x nk, as key pairs) @ V rows (nk x Evp)
    pairs_update(pp, 1, kBQ, b.vp + j0 / 2 * evp, evp, nk2, kBQ, evp, ob, evp, two_terms ? pp2 : nullptr);
  }

  alignas(64) float lv[kBQ], mv[kBQ];
  _mm512_store_ps(lv, l[0]);
  _mm512_store_ps(lv + 16, l[1]);
  _mm512_store_ps(mv, m[0]);
  _mm512_store_ps(mv + 16, m[1]);
  for (int64_t q = 0; q < b.nq; ++q) {
    const float inv = lv[q] > 0.0f ? 1.0f / lv[q] : 0.0f;
    uint16_t* out = static_cast<uint16_t*>(b.o) + q * p.o_row;
    uint16_t* lo = b.o_lo != nullptr ? static_cast<uint16_t*>(b.o_lo) + q * p.o_row : nullptr;
    const float* row = ob + q * evp;
    int64_t c = 0;
    for (; c + 16 <= p.Ev; c += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(inv));
      const __m256bh r = _mm512_cvtneps_pbh(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)r);
      if (lo != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c), (__m256i)_mm512_cvtneps_pbh(residual_of_bf16(x, r)));
      }
    }
    for (; c < p.Ev; ++c) {
      const float x = row[c] * inv;
      out[c] = x != x ? uint16_t{0x7fc0} : round_bf16(x);  // a NaN row stays NaN
      if (lo != nullptr) {
        const uint32_t bits = static_cast<uint32_t>(out[c]) << 16;
        float hi;
        std::memcpy(&hi, &bits, sizeof hi);
        lo[c] = __builtin_isfinite(hi) ? round_bf16(x - hi) : uint16_t{0};
      }
    }
    if (b.lse != nullptr) {  // base 2, as the float32 kernel's
      b.lse[q] = lv[q] > 0.0f ? mv[q] + __builtin_log2f(lv[q]) : kNegInf;
      if (lv[q] != lv[q]) b.lse[q] = lv[q];
    }
  }
}

}  // namespace
}  // namespace attn::cpu::avx512_bf16

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace attn::cpu {
const Bf16ForwardKernel& bf16_kernel_avx512() {
  using namespace avx512_bf16;
  static const Bf16ForwardKernel k{kBQ, workspace_bytes, nullptr, nullptr, packed_v_words, pack_pairs,
                                   forward_block, /*residual_ok=*/true};
  return k;
}
}  // namespace attn::cpu

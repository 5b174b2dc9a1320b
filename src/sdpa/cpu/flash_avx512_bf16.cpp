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
//                      (pack_v_pairs) before any query block runs, and shared by all of them
//   ob  (32, Evp) f32  output accumulator, rescaled when a row's max grows
// S^T tiles: 8 keys x 2 vectors of queries, per pair of E one broadcast of k's pair and two
// vdpbf16ps (2 products each) per key. P.V tiles: 4 query rows x 4 vectors of Ev, per key pair
// one load of vp per vector, one broadcast of pp per row, 16 vdpbf16ps.
// Memory traffic per block: K and V of the head stream once in bf16 (half of float32's bytes).
//
// Numerics: products of two bf16 are exact in float32; vdpbf16ps treats bf16 subnormals as zero
// (values below 1.2e-38, far under any attention input's resolution). P is rounded to bf16
// before P.V (as PyTorch's and FlashAttention's bf16 kernels do); the row sums use the float32
// P. The registry keeps problems whose V holds NaN/Inf away from this kernel (a dropped or
// masked weight of 0 times Inf would be NaN here), and the float32 kernel takes them widened.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>

#include "sdpa/cpu/exp2_avx512.hpp"
#include "sdpa/cpu/flash_bf16.hpp"

namespace attn::cpu::avx512_bf16 {
namespace {

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

// The pair (row[2*i], row[2*i+1]) as one 32-bit lane; an odd tail keeps only row[2*i] (the
// element past the row is neither read nor multiplied: it could be NaN or out of bounds).
inline uint32_t pair_at(const uint16_t* row, int64_t i, int64_t n) {
  const uint32_t lo = row[2 * i];
  const uint32_t hi = 2 * i + 1 < n ? row[2 * i + 1] : 0u;
  return lo | (hi << 16);
}

// Two float32 vectors (keys 2j2 and 2j2+1 of 16 queries) rounded to bf16 and interleaved as
// one pair per query lane. vcvtneps2bf16 rounds to nearest even, as float_to_bf16 does.
inline __m512i pair_rows(__m512 even, __m512 odd) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

inline uint32_t load_u32(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

template <int JT>
inline void scores_tile(const uint32_t* qt2, const uint16_t* kr, int64_t k_row, int64_t E, float* st) {
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
    _mm512_storeu_ps(st + t * kBQ, acc[t][0]);
    _mm512_storeu_ps(st + t * kBQ + 16, acc[t][1]);
  }
}

// Causal and explicit masks on S^T, assigning -inf (the float32 kernel's rules).
void mask_block(const FlashParams& p, const FlashBlock16& b, int64_t j0, int64_t nk, float* st) {
  if (p.causal && j0 + nk > b.i0 + p.causal_offset + 1) {
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

void dropout_block(const FlashParams& p, const FlashBlock16& b, int64_t j0, int64_t nk, float* st) {
  const float inv_keep = 1.0f / (1.0f - p.dropout_p);
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t q = 0; q < b.nq; ++q) {
      float& x = st[jj * kBQ + q];
      x = dropout_keep(p, b.bh, b.i0 + q, j0 + jj) ? x * inv_keep : x * 0.0f;
    }
  }
}

// ob[r][c0 : c0 + CV*16] += sum_j2 pp[j2][r] . vp[j2][c0 : ...] for every row r of the block.
template <int CV>
inline void pv_chunk(const uint32_t* pp, const uint32_t* vp, int64_t nk2, int64_t evp, int64_t c0, float* ob) {
  constexpr int kRT = 4;
  for (int64_t r0 = 0; r0 < kBQ; r0 += kRT) {
    __m512 acc[kRT][CV];
    for (int r = 0; r < kRT; ++r) {
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_loadu_ps(ob + (r0 + r) * evp + c0 + c * 16);
    }
    for (int64_t j2 = 0; j2 < nk2; ++j2) {
      __m512bh vj[CV];
      for (int c = 0; c < CV; ++c) vj[c] = (__m512bh)_mm512_loadu_si512(vp + j2 * evp + c0 + c * 16);
      for (int r = 0; r < kRT; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[j2 * kBQ + r0 + r]));
        for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vj[c]);
      }
    }
    for (int r = 0; r < kRT; ++r) {
      for (int c = 0; c < CV; ++c) _mm512_storeu_ps(ob + (r0 + r) * evp + c0 + c * 16, acc[r][c]);
    }
  }
}

int64_t workspace_bytes(int64_t E, int64_t Ev) {
  const int64_t evp = (Ev + 15) / 16 * 16, e2 = (E + 1) / 2;
  return 4 * (e2 * kBQ + kBK * kBQ + kBK / 2 * kBQ + kBQ * evp);
}

int64_t packed_v_words(int64_t S, int64_t Ev) { return (S + 1) / 2 * ((Ev + 15) / 16 * 16); }

// V of one head (S rows of Ev bf16, row stride v_row) as key pairs for vdpbf16ps:
// out[j2 * Evp + c] = v[2 j2][c] | v[2 j2 + 1][c] << 16, Evp = Ev rounded up to 16, zero padded.
void pack_v_pairs(const void* v_bits, int64_t v_row, int64_t S, int64_t Ev, uint32_t* out) {
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

void forward_block(const FlashParams& p, const FlashBlock16& b, void* workspace) {
  const int64_t evp = (p.Ev + 15) / 16 * 16, e2n = (p.E + 1) / 2;
  const auto* bq = static_cast<const uint16_t*>(b.q);
  const auto* bk = static_cast<const uint16_t*>(b.k);
  auto* qt2 = static_cast<uint32_t*>(workspace);
  auto* st = reinterpret_cast<float*>(qt2 + e2n * kBQ);
  auto* pp = reinterpret_cast<uint32_t*>(st + kBK * kBQ);
  auto* ob = reinterpret_cast<float*>(pp + kBK / 2 * kBQ);

  for (int64_t e2 = 0; e2 < e2n; ++e2) {
    for (int64_t q = 0; q < kBQ; ++q) qt2[e2 * kBQ + q] = q < b.nq ? pair_at(bq + q * p.q_row, e2, p.E) : 0u;
  }
  std::memset(ob, 0, static_cast<size_t>(kBQ * evp) * sizeof(float));
  __m512 m[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
  __m512 l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};

  int64_t s_end = p.S;
  if (p.causal) s_end = imin(b.i0 + b.nq + p.causal_offset, p.S);
  if (s_end < 0) s_end = 0;
  const __m512 scale = _mm512_set1_ps(p.scale_log2);

  for (int64_t j0 = 0; j0 < s_end; j0 += kBK) {
    const int64_t nk = imin(kBK, s_end - j0), nk2 = (nk + 1) / 2;
    int64_t jj = 0;
    for (; jj + kJT <= nk; jj += kJT) scores_tile<kJT>(qt2, bk + (j0 + jj) * p.k_row, p.k_row, p.E, st + jj * kBQ);
    for (; jj < nk; ++jj) scores_tile<1>(qt2, bk + (j0 + jj) * p.k_row, p.k_row, p.E, st + jj * kBQ);
    for (int64_t i = 0; i < nk * kBQ; i += 16) _mm512_storeu_ps(st + i, _mm512_mul_ps(_mm512_loadu_ps(st + i), scale));
    mask_block(p, b, j0, nk, st);

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
      for (int64_t j = 0; j < nk; ++j) {
        const __m512 pj = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(st + j * kBQ + h * 16), msafe));
        _mm512_storeu_ps(st + j * kBQ + h * 16, pj);
        sum = _mm512_add_ps(sum, pj);
      }
      l[h] = _mm512_fmadd_ps(l[h], alpha, sum);
      m[h] = mx;
      alignas(64) float a[16];
      _mm512_store_ps(a, alpha);
      for (int q = 0; q < 16; ++q) {
        float* row = ob + (h * 16 + q) * evp;
        const __m512 av = _mm512_set1_ps(a[q]);
        for (int64_t c = 0; c < evp; c += 16) _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), av));
      }
    }
    if (p.dropout_p > 0.0f) dropout_block(p, b, j0, nk, st);

    // P^T as key pairs; an odd last key pairs with a zero weight (and, in vp, a zero value row,
    // or the next block's first key: kBK is even, so only the head's last key is ever odd).
    if (nk % 2 != 0) std::memset(st + nk * kBQ, 0, kBQ * sizeof(float));
    for (int64_t j2 = 0; j2 < nk2; ++j2) {
      for (int h = 0; h < 2; ++h) {
        const __m512i pr = pair_rows(_mm512_loadu_ps(st + 2 * j2 * kBQ + h * 16),
                                     _mm512_loadu_ps(st + (2 * j2 + 1) * kBQ + h * 16));
        _mm512_storeu_si512(pp + j2 * kBQ + h * 16, pr);
      }
    }
    const uint32_t* vp = b.vp + j0 / 2 * evp;
    int64_t c0 = 0;
    for (; c0 + 64 <= evp; c0 += 64) pv_chunk<4>(pp, vp, nk2, evp, c0, ob);
    for (; c0 < evp; c0 += 16) pv_chunk<1>(pp, vp, nk2, evp, c0, ob);
  }

  alignas(64) float lv[kBQ], mv[kBQ];
  _mm512_store_ps(lv, l[0]);
  _mm512_store_ps(lv + 16, l[1]);
  _mm512_store_ps(mv, m[0]);
  _mm512_store_ps(mv + 16, m[1]);
  for (int64_t q = 0; q < b.nq; ++q) {
    const float inv = lv[q] > 0.0f ? 1.0f / lv[q] : 0.0f;
    uint16_t* out = static_cast<uint16_t*>(b.o) + q * p.o_row;
    const float* row = ob + q * evp;
    int64_t c = 0;
    for (; c + 16 <= p.Ev; c += 16) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)r);
    }
    for (; c < p.Ev; ++c) {
      const float x = row[c] * inv;
      out[c] = x != x ? uint16_t{0x7fc0} : round_bf16(x);  // a NaN row stays NaN
    }
    if (b.lse != nullptr) {  // base 2, as the float32 kernel's
      b.lse[q] = lv[q] > 0.0f ? mv[q] + __builtin_log2f(lv[q]) : kNegInf;
      if (lv[q] != lv[q]) b.lse[q] = lv[q];
    }
  }
}

}  // namespace
}  // namespace attn::cpu::avx512_bf16

namespace attn::cpu {
const Bf16ForwardKernel& bf16_kernel_avx512() {
  using namespace avx512_bf16;
  static const Bf16ForwardKernel k{kBQ, workspace_bytes, nullptr, nullptr, packed_v_words, pack_v_pairs,
                                   forward_block};
  return k;
}
}  // namespace attn::cpu

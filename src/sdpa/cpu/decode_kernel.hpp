// Split-KV decode kernel (flash-decoding) for one work item: R query rows against one kv head's
// keys [j0, j1), leaving a partial softmax (see decode_params.hpp).
//
// Included after flash_kernel.hpp by flash_avx512.cpp, flash_avx2.cpp and flash_generic.cpp,
// so it shares their vector type `vf` (W floats), exp2v and per-ISA namespace.
//
// Shapes and tiling: the item's rows are few (GQA group x L <= 16 queries), its keys many.
// Keys go by chunks of up to kDecodeChunk tokens (a chunk may span pages; each page's run of
// rows is contiguous):
//   st   (R, kDecodeChunk)  base-2 scores of the chunk, then its probabilities
//   kbuf (Ep), vbuf (Evp)   one key / value row widened to float32 (16-bit or int8 caches, or a
//                           head dim that is not a whole number of vectors)
//   acc  (R, Evp)           the item's output accumulators (the caller's partial buffer)
// A key row is read from memory once and dotted with all R query rows while it sits in L1; a
// value row likewise feeds all R accumulators. So K and V stream through once per kv head:
// (E + Ev) * S * sizeof(element) bytes per item range, the whole cost of decoding. The
// arithmetic (R dot products and R AXPYs per token) is far below what the memory allows, so
// the code favours simplicity over register tiling.
//
// Numerics: as the fused forward's (flash_kernel.hpp): scores are scaled once after the dot
// product, masked positions get -inf (never added), a zero probability never multiplies a
// value (so NaN/Inf in a value whose weight is 0 cannot leak), and a row with no visible key
// keeps l = 0. The driver merges ranges with the same rule.
#include "sdpa/cpu/decode_params.hpp"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace attn::cpu::ATTN_SIMD_NS {

constexpr int64_t kDecodeChunk = 64;

inline int64_t decode_workspace_floats(int64_t R, int64_t Ep, int64_t Evp) {
  return R * kDecodeChunk + Ep + Evp;
}

inline float hsum(vf x) {
#if ATTN_SIMD_WIDTH == 16
  using v8 = float __attribute__((vector_size(32)));
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#elif ATTN_SIMD_WIDTH == 8
  const vf a = x;
#endif
#if ATTN_SIMD_WIDTH >= 8
  using v4 = float __attribute__((vector_size(16)));
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  return (x[0] + x[2]) + (x[1] + x[3]);
#endif
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

inline float element(const void* row, KvType t, int64_t e) {
  switch (t) {
    case KvType::kFloat32: return static_cast<const float*>(row)[e];
    case KvType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[e]) << 16;
      float r;
      std::memcpy(&r, &bits, sizeof r);
      return r;
    }
    case KvType::kFloat16: return half_to_float(static_cast<const uint16_t*>(row)[e]);
    case KvType::kInt8: return static_cast<float>(static_cast<const int8_t*>(row)[e]);
  }
  return 0.0f;
}

// W elements of a row of type T starting at e, as floats.
template <KvType T>
inline vf load_as_float(const void* row, int64_t e) {
  if constexpr (T == KvType::kFloat32) {
    return load(static_cast<const float*>(row) + e);
  } else if constexpr (T == KvType::kBFloat16) {
    using vu16 = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));
    vu16 h;
    std::memcpy(&h, static_cast<const uint16_t*>(row) + e, sizeof h);
    using vu32 = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));
    const vu32 bits = __builtin_convertvector(h, vu32) << 16;  // unsigned: no signed overflow
    vf r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  } else if constexpr (T == KvType::kInt8) {
    using vi8 = int8_t __attribute__((vector_size(W)));
    vi8 b;
    std::memcpy(&b, static_cast<const int8_t*>(row) + e, sizeof b);
    return __builtin_convertvector(b, vf);
  } else {  // kFloat16
#if defined(__AVX512F__)
    if constexpr (W == 16) {
      const __m512 r = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + e)));
      vf out;
      std::memcpy(&out, &r, sizeof out);
      return out;
    }
#endif
#if defined(__F16C__)
    if constexpr (W == 8) {
      const __m256 r = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + e)));
      vf out;
      std::memcpy(&out, &r, sizeof out);
      return out;
    }
#endif
    vf out;
    for (int l = 0; l < W; ++l) out[l] = half_to_float(static_cast<const uint16_t*>(row)[e + l]);
    return out;
  }
}

// The row as float32, zero-padded to `padded` elements: a pointer into the cache itself when
// it is float32 already and a whole number of vectors, else into buf.
template <KvType T>
inline const float* widen_row(const void* row, int64_t n, int64_t padded, float* buf) {
  if constexpr (T == KvType::kFloat32) {
    if (n == padded && n % W == 0) return static_cast<const float*>(row);
  }
  int64_t e = 0;
  for (; e + W <= n; e += W) store(buf + e, load_as_float<T>(row, e));
  for (; e < n; ++e) buf[e] = element(row, T, e);
  for (; e < padded; ++e) buf[e] = 0.0f;
  return buf;
}

constexpr int64_t elem_size(KvType t) {
  return t == KvType::kFloat32 ? 4 : t == KvType::kInt8 ? 1 : 2;
}

// Calls f(u, row, scale) for tokens j0 + u, u in [0, n), walking the pages: one division per
// page run, not per token. `scale` is the int8 scale of the row (1 for float caches).
template <KvType T, typename F>
inline void for_rows(const DecodeKv& kv, bool values, int64_t j0, int64_t n, F&& f) {
  const char* base = static_cast<const char*>(values ? kv.v : kv.k);
  const int64_t page_stride = values ? kv.v_page : kv.k_page;
  const int64_t row_stride = values ? kv.v_row : kv.k_row;
  const float* scales = values ? kv.v_scale : kv.k_scale;
  int64_t u = 0;
  while (u < n) {
    const int64_t j = j0 + u, slot = j / kv.page_size, r0 = j % kv.page_size;
    const int64_t page = kv.pages != nullptr ? kv.pages[slot] : slot;
    const int64_t run = imin(n - u, kv.page_size - r0);
    const char* row = base + (page * page_stride + r0 * row_stride) * elem_size(T);
    const float* sc = T == KvType::kInt8 ? scales + page * kv.scale_page + r0 : nullptr;
    for (int64_t t = 0; t < run; ++t) {
      f(u + t, row + t * row_stride * elem_size(T), T == KvType::kInt8 ? sc[t] : 1.0f);
    }
    u += run;
  }
}

template <KvType T>
inline void decode_split_t(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, float* ws) {
  float* st = ws;
  float* kbuf = st + it.R * kDecodeChunk;
  float* vbuf = kbuf + p.Ep;
  constexpr float kLog2e = 1.4426950408889634f;

  // Keys past every row's causal limit are read by no row.
  int64_t j_end = it.j1;
  if (p.causal) {
    int64_t last = -1;
    for (int64_t r = 0; r < it.R; ++r) last = it.query_pos[r] + kv.causal_offset > last ? it.query_pos[r] + kv.causal_offset : last;
    j_end = imin(j_end, last + 1);
  }
  for (int64_t r = 0; r < it.R; ++r) {
    it.m[r] = kNegInf;
    it.l[r] = 0.0f;
    zero(it.acc + r * p.Evp, p.Evp);
  }

  for (int64_t c0 = it.j0; c0 < j_end; c0 += kDecodeChunk) {
    const int64_t nk = imin(kDecodeChunk, j_end - c0);
    const int64_t nkp = (nk + W - 1) / W * W;

    for_rows<T>(kv, false, c0, nk, [&](int64_t u, const char* row, float kscale) {
      const float* kr = widen_row<T>(row, p.E, p.Ep, kbuf);
      const float s = kscale * p.scale_log2;
      for (int64_t r = 0; r < it.R; ++r) {
        const float* q = it.q + r * p.Ep;
        vf a0 = {}, a1 = {};
        int64_t e = 0;
        for (; e + 2 * W <= p.Ep; e += 2 * W) {
          a0 += load(q + e) * load(kr + e);
          a1 += load(q + e + W) * load(kr + e + W);
        }
        if (e < p.Ep) a0 += load(q + e) * load(kr + e);
        st[r * kDecodeChunk + u] = hsum(a0 + a1) * s;
      }
    });

    for (int64_t r = 0; r < it.R; ++r) {
      float* sr = st + r * kDecodeChunk;
      if (p.causal) {
        const int64_t limit = it.query_pos[r] + kv.causal_offset;
        for (int64_t u = limit + 1 - c0 < 0 ? 0 : limit + 1 - c0; u < nk; ++u) sr[u] = kNegInf;
      }
      if (it.mask[r] != nullptr) {
        const float* mr = it.mask[r] + c0 * p.mask_col;
        for (int64_t u = 0; u < nk; ++u) {
          const float mv = mr[u * p.mask_col];
          if (p.mask_is_bool) {
            if (mv == 0.0f) sr[u] = kNegInf;
          } else {
            sr[u] += mv * kLog2e;  // additive masks are in natural-log units
          }
        }
      }
      for (int64_t u = nk; u < nkp; ++u) sr[u] = kNegInf;

      // Online softmax over the chunk: new max, rescale, probabilities, sum.
      vf mx = splat(it.m[r]);
      for (int64_t u = 0; u < nkp; u += W) mx = vmax(mx, load(sr + u));
      float m_new = it.m[r];
      for (int l = 0; l < W; ++l) m_new = mx[l] > m_new || mx[l] != mx[l] ? mx[l] : m_new;
      const float msafe = m_new == kNegInf ? 0.0f : m_new;  // all hidden so far: exp2 gives 0
      const float alpha = exp2v(splat(it.m[r] - msafe))[0];
      vf sum = {};
      for (int64_t u = 0; u < nkp; u += W) {
        const vf pu = exp2v(load(sr + u) - msafe);
        store(sr + u, pu);
        sum += pu;
      }
      it.l[r] = it.l[r] * alpha + hsum(sum);
      it.m[r] = m_new;
      if (alpha != 1.0f) {
        float* a = it.acc + r * p.Evp;
        for (int64_t c = 0; c < p.Evp; c += W) store(a + c, load(a + c) * alpha);
      }
    }

    for_rows<T>(kv, true, c0, nk, [&](int64_t u, const char* row, float vscale) {
      const float* vr = widen_row<T>(row, p.Ev, p.Evp, vbuf);
      for (int64_t r = 0; r < it.R; ++r) {
        const float pr = st[r * kDecodeChunk + u];
        if (pr == 0.0f) continue;  // a zero weight must not turn a NaN/Inf value into NaN
        const vf pb = splat(pr * vscale);
        float* a = it.acc + r * p.Evp;
        for (int64_t c = 0; c < p.Evp; c += W) store(a + c, load(a + c) + pb * load(vr + c));
      }
    });
  }
}

inline void decode_split(const DecodeParams& p, const DecodeKv& kv, const DecodeItem& it, float* ws) {
  switch (p.kv) {
    case KvType::kFloat32: return decode_split_t<KvType::kFloat32>(p, kv, it, ws);
    case KvType::kBFloat16: return decode_split_t<KvType::kBFloat16>(p, kv, it, ws);
    case KvType::kFloat16: return decode_split_t<KvType::kFloat16>(p, kv, it, ws);
    case KvType::kInt8: return decode_split_t<KvType::kInt8>(p, kv, it, ws);
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

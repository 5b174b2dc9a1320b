// The split-KV decode kernel's rows (decode_kernel.hpp): how it finds, prefetches and reads the
// keys and values. A step covers a chunk of up to kDecodeChunk tokens of one kv head; chunk_rows
// finds its rows through the pages, the prefetch helpers request them ahead of use (key rows
// kPrefetchAhead tokens on, value rows a step ahead: decode_pv.hpp's PvPrefetch), and
// load_as_float widens a cache's elements to float32 in registers (widen_row into a buffer, for
// rows that are not a whole number of vectors). The lane reductions (hsum, hmax) are here too.
// Included by decode_kernel.hpp inside its per-ISA namespace, after flash_kernel.hpp (vf, W,
// load, store).
//
// Prefetch helpers are always_inline: GCC finds a function whose only effect is a prefetch pure
// and drops its calls (a plain inline one vanished from decode_step).
#pragma once

namespace attn::cpu::ATTN_SIMD_NS {

constexpr int64_t kDecodeChunk = 64;
constexpr int64_t kPrefetchAhead = 16;  // key rows
// Prefetches go to L2 (prefetcht1), not L1 (prefetcht0): an L1 prefetch holds one of the
// core's few L1 miss buffers until its line arrives from memory, so the stream stalls on them
// while the core computes; L2 tracks many more misses, and the L1's own stream prefetcher
// brings the lines the last step from L2. Measured on AMD Zen 4 (2 threads, H_q 32, H_kv 8,
// E 128, S 8192, 4 KiB pages then): float32 K/V 3.5-3.7 -> 2.6 ms, bf16 K/V 1.93 -> 1.50 ms,
// H_kv 32: 11.1-11.7 -> 9.0-9.6 ms; one thread 6.9-7.0 -> 4.5-4.7 ms. Prefetching 32, 64 or 128
// rows ahead instead of 16, or 8-16 KiB ahead whatever the row size, measured no better; no
// software prefetch at all was 1.2-1.6x slower. Also tried on huge pages and measured no better
// (float32, alternating): a line in every 2, 4 or 8 (1 thread 4.6 -> 5.6-6.5 ms: the hardware
// does not fill the gaps); the next chunk's keys prefetched during P.V instead of 16 rows ahead
// (4.1 -> 4.8 ms); keys and values as one stream 8-48 rows ahead (3.8 -> 4.9-5.1 ms); no value
// prefetch (no faster from contiguous K/V, 2.62 -> 2.94 ms with 16-token pages). Where the time
// went: one thread took about the sum of its arithmetic (~120 cycles per token at H_q/H_kv = 4,
// E 128, a quarter of it on the prefetch instructions) and its memory time, two threads ~75 % of
// the read probe: the score loop prefetched this chunk's values too, so memory was idle while
// P.V computed. The values prefetched a chunk ahead by P.V instead (PvPrefetch), alternating
// with the old binary on Zen 4: float32 2 threads 2.47-2.89 -> 2.14-2.37 ms (73 -> 85 % of a
// 33-37 GB/s probe; a 61-65 GB/s probe, seen in some runs, the kernel reaches at ~55 %), one
// thread 4.0-4.1 -> 3.4-3.5 ms, bf16 1.15-1.27 -> 1.04-1.10 ms. Prefetching the next chunk's
// values in memory order instead (row by row, the same lines per step) was 4 % faster from
// contiguous K/V but 1.16x slower with 16-token pages (1.07x for this order).
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's locality 2 is prefetcht1

// The lines of bytes [0, kBytes) from p, into L2 (kLocality 2: prefetcht1) or L1 (3: prefetcht0).
template <int64_t kBytes, int kLocality = kPrefetchLocality>
[[gnu::always_inline]] inline void prefetch_lines(const void* p) {
  for (int64_t b = 0; b < kBytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, kLocality);
}

// The lines of bytes [0, bytes) from p, into L2.
[[gnu::always_inline]] inline void prefetch_bytes(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, kPrefetchLocality);
}

// The key row kPrefetchAhead tokens after token u, if there is one among the n rows of kr.
[[gnu::always_inline]] inline void prefetch_key_ahead(const char* const* kr, int64_t n, int64_t u, int64_t k_bytes) {
  if (u + kPrefetchAhead < n) prefetch_bytes(kr[u + kPrefetchAhead], k_bytes);
}

// x's lanes combined by `op` (on vectors and on floats) in a halving tree: lanes l and l + W/2,
// then l + W/4, and so on. hsum4 and hsum16 add in the same order.
template <typename Op>
inline float reduce_lanes(vf x, Op op) {
#if ATTN_SIMD_WIDTH == 16
  using v8 = float __attribute__((vector_size(32)));
  const v8 a = op(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
                  __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
#elif ATTN_SIMD_WIDTH == 8
  const vf a = x;
#endif
#if ATTN_SIMD_WIDTH >= 8
  using v4 = float __attribute__((vector_size(16)));
  const v4 b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#else
  const vf b = x;
#endif
  return op(op(b[0], b[2]), op(b[1], b[3]));
}

inline float hsum(vf x) {
  return reduce_lanes(x, [](auto a, auto b) { return a + b; });
}

// The largest lane (no lane may be NaN: the caller tests first).
inline float hmax(vf x) {
  return reduce_lanes(x, [](auto a, auto b) { return a > b ? a : b; });
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
    const uint16_t* src = static_cast<const uint16_t*>(row) + e;
#if defined(__AVX512F__)
    if constexpr (W == 16) {  // one vpmovzxwd zmm (the generic form splits it in two halves)
      const __m512i b = _mm512_maskz_slli_epi32(
          0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
      vf out;
      std::memcpy(&out, &b, sizeof out);
      return out;
    }
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) {
      const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16);
      vf out;
      std::memcpy(&out, &b, sizeof out);
      return out;
    }
#endif
    using vu16 = uint16_t __attribute__((vector_size(W * sizeof(uint16_t))));
    vu16 h;
    std::memcpy(&h, src, sizeof h);
    using vu32 = uint32_t __attribute__((vector_size(W * sizeof(uint32_t))));
    const vu32 bits = __builtin_convertvector(h, vu32) << 16;  // unsigned: no signed overflow
    vf r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  } else if constexpr (T == KvType::kInt8) {
#if defined(__AVX512F__)
    if constexpr (W == 16) {  // vpmovsxbd + vcvtdq2ps (the generic form is scalarised; the maskz forms
                              // keep GCC 12 from warning about _mm512_undefined)
      const __m512 f = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff,
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + e))));
      vf out;
      std::memcpy(&out, &f, sizeof out);
      return out;
    }
#endif
#if defined(__AVX2__)
    if constexpr (W == 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + e))));
      vf out;
      std::memcpy(&out, &f, sizeof out);
      return out;
    }
#endif
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

// The pool's page that holds token j.
inline int64_t page_of(const DecodeKv& kv, int64_t j) {
  const int64_t slot = j / kv.page_size;
  return kv.pages != nullptr ? kv.pages[slot] : slot;
}

// The address of token j's key row (or with `values`, its value row), through the pages.
template <KvType T>
inline const char* row_address(const DecodeKv& kv, bool values, int64_t j) {
  const char* base = static_cast<const char*>(values ? kv.v : kv.k);
  const int64_t page_elems = values ? kv.v_page : kv.k_page, row_elems = values ? kv.v_row : kv.k_row;
  return base + (page_of(kv, j) * page_elems + j % kv.page_size * row_elems) * elem_size(T);
}

// The chunk's row addresses: rows[u] (and for int8 scales[u], the row's scale; float caches
// leave scales alone) of tokens j0 + u, u in [0, n), walking the pages one run of a page at a
// time (row_address for the run's first row, then the row stride).
template <KvType T>
inline void chunk_rows(const DecodeKv& kv, bool values, int64_t j0, int64_t n, const char** rows,
                       float* scales) {
  const int64_t row_bytes = (values ? kv.v_row : kv.k_row) * elem_size(T);
  const float* sc = values ? kv.v_scale : kv.k_scale;
  int64_t u = 0;
  while (u < n) {
    const int64_t j = j0 + u, r0 = j % kv.page_size;
    const int64_t run = imin(n - u, kv.page_size - r0);
    const char* row = row_address<T>(kv, values, j);
    for (int64_t t = 0; t < run; ++t) rows[u + t] = row + t * row_bytes;
    if (T == KvType::kInt8) {
      const int64_t page = page_of(kv, j);
      for (int64_t t = 0; t < run; ++t) scales[u + t] = sc[page * kv.scale_page + r0 + t];
    }
    u += run;
  }
}

}  // namespace attn::cpu::ATTN_SIMD_NS

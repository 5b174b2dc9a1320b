// The tiled kernels behind attn::flex_attention (attn/flex_attention.hpp): plain arrays in, no
// attn types, instantiated in the caller's translation unit with the caller's score_mod and
// mask_mod inlined.
//
// Shapes: B batches, Hq query heads reading Hkv key/value heads (Hq % Hkv == 0), L queries and S
// keys of E features, values of Ev features. Inputs are read through their strides; outputs are
// written row-major: out (B, Hq, L, Ev), lse (B, Hq, L), dQ/dK/dV as q/k/v.
//
// Tiling (FlashAttention-2): a work item is one (batch, head, query tile of bq rows); it walks the
// key tiles of bk keys in order, computes the bq x bk score tile, applies mask_mod and score_mod
// element by element, and folds the tile into a running max / running sum / output accumulator
// (online softmax). The block mask says per tile whether it is empty (skipped: no score, no call),
// partial (mask_mod called per element) or full (mask_mod not called).
//
// Memory traffic: keys are packed once per call, transposed per tile (E x bk, so a score row is a
// run of vector FMAs over keys whatever E is) and values row-major padded to the vector width;
// each item then reads its query tile once and every non-empty key/value tile once, all from L1/L2
// (a 64 x 64 tile of E = 128 is 32 KB). No L x S matrix exists: per thread, O(bq * (bk + Ev)).
//
// Backward: two passes over the same tiles, each output written by exactly one item, so results
// are bit-identical for any thread count without atomics. Pass 1, items (batch, kv head, key
// tile): dK and dV of those keys from every query of the group's heads. Pass 2, items (batch,
// head, query tile): dQ. Both recompute P = exp(x - lse) from the forward's LSE (the price of no
// L x S buffer and of no races: the score tile is computed twice).
//
// Vector width: GCC vector extensions, 16 lanes where the translation unit is compiled with
// AVX-512F, 8 with AVX, else 4. Everything whose code depends on the width lives in an inline
// namespace named after it, so translation units built for different instruction sets do not
// merge their instantiations at link time (one AVX-512 copy must never serve an AVX2-only TU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define ATTN_FLEX_LANES 16
#define ATTN_FLEX_ISA_NS flex_isa_avx512
#elif defined(__AVX__)
#define ATTN_FLEX_LANES 8
#define ATTN_FLEX_ISA_NS flex_isa_avx
#else
#define ATTN_FLEX_LANES 4
#define ATTN_FLEX_ISA_NS flex_isa_generic
#endif

namespace attn::flex::detail {

// Tile kinds as stored in a block mask (values of attn::flex::TileKind).
inline constexpr uint8_t kTileEmpty = 0, kTilePartial = 1, kTileFull = 2;

// A tensor of up to 4 dims read as (batch, head, row, col); missing leading dims have stride 0.
struct Strided {
  const float* p = nullptr;
  int64_t sb = 0, sh = 0, sr = 0, sc = 0;
  float at(int64_t b, int64_t h, int64_t r, int64_t c) const { return p[b * sb + h * sh + r * sr + c * sc]; }
};

struct Dims {
  int64_t B, Hq, Hkv, L, S, E, Ev;
};

// Which tiles to visit. kinds == nullptr: every tile is `fallback` (partial, or full for NoMask).
// Batch/head extents of 1 broadcast (the block mask was built once for all of them).
struct Tiles {
  const uint8_t* kinds = nullptr;
  int64_t B = 1, H = 1, nq = 0, nk = 0;
  uint8_t fallback = kTilePartial;
  uint8_t at(int64_t b, int64_t h, int64_t qt, int64_t kt) const {
    if (kinds == nullptr) return fallback;
    const int64_t bb = B == 1 ? 0 : b, hh = H == 1 ? 0 : h;
    return kinds[((bb * H + hh) * nq + qt) * nk + kt];
  }
};

struct FwdArgs {
  Dims d;
  float scale;
  Strided q, k, v;
  int64_t bq, bk;  // tile sizes; bk a multiple of 16 (every vector width)
  Tiles tiles;
  float* out;  // (B, Hq, L, Ev)
  float* lse;  // (B, Hq, L) or nullptr
  int threads;
};

struct BwdArgs {
  Dims d;
  float scale;
  Strided q, k, v, out, dout;
  Strided lse;  // (batch, head, row) with col unused
  int64_t bq, bk;
  Tiles tiles;
  float* dq;  // q's shape, row-major
  float* dk;
  float* dv;
  int threads;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs body(i, scratch) for i in [0, n), each i on one thread, with one copy of `proto` per
// thread. Items are independent, so the order in which threads take them changes no bits.
// Without OpenMP (the caller's TU built without -fopenmp) the items run in order on this thread.
template <class Scratch, class Body>
void run_items(int64_t n, int threads, const Scratch& proto, const Body& body) {
#ifdef _OPENMP
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt) if (n > 1 && nt > 1)
  {
    Scratch s = proto;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(i, s);
  }
#else
  (void)threads;
  Scratch s = proto;
  for (int64_t i = 0; i < n; ++i) body(i, s);
#endif
}

inline namespace ATTN_FLEX_ISA_NS {

inline constexpr int kLanes = ATTN_FLEX_LANES;
typedef float vf __attribute__((vector_size(4 * ATTN_FLEX_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * ATTN_FLEX_LANES)));

// memcpy: tiles are only 4-byte aligned (row strides of E floats); compiles to unaligned moves.
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float c) { return vf{} + c; }
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(x) lane by lane, within ~2 ulp of std::exp: 2^n * p(r) with n = round(x / ln 2) and a
// degree-7 Taylor polynomial on |r| <= ln2/2 (truncation 5e-9 relative). Below -87 the result is
// exactly 0 (softmax's excluded -inf scores, and weights below FLT_MIN that would only be
// subnormal noise); NaN stays NaN. The rounding avoids the add-and-subtract-2^23 trick, which
// -ffast-math in the caller's TU would fold away.
inline vf exp_v(vf x) {
  const float lo = -87.0f, hi = 88.3f;  // 2^n stays a normal float for n in [-126, 127]
  vf xc = x < lo ? splat(lo) : x;
  xc = xc > hi ? splat(hi) : xc;
  const vf t = xc * 1.44269504088896341f;
  const vi ni = __builtin_convertvector(t + (t < 0.0f ? splat(-0.5f) : splat(0.5f)), vi);
  const vf n = __builtin_convertvector(ni, vf);
  vf r = xc - n * 0.693359375f;  // ln 2 split in two: n * hi is exact
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vf two_n = (vf)((ni + 127) << 23);
  const vf y = p * two_n;
  return x < lo ? splat(0.0f) : y;
}

// C[i][0:n) += sum_k A(i, k) * Bm[k][0:n) for i < m, with A(i, k) = a[i * ars + k * acs] (so a
// transposed A costs nothing) and n a multiple of kLanes. Four vector accumulators per pass keep
// C in registers while one row of Bm streams from L1. kSkipZero: a zero weight skips its row of
// Bm, so an excluded key's Inf/NaN value (weight exactly 0) cannot turn into 0 * Inf = NaN.
template <bool kSkipZero>
inline void gemm_acc(float* c, int64_t ldc, int64_t m, int64_t n, const float* a, int64_t ars,
                     int64_t acs, int64_t kdim, const float* bm, int64_t ldb) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* ai = a + i * ars;
    int64_t col = 0;
    for (; col + 4 * kLanes <= n; col += 4 * kLanes) {
      vf c0 = load(ci + col), c1 = load(ci + col + kLanes), c2 = load(ci + col + 2 * kLanes),
         c3 = load(ci + col + 3 * kLanes);
      for (int64_t k = 0; k < kdim; ++k) {
        const float w = ai[k * acs];
        if (kSkipZero && w == 0.0f) continue;
        const float* bk = bm + k * ldb + col;
        c0 += w * load(bk);
        c1 += w * load(bk + kLanes);
        c2 += w * load(bk + 2 * kLanes);
        c3 += w * load(bk + 3 * kLanes);
      }
      store(ci + col, c0);
      store(ci + col + kLanes, c1);
      store(ci + col + 2 * kLanes, c2);
      store(ci + col + 3 * kLanes, c3);
    }
    for (; col < n; col += kLanes) {
      vf c0 = load(ci + col);
      for (int64_t k = 0; k < kdim; ++k) {
        const float w = ai[k * acs];
        if (kSkipZero && w == 0.0f) continue;
        c0 += w * load(bm + k * ldb + col);
      }
      store(ci + col, c0);
    }
  }
}

inline int64_t round_up_lanes(int64_t n) { return ceil_div(n, kLanes) * kLanes; }

// Keys of one (batch, kv head) transposed per tile: [tile][feature][bk], zero beyond S.
inline void pack_transposed_tiles(float* dst, const Strided& src, int64_t b, int64_t h, int64_t rows,
                                  int64_t cols, int64_t bk) {
  const int64_t ntiles = ceil_div(rows, bk);
  std::fill(dst, dst + ntiles * cols * bk, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* t = dst + (r / bk) * cols * bk + r % bk;
    for (int64_t c = 0; c < cols; ++c) t[c * bk] = src.at(b, h, r, c);
  }
}

// Rows of one (batch, head) row-major with `ld` >= cols columns, zero-padded to `padded_rows`.
inline void pack_rows(float* dst, const Strided& src, int64_t b, int64_t h, int64_t rows, int64_t cols,
                      int64_t ld, int64_t padded_rows) {
  std::fill(dst, dst + padded_rows * ld, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * ld + c] = src.at(b, h, r, c);
  }
}

// Scores of a tile through the user's functors, in place: s[r][j] holds q.k on entry and x (or
// -inf where excluded or beyond the keys) on return; g (if given) receives d score_mod / d score
// at included positions and 0 elsewhere. Returns nothing; the caller reads the row maxima itself.
template <class ScoreMod, class MaskMod, bool kWithGrad>
inline void apply_mods(float* s, float* g, int64_t ld, int64_t rows, int64_t cols, int64_t b, int64_t h,
                       int64_t i0, int64_t j0, bool partial, float scale, const ScoreMod& score_mod,
                       const MaskMod& mask_mod) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * ld;
    float* gr = kWithGrad ? g + r * ld : nullptr;
    const int64_t i = i0 + r;
    for (int64_t j = 0; j < cols; ++j) {
      const float raw = sr[j] * scale;
      if (partial && !mask_mod(b, h, i, j0 + j)) {
        sr[j] = kNegInf;
        if constexpr (kWithGrad) gr[j] = 0.0f;
        continue;
      }
      sr[j] = score_mod(raw, b, h, i, j0 + j);
      if constexpr (kWithGrad) gr[j] = score_mod.grad(raw, b, h, i, j0 + j);
    }
    for (int64_t j = cols; j < ld; ++j) {
      sr[j] = kNegInf;
      if constexpr (kWithGrad) gr[j] = 0.0f;
    }
  }
}

// ---- forward --------------------------------------------------------------------------------------

struct FwdScratch {
  std::vector<float> q, s, acc, m, l;
};

template <class ScoreMod, class MaskMod>
void flex_forward(const FwdArgs& a, const ScoreMod& score_mod, const MaskMod& mask_mod) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const Dims& d = a.d;
  const int64_t group = d.Hq / d.Hkv, bq = a.bq, bk = a.bk;
  const int64_t nkt = ceil_div(d.S, bk), nqt = ceil_div(d.L, bq), spad = nkt * bk;
  const int64_t evp = round_up_lanes(d.Ev);
  const int64_t kt_size = d.E * bk, kpack = nkt * kt_size, vpack = spad * evp;

  // Keys and values once per (batch, kv head); every query tile of every head in the group reuses them.
  std::vector<float> kt(static_cast<size_t>(d.B * d.Hkv * kpack)), vr(static_cast<size_t>(d.B * d.Hkv * vpack));
  run_items(d.B * d.Hkv, a.threads, 0, [&](int64_t item, int) {
    const int64_t b = item / d.Hkv, h = item % d.Hkv;
    pack_transposed_tiles(kt.data() + item * kpack, a.k, b, h, d.S, d.E, bk);
    pack_rows(vr.data() + item * vpack, a.v, b, h, d.S, d.Ev, evp, spad);
  });

  FwdScratch proto;
  proto.q.resize(static_cast<size_t>(bq * d.E));
  proto.s.resize(static_cast<size_t>(bq * bk));
  proto.acc.resize(static_cast<size_t>(bq * evp));
  proto.m.resize(static_cast<size_t>(bq));
  proto.l.resize(static_cast<size_t>(bq));

  run_items(d.B * d.Hq * nqt, a.threads, proto, [&](int64_t item, FwdScratch& w) {
    const int64_t qt = item % nqt, bh = item / nqt, b = bh / d.Hq, h = bh % d.Hq;
    const int64_t kvi = b * d.Hkv + h / group;
    const int64_t i0 = qt * bq, rows = std::min(bq, d.L - i0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < d.E; ++e) w.q[r * d.E + e] = a.q.at(b, h, i0 + r, e);
    }
    std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    std::fill(w.m.begin(), w.m.end(), kNegInf);
    std::fill(w.l.begin(), w.l.end(), 0.0f);
    for (int64_t t = 0; t < nkt; ++t) {
      const uint8_t kind = a.tiles.at(b, h, qt, t);
      if (kind == kTileEmpty) continue;
      const int64_t j0 = t * bk, cols = std::min(bk, d.S - j0);
      float* s = w.s.data();
      std::fill(s, s + rows * bk, 0.0f);
      gemm_acc<false>(s, bk, rows, bk, w.q.data(), d.E, 1, d.E, kt.data() + kvi * kpack + t * kt_size, bk);
      apply_mods<ScoreMod, MaskMod, false>(s, nullptr, bk, rows, cols, b, h, i0, j0, kind == kTilePartial,
                                           a.scale, score_mod, mask_mod);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * bk;
        // NaN-propagating max: a NaN score must reach the output, not be dropped by the max.
        float mx = kNegInf;
        for (int64_t j = 0; j < cols; ++j) mx = (sr[j] > mx || std::isnan(sr[j])) ? sr[j] : mx;
        const float m_old = w.m[r];
        const float m_new = std::isnan(mx) || std::isnan(m_old) ? mx + m_old : std::max(m_old, mx);
        if (m_new == kNegInf) {  // nothing included yet in this row: weights 0 (exp(-inf + inf) is NaN)
          std::fill(sr, sr + bk, 0.0f);
          continue;
        }
        const float alpha = std::exp(m_old - m_new);  // 0 on the first included tile
        vf sum{};
        for (int64_t j = 0; j < bk; j += kLanes) {
          const vf p = exp_v(load(sr + j) - m_new);
          store(sr + j, p);
          sum += p;
        }
        w.l[r] = w.l[r] * alpha + hsum(sum);
        if (alpha != 1.0f) {
          float* ar = w.acc.data() + r * evp;
          for (int64_t e = 0; e < evp; e += kLanes) store(ar + e, load(ar + e) * alpha);
        }
        w.m[r] = m_new;
      }
      gemm_acc<true>(w.acc.data(), evp, rows, evp, s, bk, 1, cols, vr.data() + kvi * vpack + j0 * evp, evp);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = (b * d.Hq + h) * d.L + i0 + r;
      const float l = w.l[r];
      // A row with every key excluded: output 0, lse -inf (attn's fully-masked-row policy).
      const float inv = l == 0.0f ? 0.0f : 1.0f / l;
      float* o = a.out + row * d.Ev;
      const float* ar = w.acc.data() + r * evp;
      for (int64_t e = 0; e < d.Ev; ++e) o[e] = ar[e] * inv;
      if (a.lse != nullptr) a.lse[row] = l == 0.0f ? kNegInf : w.m[r] + std::log(l);
    }
  });
}

// ---- backward -------------------------------------------------------------------------------------

struct BwdScratch {
  std::vector<float> p, ds, g, acc1, acc2;
};

// Packed operands of the backward, per (batch, kv head): keys transposed per tile, values
// transposed per tile, keys row-major; per (batch, head): queries, dO, D = rowsum(dO * O), lse.
struct BwdPack {
  int64_t nkt, nqt, spad, lpad, ep, evp, kt_size, vt_size;
  std::vector<float> kt, vt, krow, qrow, dorow, drow, lse;
};

// P and dS of query tile qt of head (b, h) against key tile t; both zero where excluded.
//   P = exp(x - lse), dP = dO V^T, dS = P (dP - D) * score_mod'(s)   (the caller applies `scale`).
template <class ScoreMod, class MaskMod>
inline void ds_tile(const BwdArgs& a, const BwdPack& pk, BwdScratch& w, int64_t b, int64_t h, int64_t qt,
                    int64_t t, bool partial, const ScoreMod& score_mod, const MaskMod& mask_mod) {
  const Dims& d = a.d;
  const int64_t bk = a.bk, bq = a.bq;
  const int64_t kvi = b * d.Hkv + h / (d.Hq / d.Hkv), bh = b * d.Hq + h;
  const int64_t i0 = qt * bq, rows = std::min(bq, d.L - i0), j0 = t * bk, cols = std::min(bk, d.S - j0);
  float* p = w.p.data();
  float* ds = w.ds.data();
  std::fill(p, p + rows * bk, 0.0f);
  std::fill(ds, ds + rows * bk, 0.0f);
  gemm_acc<false>(p, bk, rows, bk, pk.qrow.data() + (bh * pk.lpad + i0) * pk.ep, pk.ep, 1, d.E,
                  pk.kt.data() + kvi * pk.nkt * pk.kt_size + t * pk.kt_size, bk);
  gemm_acc<false>(ds, bk, rows, bk, pk.dorow.data() + (bh * pk.lpad + i0) * pk.evp, pk.evp, 1, d.Ev,
                  pk.vt.data() + kvi * pk.nkt * pk.vt_size + t * pk.vt_size, bk);
  apply_mods<ScoreMod, MaskMod, true>(p, w.g.data(), bk, rows, cols, b, h, i0, j0, partial, a.scale,
                                      score_mod, mask_mod);
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p + r * bk;
    float* dr = ds + r * bk;
    const float* gr = w.g.data() + r * bk;
    const float lse = pk.lse[bh * pk.lpad + i0 + r], dd = pk.drow[bh * pk.lpad + i0 + r];
    if (lse == -std::numeric_limits<float>::infinity()) {  // a row with every key excluded
      std::fill(pr, pr + bk, 0.0f);
      std::fill(dr, dr + bk, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < bk; j += kLanes) {
      const vf pv = exp_v(load(pr + j) - lse);
      // Where P is 0 so is dS, even if dP is Inf or NaN (an excluded key's value).
      const vf dsv = pv == 0.0f ? splat(0.0f) : pv * (load(dr + j) - dd) * load(gr + j);
      store(pr + j, pv);
      store(dr + j, dsv);
    }
  }
}

template <class ScoreMod, class MaskMod>
void flex_backward(const BwdArgs& a, const ScoreMod& score_mod, const MaskMod& mask_mod) {
  const Dims& d = a.d;
  const int64_t group = d.Hq / d.Hkv, bq = a.bq, bk = a.bk;
  BwdPack pk;
  pk.nkt = ceil_div(d.S, bk);
  pk.nqt = ceil_div(d.L, bq);
  pk.spad = pk.nkt * bk;
  pk.lpad = pk.nqt * bq;
  pk.ep = round_up_lanes(d.E);
  pk.evp = round_up_lanes(d.Ev);
  pk.kt_size = d.E * bk;
  pk.vt_size = d.Ev * bk;
  const int64_t nkv = d.B * d.Hkv, nq = d.B * d.Hq;
  pk.kt.resize(static_cast<size_t>(nkv * pk.nkt * pk.kt_size));
  pk.vt.resize(static_cast<size_t>(nkv * pk.nkt * pk.vt_size));
  pk.krow.resize(static_cast<size_t>(nkv * pk.spad * pk.ep));
  pk.qrow.resize(static_cast<size_t>(nq * pk.lpad * pk.ep));
  pk.dorow.resize(static_cast<size_t>(nq * pk.lpad * pk.evp));
  pk.drow.assign(static_cast<size_t>(nq * pk.lpad), 0.0f);
  pk.lse.assign(static_cast<size_t>(nq * pk.lpad), 0.0f);
  run_items(nkv, a.threads, 0, [&](int64_t item, int) {
    const int64_t b = item / d.Hkv, h = item % d.Hkv;
    pack_transposed_tiles(pk.kt.data() + item * pk.nkt * pk.kt_size, a.k, b, h, d.S, d.E, bk);
    pack_transposed_tiles(pk.vt.data() + item * pk.nkt * pk.vt_size, a.v, b, h, d.S, d.Ev, bk);
    pack_rows(pk.krow.data() + item * pk.spad * pk.ep, a.k, b, h, d.S, d.E, pk.ep, pk.spad);
  });
  run_items(nq, a.threads, 0, [&](int64_t item, int) {
    const int64_t b = item / d.Hq, h = item % d.Hq;
    pack_rows(pk.qrow.data() + item * pk.lpad * pk.ep, a.q, b, h, d.L, d.E, pk.ep, pk.lpad);
    pack_rows(pk.dorow.data() + item * pk.lpad * pk.evp, a.dout, b, h, d.L, d.Ev, pk.evp, pk.lpad);
    for (int64_t i = 0; i < d.L; ++i) {
      // D in float64: dP - D cancels where one key dominates, so D's own rounding should not add to it.
      double s = 0.0;
      for (int64_t e = 0; e < d.Ev; ++e) s += static_cast<double>(a.dout.at(b, h, i, e)) * a.out.at(b, h, i, e);
      pk.drow[item * pk.lpad + i] = static_cast<float>(s);
      pk.lse[item * pk.lpad + i] = a.lse.at(b, h, i, 0);
    }
  });

  BwdScratch proto;
  proto.p.resize(static_cast<size_t>(bq * bk));
  proto.ds.resize(static_cast<size_t>(bq * bk));
  proto.g.resize(static_cast<size_t>(bq * bk));

  // Pass 1: dK, dV of one key tile of one kv head, summed over the group's heads and all queries.
  BwdScratch proto1 = proto;
  proto1.acc1.resize(static_cast<size_t>(bk * pk.ep));
  proto1.acc2.resize(static_cast<size_t>(bk * pk.evp));
  run_items(nkv * pk.nkt, a.threads, proto1, [&](int64_t item, BwdScratch& w) {
    const int64_t t = item % pk.nkt, kvi = item / pk.nkt, b = kvi / d.Hkv, hkv = kvi % d.Hkv;
    const int64_t j0 = t * bk, cols = std::min(bk, d.S - j0);
    std::fill(w.acc1.begin(), w.acc1.end(), 0.0f);
    std::fill(w.acc2.begin(), w.acc2.end(), 0.0f);
    for (int64_t gi = 0; gi < group; ++gi) {
      const int64_t h = hkv * group + gi, bh = b * d.Hq + h;
      for (int64_t qt = 0; qt < pk.nqt; ++qt) {
        const uint8_t kind = a.tiles.at(b, h, qt, t);
        if (kind == kTileEmpty) continue;
        const int64_t i0 = qt * bq, rows = std::min(bq, d.L - i0);
        ds_tile(a, pk, w, b, h, qt, t, kind == kTilePartial, score_mod, mask_mod);
        // dV[j] += sum_i P[i][j] dO[i];  dK[j] += sum_i dS[i][j] Q[i]   (A transposed: ars 1, acs bk)
        gemm_acc<true>(w.acc2.data(), pk.evp, cols, pk.evp, w.p.data(), 1, bk, rows,
                       pk.dorow.data() + (bh * pk.lpad + i0) * pk.evp, pk.evp);
        gemm_acc<true>(w.acc1.data(), pk.ep, cols, pk.ep, w.ds.data(), 1, bk, rows,
                       pk.qrow.data() + (bh * pk.lpad + i0) * pk.ep, pk.ep);
      }
    }
    for (int64_t j = 0; j < cols; ++j) {
      float* dk = a.dk + (kvi * d.S + j0 + j) * d.E;
      float* dv = a.dv + (kvi * d.S + j0 + j) * d.Ev;
      for (int64_t e = 0; e < d.E; ++e) dk[e] = a.scale * w.acc1[j * pk.ep + e];
      for (int64_t e = 0; e < d.Ev; ++e) dv[e] = w.acc2[j * pk.evp + e];
    }
  });

  // Pass 2: dQ of one query tile of one head, from every key tile.
  BwdScratch proto2 = proto;
  proto2.acc1.resize(static_cast<size_t>(bq * pk.ep));
  run_items(nq * pk.nqt, a.threads, proto2, [&](int64_t item, BwdScratch& w) {
    const int64_t qt = item % pk.nqt, bh = item / pk.nqt, b = bh / d.Hq, h = bh % d.Hq;
    const int64_t kvi = b * d.Hkv + h / group;
    const int64_t i0 = qt * bq, rows = std::min(bq, d.L - i0);
    std::fill(w.acc1.begin(), w.acc1.end(), 0.0f);
    for (int64_t t = 0; t < pk.nkt; ++t) {
      const uint8_t kind = a.tiles.at(b, h, qt, t);
      if (kind == kTileEmpty) continue;
      const int64_t j0 = t * bk, cols = std::min(bk, d.S - j0);
      ds_tile(a, pk, w, b, h, qt, t, kind == kTilePartial, score_mod, mask_mod);
      // dQ[i] += sum_j dS[i][j] K[j]
      gemm_acc<true>(w.acc1.data(), pk.ep, rows, pk.ep, w.ds.data(), bk, 1, cols,
                     pk.krow.data() + (kvi * pk.spad + j0) * pk.ep, pk.ep);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dq = a.dq + (bh * d.L + i0 + r) * d.E;
      for (int64_t e = 0; e < d.E; ++e) dq[e] = a.scale * w.acc1[r * pk.ep + e];
    }
  });
}

}  // inline namespace ATTN_FLEX_ISA_NS
}  // namespace attn::flex::detail

// flex_attention: attention with your own score modification and mask, compiled into the kernel
// (PyTorch's FlexAttention idea, on the CPU, header-only).
//
//   x_ij = score_mod(scale * q_i . k_j, b, h, i, j)   where mask_mod(b, h, i, j) is true
//   x_ij excluded (never added: weight exactly 0)     where it is false
//   out_i = softmax_j(x_ij) V,   lse_i = log sum_j exp(x_ij)   (natural log)
//
// Shapes are scaled_dot_product_attention's (attn/sdpa.hpp): query (B, H, L, E), (H, L, E) or
// (L, E); key (.., S, E) and value (.., S, Ev) with the same leading dims, or H_kv heads with
// enable_gqa (query head h reads key/value head h / (H / H_kv)). b and h passed to the functors
// are 0 where the dim is absent. float32 only. A query row with every key excluded gets output 0
// and lse -inf (attn's fully-masked-row policy; PyTorch gives NaN); NaN in an included score
// propagates. Bad arguments throw DTypeError / ShapeError / ValueError naming the argument, before
// anything is computed.
//
// Tiling and memory traffic: attn/flex_attention_kernel.hpp (FlashAttention-2 tiles of bq queries
// x bk keys with an online softmax, O(L) memory; the backward recomputes P from the LSE).
//
// The functors (see docs/API.md, "flex_attention: your own score_mod / mask_mod"):
//   score_mod: float operator()(float score, int64_t b, int64_t h, int64_t i, int64_t j) const
//              and, for flex_attention_backward, the derivative at the same point:
//              float grad(float score, int64_t b, int64_t h, int64_t i, int64_t j) const
//              (flex::with_grad(f, df) makes one from two lambdas);
//   mask_mod:  bool operator()(int64_t b, int64_t h, int64_t i, int64_t j) const  (true = key j
//              takes part).
// They are template arguments, inlined into the tile loops: no indirect call per element. They
// are called concurrently from OpenMP threads, only for i < L, j < S, and must not throw.
//
// Block mask (FlexAttention's create_block_mask): flex::create_block_mask(mask_mod, B, H, L, S)
// classifies each (query tile, key tile) once as empty (skipped: no scores, no calls), partial
// (mask_mod called per element) or full (mask_mod not called). Pass it in FlexOptions::block_mask;
// its tile sizes become the kernel's. Without one every tile is partial (mask_mod everywhere).
//
// Building for your instruction set: everything here is instantiated in YOUR translation unit,
// so it is vectorised for that TU's flags: 16 lanes with -mavx512f, 8 with -mavx/-mavx2, else 4.
// Compile the file that calls flex_attention with e.g. `-O3 -march=native` or
// `-O3 -mavx512f -mfma -ffp-contract=fast` (the last lets a*b+c become one FMA; with -std=c++20
// GCC does not contract otherwise). A __attribute__((target("avx512f"))) on the calling function
// is NOT enough: the width is chosen from the TU's macros and templates do not inherit the
// attribute, so put the call in its own .cpp built with the flags. Threads: OpenMP when the TU is
// built with -fopenmp (attn's CMake target and attn.pc add it), else one thread; results are
// bit-identical for any num_threads.
//
// For the common cases attn has faster fused paths: scaled_dot_product_attention with is_causal,
// attn_mask, enable_gqa (and the other SdpaOptions) runs hand-tuned kernels for every ISA in one
// build; prefer them where they express what you need, and flex_attention for everything else.
#pragma once

#include <atomic>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/error.hpp"
#include "attn/flex_attention_kernel.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn {
namespace flex {

// ---- functors --------------------------------------------------------------------------------------

template <class F>
concept ScoreMod = requires(const F& f, float s, int64_t n) {
  { f(s, n, n, n, n) } -> std::convertible_to<float>;
};
template <class F>
concept ScoreModWithGrad = ScoreMod<F> && requires(const F& f, float s, int64_t n) {
  { f.grad(s, n, n, n, n) } -> std::convertible_to<float>;
};
template <class F>
concept MaskMod = requires(const F& f, int64_t n) {
  { f(n, n, n, n) } -> std::convertible_to<bool>;
};

// The score unchanged: plain attention.
struct NoScoreMod {
  float operator()(float s, int64_t, int64_t, int64_t, int64_t) const { return s; }
  float grad(float, int64_t, int64_t, int64_t, int64_t) const { return 1.0f; }
};

// Every key takes part. flex_attention treats every tile as full: the mask is never called.
struct NoMask {
  bool operator()(int64_t, int64_t, int64_t, int64_t) const { return true; }
};

// Key j takes part for j <= i + offset: offset 0 is PyTorch's is_causal (top-left), S - L its
// bottom-right alignment (decoding with a KV cache).
struct Causal {
  int64_t offset = 0;
  bool operator()(int64_t, int64_t, int64_t i, int64_t j) const { return j <= i + offset; }
};

// A score_mod with its derivative, from two callables of the score_mod signature (lambdas cannot
// have a grad member): flex::with_grad([](float s, auto...) { return c * std::tanh(s / c); },
//                                      [](float s, auto...) { float t = std::tanh(s / c); return 1 - t * t; })
template <class F, class G>
struct ScoreModWithDerivative {
  F f;
  G g;
  float operator()(float s, int64_t b, int64_t h, int64_t i, int64_t j) const { return f(s, b, h, i, j); }
  float grad(float s, int64_t b, int64_t h, int64_t i, int64_t j) const { return g(s, b, h, i, j); }
};
template <class F, class G>
ScoreModWithDerivative<F, G> with_grad(F f, G g) {
  return {std::move(f), std::move(g)};
}

// ---- block mask ------------------------------------------------------------------------------------

enum class TileKind : uint8_t { kEmpty = detail::kTileEmpty, kPartial = detail::kTilePartial, kFull = detail::kTileFull };

inline constexpr int64_t kDefaultQBlock = 64;
inline constexpr int64_t kDefaultKvBlock = 64;

// Per (batch, head, query tile, key tile): is any key of the tile included, and are all? A batch
// or head extent of 1 is broadcast: the mask_mod was evaluated at b = 0 (h = 0) only, a promise
// that its empty/full pattern does not depend on that index (partial tiles still call mask_mod
// with the true b, h). It must be built from the very mask_mod passed to flex_attention: a tile
// marked full skips the mask, one marked empty skips everything.
class BlockMask {
 public:
  BlockMask() = default;
  // From tile kinds laid out (B, H, ceil(L / q_block), ceil(S / kv_block)); ValueError unless
  // the sizes agree (create_block_mask fills it from a mask_mod).
  BlockMask(int64_t B, int64_t H, int64_t L, int64_t S, int64_t q_block, int64_t kv_block, std::vector<uint8_t> kinds)
      : B_(B), H_(H), L_(L), S_(S), bq_(q_block), bk_(kv_block), kinds_(std::move(kinds)) {
    if (B < 1 || H < 1 || L < 1 || S < 1 || q_block < 1 || kv_block < 1) {
      throw ValueError("BlockMask: B, H, L, S, q_block and kv_block must be >= 1");
    }
    nq_ = detail::ceil_div(L, q_block);
    nk_ = detail::ceil_div(S, kv_block);
    if (static_cast<int64_t>(kinds_.size()) != B * H * nq_ * nk_) {
      throw ValueError("BlockMask: kinds has " + std::to_string(kinds_.size()) + " entries, expected B * H * " +
                       std::to_string(nq_) + " * " + std::to_string(nk_) + " = " + std::to_string(B * H * nq_ * nk_));
    }
    for (uint8_t k : kinds_) {
      if (k > detail::kTileFull) throw ValueError("BlockMask: a tile kind must be 0 (empty), 1 (partial) or 2 (full), got " + std::to_string(k));
    }
  }
  int64_t batch() const { return B_; }
  int64_t heads() const { return H_; }
  int64_t q_len() const { return L_; }
  int64_t kv_len() const { return S_; }
  int64_t q_block() const { return bq_; }
  int64_t kv_block() const { return bk_; }
  int64_t num_q_tiles() const { return nq_; }
  int64_t num_kv_tiles() const { return nk_; }
  bool defined() const { return !kinds_.empty(); }
  TileKind tile(int64_t b, int64_t h, int64_t q_tile, int64_t kv_tile) const {
    return static_cast<TileKind>(kinds_[static_cast<size_t>(((b * H_ + h) * nq_ + q_tile) * nk_ + kv_tile)]);
  }
  int64_t count(TileKind kind) const {
    int64_t n = 0;
    for (uint8_t k : kinds_) n += k == static_cast<uint8_t>(kind);
    return n;
  }
  const uint8_t* data() const { return kinds_.data(); }

 private:
  int64_t B_ = 0, H_ = 0, L_ = 0, S_ = 0, bq_ = 0, bk_ = 0, nq_ = 0, nk_ = 0;
  std::vector<uint8_t> kinds_;
};

// Evaluates mask_mod on every (b < B, h < H, i < L, j < S) once (in parallel with OpenMP) and keeps
// one byte per tile. B or H = 1 broadcasts over the call's batches or heads. q_block in [1, 1024];
// kv_block a multiple of 16 in [16, 1024] (whole vectors for every ISA). Else ValueError.
template <class M>
BlockMask create_block_mask(const M& mask_mod, int64_t B, int64_t H, int64_t L, int64_t S,
                            int64_t q_block = kDefaultQBlock, int64_t kv_block = kDefaultKvBlock,
                            int num_threads = 0) {
  static_assert(MaskMod<M>, "create_block_mask: mask_mod must be callable as bool(int64_t b, int64_t h, int64_t i, int64_t j) const");
  auto positive = [](const char* name, int64_t v) {
    if (v < 1) throw ValueError(std::string("create_block_mask: ") + name + " must be >= 1, got " + std::to_string(v));
  };
  positive("B", B);
  positive("H", H);
  positive("L", L);
  positive("S", S);
  if (q_block < 1 || q_block > 1024) {
    throw ValueError("create_block_mask: q_block must be in [1, 1024], got " + std::to_string(q_block));
  }
  if (kv_block < 16 || kv_block > 1024 || kv_block % 16 != 0) {
    throw ValueError("create_block_mask: kv_block must be a multiple of 16 in [16, 1024], got " +
                     std::to_string(kv_block));
  }
  const int64_t nq = detail::ceil_div(L, q_block), nk = detail::ceil_div(S, kv_block);
  std::vector<uint8_t> kinds_v(static_cast<size_t>(B * H * nq * nk), detail::kTileEmpty);
  uint8_t* kinds = kinds_v.data();
  detail::run_items(B * H * nq, num_threads, 0, [&](int64_t item, int) {
    const int64_t qt = item % nq, bh = item / nq, b = bh / H, h = bh % H;
    const int64_t i0 = qt * q_block, i1 = std::min(L, i0 + q_block);
    for (int64_t t = 0; t < nk; ++t) {
      const int64_t j0 = t * kv_block, j1 = std::min(S, j0 + kv_block);
      bool any = false, all = true;
      for (int64_t i = i0; i < i1 && (all || !any); ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          const bool in = static_cast<bool>(mask_mod(b, h, i, j));
          any = any || in;
          all = all && in;
        }
      }
      kinds[item * nk + t] = !any ? detail::kTileEmpty : all ? detail::kTileFull : detail::kTilePartial;
    }
  });
  return BlockMask(B, H, L, S, q_block, kv_block, std::move(kinds_v));
}

}  // namespace flex

struct FlexOptions {
  std::optional<double> scale;  // default 1/sqrt(E); finite, else ValueError
  bool enable_gqa = false;      // key/value may have H_kv heads, H_q a multiple of H_kv
  bool need_lse = false;        // also return lse (flex_attention_backward needs it)
  int num_threads = 0;          // 0 = OpenMP's default; ignored without -fopenmp
  // Tiles from create_block_mask on the same mask_mod (not owned: must outlive the call). Its
  // extents must be (1 or B, 1 or H, L, S), else ShapeError.
  const flex::BlockMask* block_mask = nullptr;
};

namespace flex::detail {

// The checked problem: sizes, strides and the tiles to visit.
struct Checked {
  Dims d;
  Shape lead;       // query's leading dims
  Shape out_shape;  // (..., L, Ev)
  Shape lse_shape;  // (..., L)
  float scale;
  Strided q, k, v;
  Tiles tiles;
  int64_t bq, bk;
};

inline std::string shape_str(const TensorView& t) { return t.defined() ? t.shape().str() : "undefined"; }

// (batch, head, row, col) strides of a 2-4 dim tensor whose last `trailing` dims are (row, col)
// or just (row) (then col is unused).
inline Strided strided(const TensorView& t, int trailing = 2) {
  Strided s;
  s.p = t.data();
  const int n = t.dim();
  if (trailing == 2) {
    s.sr = t.stride(n - 2);
    s.sc = t.stride(n - 1);
  } else {
    s.sr = t.stride(n - 1);
  }
  const int lead = n - trailing;
  if (lead >= 1) s.sh = t.stride(lead - 1);
  if (lead >= 2) s.sb = t.stride(lead - 2);
  return s;
}

inline Checked check(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                     const FlexOptions& o, bool no_mask) {
  const std::string f = fn;
  const char* names[3] = {"query", "key", "value"};
  const TensorView* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (!ts[i]->defined()) throw ValueError(f + ": " + names[i] + " is undefined");
    if (ts[i]->dtype() != DType::kFloat32) {
      throw DTypeError(f + ": " + names[i] + " must be float32, got " + std::string(dtype_name(ts[i]->dtype())));
    }
    if (ts[i]->dim() < 2 || ts[i]->dim() > 4) {
      throw ShapeError(f + ": " + names[i] + " must have 2 to 4 dims (..., seq, embed), got shape " +
                       ts[i]->shape().str());
    }
    if (ts[i]->numel() == 0) throw ShapeError(f + ": " + names[i] + " is empty (shape " + ts[i]->shape().str() + ")");
  }
  if (k.dim() != q.dim() || v.dim() != q.dim()) {
    throw ShapeError(f + ": query, key and value must have the same number of dims, got query " + q.shape().str() +
                     ", key " + k.shape().str() + ", value " + v.shape().str());
  }
  Checked c{};
  const int nd = q.dim();
  const int head_dim = nd >= 3 ? nd - 3 : -1;
  for (int i = 0; i < nd - 2; ++i) {
    c.lead.push_back(q.size(i));
    if (o.enable_gqa && i == head_dim) continue;
    if (k.size(i) != q.size(i) || v.size(i) != q.size(i)) {
      throw ShapeError(f + ": key and value must have query's leading (batch, head) dims, got query " +
                       q.shape().str() + ", key " + k.shape().str() + ", value " + v.shape().str());
    }
  }
  c.d.B = nd == 4 ? q.size(0) : 1;
  c.d.Hq = nd >= 3 ? q.size(head_dim) : 1;
  c.d.Hkv = nd >= 3 ? k.size(head_dim) : 1;
  if (nd >= 3 && v.size(head_dim) != c.d.Hkv) {
    throw ShapeError(f + ": key and value must have the same number of heads (dim -3), got key " + k.shape().str() +
                     ", value " + v.shape().str());
  }
  if (c.d.Hq % c.d.Hkv != 0) {
    throw ShapeError(f + ": with enable_gqa, query's number of heads (" + std::to_string(c.d.Hq) +
                     ") must be a multiple of key/value's (" + std::to_string(c.d.Hkv) + "); got query " +
                     q.shape().str() + ", key " + k.shape().str());
  }
  c.d.L = q.size(-2);
  c.d.E = q.size(-1);
  c.d.S = k.size(-2);
  c.d.Ev = v.size(-1);
  c.out_shape = c.lse_shape = c.lead;
  c.out_shape.push_back(c.d.L);
  c.out_shape.push_back(c.d.Ev);
  c.lse_shape.push_back(c.d.L);
  if (k.size(-1) != c.d.E) {
    throw ShapeError(f + ": key's embed dim must equal query's (" + std::to_string(c.d.E) + "), got key shape " +
                     k.shape().str() + " (query shape " + q.shape().str() + ")");
  }
  if (v.size(-2) != c.d.S) {
    throw ShapeError(f + ": value's sequence length must equal key's (" + std::to_string(c.d.S) +
                     "), got value shape " + v.shape().str() + " (key shape " + k.shape().str() + ")");
  }
  double scale = 1.0 / std::sqrt(static_cast<double>(c.d.E));
  if (o.scale) {
    if (!std::isfinite(*o.scale) || std::fabs(*o.scale) > std::numeric_limits<float>::max()) {
      throw ValueError(f + ": scale must be finite in float32, got " + std::to_string(*o.scale));
    }
    scale = *o.scale;
  }
  c.scale = static_cast<float>(scale);
  c.bq = kDefaultQBlock;
  c.bk = kDefaultKvBlock;
  c.tiles.fallback = no_mask ? kTileFull : kTilePartial;
  if (o.block_mask != nullptr) {
    const BlockMask& m = *o.block_mask;
    if (!m.defined() || (m.batch() != 1 && m.batch() != c.d.B) || (m.heads() != 1 && m.heads() != c.d.Hq) ||
        m.q_len() != c.d.L || m.kv_len() != c.d.S) {
      throw ShapeError(f + ": options.block_mask must be built for (B, H, L, S) = (" + std::to_string(c.d.B) + " or 1, " +
                       std::to_string(c.d.Hq) + " or 1, " + std::to_string(c.d.L) + ", " + std::to_string(c.d.S) +
                       "), got (" + std::to_string(m.batch()) + ", " + std::to_string(m.heads()) + ", " +
                       std::to_string(m.q_len()) + ", " + std::to_string(m.kv_len()) + ")");
    }
    c.bq = m.q_block();
    c.bk = m.kv_block();
    c.tiles.kinds = m.data();
    c.tiles.B = m.batch();
    c.tiles.H = m.heads();
    c.tiles.nq = m.num_q_tiles();
    c.tiles.nk = m.num_kv_tiles();
  }
  c.q = strided(q);
  c.k = strided(k);
  c.v = strided(v);
  return c;
}

inline void require_shape(const char* what, const TensorView& t, const Shape& want, const char* hint) {
  if (!t.defined()) {
    throw ValueError(std::string("flex_attention_backward: ") + what + " is undefined" + hint);
  }
  if (t.dtype() != DType::kFloat32) {
    throw DTypeError(std::string("flex_attention_backward: ") + what + " must be float32, got " +
                     std::string(dtype_name(t.dtype())));
  }
  if (!(t.shape() == want)) {
    throw ShapeError(std::string("flex_attention_backward: ") + what + " must have shape " + want.str() +
                     " (the forward's), got " + t.shape().str());
  }
}

}  // namespace flex::detail

inline namespace ATTN_FLEX_ISA_NS {

// Forward: SdpaResult{output (..., L, Ev), {}, lse (..., L) when options.need_lse}.
template <class ScoreModT, class MaskModT>
SdpaResult flex_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                          const ScoreModT& score_mod, const MaskModT& mask_mod, const FlexOptions& options = {}) {
  static_assert(flex::ScoreMod<ScoreModT>,
                "flex_attention: score_mod must be callable as float(float score, int64_t b, int64_t h, int64_t i, int64_t j) const");
  static_assert(flex::MaskMod<MaskModT>,
                "flex_attention: mask_mod must be callable as bool(int64_t b, int64_t h, int64_t i, int64_t j) const");
  constexpr bool kNoMask = std::is_same_v<MaskModT, flex::NoMask>;
  const flex::detail::Checked c = flex::detail::check("flex_attention", query, key, value, options, kNoMask);
  SdpaResult r;
  r.output = Tensor::empty(c.out_shape);
  if (options.need_lse) r.lse = Tensor::empty(c.lse_shape);
  flex::detail::FwdArgs a{c.d, c.scale, c.q, c.k, c.v, c.bq, c.bk, c.tiles, r.output.data(),
                          options.need_lse ? r.lse.data() : nullptr, options.num_threads};
  flex::detail::flex_forward(a, score_mod, mask_mod);
  return r;
}

// Backward: dQ, dK, dV (H_kv heads with GQA: summed over the group) for grad_output given the
// forward's result on the same inputs, functors and options (forward.lse needed: run it with
// need_lse = true, else ValueError):
//   dV = P^T dO,  dP = dO V^T,  dX = P (dP - rowsum(dO * O)),  dS = dX * score_mod.grad(s),
//   dQ = scale dS K,  dK = scale dS^T Q.
template <class ScoreModT, class MaskModT>
SdpaGrads flex_attention_backward(const TensorView& grad_output, const TensorView& query, const TensorView& key,
                                  const TensorView& value, const SdpaResult& forward, const ScoreModT& score_mod,
                                  const MaskModT& mask_mod, const FlexOptions& options = {}) {
  static_assert(flex::ScoreModWithGrad<ScoreModT>,
                "flex_attention_backward: the score_mod needs `float operator()(float score, int64_t b, int64_t h, "
                "int64_t i, int64_t j) const` and a member `float grad(...) const` (same arguments) returning d(score_mod)/d(score); wrap lambdas with attn::flex::with_grad(f, df)");
  static_assert(flex::MaskMod<MaskModT>,
                "flex_attention_backward: mask_mod must be callable as bool(int64_t b, int64_t h, int64_t i, int64_t j) const");
  constexpr bool kNoMask = std::is_same_v<MaskModT, flex::NoMask>;
  const flex::detail::Checked c = flex::detail::check("flex_attention_backward", query, key, value, options, kNoMask);
  flex::detail::require_shape("grad_output", grad_output, c.out_shape, "");
  flex::detail::require_shape("forward.output", forward.output, c.out_shape, " (pass the forward's SdpaResult)");
  flex::detail::require_shape("forward.lse", forward.lse, c.lse_shape, " (run the forward with need_lse = true)");
  SdpaGrads g;
  g.grad_query = Tensor::empty(query.shape());
  g.grad_key = Tensor::empty(key.shape());
  g.grad_value = Tensor::empty(value.shape());
  flex::detail::BwdArgs a{c.d, c.scale, c.q, c.k, c.v,
                          flex::detail::strided(forward.output), flex::detail::strided(grad_output),
                          flex::detail::strided(forward.lse, 1), c.bq, c.bk, c.tiles,
                          g.grad_query.data(), g.grad_key.data(), g.grad_value.data(), options.num_threads};
  // Only the static_assert above speaks when grad is missing, not a cascade from the kernel.
  if constexpr (flex::ScoreModWithGrad<ScoreModT>) flex::detail::flex_backward(a, score_mod, mask_mod);
  return g;
}

}  // inline namespace ATTN_FLEX_ISA_NS
}  // namespace attn

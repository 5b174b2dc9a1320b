// Input preparation shared by the fused forward (flash_fwd.cpp) and backward (flash_bwd.cpp):
// one place turns a validated problem into kernel parameters, so the two passes cannot disagree
// on scale, masking or dropout.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "sdpa/cpu/flash_params.hpp"
#include "sdpa/problem.hpp"

namespace attn::cpu {

// The rows of t (every dim but the last) in the order they lie in memory: leading dims by
// decreasing stride. q, k, v split from a fused projection and viewed as (B, H, T, E) hold a
// head's rows a few KiB apart; walked in (B, H, T) order each row was a new page and a wait on
// memory (GPT-2 small, T = 2048, bf16: a forward and backward on such inputs took ~11 ms more than
// on contiguous ones, ~3 ms more since), walked in (B, T, H) order they are read as they lie.
class RowWalk {
 public:
  explicit RowWalk(const TensorView& t) : lead_(t.dim() - 1) {
    int order[kMaxDims] = {};
    for (int d = 0; d < lead_; ++d) order[d] = d;
    std::stable_sort(order, order + lead_, [&](int a, int b) { return t.stride(a) > t.stride(b); });
    int64_t dst_stride[kMaxDims] = {};
    for (int64_t d = lead_ - 1, st = t.size(-1); d >= 0; --d) {
      dst_stride[d] = st;
      st *= t.size(static_cast<int>(d));
    }
    for (int i = 0; i < lead_; ++i) {
      size_[i] = t.size(order[i]);
      from_stride_[i] = t.stride(order[i]);
      to_stride_[i] = dst_stride[order[i]];
    }
  }
  // Row r of the walk: its offset in t (from) and in a contiguous tensor of t's shape (to).
  void at(int64_t r, int64_t& from, int64_t& to) const {
    from = to = 0;
    for (int i = lead_ - 1; i >= 0; --i) {
      const int64_t idx = r % size_[i];
      r /= size_[i];
      from += idx * from_stride_[i];
      to += idx * to_stride_[i];
    }
  }

 private:
  int lead_;
  int64_t size_[kMaxDims] = {}, from_stride_[kMaxDims] = {}, to_stride_[kMaxDims] = {};  // outermost first
};

// A contiguous copy of t; when its last dim is contiguous, a whole row per memcpy on `threads`
// threads, in memory order (TensorView::contiguous gathers element by element on one: a
// token-major K and V of 30 M floats took longer to copy than a short sequence's attention).
inline Tensor copy_rows(const TensorView& t, int threads) {
  if (t.stride(-1) != 1) return t.contiguous();  // rows are not runs of memory: gather
  Tensor out = Tensor::empty(t.shape(), t.dtype());
  const int64_t cols = t.size(-1), rows = cols > 0 ? t.numel() / cols : 0;
  const size_t esize = static_cast<size_t>(t.element_size()), bytes = static_cast<size_t>(cols) * esize;
  const char* src = static_cast<const char*>(t.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const RowWalk walk(t);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t from, to;
    walk.at(r, from, to);
    std::memcpy(dst + static_cast<size_t>(to) * esize, src + static_cast<size_t>(from) * esize, bytes);
  }
  return out;
}

// The kernels read rows whose last dim is contiguous; anything else is copied once into storage.
inline TensorView rows_contiguous(const TensorView& t, Tensor& storage) {
  if (t.stride(-1) == 1) return t;
  storage = t.contiguous();
  return storage;
}

// Keys and values for the prefill kernels, with each head's rows adjacent: a head of K/V whose rows
// lie a token apart (a (B, S, H, E) tensor viewed as (B, H, S, E), as projections and varlen's
// token-major layout give) spreads over H times as many pages, each row on its own, and the
// kernel's passes over it miss the TLB and the page-bound hardware prefetch: measured 43 % slower
// for causal attention at L = 4001, H = 12 (3 % without causal). One copy, O(S * E) per head,
// is small beside the O(L * S * E) work that reads it again for every query block.
inline TensorView rows_adjacent(const TensorView& t, Tensor& storage, int threads) {
  if (t.stride(-1) == 1 && (t.stride(-2) == t.size(-1) || t.size(-2) == 1)) return t;
  storage = t.stride(-1) == 1 ? copy_rows(t, threads) : t.contiguous();
  return storage;
}

// False if an element of t, read as its bits U, has every bit of `exponent` set (Inf or NaN).
// On the bits an OR over integers vectorises at any -m level, where a float sum (x - x is NaN for
// NaN and Inf) was one dependent add per element. Rows on `threads` threads, in memory order: a
// serial scan of V cost a few percent of a short call.
template <class U>
inline bool no_inf_or_nan(const TensorView& t, U exponent, int threads) {
  const auto* bits = static_cast<const U*>(t.raw_data());
  bool ok = true;
  if (t.stride(-1) != 1) {
    for_each_offset(t, [&](int64_t o) { ok = ok && (bits[o] & exponent) != exponent; });
    return ok;
  }
  const int64_t cols = t.size(-1), rows = cols > 0 ? t.numel() / cols : 0;
  const RowWalk walk(t);
#pragma omp parallel for num_threads(threads) schedule(static) reduction(&& : ok) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t from, to;
    walk.at(r, from, to);
    const U* row = bits + from;
    unsigned bad = 0;
    for (int64_t e = 0; e < cols; ++e) bad |= static_cast<unsigned>((row[e] & exponent) == exponent);
    ok = ok && bad == 0;
  }
  return ok;
}

// False if the float32 t holds a NaN or Inf: the kernels then guard their products so that a zero
// weight never multiplies it (docs/NUMERICS.md).
inline bool all_finite(const TensorView& t, int threads = 1) { return no_inf_or_nan<uint32_t>(t, 0x7f800000u, threads); }

// The softmax scale actually applied: PyTorch's `scores / sqrt(E)` is a division by the float32
// divisor, which the kernels turn into a multiplication by its exact reciprocal.
inline double flash_softmax_scale(const detail::SdpaProblem& p) {
  return p.divide ? 1.0 / static_cast<double>(p.divisor) : p.scale;
}

// The parameters of one call, from the problem and the row-contiguous q, k, v the kernel reads.
// guard_v is left to the caller: the forward guards V only, the backward every input.
inline FlashParams make_flash_params(const detail::SdpaProblem& p, const SdpaOptions& options,
                                     const TensorView& q, const TensorView& k,
                                     const TensorView& v) {
  FlashParams fp;
  fp.L = p.L, fp.S = p.S, fp.E = p.E, fp.Ev = p.Ev;
  fp.q_row = q.stride(-2), fp.k_row = k.stride(-2), fp.v_row = v.stride(-2);
  fp.o_row = p.Ev;  // the forward's output is allocated contiguous
  fp.scale_log2 = static_cast<float>(flash_softmax_scale(p) * std::numbers::log2e);
  // The band: is_causal and the window's right side both bound j from above (the tighter
  // wins), the window's left side from below.
  if (p.causal || p.window_right >= 0) {
    fp.causal = true;
    fp.causal_offset = p.key_hi(0);
  }
  if (p.window_left >= 0) {
    fp.band_lo = true;
    fp.lo_offset = p.key_lo(0);
  }
  fp.softcap2 = static_cast<float>(p.softcap * std::numbers::log2e);
  fp.alibi = p.alibi.defined();
  fp.diag_offset = p.diag_offset;
  if (p.mask.defined()) {
    fp.mask_row = p.mask.stride(-2);
    fp.mask_col = p.mask.stride(-1);
    fp.mask_is_bool = p.mask_is_bool;
  }
  fp.dropout_p = p.dropout_p;
  fp.reduction = options.allow_fp16_bf16_reduction;
  fp.dropout_seed = options.dropout_seed;
  fp.dropout_offset = options.dropout_offset;
  fp.dropout_i0 = p.q_pos;
  fp.dropout_j0 = p.k_pos;
  return fp;
}

inline FlashBwdParams make_flash_bwd_params(const detail::SdpaProblem& p,
                                            const SdpaOptions& options, const TensorView& q,
                                            const TensorView& k, const TensorView& v) {
  FlashBwdParams bp;
  static_cast<FlashParams&>(bp) = make_flash_params(p, options, q, k, v);
  bp.scale = static_cast<float>(flash_softmax_scale(p));
  return bp;
}

// The forward's result: output (lead..., L, Ev) in `dtype`, and the float32 LSE (lead..., L)
// when `want_lse` (the kernels keep it in base 2 until the driver converts it).
inline SdpaResult make_forward_result(const detail::SdpaProblem& p, DType dtype, bool want_lse) {
  Shape out_shape = p.lead, lse_shape = p.lead;
  out_shape.push_back(p.L);
  out_shape.push_back(p.Ev);
  lse_shape.push_back(p.L);
  SdpaResult result;
  result.output = Tensor::empty(out_shape, dtype);
  if (want_lse) result.lse = Tensor::empty(lse_shape);
  return result;
}

// The forward's work items b * nqb + query block, head by head so K and V stay in cache; within
// a causal head the longest blocks (the last ones) go first, so the short ones even out the
// threads at the end of a dynamic schedule.
inline std::vector<int64_t> forward_work_items(const detail::SdpaProblem& p, int64_t block_q) {
  const int64_t nqb = (p.L + block_q - 1) / block_q;
  std::vector<int64_t> items(static_cast<size_t>(p.batch * nqb));
  for (size_t i = 0; i < items.size(); ++i) items[i] = static_cast<int64_t>(i);
  if (p.causal) {
    for (int64_t b = 0; b < p.batch; ++b) std::reverse(items.begin() + b * nqb, items.begin() + (b + 1) * nqb);
  }
  return items;
}

}  // namespace attn::cpu

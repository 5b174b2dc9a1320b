#include "sdpa/problem.hpp"

#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <vector>
#include <fmt/format.h>

#include "attn/error.hpp"

namespace attn::detail {

namespace {
// True if `from` broadcasts to exactly `to` (PyTorch's expand rules).
bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.ndim() == 0 || from.ndim() > to.ndim()) return false;
  for (int i = 1; i <= from.ndim(); ++i) {
    const int64_t f = from[from.ndim() - i], t = to[to.ndim() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}

// query_pos_offset and key_pos_offset, into p (whose L and S are known).
void check_positions(const SdpaOptions& o, SdpaProblem& p) {
  constexpr int64_t kLimit = int64_t{1} << 32;
  const auto check = [](int64_t offset, int64_t len, const char* name) {
    if (offset < 0 || offset > kLimit - len) {
      throw ValueError(fmt::format("scaled_dot_product_attention: {} must be >= 0 with {} + length "
                                   "({}) <= 2^32, got {}", name, name, len, offset));
    }
  };
  check(o.query_pos_offset, p.L, "query_pos_offset");
  check(o.key_pos_offset, p.S, "key_pos_offset");
  p.q_pos = o.query_pos_offset;
  p.k_pos = o.key_pos_offset;
}

// The variants block of SdpaOptions, into p (whose shapes and alignment are already known).
void check_variants(const SdpaOptions& o, SdpaProblem& p) {
  const char* who = "scaled_dot_product_attention";
  check_window_size(o.window_size, who, "window_size");
  // A side of L + S + |q_pos - k_pos| or more hides nothing more than that does (it bounds
  // |i' - j|): clamp it, so that i' - left and i' + right cannot overflow (INT64_MAX is a valid
  // "the whole sequence"). Positions are < 2^32 (check_positions), so the sum cannot overflow.
  const int64_t reach = p.L + p.S + (p.q_pos > p.k_pos ? p.q_pos - p.k_pos : p.k_pos - p.q_pos);
  p.window_left = std::min(o.window_size.left, reach);
  p.window_right = std::min(o.window_size.right, reach);
  p.diag_offset = o.causal_alignment == CausalAlignment::kBottomRight ? p.S - p.L : 0;
  p.diag_offset += p.q_pos - p.k_pos;
  p.softcap = check_softcap(o.softcap, who, "softcap");
  if (o.alibi_slopes) {
    std::vector<Shape> allowed{Shape{p.heads_q}};
    if (p.lead.ndim() == 2) allowed.push_back(Shape{p.lead[0], p.heads_q});
    check_head_param(*o.alibi_slopes, who, "alibi_slopes", allowed);
    p.alibi = *o.alibi_slopes;
  }
  if (o.sinks) {
    check_head_param(*o.sinks, who, "sinks", {Shape{p.heads_q}});
    p.sinks = *o.sinks;
  }
}
}  // namespace

void check_window_size(const WindowSize& w, const char* who, const char* name) {
  if (w.left < -1 || w.right < -1) {
    throw ValueError(fmt::format("{}: {} must be (left, right) with each >= -1 (-1 = unbounded), "
                                 "got ({}, {})", who, name, w.left, w.right));
  }
}

// The fused kernels keep scores in base 2 in float32: a slope, a sink or a softcap enters them
// as float(value * log2(e)), which must stay finite (scale has the same bound).
constexpr double kMaxBase2 = std::numeric_limits<float>::max() / std::numbers::log2e;

double check_softcap(const std::optional<double>& c, const char* who, const char* name) {
  if (!c) return 0.0;
  // Below float32's smallest normal the kernels' 1 / softcap would be infinite (or softcap
  // itself 0); above kMaxBase2 softcap * log2(e) would be.
  constexpr double kMinSoftcap = std::numeric_limits<float>::min();
  if (!(*c >= kMinSoftcap && *c <= kMaxBase2)) {
    throw ValueError(fmt::format("{}: {} must be a finite value > 0, in [{:.4g}, {:.4g}] (float32's "
                                 "normal range; unset for none), got {}", who, name, kMinSoftcap,
                                 kMaxBase2, *c));
  }
  return *c;
}

void check_head_param(const TensorView& t, const char* who, const char* name,
                      const std::vector<Shape>& allowed) {
  std::string want;
  for (const Shape& s : allowed) want += (want.empty() ? "" : " or ") + s.str();
  if (!t.defined()) throw ValueError(fmt::format("{}: {} is undefined", who, name));
  if (t.dtype() != DType::kFloat32) {
    throw DTypeError(fmt::format("{}: {} must be float32 of shape {}, got {}", who, name, want,
                                 dtype_name(t.dtype())));
  }
  bool ok = false;
  for (const Shape& s : allowed) ok = ok || t.shape() == s;
  if (!ok) {
    throw ShapeError(fmt::format("{}: {} must have shape {}, got {}", who, name, want, t.shape().str()));
  }
  for_each_offset(t, [&](int64_t off) {
    if (!std::isfinite(t.data()[off]) || std::fabs(static_cast<double>(t.data()[off])) > kMaxBase2) {
      throw ValueError(fmt::format("{}: {} must be finite, at most {:.4g} in magnitude (float32 range "
                                   "of value * log2(e)), got {}", who, name, kMaxBase2, t.data()[off]));
    }
  });
}

float SdpaProblem::alibi_slope(int64_t b) const {
  if (!alibi.defined()) return 0.0f;
  const int64_t h = b % heads_q;
  if (alibi.dim() == 1) return alibi.data()[h * alibi.stride(0)];
  return alibi.data()[(b / heads_q) * alibi.stride(0) + h * alibi.stride(1)];
}

std::string SdpaProblem::variants_used() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (on) s += (s.empty() ? "" : ", ") + std::string(name);
  };
  add(window_left >= 0 || window_right >= 0, "window_size");
  add(softcap > 0, "softcap");
  add(alibi.defined(), "alibi_slopes");
  add(sinks.defined(), "sinks");
  return s;
}

float SdpaProblem::sink(int64_t b) const {
  if (!sinks.defined()) return -std::numeric_limits<float>::infinity();
  return sinks.data()[(b % heads_q) * sinks.stride(0)];
}

SdpaProblem check_sdpa(const TensorView& q, const TensorView& k, const TensorView& v,
                       const SdpaOptions& o) {
  const char* names[3] = {"query", "key", "value"};
  const TensorView* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (!ts[i]->defined()) throw ValueError(fmt::format("scaled_dot_product_attention: {} is undefined", names[i]));
    if (ts[i]->dim() < 2 || ts[i]->dim() > 4) {
      throw ShapeError(fmt::format(
          "scaled_dot_product_attention: {} must have 2 to 4 dims (..., seq, embed), got shape {}",
          names[i], ts[i]->shape().str()));
    }
    if (ts[i]->numel() == 0) {
      throw ShapeError(fmt::format("scaled_dot_product_attention: {} is empty (shape {})", names[i],
                                   ts[i]->shape().str()));
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (!is_floating(ts[i]->dtype())) {
      throw DTypeError(fmt::format(
          "scaled_dot_product_attention: {} must be float32, bfloat16, float16 or float64, got {}",
          names[i], dtype_name(ts[i]->dtype())));
    }
  }
  // Float32 queries may read bfloat16/float16 keys and values (a low-precision KV cache); the
  // registry then looks for a kernel that takes the pair.
  const bool mixed_kv = q.dtype() == DType::kFloat32 && k.dtype() == v.dtype() &&
                        is_sixteen_bit_float(k.dtype());
  if (!mixed_kv && (k.dtype() != q.dtype() || v.dtype() != q.dtype())) {
    throw DTypeError(fmt::format(
        "scaled_dot_product_attention: query, key and value must have the same dtype, got query "
        "{}, key {}, value {}", dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype())));
  }
  if (k.dim() != q.dim() || v.dim() != q.dim()) {
    throw ShapeError(fmt::format(
        "scaled_dot_product_attention: query, key and value must have the same number of dims, got "
        "query {}, key {}, value {}", q.shape().str(), k.shape().str(), v.shape().str()));
  }
  SdpaProblem p{};
  // With enable_gqa the head dim (-3) of key/value may divide query's; it is checked below.
  const int head_dim = q.dim() >= 3 ? q.dim() - 3 : -1;
  for (int i = 0; i < q.dim() - 2; ++i) {
    if (o.enable_gqa && i == head_dim) {
      p.lead.push_back(q.size(i));
      continue;
    }
    if (k.size(i) != q.size(i) || v.size(i) != q.size(i)) {
      throw ShapeError(fmt::format(
          "scaled_dot_product_attention: key and value must have query's leading (batch, head) dims "
          "{}, got query {}, key {}, value {}", Shape(std::span(q.shape().begin(), static_cast<size_t>(q.dim() - 2))).str(),
          q.shape().str(), k.shape().str(), v.shape().str()));
    }
    p.lead.push_back(q.size(i));
  }
  p.batch = p.lead.numel();
  if (head_dim >= 0) {
    p.heads_q = q.size(head_dim);
    p.heads_kv = k.size(head_dim);
    if (v.size(head_dim) != p.heads_kv) {
      throw ShapeError(fmt::format(
          "scaled_dot_product_attention: key and value must have the same number of heads (dim -3), "
          "got key {}, value {}", k.shape().str(), v.shape().str()));
    }
    if (p.heads_q % p.heads_kv != 0) {  // only reachable with enable_gqa (else caught above)
      throw ShapeError(fmt::format(
          "scaled_dot_product_attention: with enable_gqa, query's number of heads ({}) must be a "
          "multiple of key/value's ({}); got query {}, key {}", p.heads_q, p.heads_kv,
          q.shape().str(), k.shape().str()));
    }
    p.group = p.heads_q / p.heads_kv;
  }
  p.L = q.size(-2);
  p.E = q.size(-1);
  p.S = k.size(-2);
  p.Ev = v.size(-1);
  if (k.size(-1) != p.E) {
    throw ShapeError(fmt::format(
        "scaled_dot_product_attention: key's embed dim must equal query's ({}), got key shape {} "
        "(query shape {})", p.E, k.shape().str(), q.shape().str()));
  }
  if (v.size(-2) != p.S) {
    throw ShapeError(fmt::format(
        "scaled_dot_product_attention: value's sequence length must equal key's ({}), got value "
        "shape {} (key shape {})", p.S, v.shape().str(), k.shape().str()));
  }
  if (!(o.dropout_p >= 0.0f && o.dropout_p <= 1.0f)) {
    throw ValueError(fmt::format("scaled_dot_product_attention: dropout_p must be in [0, 1], got {}",
                                 o.dropout_p));
  }
  p.dropout_p = o.dropout_p;
  p.dtype = q.dtype();
  p.kv_dtype = k.dtype();
  if (static_cast<unsigned>(o.float32_matmul_precision) > static_cast<unsigned>(Float32MatmulPrecision::kMedium)) {
    throw ValueError(fmt::format("scaled_dot_product_attention: float32_matmul_precision must be kDefault, "
                                 "kHighest, kHigh or kMedium, got {}",
                                 static_cast<unsigned>(o.float32_matmul_precision)));
  }
  p.f32_precision = o.float32_matmul_precision == Float32MatmulPrecision::kDefault
                        ? get_float32_matmul_precision()
                        : o.float32_matmul_precision;
  if (o.is_causal && o.attn_mask) {
    throw ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=true, not both");
  }
  // The alignment only places the diagonal of is_causal's mask; without is_causal it is ignored.
  p.causal = o.is_causal;
  check_positions(o, p);
  p.causal_offset =
      o.is_causal && o.causal_alignment == CausalAlignment::kBottomRight ? p.S - p.L : 0;
  if (o.is_causal) p.causal_offset += p.q_pos - p.k_pos;
  if (o.scale) {
    // The kernels multiply in float32, the fused one by scale * log2(e): a scale whose float32
    // multiplier would be infinite is as unusable as an infinite one.
    constexpr double kMaxScale = std::numeric_limits<float>::max() / std::numbers::log2e;
    if (!std::isfinite(*o.scale) || std::fabs(*o.scale) > kMaxScale) {
      throw ValueError(fmt::format(
          "scaled_dot_product_attention: scale must be finite, at most {:.4g} in magnitude (float32 "
          "range of scale * log2(e)), got {}", kMaxScale, *o.scale));
    }
    p.scale = *o.scale;
    p.divide = false;
  } else {
    p.scale = 1.0 / std::sqrt(static_cast<double>(p.E));
    p.divide = true;
    p.divisor = static_cast<float>(std::sqrt(static_cast<double>(p.E)));
  }
  if (o.attn_mask) {
    const TensorView& m = o.attn_mask->values;
    Shape target = p.lead;
    target.push_back(p.L);
    target.push_back(p.S);
    if (!m.defined() || !broadcasts_to(m.shape(), target)) {
      throw ShapeError(fmt::format(
          "scaled_dot_product_attention: attn_mask of shape {} does not broadcast to (..., L, S) = {}",
          m.defined() ? m.shape().str() : "undefined", target.str()));
    }
    p.mask_is_bool = o.attn_mask->kind == AttnMask::Kind::kBool;
    // PyTorch takes a bool mask or one of the query's dtype; attn takes a boolean mask of any
    // dtype (nonzero = takes part) and an additive mask of any floating dtype.
    if (!p.mask_is_bool && !is_floating(m.dtype())) {
      throw DTypeError(fmt::format(
          "scaled_dot_product_attention: an additive attn_mask must have a floating dtype, got {}",
          dtype_name(m.dtype())));
    }
    if (m.dtype() == DType::kFloat32) {
      p.mask = m.expand(target);
    } else {
      p.mask_storage = std::make_shared<const Tensor>(m.to(DType::kFloat32));
      p.mask = p.mask_storage->expand(target);
    }
  }
  check_variants(o, p);
  return p;
}

namespace {
void require_shape(const TensorView& t, const Shape& want, const char* name, const char* hint) {
  if (!t.defined()) {
    throw ValueError(fmt::format("scaled_dot_product_attention_backward: {} is undefined{}", name, hint));
  }
  if (!(t.shape() == want)) {
    throw ShapeError(fmt::format(
        "scaled_dot_product_attention_backward: {} must have shape {} (the forward's), got {}",
        name, want.str(), t.shape().str()));
  }
}
}  // namespace

void check_attn_mask_grad(const SdpaOptions& options, const SdpaProblem& p, const char* who) {
  if (options.need_attn_mask_grad && (!options.attn_mask || p.mask_is_bool)) {
    throw ValueError(fmt::format(
        "{}: need_attn_mask_grad needs an additive attn_mask, got {} (a boolean mask selects keys "
        "and has no gradient)", who, options.attn_mask ? "a boolean one" : "none"));
  }
}

void check_sdpa_backward(const TensorView& grad_output, const SdpaSaved& forward,
                         const SdpaOptions& options, const SdpaProblem& p) {
  Shape out = p.lead, lse = p.lead, weights = p.lead;
  out.push_back(p.L);
  out.push_back(p.Ev);
  lse.push_back(p.L);
  weights.push_back(p.L);
  weights.push_back(p.S);
  require_shape(grad_output, out, "grad_output", "");
  require_shape(forward.output, out, "forward.output", " (pass the forward's SdpaResult)");
  require_shape(forward.lse, lse, "forward.lse", " (run the forward with need_lse = true)");
  if (grad_output.dtype() != p.dtype || forward.output.dtype() != p.dtype) {
    throw DTypeError(fmt::format(
        "scaled_dot_product_attention_backward: grad_output and forward.output must have the "
        "inputs' dtype {}, got grad_output {}, forward.output {}", dtype_name(p.dtype),
        dtype_name(grad_output.dtype()), dtype_name(forward.output.dtype())));
  }
  if (forward.output_residual.defined()) {
    if (!is_sixteen_bit_float(p.dtype)) {
      throw ValueError(fmt::format(
          "scaled_dot_product_attention_backward: forward.output_residual is for bfloat16 and "
          "float16 calls (their output's rounding error), got one for a {} call: leave it undefined",
          dtype_name(p.dtype)));
    }
    require_shape(forward.output_residual, out, "forward.output_residual", "");
    if (forward.output_residual.dtype() != p.dtype) {
      throw DTypeError(fmt::format("scaled_dot_product_attention_backward: forward.output_residual "
                                   "must have the output's dtype {}, got {}", dtype_name(p.dtype),
                                   dtype_name(forward.output_residual.dtype())));
    }
  }
  const DType lse_dtype = p.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  if (forward.lse.dtype() != lse_dtype) {
    throw DTypeError(fmt::format("scaled_dot_product_attention_backward: forward.lse must be {} "
                                 "(the forward's), got {}", dtype_name(lse_dtype),
                                 dtype_name(forward.lse.dtype())));
  }
  check_attn_mask_grad(options, p, "scaled_dot_product_attention_backward");
  if (p.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kTorch) {
    require_shape(forward.attn_weights, weights, "forward.attn_weights",
                  " (dropout with DropoutRng::kTorch cannot be drawn again: run the forward with "
                  "need_weights = true, or use DropoutRng::kPhilox)");
  }
}

int64_t lead_offset(const TensorView& t, const Shape& lead, int64_t b) {
  int64_t off = 0;
  for (int i = lead.ndim() - 1; i >= 0; --i) {
    off += (b % lead[i]) * t.stride(i);
    b /= lead[i];
  }
  return off;
}

int64_t kv_lead_offset(const TensorView& kv, const SdpaProblem& p, int64_t b) {
  const int nlead = p.lead.ndim();
  if (nlead == 0) return 0;
  const int64_t outer = b / p.heads_q, h = b % p.heads_q;  // outer: batch index of 4-D inputs
  int64_t off = (h / p.group) * kv.stride(nlead - 1);
  if (nlead == 2) off += outer * kv.stride(0);
  return off;
}

}  // namespace attn::detail

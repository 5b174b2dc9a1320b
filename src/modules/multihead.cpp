// torch.nn.MultiheadAttention on top of scaled_dot_product_attention: project with the slices of
// in_proj_weight (or torch's separate q/k/v_proj_weight when kdim or vdim differs), split heads
// (views), merge torch's two masks into one additive mask, attend, merge heads, out_proj.
#include "attn/multihead.hpp"

#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <vector>

#include "attn/error.hpp"

namespace attn::nn {

namespace {

constexpr const char* kName = "MultiheadAttention";

int64_t checked_head_dim(int64_t embed_dim, int64_t num_heads) {
  if (embed_dim <= 0) throw ValueError(fmt::format("{}: embed_dim must be positive, got {}", kName, embed_dim));
  if (num_heads <= 0) throw ValueError(fmt::format("{}: num_heads must be positive, got {}", kName, num_heads));
  if (embed_dim % num_heads != 0) {
    throw ValueError(fmt::format("{}: embed_dim must be divisible by num_heads, got embed_dim = {}, "
                                 "num_heads = {}", kName, embed_dim, num_heads));
  }
  return embed_dim / num_heads;
}

// torch.nn.init.xavier_uniform_(w) for a 2-D (fan_out, fan_in) weight, with torch's arithmetic
// for the bound so the drawn floats are identical.
void xavier_uniform_(TensorView w, Generator& gen) {
  const double fan_in = static_cast<double>(w.size(1)), fan_out = static_cast<double>(w.size(0));
  const double stddev = 1.0 * std::sqrt(2.0 / (fan_in + fan_out));
  const double a = std::sqrt(3.0) * stddev;
  uniform_(w, -a, a, gen);
}

// A float mask in torch's convention to an additive one: nonzero (True) = -inf when `is_bool`.
Tensor to_additive(const TensorView& m, bool is_bool) {
  Tensor out = m.contiguous();
  if (is_bool) {
    float* p = out.data();
    for (int64_t i = 0; i < out.numel(); ++i) p[i] = p[i] != 0.0f ? -std::numeric_limits<float>::infinity() : 0.0f;
  }
  return out;
}

}  // namespace

MultiheadAttention::MultiheadAttention(int64_t embed_dim_, int64_t num_heads_, float dropout_,
                                       bool bias, bool add_bias_kv, bool add_zero_attn_,
                                       int64_t kdim_, int64_t vdim_, bool batch_first_,
                                       Generator& gen)
    : embed_dim(embed_dim_), num_heads(num_heads_),
      head_dim(checked_head_dim(embed_dim_, num_heads_)), kdim(kdim_ == 0 ? embed_dim_ : kdim_),
      vdim(vdim_ == 0 ? embed_dim_ : vdim_), dropout(dropout_), batch_first(batch_first_),
      add_zero_attn(add_zero_attn_),
      // torch builds out_proj (drawing its default Linear init) before _reset_parameters.
      out_proj(embed_dim_, embed_dim_, bias, gen) {
  if (!(dropout >= 0.0f && dropout <= 1.0f)) {
    throw ValueError(fmt::format("{}: dropout must be in [0, 1], got {}", kName, dropout));
  }
  if (kdim_ < 0 || vdim_ < 0) {
    throw ValueError(fmt::format("{}: kdim and vdim must be positive (0 or none: embed_dim), got kdim = {}, "
                                 "vdim = {}", kName, kdim_, vdim_));
  }
  // torch's _reset_parameters: xavier_uniform_ on in_proj_weight, or on q_, k_ and v_proj_weight
  // in turn, then zero biases.
  if (kdim == embed_dim && vdim == embed_dim) {
    in_proj_weight = Tensor::empty({3 * embed_dim, embed_dim});
    xavier_uniform_(in_proj_weight, gen);
  } else {
    q_proj_weight = Tensor::empty({embed_dim, embed_dim});
    k_proj_weight = Tensor::empty({embed_dim, kdim});
    v_proj_weight = Tensor::empty({embed_dim, vdim});
    for (Tensor* w : {&q_proj_weight, &k_proj_weight, &v_proj_weight}) xavier_uniform_(*w, gen);
  }
  if (bias) {
    in_proj_bias = Tensor::zeros({3 * embed_dim});
    out_proj.bias = Tensor::zeros({embed_dim});
  }
  if (add_bias_kv) {
    // xavier_normal_ of a (1, 1, E) tensor: fan_in = fan_out = E, std = sqrt(2 / (2E)).
    const double stddev = std::sqrt(2.0 / static_cast<double>(2 * embed_dim));
    for (Tensor* b : {&bias_k, &bias_v}) {
      *b = Tensor::empty({1, 1, embed_dim});
      normal_(*b, 0.0, stddev, gen);
    }
  }
}

NamedTensors MultiheadAttention::named_parameters() {
  // torch's registration order, which its state_dict keeps.
  NamedTensors p;
  if (in_proj_weight.defined()) {
    p.emplace_back("in_proj_weight", &in_proj_weight);
  } else {
    p = {{"q_proj_weight", &q_proj_weight}, {"k_proj_weight", &k_proj_weight}, {"v_proj_weight", &v_proj_weight}};
  }
  if (in_proj_bias.defined()) p.emplace_back("in_proj_bias", &in_proj_bias);
  if (bias_k.defined()) p.insert(p.end(), {{"bias_k", &bias_k}, {"bias_v", &bias_v}});
  append_prefixed(p, "out_proj", out_proj.named_parameters());
  return p;
}

MultiheadAttention::Result MultiheadAttention::forward(
    const TensorView& query, const TensorView& key, const TensorView& value,
    const TensorView& key_padding_mask, bool need_weights, const TensorView& attn_mask,
    bool average_attn_weights, bool is_causal, bool key_padding_mask_is_bool,
    bool attn_mask_is_bool) const {
  const int nd = query.dim();
  if (nd != 2 && nd != 3) {
    throw ShapeError(fmt::format("{}: query must be 3-D (batched) or 2-D (unbatched), got shape {}",
                                 kName, query.shape().str()));
  }
  const bool batched = nd == 3;
  if (key.dim() != nd || value.dim() != nd) {
    throw ShapeError(fmt::format("{}: key and value must be {}-D like query {}, got key {} and value {}",
                                 kName, nd, query.shape().str(), key.shape().str(), value.shape().str()));
  }
  // Everything as (N, L, E) views.
  auto nle = [&](const TensorView& t) {
    if (!batched) return t.unsqueeze(0);
    return batch_first ? t : t.transpose(0, 1);
  };
  const TensorView q = nle(query), k = nle(key), v = nle(value);
  const int64_t N = q.size(0), L = q.size(1), S = k.size(1), E = embed_dim, H = num_heads;
  const char* layout = !batched ? "(S, dim)" : batch_first ? "(N, S, dim)" : "(S, N, dim)";
  if (q.size(2) != E) {
    throw ShapeError(fmt::format("{}: query's last dim must be embed_dim = {}, got shape {}", kName, E,
                                 query.shape().str()));
  }
  if (k.size(0) != N || v.size(0) != N || v.size(1) != S || k.size(2) != kdim || v.size(2) != vdim) {
    throw ShapeError(fmt::format("{}: key and value must be {} with N = {}, one S, dim = kdim = {} for key and "
                                 "dim = vdim = {} for value, got key {} and value {}", kName, layout, N,
                                 kdim, vdim, key.shape().str(), value.shape().str()));
  }

  auto project = [&](const TensorView& x, int64_t part) {
    const Tensor* sep[3] = {&q_proj_weight, &k_proj_weight, &v_proj_weight};
    const TensorView w = in_proj_weight.defined() ? in_proj_weight.slice(0, part * E, (part + 1) * E)
                                                  : TensorView(*sep[part]);
    const TensorView b = in_proj_bias.defined() ? in_proj_bias.slice(0, part * E, (part + 1) * E)
                                                : TensorView{};
    return linear(x, w, b);  // (N, T, E), contiguous
  };
  const Tensor qp = project(q, 0);
  // torch's extra keys after the projection: bias_k / bias_v, then a zero key and value.
  const int64_t extra = (bias_k.defined() ? 1 : 0) + (add_zero_attn ? 1 : 0), S2 = S + extra;
  const Tensor zero_key = Tensor::zeros({N, 1, E});
  auto with_extra_keys = [&](Tensor x, const Tensor& b) {
    if (extra == 0) return x;
    std::vector<TensorView> parts{x};
    if (b.defined()) parts.push_back(b.expand({N, 1, E}));
    if (add_zero_attn) parts.push_back(zero_key);
    return cat(parts, 1);
  };
  const Tensor kp = with_extra_keys(project(k, 1), bias_k), vp = with_extra_keys(project(v, 2), bias_v);
  // (N, T, E) -> (N, T, H, hd) -> (N, H, T, hd): views.
  auto split = [&](const Tensor& t, int64_t T) { return t.view({N, T, H, head_dim}).transpose(1, 2); };

  // torch merges both masks into one float mask added to the scores; so does attn, shaped
  // (N or 1, H or 1, L, S) so that SDPA broadcasts it.
  Tensor mask;
  if (attn_mask.defined()) {
    Shape want2{L, S}, want3{batched ? N * H : H, L, S};
    if (attn_mask.dim() == 2 && attn_mask.shape() == want2) {
      mask = to_additive(attn_mask, attn_mask_is_bool).view({1, 1, L, S}).contiguous();
    } else if (attn_mask.dim() == 3 && attn_mask.shape() == want3) {
      mask = to_additive(attn_mask, attn_mask_is_bool).view({N, H, L, S}).contiguous();
    } else {
      throw ShapeError(fmt::format("{}: attn_mask must be {} or {}, got {}", kName, want2.str(),
                                   want3.str(), attn_mask.shape().str()));
    }
  }
  if (key_padding_mask.defined()) {
    const Shape want = batched ? Shape{N, S} : Shape{S};
    if (!(key_padding_mask.shape() == want)) {
      throw ShapeError(fmt::format("{}: key_padding_mask must be {}, got {}", kName, want.str(),
                                   key_padding_mask.shape().str()));
    }
    const Tensor kpm = to_additive(key_padding_mask, key_padding_mask_is_bool).view({N, 1, 1, S}).contiguous();
    mask = mask.defined() ? add(mask, kpm) : kpm;
  }

  SdpaOptions opt;
  opt.dropout_p = training_ ? dropout : 0.0f;
  opt.need_weights = need_weights;
  if (is_causal && !mask.defined() && extra == 0) {
    opt.is_causal = true;
  } else if (is_causal) {
    if (!mask.defined()) mask = Tensor::zeros({1, 1, L, S});
    // SDPA takes is_causal or a mask, not both: fold the causal mask into the additive one
    // (expanded first: a key_padding_mask alone is (N, 1, 1, S)).
    Tensor full = mask.expand({mask.size(0), mask.size(1), L, S}).contiguous();
    const int64_t planes = L * S == 0 ? 0 : full.numel() / (L * S);
    float* p = full.data();
    for (int64_t b = 0; b < planes; ++b) {
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = i + 1; j < S; ++j) p[(b * L + i) * S + j] = -std::numeric_limits<float>::infinity();
      }
    }
    mask = std::move(full);
  }
  if (mask.defined() && extra > 0) {  // the extra keys' columns: 0, as torch pads its masks
    const Tensor pad = Tensor::zeros({mask.size(0), mask.size(1), mask.size(2), extra});
    mask = cat(std::vector<TensorView>{mask, pad}, 3);
  }
  if (mask.defined()) opt.attn_mask = AttnMask::additive(mask);

  SdpaResult r = scaled_dot_product_attention(split(qp, L), split(kp, S2), split(vp, S2), opt);
  // (N, H, L, hd) -> (N, L, H, hd) -> (N, L, E) -> out_proj.
  const Tensor merged = r.output.transpose(1, 2).contiguous();
  Tensor out = out_proj.forward(merged.view({N, L, E}));

  Result res;
  if (!batched) {
    res.output = out.view({L, E}).contiguous();
  } else {
    res.output = batch_first ? std::move(out) : out.transpose(0, 1).contiguous();
  }
  if (need_weights) {
    Tensor w = average_attn_weights ? div(sum(r.attn_weights, 1), static_cast<float>(H))
                                    : std::move(r.attn_weights);
    res.attn_weights = batched ? std::move(w) : w.select(0, 0).contiguous();
  }
  return res;
}

}  // namespace attn::nn

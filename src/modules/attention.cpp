// The chapter's attention modules. Each projects its input and hands the attention itself to
// scaled_dot_product_attention, so the modules and the functional API cannot drift apart.
//
// Each forward is written once, as forward_impl(self, x) for a const or non-const self: the
// const instantiation only computes; the non-const one runs its submodules' recording forwards
// and, with gradients enabled, saves the attention context for backward
// (attention_backward.cpp). Both compute the same output bits. MultiHeadAttention's cached
// forward (incremental decoding) goes through the same scaled_dot_product_attention call, over
// the keys and values its KVCacheLayer holds.
#include <fmt/format.h>
#include <optional>
#include <type_traits>
#include <utility>

#include "attn/error.hpp"
#include "attn/modules.hpp"

namespace attn::nn {

namespace {

void require_positive(int64_t v, const char* module, const char* arg) {
  if (v <= 0) throw ValueError(fmt::format("{}: {} must be positive, got {}", module, arg, v));
}

// x must be (num_tokens, d_in) or (b, num_tokens, d_in).
void check_input(const TensorView& x, int64_t d_in, const char* module, bool batched_only) {
  const bool rank_ok = batched_only ? x.dim() == 3 : (x.dim() == 2 || x.dim() == 3);
  if (!x.defined() || !rank_ok || x.size(-1) != d_in || x.numel() == 0) {
    throw ShapeError(fmt::format("{}: x must have shape {} with num_tokens > 0 and d_in = {}, got {}",
                                 module, batched_only ? "(b, num_tokens, d_in)" : "(..., num_tokens, d_in)",
                                 d_in, x.defined() ? x.shape().str() : "undefined"));
  }
}

void check_context(const TensorView& x, int64_t context_length, const char* module) {
  if (x.size(-2) > context_length) {
    throw ShapeError(fmt::format("{}: num_tokens = {} exceeds context_length = {} (input shape {})",
                                 module, x.size(-2), context_length, x.shape().str()));
  }
}

Tensor causal_mask_buffer(int64_t context_length) {
  return triu(Tensor::ones({context_length, context_length}), 1);
}

SdpaOptions causal_options(const Dropout& dropout, bool training,
                           std::optional<double> scale = std::nullopt) {
  SdpaOptions o;
  o.is_causal = true;
  o.dropout_p = training ? dropout.p : 0.0f;
  o.generator = dropout.generator;
  o.scale = scale;
  return o;
}

// What the backward needs from scaled_dot_product_attention: the lse, for 16-bit inputs the
// output's float32 residual (the backward then need not re-derive it), and with PyTorch-stream
// dropout the post-dropout weights (that mask cannot be drawn again).
SdpaOptions for_backward(SdpaOptions o) {
  o.need_lse = true;
  o.need_output_residual = true;
  if (o.dropout_p > 0.0f && o.dropout_rng == DropoutRng::kTorch) o.need_weights = true;
  return o;
}

using SavedAttention = std::optional<detail::AttentionContext>;

// Where a recording forward saves its context: nowhere with gradients disabled. Resets the slot
// first, so a failed or no-grad forward never leaves an older context behind.
SavedAttention* save_slot(SavedAttention& slot) {
  slot.reset();
  return is_grad_enabled() ? &slot : nullptr;
}

// Attention over the views q, k, v of the projections; with `save`, the projections, the input
// (when the module needs it) and SDPA's result are kept for backward.
Tensor attend(SavedAttention* save, const TensorView& input, const Tensor& queries,
              const Tensor& keys, const Tensor& values, const TensorView& q, const TensorView& k,
              const TensorView& v, const SdpaOptions& o) {
  if (save == nullptr) return scaled_dot_product_attention(q, k, v, o).output;
  detail::AttentionContext ctx;
  ctx.options = for_backward(o);
  ctx.result = scaled_dot_product_attention(q, k, v, ctx.options);
  if (input.defined()) ctx.input = input.contiguous();
  ctx.queries = queries;
  ctx.keys = keys;
  ctx.values = values;
  ctx.output_shape = ctx.result.output.shape();
  Tensor out = ctx.result.output;
  *save = std::move(ctx);
  return out;
}

// The three projections' parameters under their PyTorch names, in registration order.
NamedTensors qkv_parameters(Linear& W_query, Linear& W_key, Linear& W_value) {
  NamedTensors p;
  append_prefixed(p, "W_query", W_query.named_parameters());
  append_prefixed(p, "W_key", W_key.named_parameters());
  append_prefixed(p, "W_value", W_value.named_parameters());
  return p;
}

}  // namespace

// ---- SelfAttentionV1 ----------------------------------------------------------------------------

SelfAttentionV1::SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen) {
  require_positive(d_in, "SelfAttentionV1", "d_in");
  require_positive(d_out, "SelfAttentionV1", "d_out");
  W_query = rand({d_in, d_out}, gen);
  W_key = rand({d_in, d_out}, gen);
  W_value = rand({d_in, d_out}, gen);
  grad_W_query = Tensor::zeros({d_in, d_out});
  grad_W_key = Tensor::zeros({d_in, d_out});
  grad_W_value = Tensor::zeros({d_in, d_out});
}

template <typename Self>
Tensor SelfAttentionV1::forward_impl(Self& self, const TensorView& x) {
  SavedAttention* save = nullptr;
  if constexpr (!std::is_const_v<Self>) save = save_slot(self.saved_);
  check_input(x, self.W_query.size(0), "SelfAttentionV1", false);
  const Tensor keys = matmul(x, self.W_key), queries = matmul(x, self.W_query),
         values = matmul(x, self.W_value);
  return attend(save, x, queries, keys, values, queries, keys, values, SdpaOptions{});
}

Tensor SelfAttentionV1::forward(const TensorView& x) const { return forward_impl(*this, x); }
Tensor SelfAttentionV1::forward(const TensorView& x) { return forward_impl(*this, x); }

NamedTensors SelfAttentionV1::named_parameters() {
  return {{"W_query", &W_query}, {"W_key", &W_key}, {"W_value", &W_value}};
}

// ---- SelfAttentionV2 ----------------------------------------------------------------------------

SelfAttentionV2::SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias, Generator& gen)
    : W_query(d_in, d_out, qkv_bias, gen), W_key(d_in, d_out, qkv_bias, gen),
      W_value(d_in, d_out, qkv_bias, gen) {}

template <typename Self>
Tensor SelfAttentionV2::forward_impl(Self& self, const TensorView& x) {
  SavedAttention* save = nullptr;
  if constexpr (!std::is_const_v<Self>) save = save_slot(self.saved_);
  check_input(x, self.W_query.in_features, "SelfAttentionV2", false);
  const Tensor keys = self.W_key.forward(x), queries = self.W_query.forward(x),
         values = self.W_value.forward(x);
  return attend(save, TensorView(), queries, keys, values, queries, keys, values, SdpaOptions{});
}

Tensor SelfAttentionV2::forward(const TensorView& x) const { return forward_impl(*this, x); }
Tensor SelfAttentionV2::forward(const TensorView& x) { return forward_impl(*this, x); }

NamedTensors SelfAttentionV2::named_parameters() {
  return qkv_parameters(W_query, W_key, W_value);
}

// ---- CausalAttention ----------------------------------------------------------------------------

CausalAttention::CausalAttention(int64_t d_in_, int64_t d_out_, int64_t context_length_,
                                 float dropout_p, bool qkv_bias, Generator& gen)
    : d_in(d_in_), d_out(d_out_), context_length(context_length_),
      W_query(d_in_, d_out_, qkv_bias, gen), W_key(d_in_, d_out_, qkv_bias, gen),
      W_value(d_in_, d_out_, qkv_bias, gen), dropout(dropout_p) {
  require_positive(context_length, "CausalAttention", "context_length");
  mask = causal_mask_buffer(context_length);
}

template <typename Self>
Tensor CausalAttention::forward_impl(Self& self, const TensorView& x) {
  SavedAttention* save = nullptr;
  if constexpr (!std::is_const_v<Self>) save = save_slot(self.saved_);
  check_input(x, self.d_in, "CausalAttention", true);
  check_context(x, self.context_length, "CausalAttention");
  const Tensor keys = self.W_key.forward(x), queries = self.W_query.forward(x),
         values = self.W_value.forward(x);
  return attend(save, TensorView(), queries, keys, values, queries, keys, values,
                causal_options(self.dropout, self.training_));
}

Tensor CausalAttention::forward(const TensorView& x) const { return forward_impl(*this, x); }
Tensor CausalAttention::forward(const TensorView& x) { return forward_impl(*this, x); }

NamedTensors CausalAttention::named_parameters() {
  return qkv_parameters(W_query, W_key, W_value);
}

NamedTensors CausalAttention::named_buffers() { return {{"mask", &mask}}; }

// torch lists a module's own buffer before its submodules' parameters: "mask", "W_query.weight", ...
NamedTensors CausalAttention::state_dict() {
  NamedTensors all = named_buffers();
  NamedTensors params = named_parameters();
  all.insert(all.end(), params.begin(), params.end());
  return all;
}

void CausalAttention::train(bool mode) {
  Module::train(mode);
  dropout.train(mode);
}

// ---- MultiHeadAttentionWrapper ----------------------------------------------------------------

MultiHeadAttentionWrapper::MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out,
                                                     int64_t context_length, float dropout,
                                                     int64_t num_heads, bool qkv_bias,
                                                     Generator& gen) {
  require_positive(num_heads, "MultiHeadAttentionWrapper", "num_heads");
  heads.reserve(static_cast<size_t>(num_heads));
  for (int64_t h = 0; h < num_heads; ++h) {
    heads.emplace_back(d_in, d_out, context_length, dropout, qkv_bias, gen);
  }
}

Tensor MultiHeadAttentionWrapper::forward(const TensorView& x) const {
  check_input(x, heads.front().d_in, "MultiHeadAttentionWrapper", true);
  check_context(x, heads.front().context_length, "MultiHeadAttentionWrapper");
  std::vector<Tensor> outs;
  for (const CausalAttention& head : heads) outs.push_back(head.forward(x));
  std::vector<TensorView> views(outs.begin(), outs.end());
  return cat(views, -1);
}

Tensor MultiHeadAttentionWrapper::forward(const TensorView& x) {
  saved_output_shape_.reset();
  check_input(x, heads.front().d_in, "MultiHeadAttentionWrapper", true);
  check_context(x, heads.front().context_length, "MultiHeadAttentionWrapper");
  std::vector<Tensor> outs;
  for (CausalAttention& head : heads) outs.push_back(head.forward(x));
  std::vector<TensorView> views(outs.begin(), outs.end());
  Tensor out = cat(views, -1);
  if (is_grad_enabled()) saved_output_shape_ = out.shape();
  return out;
}

NamedTensors MultiHeadAttentionWrapper::named_parameters() {
  NamedTensors p;
  for (size_t h = 0; h < heads.size(); ++h) {
    append_prefixed(p, "heads." + std::to_string(h), heads[h].named_parameters());
  }
  return p;
}

NamedTensors MultiHeadAttentionWrapper::named_buffers() {
  NamedTensors p;
  for (size_t h = 0; h < heads.size(); ++h) {
    append_prefixed(p, "heads." + std::to_string(h), heads[h].named_buffers());
  }
  return p;
}

NamedTensors MultiHeadAttentionWrapper::state_dict() {
  NamedTensors p;
  for (size_t h = 0; h < heads.size(); ++h) {
    append_prefixed(p, "heads." + std::to_string(h), heads[h].state_dict());
  }
  return p;
}

void MultiHeadAttentionWrapper::train(bool mode) {
  Module::train(mode);
  for (CausalAttention& head : heads) head.train(mode);
}

// ---- KVCacheLayer ---------------------------------------------------------------------------------

KVCacheLayer::KVCacheLayer(int64_t batch, int64_t num_heads, int64_t capacity, int64_t head_dim) {
  require_positive(batch, "KVCacheLayer", "batch");
  require_positive(num_heads, "KVCacheLayer", "num_heads");
  require_positive(capacity, "KVCacheLayer", "capacity");
  require_positive(head_dim, "KVCacheLayer", "head_dim");
  keys = Tensor::zeros({batch, num_heads, capacity, head_dim});
  values = Tensor::zeros({batch, num_heads, capacity, head_dim});
}

// ---- MultiHeadAttention -----------------------------------------------------------------------

namespace {
int64_t checked_head_dim(int64_t d_out, int64_t num_heads) {
  require_positive(num_heads, "MultiHeadAttention", "num_heads");
  require_positive(d_out, "MultiHeadAttention", "d_out");
  if (d_out % num_heads != 0) {
    throw ValueError(fmt::format("MultiHeadAttention: d_out must be divisible by num_heads, got "
                                 "d_out = {}, num_heads = {}", d_out, num_heads));
  }
  return d_out / num_heads;
}
}  // namespace

MultiHeadAttention::MultiHeadAttention(int64_t d_in_, int64_t d_out_, int64_t context_length_,
                                       float dropout_p, int64_t num_heads_, bool qkv_bias,
                                       Generator& gen)
    : d_in(d_in_), d_out(d_out_), num_heads(num_heads_),
      head_dim(checked_head_dim(d_out_, num_heads_)), context_length(context_length_),
      W_query(d_in_, d_out_, qkv_bias, gen), W_key(d_in_, d_out_, qkv_bias, gen),
      W_value(d_in_, d_out_, qkv_bias, gen), out_proj(d_out_, d_out_, true, gen),
      dropout(dropout_p) {
  require_positive(context_length, "MultiHeadAttention", "context_length");
  mask = causal_mask_buffer(context_length);
}

template <typename Self>
Tensor MultiHeadAttention::forward_impl(Self& self, const TensorView& x) {
  SavedAttention* save = nullptr;
  if constexpr (!std::is_const_v<Self>) save = save_slot(self.saved_);
  check_input(x, self.d_in, "MultiHeadAttention", true);
  check_context(x, self.context_length, "MultiHeadAttention");
  const int64_t b = x.size(0), T = x.size(1);
  const Tensor keys = self.W_key.forward(x), queries = self.W_query.forward(x),
         values = self.W_value.forward(x);
  // (b, T, d_out) -> (b, T, H, hd) -> (b, H, T, hd): views, no copies.
  auto split = [&](const Tensor& t) {
    return t.view({b, T, self.num_heads, self.head_dim}).transpose(1, 2);
  };
  const Tensor context = attend(save, TensorView(), queries, keys, values, split(queries),
                                split(keys), split(values),
                                causal_options(self.dropout, self.training_, self.scale));
  // (b, H, T, hd) -> (b, T, H, hd) -> (b, T, d_out)
  const Tensor merged = context.transpose(1, 2).contiguous();
  return self.out_proj.forward(merged.view({b, T, self.d_out}));
}

Tensor MultiHeadAttention::forward(const TensorView& x) const { return forward_impl(*this, x); }
Tensor MultiHeadAttention::forward(const TensorView& x) { return forward_impl(*this, x); }

namespace {

// dst = src for two 4-D float32 views of one shape: the new positions' rows of the cache.
void copy_4d(const TensorView& dst, const TensorView& src) {
  for (int64_t a = 0; a < src.size(0); ++a)
    for (int64_t b = 0; b < src.size(1); ++b)
      for (int64_t c = 0; c < src.size(2); ++c) {
        const float* s = src.data() + a * src.stride(0) + b * src.stride(1) + c * src.stride(2);
        float* d = dst.data() + a * dst.stride(0) + b * dst.stride(1) + c * dst.stride(2);
        for (int64_t e = 0; e < src.size(3); ++e) d[e * dst.stride(3)] = s[e * src.stride(3)];
      }
}

// Everything forward_cached could trip over, checked before the cache is written, so that a
// refused call leaves it as it was.
void check_cache(const KVCacheLayer& cache, int64_t batch, int64_t num_heads, int64_t head_dim,
                 int64_t new_positions) {
  const char* who = "MultiHeadAttention.forward_cached";
  const std::pair<const char*, const Tensor*> tensors[] = {{"keys", &cache.keys},
                                                           {"values", &cache.values}};
  for (const auto& [name, t] : tensors) {
    const bool ok = t->defined() && t->dim() == 4 && t->dtype() == DType::kFloat32 &&
                    t->is_contiguous() && t->size(0) == batch && t->size(1) == num_heads &&
                    t->size(3) == head_dim && t->shape() == cache.keys.shape();
    if (!ok) {
      throw ShapeError(fmt::format(
          "{}: cache.{} must be a contiguous float32 tensor (batch, num_heads, capacity, "
          "head_dim) = ({}, {}, capacity, {}) shaped like cache.keys, got {} {}",
          who, name, batch, num_heads, head_dim, t->defined() ? t->shape().str() : "undefined",
          t->defined() ? dtype_name(t->dtype()) : ""));
    }
  }
  const int64_t capacity = cache.capacity();
  if (cache.length < 0 || cache.length > capacity) {
    throw ShapeError(fmt::format("{}: cache.length must be in [0, {}] (the cache's capacity), got {}",
                                 who, capacity, cache.length));
  }
  if (new_positions > capacity - cache.length) {
    throw ShapeError(fmt::format("{}: {} new positions at cache.length = {} exceed the cache's "
                                 "capacity = {} (at most {} more fit)",
                                 who, new_positions, cache.length, capacity,
                                 capacity - cache.length));
  }
}

}  // namespace

Tensor MultiHeadAttention::forward_cached(const TensorView& x, KVCacheLayer& cache,
                                          Tensor* attn_weights) const {
  // x (b, L, d_in) at positions [cache.length, cache.length + L) -> (b, L, d_out)
  check_input(x, d_in, "MultiHeadAttention.forward_cached", true);
  const int64_t b = x.size(0), L = x.size(1), start = cache.length;
  check_cache(cache, b, num_heads, head_dim, L);
  const int64_t S = start + L;
  const Tensor queries = W_query.forward(x), keys = W_key.forward(x), values = W_value.forward(x);
  auto split = [&](const Tensor& t) { return t.view({b, L, num_heads, head_dim}).transpose(1, 2); };
  copy_4d(cache.keys.slice(2, start, S), split(keys));
  copy_4d(cache.values.slice(2, start, S), split(values));
  // The L new queries against all S cached keys: query i is position start + i, so it sees
  // keys j <= i + (S - L), the bottom-right alignment. No dropout: this path is inference only.
  SdpaOptions o;
  o.is_causal = true;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.scale = scale;
  o.need_weights = attn_weights != nullptr;
  SdpaResult r = scaled_dot_product_attention(split(queries), cache.keys.slice(2, 0, S),
                                              cache.values.slice(2, 0, S), o);
  cache.length = S;
  if (attn_weights != nullptr) *attn_weights = std::move(r.attn_weights);
  // (b, H, L, hd) -> (b, L, H, hd) -> (b, L, d_out)
  const Tensor merged = r.output.transpose(1, 2).contiguous();
  return out_proj.forward(merged.view({b, L, d_out}));
}

KVCacheLayer MultiHeadAttention::make_cache(int64_t batch, std::optional<int64_t> capacity) const {
  return KVCacheLayer(batch, num_heads, capacity.value_or(context_length), head_dim);
}

NamedTensors MultiHeadAttention::named_parameters() {
  NamedTensors p = qkv_parameters(W_query, W_key, W_value);
  append_prefixed(p, "out_proj", out_proj.named_parameters());
  return p;
}

NamedTensors MultiHeadAttention::named_buffers() { return {{"mask", &mask}}; }

NamedTensors MultiHeadAttention::state_dict() {
  NamedTensors all = named_buffers();
  NamedTensors params = named_parameters();
  all.insert(all.end(), params.begin(), params.end());
  return all;
}

void MultiHeadAttention::train(bool mode) {
  Module::train(mode);
  dropout.train(mode);
}

}  // namespace attn::nn

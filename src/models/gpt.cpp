// The tiny GPT: blocks of the chapter's MultiHeadAttention between LayerNorms and an MLP, with
// explicit backward passes (each submodule differentiates itself; the block and the model only
// route gradients through the residual connections), and the KV-cache inference path.
#include "attn/gpt.hpp"

#include <fmt/format.h>

#include "attn/error.hpp"
#include "modules/backward_util.hpp"

namespace attn::gpt {

namespace {

using nn::append_prefixed;
using nn::NamedTensors;

// (B, T, C) -> (B, H, T, hd): a view.
TensorView split_heads(const TensorView& t, int64_t H) {
  const int64_t B = t.size(0), T = t.size(1), hd = t.size(2) / H;
  return t.view({B, T, H, hd}).transpose(1, 2);
}

// (B, H, T, hd) -> (B, T, H * hd): a contiguous copy.
Tensor merge_heads(const TensorView& t) {
  const int64_t B = t.size(0), H = t.size(1), T = t.size(2), hd = t.size(3);
  Tensor merged = t.transpose(1, 2).contiguous();
  return Tensor(Shape{B, T, H * hd}, std::span<const float>(merged.data(), merged.numel()));
}

// dst[...] = src[...] for two 4-D views of one shape (the cache rows of new positions).
void copy_4d(const TensorView& dst, const TensorView& src) {
  for (int64_t a = 0; a < src.size(0); ++a)
    for (int64_t b = 0; b < src.size(1); ++b)
      for (int64_t c = 0; c < src.size(2); ++c) {
        const float* s = src.data() + a * src.stride(0) + b * src.stride(1) + c * src.stride(2);
        float* d = dst.data() + a * dst.stride(0) + b * dst.stride(1) + c * dst.stride(2);
        for (int64_t e = 0; e < src.size(3); ++e) d[e * dst.stride(3)] = s[e * src.stride(3)];
      }
}

// The uniform-average ablation: with scale 0 every score is 0, so causal softmax weights are
// 1 / (i + 1) over positions 0..i whatever the queries and keys.
SdpaOptions attention_options(AttentionKind kind) {
  SdpaOptions o;
  o.is_causal = true;
  if (kind == AttentionKind::kUniform) o.scale = 0.0;
  return o;
}

}  // namespace

void check_ids(std::span<const int64_t> ids, int64_t vocab_size, const char* what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      throw IndexError(fmt::format("{}: token id at position {} must be in [0, {}) (the vocabulary), "
                                   "got {}", what, i, vocab_size, ids[i]));
    }
  }
}

// ---- FeedForward -----------------------------------------------------------------------------------

FeedForward::FeedForward(int64_t d_model, int64_t hidden, Generator& gen)
    : fc1(d_model, hidden, true, gen), act("none"), fc2(hidden, d_model, true, gen) {}

Tensor FeedForward::forward(const TensorView& x) { return fc2.forward(act.forward(fc1.forward(x))); }
Tensor FeedForward::forward(const TensorView& x) const {
  return fc2.forward(act.forward(fc1.forward(x)));
}
Tensor FeedForward::backward(const TensorView& grad_output) {
  // (..., C) -> (..., C)
  return fc1.backward(act.backward(fc2.backward(grad_output)));
}
NamedTensors FeedForward::named_parameters() {
  NamedTensors p;
  append_prefixed(p, "layers.0", fc1.named_parameters());
  append_prefixed(p, "layers.2", fc2.named_parameters());
  return p;
}
NamedTensors FeedForward::named_grads() {
  NamedTensors p;
  append_prefixed(p, "layers.0", fc1.named_grads());
  append_prefixed(p, "layers.2", fc2.named_grads());
  return p;
}

// ---- KVCache ------------------------------------------------------------------------------------------

KVCache::KVCache(const GPTConfig& config, int64_t batch_) : batch(batch_), capacity(config.context_length) {
  config.validate();
  if (batch <= 0) throw ValueError(fmt::format("KVCache: batch must be positive, got {}", batch));
  const int64_t hd = config.d_model / config.n_heads;
  for (int64_t l = 0; l < config.n_layers; ++l) {
    keys.push_back(Tensor::zeros({batch, config.n_heads, capacity, hd}));
    values.push_back(Tensor::zeros({batch, config.n_heads, capacity, hd}));
  }
}

// ---- TransformerBlock -------------------------------------------------------------------------------

TransformerBlock::TransformerBlock(const GPTConfig& c, Generator& gen)
    : attention(c.attention), norm1(c.d_model),
      att(c.d_model, c.d_model, c.context_length, c.dropout, c.n_heads, false, gen),
      norm2(c.d_model), ff(c.d_model, c.mlp_ratio * c.d_model, gen) {}

Tensor TransformerBlock::attend(const TensorView& h) {
  // h (B, T, C) -> (B, T, C)
  uniform_saved_.reset();
  if (attention == AttentionKind::kSoftmax) return att.forward(h);
  const int64_t B = h.size(0), T = h.size(1);
  Tensor v = att.W_value.forward(h);
  SdpaOptions o = attention_options(attention);
  o.need_lse = true;
  const TensorView vh = split_heads(v, att.num_heads);
  SdpaResult r = scaled_dot_product_attention(vh, vh, vh, o);  // q, k unused at scale 0
  Tensor out = att.out_proj.forward(merge_heads(r.output).view({B, T, att.d_out}));
  if (is_grad_enabled()) uniform_saved_ = UniformSaved{std::move(v), std::move(r), o};
  return out;
}

Tensor TransformerBlock::attend_backward(const TensorView& grad_output) {
  // grad_output (B, T, C) -> dL/dh (B, T, C)
  if (attention == AttentionKind::kSoftmax) return att.backward(grad_output);
  if (!uniform_saved_) nn::detail::throw_no_saved_forward("TransformerBlock(uniform attention)");
  const UniformSaved s = std::move(*uniform_saved_);
  uniform_saved_.reset();
  const int64_t B = s.values.size(0), T = s.values.size(1);
  const Tensor d_merged = att.out_proj.backward(grad_output);
  const Tensor d_ctx = split_heads(d_merged, att.num_heads).contiguous();
  const TensorView vh = split_heads(s.values, att.num_heads);
  // At scale 0, dQ = dK = 0: only the values get a gradient.
  const SdpaGrads g = scaled_dot_product_attention_backward(d_ctx, vh, vh, vh, s.result, s.options);
  return att.W_value.backward(merge_heads(g.grad_value).view({B, T, att.d_out}));
}

Tensor TransformerBlock::forward(const TensorView& x) {
  // x (B, T, C) -> (B, T, C): x1 = x + att(norm1(x)); out = x1 + ff(norm2(x1))
  const Tensor x1 = add(x, attend(norm1.forward(x)));
  return add(x1, ff.forward(norm2.forward(x1)));
}

Tensor TransformerBlock::forward(const TensorView& x) const {
  Tensor a;
  if (attention == AttentionKind::kSoftmax) {
    a = att.forward(norm1.forward(x));
  } else {
    const int64_t B = x.size(0), T = x.size(1);
    const Tensor v = att.W_value.forward(norm1.forward(x));
    const TensorView vh = split_heads(v, att.num_heads);
    const SdpaResult r = scaled_dot_product_attention(vh, vh, vh, attention_options(attention));
    a = att.out_proj.forward(merge_heads(r.output).view({B, T, att.d_out}));
  }
  const Tensor x1 = add(x, a);
  return add(x1, ff.forward(norm2.forward(x1)));
}

Tensor TransformerBlock::backward(const TensorView& grad_output) {
  // grad_output (B, T, C) -> dL/dx (B, T, C); each residual passes its gradient straight through.
  const Tensor dx1 = add(grad_output, norm2.backward(ff.backward(grad_output)));
  return add(dx1, norm1.backward(attend_backward(dx1)));
}

Tensor TransformerBlock::forward_cached(const TensorView& x, KVCache& cache, int64_t layer,
                                        Tensor* weights) const {
  // x (B, L, C) at positions [cache.length, cache.length + L) -> (B, L, C)
  const int64_t B = x.size(0), L = x.size(1), start = cache.length, S = start + L;
  const int64_t H = att.num_heads;
  const Tensor h = norm1.forward(x);
  const Tensor q = att.W_query.forward(h), k = att.W_key.forward(h), v = att.W_value.forward(h);
  const Tensor& kc = cache.keys[static_cast<size_t>(layer)];
  const Tensor& vc = cache.values[static_cast<size_t>(layer)];
  copy_4d(kc.slice(2, start, S), split_heads(k, H));
  copy_4d(vc.slice(2, start, S), split_heads(v, H));
  // The L new queries against all S cached keys: query i is position start + i, so it sees keys
  // j <= i + (S - L), the bottom-right alignment.
  SdpaOptions o = attention_options(attention);
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.need_weights = weights != nullptr;
  SdpaResult r = scaled_dot_product_attention(split_heads(q, H), kc.slice(2, 0, S),
                                              vc.slice(2, 0, S), o);
  if (weights != nullptr) *weights = std::move(r.attn_weights);
  const Tensor x1 = add(x, att.out_proj.forward(merge_heads(r.output).view({B, L, att.d_out})));
  return add(x1, ff.forward(norm2.forward(x1)));
}

NamedTensors TransformerBlock::named_parameters() {
  NamedTensors p;
  append_prefixed(p, "norm1", norm1.named_parameters());
  append_prefixed(p, "att", att.named_parameters());
  append_prefixed(p, "norm2", norm2.named_parameters());
  append_prefixed(p, "ff", ff.named_parameters());
  return p;
}

NamedTensors TransformerBlock::named_grads() {
  NamedTensors p;
  append_prefixed(p, "norm1", norm1.named_grads());
  append_prefixed(p, "att", att.named_grads());
  append_prefixed(p, "norm2", norm2.named_grads());
  append_prefixed(p, "ff", ff.named_grads());
  return p;
}

NamedTensors TransformerBlock::state_dict() {
  NamedTensors p;
  append_prefixed(p, "norm1", norm1.state_dict());
  append_prefixed(p, "att", att.state_dict());  // "att.mask" first, as torch orders it
  append_prefixed(p, "norm2", norm2.state_dict());
  append_prefixed(p, "ff", ff.state_dict());
  return p;
}

void TransformerBlock::train(bool mode) {
  Module::train(mode);
  norm1.train(mode);
  att.train(mode);
  norm2.train(mode);
  ff.train(mode);
}

// ---- GPTModel ---------------------------------------------------------------------------------------

namespace {
const GPTConfig& validated(const GPTConfig& c) {
  c.validate();
  return c;
}
}  // namespace

GPTModel::GPTModel(const GPTConfig& c, Generator& gen)
    : config(validated(c)), tok_emb(c.vocab_size, c.d_model, gen),
      pos_emb(c.context_length, c.d_model, gen), final_norm(c.d_model) {
  blocks.reserve(static_cast<size_t>(c.n_layers));
  for (int64_t l = 0; l < c.n_layers; ++l) blocks.emplace_back(c, gen);
  if (!c.tie_weights) out_head.emplace(c.d_model, c.vocab_size, false, gen);
  // GPT-2's embedding scale: torch's N(0, 1) default would make the embeddings dominate the
  // residual stream (and, tied, the logits) at initialisation.
  normal_(tok_emb.weight, 0.0, 0.02, gen);
  normal_(pos_emb.weight, 0.0, 0.02, gen);
}

Tensor GPTModel::embed(std::span<const int64_t> ids, int64_t B, int64_t T, int64_t start) const {
  // ids (B, T) at positions [start, start + T) -> (B, T, C)
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = start + t;
  return add(tok_emb.forward(ids, {B, T}), pos_emb.forward(pos));
}

Tensor GPTModel::head(const TensorView& x) const {
  // x (B, T, C) -> logits (B, T, V)
  return config.tie_weights ? linear(x, tok_emb.weight) : out_head->forward(x);
}

namespace {
void check_forward_args(const GPTConfig& c, std::span<const int64_t> ids, int64_t B, int64_t T,
                        int64_t start) {
  if (B <= 0 || T <= 0 || static_cast<int64_t>(ids.size()) != B * T) {
    throw ShapeError(fmt::format("GPTModel: ids must hold B * T = {} * {} tokens (B, T > 0), got {}",
                                 B, T, ids.size()));
  }
  if (start + T > c.context_length) {
    throw ShapeError(fmt::format("GPTModel: {} tokens at position {} exceed context_length = {}",
                                 T, start, c.context_length));
  }
  check_ids(ids, c.vocab_size, "GPTModel");
}
}  // namespace

Tensor GPTModel::forward(std::span<const int64_t> ids, int64_t B, int64_t T) {
  // ids (B, T) -> logits (B, T, V), saving for backward
  saved_final_.reset();
  check_forward_args(config, ids, B, T, 0);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = t;
  Tensor x = add(tok_emb.forward(ids, {B, T}), pos_emb.forward(pos));
  for (TransformerBlock& block : blocks) x = block.forward(x);
  Tensor f = final_norm.forward(x);
  if (!config.tie_weights) return out_head->forward(f);
  Tensor logits = linear(f, tok_emb.weight);
  if (is_grad_enabled()) saved_final_ = std::move(f);
  return logits;
}

Tensor GPTModel::forward(std::span<const int64_t> ids, int64_t B, int64_t T) const {
  check_forward_args(config, ids, B, T, 0);
  Tensor x = embed(ids, B, T, 0);
  for (const TransformerBlock& block : blocks) x = block.forward(x);
  return head(final_norm.forward(x));
}

void GPTModel::backward(const TensorView& grad_logits) {
  // grad_logits (B, T, V): the head, the final norm, the blocks in reverse, then the embeddings.
  Tensor df;
  if (config.tie_weights) {
    if (!saved_final_) nn::detail::throw_no_saved_forward("GPTModel");
    Shape want = saved_final_->shape();
    want[2] = config.vocab_size;
    nn::detail::check_grad_output(grad_logits, want, "GPTModel");
    LinearGrads g = linear_backward(grad_logits, *saved_final_, tok_emb.weight, false);
    saved_final_.reset();
    nn::detail::accumulate_grad(tok_emb.grad_weight, g.grad_weight);
    df = std::move(g.grad_input);
  } else {
    df = out_head->backward(grad_logits);
  }
  Tensor dx = final_norm.backward(df);
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) dx = it->backward(dx);
  tok_emb.backward(dx);
  pos_emb.backward(sum(dx, 0));  // every sequence of the batch used the same positions
}

Tensor GPTModel::forward_cached(std::span<const int64_t> ids, int64_t B, int64_t L, KVCache& cache,
                                std::vector<Tensor>* attn_weights) const {
  // ids (B, L) -> logits (B, L, V) of the new positions; cache.length += L
  if (cache.batch != B || cache.capacity != config.context_length ||
      cache.keys.size() != blocks.size()) {
    throw ShapeError(fmt::format("GPTModel.forward_cached: the cache is for batch {}, context {}, {} "
                                 "layers; the call has batch {}, the model context {}, {} layers",
                                 cache.batch, cache.capacity, cache.keys.size(), B,
                                 config.context_length, blocks.size()));
  }
  check_forward_args(config, ids, B, L, cache.length);
  Tensor x = embed(ids, B, L, cache.length);
  if (attn_weights != nullptr) attn_weights->assign(blocks.size(), Tensor());
  for (size_t l = 0; l < blocks.size(); ++l) {
    x = blocks[l].forward_cached(x, cache, static_cast<int64_t>(l),
                                 attn_weights != nullptr ? &(*attn_weights)[l] : nullptr);
  }
  cache.length += L;
  return head(final_norm.forward(x));
}

NamedTensors GPTModel::named_parameters() {
  NamedTensors p{{"tok_emb.weight", &tok_emb.weight}, {"pos_emb.weight", &pos_emb.weight}};
  for (size_t l = 0; l < blocks.size(); ++l) {
    append_prefixed(p, "blocks." + std::to_string(l), blocks[l].named_parameters());
  }
  append_prefixed(p, "final_norm", final_norm.named_parameters());
  if (out_head) append_prefixed(p, "out_head", out_head->named_parameters());
  return p;
}

NamedTensors GPTModel::named_grads() {
  NamedTensors p{{"tok_emb.weight", &tok_emb.grad_weight}, {"pos_emb.weight", &pos_emb.grad_weight}};
  for (size_t l = 0; l < blocks.size(); ++l) {
    append_prefixed(p, "blocks." + std::to_string(l), blocks[l].named_grads());
  }
  append_prefixed(p, "final_norm", final_norm.named_grads());
  if (out_head) append_prefixed(p, "out_head", out_head->named_grads());
  return p;
}

NamedTensors GPTModel::state_dict() {
  NamedTensors p{{"tok_emb.weight", &tok_emb.weight}, {"pos_emb.weight", &pos_emb.weight}};
  for (size_t l = 0; l < blocks.size(); ++l) {
    append_prefixed(p, "blocks." + std::to_string(l), blocks[l].state_dict());
  }
  append_prefixed(p, "final_norm", final_norm.state_dict());
  if (out_head) append_prefixed(p, "out_head", out_head->state_dict());
  return p;
}

void GPTModel::train(bool mode) {
  Module::train(mode);
  for (TransformerBlock& block : blocks) block.train(mode);
}

}  // namespace attn::gpt

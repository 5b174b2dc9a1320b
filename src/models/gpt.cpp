// The tiny GPT: blocks of the chapter's MultiHeadAttention between LayerNorms and an MLP, with
// explicit backward passes (each submodule differentiates itself; the block and the model only
// route gradients through the residual connections), and the KV-cache inference path, which
// hands each block's attention to MultiHeadAttention::forward_cached.
#include "attn/gpt.hpp"

#include <fmt/format.h>

#include "attn/error.hpp"
#include "modules/backward_util.hpp"

namespace attn::gpt {

using nn::append_prefixed;
using nn::NamedTensors;

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
  for (int64_t l = 0; l < config.n_layers; ++l) layers.emplace_back(batch, config.n_heads, capacity, hd);
}

// ---- TransformerBlock -------------------------------------------------------------------------------

TransformerBlock::TransformerBlock(const GPTConfig& c, Generator& gen)
    : attention(c.attention), norm1(c.d_model),
      att(c.d_model, c.d_model, c.context_length, c.dropout, c.n_heads, false, gen),
      norm2(c.d_model), ff(c.d_model, c.mlp_ratio * c.d_model, gen) {
  // The uniform-average ablation: with scale 0 every score is 0, so the causal softmax weights
  // are 1 / (i + 1) over positions 0..i whatever the queries and keys (which then get no
  // gradient).
  if (attention == AttentionKind::kUniform) att.scale = 0.0;
}

Tensor TransformerBlock::forward(const TensorView& x) {
  // x (B, T, C) -> (B, T, C): x1 = x + att(norm1(x)); out = x1 + ff(norm2(x1))
  const Tensor x1 = add(x, att.forward(norm1.forward(x)));
  return add(x1, ff.forward(norm2.forward(x1)));
}

Tensor TransformerBlock::forward(const TensorView& x) const {
  const Tensor x1 = add(x, att.forward(norm1.forward(x)));
  return add(x1, ff.forward(norm2.forward(x1)));
}

Tensor TransformerBlock::backward(const TensorView& grad_output) {
  // grad_output (B, T, C) -> dL/dx (B, T, C); each residual passes its gradient straight through.
  const Tensor dx1 = add(grad_output, norm2.backward(ff.backward(grad_output)));
  return add(dx1, norm1.backward(att.backward(dx1)));
}

Tensor TransformerBlock::forward_cached(const TensorView& x, nn::KVCacheLayer& cache,
                                        Tensor* weights) const {
  // x (B, L, C) at positions [cache.length, cache.length + L) -> (B, L, C)
  const Tensor x1 = add(x, att.forward_cached(norm1.forward(x), cache, weights));
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
      cache.layers.size() != blocks.size()) {
    throw ShapeError(fmt::format("GPTModel.forward_cached: the cache is for batch {}, context {}, {} "
                                 "layers; the call has batch {}, the model context {}, {} layers",
                                 cache.batch, cache.capacity, cache.layers.size(), B,
                                 config.context_length, blocks.size()));
  }
  check_forward_args(config, ids, B, L, cache.length);
  Tensor x = embed(ids, B, L, cache.length);
  if (attn_weights != nullptr) attn_weights->assign(blocks.size(), Tensor());
  for (size_t l = 0; l < blocks.size(); ++l) {
    // cache.length is the model's position: a layer left ahead by a call that failed in a later
    // layer, or rewound with cache.length, decodes from there.
    cache.layers[l].length = cache.length;
    x = blocks[l].forward_cached(x, cache.layers[l],
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

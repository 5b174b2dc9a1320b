// Modules named as in the chapter and in torch.nn. Each is a thin layer over the functional
// core (functional.hpp, sdpa.hpp) that owns its parameters.
//
// Construction draws parameters from a Generator in the same order as the book's PyTorch code
// (e.g. MultiHeadAttention: W_query.weight, W_key.weight, W_value.weight, out_proj.weight,
// out_proj.bias), so `manual_seed(123)` gives PyTorch's exact weights. Parameter and buffer
// names are PyTorch's state_dict keys ("W_query.weight", "heads.0.W_key.weight", "mask").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attn/functional.hpp"

namespace attn::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor*>>;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = default;
  Module& operator=(const Module&) = default;
  Module(Module&&) = default;
  Module& operator=(Module&&) = default;

  // train(true) enables dropout; eval() is train(false). Propagates to submodules.
  virtual void train(bool mode = true) { training_ = mode; }
  void eval() { train(false); }
  bool training() const { return training_; }

  // Trainable tensors with PyTorch's names, in registration (= construction) order.
  virtual NamedTensors named_parameters() { return {}; }
  // Non-trainable state (e.g. the causal mask buffer).
  virtual NamedTensors named_buffers() { return {}; }
  // torch's state_dict() order: the module's own parameters, then its own buffers, then each
  // submodule's entries (recursively, in registration order). The default (parameters then
  // buffers) is right for modules whose buffers are all their own and whose submodules own no
  // buffers; modules owning a buffer and submodules override it (e.g. "mask" comes first).
  virtual NamedTensors state_dict();
  int64_t num_parameters();

 protected:
  bool training_ = true;
};

// Prefixes every name with `prefix.` (helper for composite modules).
void append_prefixed(NamedTensors& out, const std::string& prefix, NamedTensors items);

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;
  NamedTensors named_parameters() override;

  int64_t in_features, out_features;
  Tensor weight;  // (out_features, in_features)
  Tensor bias;    // (out_features) or undefined
};

class Dropout : public Module {
 public:
  explicit Dropout(float p = 0.5f, Generator* gen = nullptr);
  Tensor forward(const TensorView& x) const;

  float p;
  Generator* generator;  // nullptr: default_generator(), like torch's global generator
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& gen = default_generator());
  Tensor forward(std::span<const int64_t> ids, const Shape& ids_shape) const;
  Tensor forward(std::span<const int64_t> ids) const;  // 1-D ids
  NamedTensors named_parameters() override;

  int64_t num_embeddings, embedding_dim;
  Tensor weight;  // (num_embeddings, embedding_dim), N(0, 1)
};

// Section 3.4.1: parameters created with torch.rand(d_in, d_out); forward is x @ W.
class SelfAttentionV1 : public Module {
 public:
  SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;  // (num_tokens, d_in) -> (num_tokens, d_out)
  NamedTensors named_parameters() override;

  Tensor W_query, W_key, W_value;  // (d_in, d_out)
};

// Section 3.4.2: nn.Linear projections (weight (d_out, d_in)), optional qkv_bias.
class SelfAttentionV2 : public Module {
 public:
  SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias = false,
                  Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;  // (num_tokens, d_in) -> (num_tokens, d_out)
  NamedTensors named_parameters() override;

  Linear W_query, W_key, W_value;
};

// Section 3.5: causal mask over a context_length buffer, dropout on the weights, batched input.
class CausalAttention : public Module {
 public:
  CausalAttention(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                  bool qkv_bias = false, Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;  // (b, num_tokens, d_in) -> (b, num_tokens, d_out)
  NamedTensors named_parameters() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  int64_t d_in, d_out, context_length;
  Linear W_query, W_key, W_value;
  Dropout dropout;
  Tensor mask;  // triu(ones(context_length, context_length), diagonal=1)
};

// Section 3.6.1: num_heads independent CausalAttention heads, outputs concatenated.
class MultiHeadAttentionWrapper : public Module {
 public:
  MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                            int64_t num_heads, bool qkv_bias = false,
                            Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;  // -> (b, num_tokens, num_heads * d_out)
  NamedTensors named_parameters() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  std::vector<CausalAttention> heads;
};

// Section 3.6.2: one projection of width d_out split into num_heads heads of d_out/num_heads,
// causal attention per head, heads merged and passed through out_proj.
class MultiHeadAttention : public Module {
 public:
  MultiHeadAttention(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                     int64_t num_heads, bool qkv_bias = false,
                     Generator& gen = default_generator());
  Tensor forward(const TensorView& x) const;  // (b, num_tokens, d_in) -> (b, num_tokens, d_out)
  NamedTensors named_parameters() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  int64_t d_in, d_out, num_heads, head_dim, context_length;
  Linear W_query, W_key, W_value, out_proj;
  Dropout dropout;
  Tensor mask;
};

}  // namespace attn::nn

// Modules named as in the chapter and in torch.nn. Each is a thin layer over the functional
// core (functional.hpp, sdpa.hpp) that owns its parameters.
//
// Construction draws parameters from a Generator in the same order as the book's PyTorch code
// (e.g. MultiHeadAttention: W_query.weight, W_key.weight, W_value.weight, out_proj.weight,
// out_proj.bias), so `manual_seed(123)` gives PyTorch's exact weights. Parameter and buffer
// names are PyTorch's state_dict keys ("W_query.weight", "heads.0.W_key.weight", "mask").
//
// Backward (no autograd engine: each module differentiates itself). A non-const forward()
// saves what backward() needs, unless a NoGradGuard is active (attn/grad_mode.hpp), in which
// case it saves nothing and drops what an earlier forward saved. backward(grad_output) takes
// dL/d(output) of the latest recording forward, returns dL/d(input), adds the parameters'
// gradients into named_grads() and consumes the saved context: a second backward without a new
// forward throws ValueError (PyTorch: "Trying to backward through the graph a second time"),
// as does a backward with no forward; a grad_output whose shape is not the output's throws
// ShapeError. Backward reads the parameters' current values: update them after backward.
// A forward() on a const module only computes (as under torch.no_grad()) and saves nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attn/functional.hpp"
#include "attn/grad_mode.hpp"
#include "attn/kv_cache.hpp"

namespace attn::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor*>>;

// One trainable tensor with its gradient, for optimizers: for (auto& p : m.parameters_with_grads())
// update *p.param from *p.grad.
struct ParameterWithGrad {
  std::string name;
  Tensor* param;
  Tensor* grad;
};

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

  // The parameters' gradients (the `.grad` of each), named and ordered exactly as
  // named_parameters(), of the same shapes; zeros at construction, summed into by backward().
  virtual NamedTensors named_grads() { return {}; }
  // Sets every gradient to zero, submodules' included (optimizer.zero_grad()).
  void zero_grad();
  // named_parameters() zipped with named_grads(); throws ValueError if they ever disagree.
  std::vector<ParameterWithGrad> parameters_with_grads();

 protected:
  bool training_ = true;
};

// Prefixes every name with `prefix.` (helper for composite modules).
void append_prefixed(NamedTensors& out, const std::string& prefix, NamedTensors items);

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Generator& gen = default_generator());
  Tensor forward(const TensorView& x);        // saves x
  Tensor forward(const TensorView& x) const;  // computes only
  // grad_output (..., out_features) -> dL/dx (..., in_features)
  Tensor backward(const TensorView& grad_output);
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;

  int64_t in_features, out_features;
  Tensor weight;  // (out_features, in_features)
  Tensor bias;    // (out_features) or undefined
  Tensor grad_weight, grad_bias;  // weight.grad, bias.grad

 private:
  std::optional<Tensor> saved_input_;
};

class Dropout : public Module {
 public:
  explicit Dropout(float p = 0.5f, Generator* gen = nullptr);
  Tensor forward(const TensorView& x);        // saves the keep mask (draws as the const one)
  Tensor forward(const TensorView& x) const;  // computes only
  Tensor backward(const TensorView& grad_output);  // replays the saved mask

  float p;
  Generator* generator;  // nullptr: default_generator(), like torch's global generator

 private:
  struct Saved {
    Tensor keep_mask;
    float p;
  };
  std::optional<Saved> saved_;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& gen = default_generator());
  Tensor forward(std::span<const int64_t> ids, const Shape& ids_shape);  // saves the ids
  Tensor forward(std::span<const int64_t> ids);                         // 1-D ids
  Tensor forward(std::span<const int64_t> ids, const Shape& ids_shape) const;
  Tensor forward(std::span<const int64_t> ids) const;
  // grad_output (ids_shape + [embedding_dim]); adds into grad_weight (ids get no gradient).
  void backward(const TensorView& grad_output);
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;

  int64_t num_embeddings, embedding_dim;
  Tensor weight;  // (num_embeddings, embedding_dim), N(0, 1)
  Tensor grad_weight;

 private:
  struct Saved {
    std::vector<int64_t> ids;
    Shape ids_shape;
  };
  std::optional<Saved> saved_;
};

// nn.LayerNorm over the last dim: weight ones, bias zeros (no draws), eps 1e-5.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t normalized_shape, float eps = 1e-5f, bool elementwise_affine = true);
  Tensor forward(const TensorView& x);        // (..., C); saves x
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;

  int64_t normalized_shape;
  float eps;
  Tensor weight, bias;            // (C) each, undefined without elementwise_affine
  Tensor grad_weight, grad_bias;

 private:
  std::optional<Tensor> saved_input_;
};

// nn.GELU(approximate="none" | "tanh").
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const TensorView& x);  // saves x
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);

  std::string approximate;

 private:
  std::optional<Tensor> saved_input_;
};

namespace detail {
// What an attention module's forward saves for its backward: the projections exactly as
// passed to scaled_dot_product_attention (before any head split), its result (with lse, and
// the post-dropout weights when dropout is on) and its options.
struct AttentionContext {
  Tensor input;  // x, for modules whose projections are not Linear submodules (V1)
  Tensor queries, keys, values;
  SdpaResult result;
  SdpaOptions options;
  Shape output_shape;
};
}  // namespace detail

// Section 3.4.1: parameters created with torch.rand(d_in, d_out); forward is x @ W.
class SelfAttentionV1 : public Module {
 public:
  SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen = default_generator());
  Tensor forward(const TensorView& x);  // (num_tokens, d_in) -> (num_tokens, d_out)
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> (num_tokens, d_in)
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;

  Tensor W_query, W_key, W_value;  // (d_in, d_out)
  Tensor grad_W_query, grad_W_key, grad_W_value;

 private:
  template <typename Self>
  static Tensor forward_impl(Self& self, const TensorView& x);
  std::optional<detail::AttentionContext> saved_;
};

// Section 3.4.2: nn.Linear projections (weight (d_out, d_in)), optional qkv_bias.
class SelfAttentionV2 : public Module {
 public:
  SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias = false,
                  Generator& gen = default_generator());
  Tensor forward(const TensorView& x);  // (num_tokens, d_in) -> (num_tokens, d_out)
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> (num_tokens, d_in)
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;

  Linear W_query, W_key, W_value;

 private:
  template <typename Self>
  static Tensor forward_impl(Self& self, const TensorView& x);
  std::optional<detail::AttentionContext> saved_;
};

// Section 3.5: causal mask over a context_length buffer, dropout on the weights, batched input.
class CausalAttention : public Module {
 public:
  CausalAttention(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                  bool qkv_bias = false, Generator& gen = default_generator());
  Tensor forward(const TensorView& x);  // (b, num_tokens, d_in) -> (b, num_tokens, d_out)
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> (b, num_tokens, d_in)
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  int64_t d_in, d_out, context_length;
  Linear W_query, W_key, W_value;
  Dropout dropout;
  Tensor mask;  // triu(ones(context_length, context_length), diagonal=1)

 private:
  template <typename Self>
  static Tensor forward_impl(Self& self, const TensorView& x);
  std::optional<detail::AttentionContext> saved_;
};

// Section 3.6.1: num_heads independent CausalAttention heads, outputs concatenated.
class MultiHeadAttentionWrapper : public Module {
 public:
  MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                            int64_t num_heads, bool qkv_bias = false,
                            Generator& gen = default_generator());
  Tensor forward(const TensorView& x);  // -> (b, num_tokens, num_heads * d_out)
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> (b, num_tokens, d_in)
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  std::vector<CausalAttention> heads;

 private:
  std::optional<Shape> saved_output_shape_;
};

// One attention layer's keys and values for incremental decoding, preallocated for `capacity`
// positions so that appending never reallocates: keys and values are
// (batch, num_heads, capacity, head_dim), positions [0, length) hold data. Rows at or past
// `length` are stale, so rewinding `length` (reset(), or to a shared prefix) is all it takes to
// decode again from there.
struct KVCacheLayer {
  // Zero-filled; ValueError naming the argument for a non-positive size.
  KVCacheLayer(int64_t batch, int64_t num_heads, int64_t capacity, int64_t head_dim);
  int64_t batch() const { return keys.size(0); }
  int64_t num_heads() const { return keys.size(1); }
  int64_t capacity() const { return keys.size(2); }
  int64_t head_dim() const { return keys.size(3); }
  void reset() { length = 0; }

  Tensor keys, values;
  int64_t length = 0;
};

// Section 3.6.2: one projection of width d_out split into num_heads heads of d_out/num_heads,
// causal attention per head, heads merged and passed through out_proj.
class MultiHeadAttention : public Module {
 public:
  MultiHeadAttention(int64_t d_in, int64_t d_out, int64_t context_length, float dropout,
                     int64_t num_heads, bool qkv_bias = false,
                     Generator& gen = default_generator());
  Tensor forward(const TensorView& x);  // (b, num_tokens, d_in) -> (b, num_tokens, d_out)
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> (b, num_tokens, d_in)
  // Incremental decoding, inference only (saves nothing, no dropout): x (b, L, d_in) holds
  // positions [cache.length, cache.length + L). Their keys and values are written into the
  // cache, which advances by L, and the L queries attend causally over all cached positions
  // (bottom-right alignment: query i sees positions <= cache.length + i), then out_proj:
  // -> (b, L, d_out), what forward() gives for those rows of the whole sequence.
  // attn_weights: if non-null, receives the weights (b, num_heads, L, cache.length + L).
  // ShapeError, with the cache left unchanged, for an x or a cache that does not fit this
  // module, or L positions past the cache's capacity.
  Tensor forward_cached(const TensorView& x, KVCacheLayer& cache,
                        Tensor* attn_weights = nullptr) const;
  // The same over a paged cache (attn/kv_cache.hpp; heads_kv = num_heads, head_dim = head_dim):
  // x (N, L, d_in) holds the L newest tokens of the N distinct sequences seq_ids, each at its
  // own position cache.length(seq). Their keys and values are appended to the cache, and the
  // queries attend through paged_attention (causal, bottom-right) -> (N, L, d_out). L is at most
  // 16 (paged_attention's range; feed longer prompts in chunks). Errors (the cache unchanged):
  // ShapeError for an x or a cache that does not fit, IndexError for a dead or repeated id,
  // ValueError for L > 16 or too few free pages for all N appends.
  Tensor forward_paged(const TensorView& x, PagedKvCache& cache, std::span<const int64_t> seq_ids) const;
  // A cache for this module: (batch, num_heads, capacity, head_dim), capacity by default its
  // context_length.
  KVCacheLayer make_cache(int64_t batch, std::optional<int64_t> capacity = std::nullopt) const;
  NamedTensors named_parameters() override;
  NamedTensors named_grads() override;
  NamedTensors named_buffers() override;
  NamedTensors state_dict() override;
  void train(bool mode = true) override;

  int64_t d_in, d_out, num_heads, head_dim, context_length;
  Linear W_query, W_key, W_value, out_proj;
  Dropout dropout;
  Tensor mask;
  // scaled_dot_product_attention's `scale` for every forward and backward: nullopt is its
  // 1/sqrt(head_dim). 0 makes every score equal, so each query averages the values of its
  // causal window uniformly (the ablation of gpt::AttentionKind::kUniform).
  std::optional<double> scale;

 private:
  template <typename Self>
  static Tensor forward_impl(Self& self, const TensorView& x);
  std::optional<detail::AttentionContext> saved_;
};

}  // namespace attn::nn

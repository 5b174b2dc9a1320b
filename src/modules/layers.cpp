// Linear, Dropout, Embedding, LayerNorm and GELU with torch.nn's default initialisation, and
// their backward passes (each a call to the functional backward beside its forward).
#include <cmath>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "modules/backward_util.hpp"

namespace attn::nn {

namespace {
void require_positive(int64_t v, const char* module, const char* arg) {
  if (v <= 0) throw ValueError(fmt::format("{}: {} must be positive, got {}", module, arg, v));
}

// Shape of linear's output for input x.
Shape with_last(const Shape& s, int64_t last) {
  Shape out = s;
  out[s.ndim() - 1] = last;
  return out;
}
}  // namespace

// ---- Linear -------------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool with_bias, Generator& gen)
    : in_features(in), out_features(out) {
  require_positive(in, "Linear", "in_features");
  require_positive(out, "Linear", "out_features");
  weight = Tensor::empty({out, in});
  kaiming_uniform_linear_(weight, gen);  // weight first, then bias: PyTorch's draw order
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    bias = Tensor::empty({out});
    uniform_(bias, -bound, bound, gen);
  }
  grad_weight = detail::zeros_like_param(weight);
  grad_bias = detail::zeros_like_param(bias);
}

Tensor Linear::forward(const TensorView& x) const { return linear(x, weight, bias); }

Tensor Linear::forward(const TensorView& x) {
  saved_input_.reset();
  Tensor out = linear(x, weight, bias);
  if (is_grad_enabled()) saved_input_ = x.contiguous();
  return out;
}

Tensor Linear::backward(const TensorView& grad_output) {
  if (!saved_input_) detail::throw_no_saved_forward("Linear");
  detail::check_grad_output(grad_output, with_last(saved_input_->shape(), out_features), "Linear");
  LinearGrads g = linear_backward(grad_output, *saved_input_, weight, bias.defined());
  saved_input_.reset();
  detail::accumulate_grad(grad_weight, g.grad_weight);
  if (bias.defined()) detail::accumulate_grad(grad_bias, g.grad_bias);
  return std::move(g.grad_input);
}

NamedTensors Linear::named_parameters() {
  NamedTensors p{{"weight", &weight}};
  if (bias.defined()) p.emplace_back("bias", &bias);
  return p;
}

NamedTensors Linear::named_grads() {
  NamedTensors p{{"weight", &grad_weight}};
  if (bias.defined()) p.emplace_back("bias", &grad_bias);
  return p;
}

// ---- Dropout ------------------------------------------------------------------------------------

Dropout::Dropout(float p_, Generator* gen) : p(p_), generator(gen) {
  if (!(p >= 0.0f && p <= 1.0f)) {
    throw ValueError(fmt::format("Dropout: probability p must be in [0, 1], got {}", p));
  }
}

Tensor Dropout::forward(const TensorView& x) const {
  return dropout(x, p, training_, generator ? *generator : default_generator());
}

Tensor Dropout::forward(const TensorView& x) {
  saved_.reset();
  DropoutResult r = dropout_with_mask(x, p, training_, generator ? *generator : default_generator());
  if (is_grad_enabled()) saved_ = Saved{std::move(r.keep_mask), r.p};
  return std::move(r.output);
}

Tensor Dropout::backward(const TensorView& grad_output) {
  if (!saved_) detail::throw_no_saved_forward("Dropout");
  detail::check_grad_output(grad_output, saved_->keep_mask.shape(), "Dropout");
  Tensor dx = dropout_backward(grad_output, saved_->keep_mask, saved_->p);
  saved_.reset();
  return dx;
}

// ---- Embedding ----------------------------------------------------------------------------------

Embedding::Embedding(int64_t num, int64_t dim, Generator& gen)
    : num_embeddings(num), embedding_dim(dim) {
  require_positive(num, "Embedding", "num_embeddings");
  require_positive(dim, "Embedding", "embedding_dim");
  weight = Tensor::empty({num, dim});
  normal_(weight, 0.0, 1.0, gen);
  grad_weight = Tensor::zeros({num, dim});
}

Tensor Embedding::forward(std::span<const int64_t> ids, const Shape& ids_shape) const {
  return embedding(ids, ids_shape, weight);
}

Tensor Embedding::forward(std::span<const int64_t> ids) const {
  return embedding(ids, Shape{static_cast<int64_t>(ids.size())}, weight);
}

Tensor Embedding::forward(std::span<const int64_t> ids, const Shape& ids_shape) {
  saved_.reset();
  Tensor out = embedding(ids, ids_shape, weight);
  if (is_grad_enabled()) saved_ = Saved{std::vector<int64_t>(ids.begin(), ids.end()), ids_shape};
  return out;
}

Tensor Embedding::forward(std::span<const int64_t> ids) {
  return forward(ids, Shape{static_cast<int64_t>(ids.size())});
}

void Embedding::backward(const TensorView& grad_output) {
  if (!saved_) detail::throw_no_saved_forward("Embedding");
  Shape out_shape = saved_->ids_shape;
  out_shape.push_back(embedding_dim);
  detail::check_grad_output(grad_output, out_shape, "Embedding");
  const Tensor dw = embedding_backward(grad_output, saved_->ids, saved_->ids_shape, num_embeddings);
  saved_.reset();
  detail::accumulate_grad(grad_weight, dw);
}

NamedTensors Embedding::named_parameters() { return {{"weight", &weight}}; }
NamedTensors Embedding::named_grads() { return {{"weight", &grad_weight}}; }

// ---- LayerNorm ----------------------------------------------------------------------------------

LayerNorm::LayerNorm(int64_t c, float eps_, bool elementwise_affine)
    : normalized_shape(c), eps(eps_) {
  require_positive(c, "LayerNorm", "normalized_shape");
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    throw ValueError(fmt::format("LayerNorm: eps must be finite and >= 0, got {}", eps));
  }
  if (elementwise_affine) {
    weight = Tensor::ones({c});
    bias = Tensor::zeros({c});
  }
  grad_weight = detail::zeros_like_param(weight);
  grad_bias = detail::zeros_like_param(bias);
}

Tensor LayerNorm::forward(const TensorView& x) const {
  return layer_norm(x, {normalized_shape}, weight, bias, eps);
}

Tensor LayerNorm::forward(const TensorView& x) {
  saved_input_.reset();
  Tensor out = layer_norm(x, {normalized_shape}, weight, bias, eps);
  if (is_grad_enabled()) saved_input_ = x.contiguous();
  return out;
}

Tensor LayerNorm::backward(const TensorView& grad_output) {
  if (!saved_input_) detail::throw_no_saved_forward("LayerNorm");
  detail::check_grad_output(grad_output, saved_input_->shape(), "LayerNorm");
  LayerNormGrads g = layer_norm_backward(grad_output, *saved_input_, {normalized_shape}, weight, bias, eps);
  saved_input_.reset();
  if (weight.defined()) detail::accumulate_grad(grad_weight, g.grad_weight);
  if (bias.defined()) detail::accumulate_grad(grad_bias, g.grad_bias);
  return std::move(g.grad_input);
}

NamedTensors LayerNorm::named_parameters() {
  if (!weight.defined()) return {};
  return {{"weight", &weight}, {"bias", &bias}};
}

NamedTensors LayerNorm::named_grads() {
  if (!weight.defined()) return {};
  return {{"weight", &grad_weight}, {"bias", &grad_bias}};
}

// ---- GELU ---------------------------------------------------------------------------------------

GELU::GELU(std::string approximate_) : approximate(std::move(approximate_)) {
  if (approximate != "none" && approximate != "tanh") {
    throw ValueError(fmt::format("GELU: approximate must be 'none' or 'tanh', got '{}'", approximate));
  }
}

Tensor GELU::forward(const TensorView& x) const { return gelu(x, approximate); }

Tensor GELU::forward(const TensorView& x) {
  saved_input_.reset();
  Tensor out = gelu(x, approximate);
  if (is_grad_enabled()) saved_input_ = x.contiguous();
  return out;
}

Tensor GELU::backward(const TensorView& grad_output) {
  if (!saved_input_) detail::throw_no_saved_forward("GELU");
  detail::check_grad_output(grad_output, saved_input_->shape(), "GELU");
  Tensor dx = gelu_backward(grad_output, *saved_input_, approximate);
  saved_input_.reset();
  return dx;
}

}  // namespace attn::nn

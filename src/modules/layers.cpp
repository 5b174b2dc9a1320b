// Linear, Dropout and Embedding with torch.nn's default initialisation.
#include <cmath>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/modules.hpp"

namespace attn::nn {

namespace {
void require_positive(int64_t v, const char* module, const char* arg) {
  if (v <= 0) throw ValueError(fmt::format("{}: {} must be positive, got {}", module, arg, v));
}
}  // namespace

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
}

Tensor Linear::forward(const TensorView& x) const { return linear(x, weight, bias); }

NamedTensors Linear::named_parameters() {
  NamedTensors p{{"weight", &weight}};
  if (bias.defined()) p.emplace_back("bias", &bias);
  return p;
}

Dropout::Dropout(float p_, Generator* gen) : p(p_), generator(gen) {
  if (!(p >= 0.0f && p <= 1.0f)) {
    throw ValueError(fmt::format("Dropout: probability p must be in [0, 1], got {}", p));
  }
}

Tensor Dropout::forward(const TensorView& x) const {
  return dropout(x, p, training_, generator ? *generator : default_generator());
}

Embedding::Embedding(int64_t num, int64_t dim, Generator& gen)
    : num_embeddings(num), embedding_dim(dim) {
  require_positive(num, "Embedding", "num_embeddings");
  require_positive(dim, "Embedding", "embedding_dim");
  weight = Tensor::empty({num, dim});
  normal_(weight, 0.0, 1.0, gen);
}

Tensor Embedding::forward(std::span<const int64_t> ids, const Shape& ids_shape) const {
  return embedding(ids, ids_shape, weight);
}

Tensor Embedding::forward(std::span<const int64_t> ids) const {
  return embedding(ids, Shape{static_cast<int64_t>(ids.size())}, weight);
}

NamedTensors Embedding::named_parameters() { return {{"weight", &weight}}; }

}  // namespace attn::nn

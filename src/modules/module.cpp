#include <algorithm>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/modules.hpp"
#include "modules/backward_util.hpp"

namespace attn::nn {

NamedTensors Module::state_dict() {
  NamedTensors all = named_parameters();
  NamedTensors buffers = named_buffers();
  all.insert(all.end(), buffers.begin(), buffers.end());
  return all;
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t->numel();
  return n;
}

void Module::zero_grad() {
  for (auto& [name, g] : named_grads()) std::fill_n(g->data(), g->numel(), 0.0f);
}

std::vector<ParameterWithGrad> Module::parameters_with_grads() {
  const NamedTensors params = named_parameters(), grads = named_grads();
  if (params.size() != grads.size()) {
    throw ValueError(fmt::format("parameters_with_grads: {} parameters but {} gradients",
                                 params.size(), grads.size()));
  }
  std::vector<ParameterWithGrad> out;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].first != grads[i].first || !(params[i].second->shape() == grads[i].second->shape())) {
      throw ValueError(fmt::format("parameters_with_grads: parameter {} {} does not match gradient {} {}",
                                   params[i].first, params[i].second->shape().str(), grads[i].first,
                                   grads[i].second->shape().str()));
    }
    out.push_back({params[i].first, params[i].second, grads[i].second});
  }
  return out;
}

void append_prefixed(NamedTensors& out, const std::string& prefix, NamedTensors items) {
  for (auto& [name, t] : items) out.emplace_back(prefix + "." + name, t);
}

namespace detail {

void throw_no_saved_forward(const char* module) {
  throw ValueError(fmt::format(
      "{}.backward: no saved forward to differentiate (expected one forward() with gradients "
      "enabled before each backward(); got none, a forward under NoGradGuard, or a context "
      "already consumed by an earlier backward)",
      module));
}

void check_grad_output(const TensorView& grad_output, const Shape& expected, const char* module) {
  if (!grad_output.defined() || !(grad_output.shape() == expected)) {
    throw ShapeError(fmt::format("{}.backward: grad_output must have the forward output's shape {}, got {}",
                                 module, expected.str(),
                                 grad_output.defined() ? grad_output.shape().str() : "undefined"));
  }
}

void accumulate_grad(Tensor& grad, const TensorView& delta) {
  if (!(grad.shape() == delta.shape())) {
    throw ShapeError(fmt::format("accumulate_grad: gradient of shape {} cannot take a delta of shape {}",
                                 grad.shape().str(), delta.shape().str()));
  }
  float* dst = grad.data();
  for_each_offset(delta, [&](int64_t o) { *dst++ += delta.data()[o]; });
}

Tensor zeros_like_param(const TensorView& param) {
  return param.defined() ? Tensor::zeros(param.shape()) : Tensor();
}

}  // namespace detail

}  // namespace attn::nn

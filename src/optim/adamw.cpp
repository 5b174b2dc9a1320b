// AdamW, gradient clipping and the learning-rate schedule (include/attn/optim.hpp).
#include "attn/optim.hpp"

#include <cmath>
#include <fmt/format.h>
#include <numbers>

#include "attn/error.hpp"

namespace attn::optim {

AdamW::AdamW(std::vector<nn::ParameterWithGrad> params, const AdamWOptions& options,
             const DecayFilter& decays)
    : options_(options) {
  if (!(options.lr >= 0.0) || !(options.eps >= 0.0) || !(options.weight_decay >= 0.0)) {
    throw ValueError(fmt::format("AdamW: lr, eps and weight_decay must be >= 0, got lr = {}, eps = {}, "
                                 "weight_decay = {}", options.lr, options.eps, options.weight_decay));
  }
  if (!(options.beta1 >= 0.0 && options.beta1 < 1.0) || !(options.beta2 >= 0.0 && options.beta2 < 1.0)) {
    throw ValueError(fmt::format("AdamW: betas must be in [0, 1), got ({}, {})", options.beta1, options.beta2));
  }
  for (nn::ParameterWithGrad& p : params) {
    const bool decay = decays ? decays(p) : true;
    slots_.push_back({p, decay, Tensor::zeros(p.param->shape()), Tensor::zeros(p.param->shape())});
  }
}

void AdamW::step() {
  ++steps_;
  const AdamWOptions& o = options_;
  const double t = static_cast<double>(steps_);
  const double bias_correction1 = 1.0 - std::pow(o.beta1, t);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, t));
  // The float32 scalars PyTorch's CPU kernels multiply with (Python floats cast to the dtype).
  const float step_size = static_cast<float>(-(o.lr / bias_correction1));
  const float b1 = static_cast<float>(o.beta1), one_b1 = static_cast<float>(1.0 - o.beta1);
  const float b2 = static_cast<float>(o.beta2), one_b2 = static_cast<float>(1.0 - o.beta2);
  const float bc2 = static_cast<float>(bias_correction2_sqrt), eps = static_cast<float>(o.eps);
  for (Slot& s : slots_) {
    float* p = s.p.param->data();
    const float* g = s.p.grad->data();
    float* m = s.exp_avg.data();
    float* v = s.exp_avg_sq.data();
    const float keep = static_cast<float>(1.0 - o.lr * (s.decay ? o.weight_decay : 0.0));
    const int64_t n = s.p.param->numel();
    for (int64_t i = 0; i < n; ++i) {
      p[i] *= keep;                                       // param.mul_(1 - lr * wd)
      m[i] = std::fma(g[i], one_b1, m[i] * b1);           // exp_avg.mul_(b1).add_(g, alpha=1-b1)
      v[i] = v[i] * b2 + (one_b2 * g[i]) * g[i];          // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
      const float denom = std::sqrt(v[i]) / bc2 + eps;    // (v.sqrt() / bc2_sqrt).add_(eps)
      p[i] = p[i] + step_size * m[i] / denom;             // param.addcdiv_(m, denom, -step_size)
    }
  }
}

nn::NamedTensors AdamW::state() {
  nn::NamedTensors out;
  for (Slot& s : slots_) out.emplace_back("exp_avg." + s.p.name, &s.exp_avg);
  for (Slot& s : slots_) out.emplace_back("exp_avg_sq." + s.p.name, &s.exp_avg_sq);
  return out;
}

void AdamW::load_state(int64_t steps, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  if (steps < 0) throw ValueError(fmt::format("AdamW.load_state: steps must be >= 0, got {}", steps));
  nn::NamedTensors dst = state();
  std::vector<const Tensor*> src(dst.size(), nullptr);
  for (size_t i = 0; i < dst.size(); ++i) {
    for (const auto& [name, t] : tensors) {
      if (name == dst[i].first) src[i] = &t;
    }
    if (src[i] == nullptr) {
      throw ValueError(fmt::format("AdamW.load_state: missing optimizer state '{}'", dst[i].first));
    }
    if (!(src[i]->shape() == dst[i].second->shape())) {
      throw ShapeError(fmt::format("AdamW.load_state: '{}' must have shape {}, got {}", dst[i].first,
                                   dst[i].second->shape().str(), src[i]->shape().str()));
    }
  }
  for (size_t i = 0; i < dst.size(); ++i) *dst[i].second = src[i]->contiguous();
  steps_ = steps;
}

double clip_grad_norm(const std::vector<nn::ParameterWithGrad>& params, double max_norm) {
  double sq = 0.0;
  for (const nn::ParameterWithGrad& p : params) {
    const float* g = p.grad->data();
    for (int64_t i = 0; i < p.grad->numel(); ++i) sq += static_cast<double>(g[i]) * g[i];
  }
  const double norm = std::sqrt(sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    const float c = static_cast<float>(coef);
    for (const nn::ParameterWithGrad& p : params) {
      float* g = p.grad->data();
      for (int64_t i = 0; i < p.grad->numel(); ++i) g[i] *= c;
    }
  }
  return norm;
}

double warmup_cosine_lr(int64_t step, int64_t warmup, int64_t total, double lr, double min_lr) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step >= total || total <= warmup) return min_lr;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace attn::optim

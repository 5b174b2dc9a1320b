// Optimisation for the explicit-backward modules: AdamW with PyTorch's semantics, gradient-norm
// clipping (torch.nn.utils.clip_grad_norm_) and the warm-up + cosine learning-rate schedule.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attn/modules.hpp"

namespace attn::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// torch.optim.AdamW (foreach=False, amsgrad=False, maximize=False), one step:
//   p *= 1 - lr * weight_decay              (decoupled decay, before the moment update)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// in float32 with the scalars computed in double, as PyTorch's single-tensor path. `decays`
// selects the parameters that take weight decay (PyTorch: a second param group with
// weight_decay = 0); by default all of them.
class AdamW {
 public:
  using DecayFilter = std::function<bool(const nn::ParameterWithGrad&)>;
  AdamW(std::vector<nn::ParameterWithGrad> params, const AdamWOptions& options,
        const DecayFilter& decays = nullptr);

  void step();                     // one update from the current gradients
  void set_lr(double lr) { options_.lr = lr; }
  double lr() const { return options_.lr; }
  int64_t steps() const { return steps_; }

  // The state under "exp_avg.<name>" / "exp_avg_sq.<name>" (for checkpoints), and back: the
  // steps taken so far and tensors of the parameters' shapes (ShapeError / ValueError naming
  // the entry otherwise).
  nn::NamedTensors state();
  void load_state(int64_t steps, const std::vector<std::pair<std::string, Tensor>>& tensors);

 private:
  struct Slot {
    nn::ParameterWithGrad p;
    bool decay;
    Tensor exp_avg, exp_avg_sq;
  };
  std::vector<Slot> slots_;
  AdamWOptions options_;
  int64_t steps_ = 0;
};

// torch.nn.utils.clip_grad_norm_(params, max_norm): the total L2 norm of all gradients (float64
// here), and when it exceeds max_norm every gradient is scaled by max_norm / (norm + 1e-6).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<nn::ParameterWithGrad>& params, double max_norm);

// Linear warm-up from lr / warmup to lr over `warmup` steps, then cosine decay to min_lr at
// `total` steps (step counts from 0).
double warmup_cosine_lr(int64_t step, int64_t warmup, int64_t total, double lr, double min_lr);

}  // namespace attn::optim

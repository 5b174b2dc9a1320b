// Checks and accumulation shared by the modules' backward() functions.
#pragma once

#include "attn/modules.hpp"

namespace attn::nn::detail {

// Throws ValueError: `module`.backward found nothing saved (no forward, a forward under
// NoGradGuard, or the context already consumed by an earlier backward).
[[noreturn]] void throw_no_saved_forward(const char* module);

// Throws ShapeError naming grad_output unless it has the forward output's shape.
void check_grad_output(const TensorView& grad_output, const Shape& expected, const char* module);

// grad += delta (same shape; delta may be any view, e.g. a transpose).
void accumulate_grad(Tensor& grad, const TensorView& delta);

// A zero gradient for a parameter (undefined for an undefined parameter, e.g. no bias).
Tensor zeros_like_param(const TensorView& param);

}  // namespace attn::nn::detail

// attn::scaled_dot_product_attention and its backward: validate once, then hand the problem to
// a backend.
#include <fmt/format.h>

#include "attn/error.hpp"
#include "sdpa/registry.hpp"

namespace attn {

SdpaResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                        const TensorView& value, const SdpaOptions& options) {
  const detail::SdpaProblem p = detail::check_sdpa(query, key, value, options);
  switch (options.backend) {
    case SdpaBackend::kReference:
      return reference::sdpa_forward(query, key, value, options, p);
    case SdpaBackend::kFused:
      if (!cpu::fused_supports(options)) {
        throw ValueError(
            "scaled_dot_product_attention: backend kFused does not support dropout with "
            "DropoutRng::kTorch (PyTorch's sequential stream); use DropoutRng::kPhilox or kAuto");
      }
      return cpu::flash_forward(query, key, value, options, p);
    case SdpaBackend::kAuto:
      break;
  }
  if (cpu::fused_supports(options)) return cpu::flash_forward(query, key, value, options, p);
  return reference::sdpa_forward(query, key, value, options, p);
}

SdpaGrads scaled_dot_product_attention_backward(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const SdpaResult& forward,
                                                const SdpaOptions& options) {
  const detail::SdpaProblem p = detail::check_sdpa(query, key, value, options);
  detail::check_sdpa_backward(grad_output, forward, options, p);
  const bool fused = options.backend == SdpaBackend::kFused ||
                     (options.backend == SdpaBackend::kAuto && cpu::fused_supports(options));
  if (fused && !cpu::fused_supports(options)) {
    throw ValueError(
        "scaled_dot_product_attention_backward: backend kFused does not support dropout with "
        "DropoutRng::kTorch (PyTorch's sequential stream); use DropoutRng::kPhilox or kAuto");
  }
  if (fused) return cpu::flash_backward(grad_output, query, key, value, forward, options, p);
  return reference::sdpa_backward(grad_output, query, key, value, forward, options, p);
}

}  // namespace attn

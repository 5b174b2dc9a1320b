// attn::scaled_dot_product_attention and its backward: validate once, choose a kernel from the
// registry (src/sdpa/registry.cpp), then hand it the problem. The choice happens before any
// kernel runs, so a refused call computes nothing and draws no random numbers.
#include "attn/error.hpp"
#include "sdpa/registry.hpp"

namespace attn {

SdpaResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                        const TensorView& value, const SdpaOptions& options) {
  const detail::SdpaProblem p = detail::check_sdpa(query, key, value, options);
  const detail::SdpaKernel& kernel =
      detail::select_sdpa_kernel(p, options, "scaled_dot_product_attention");
  return kernel.forward(query, key, value, options, p);
}

SdpaGrads scaled_dot_product_attention_backward(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const SdpaSaved& forward,
                                                const SdpaOptions& options) {
  const detail::SdpaProblem p = detail::check_sdpa(query, key, value, options);
  detail::check_sdpa_backward(grad_output, forward, options, p);
  const detail::SdpaKernel& kernel =
      detail::select_sdpa_kernel(p, options, "scaled_dot_product_attention_backward");
  return kernel.backward(grad_output, query, key, value, forward, options, p);
}

std::string sdpa_kernel_name(const TensorView& query, const TensorView& key,
                             const TensorView& value, const SdpaOptions& options) {
  const detail::SdpaProblem p = detail::check_sdpa(query, key, value, options);
  return std::string(detail::select_sdpa_kernel(p, options, "scaled_dot_product_attention").name);
}

}  // namespace attn

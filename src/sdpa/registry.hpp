// The backends behind attn::scaled_dot_product_attention (src/sdpa/sdpa.cpp picks
// one). Each receives arguments already validated by check_sdpa.
#pragma once

#include "attn/sdpa.hpp"
#include "sdpa/problem.hpp"

namespace attn::reference {
SdpaResult sdpa_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SdpaOptions& options, const detail::SdpaProblem& problem);
SdpaGrads sdpa_backward(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                        const TensorView& v, const SdpaResult& forward, const SdpaOptions& options,
                        const detail::SdpaProblem& problem);
}  // namespace attn::reference

namespace attn::cpu {
// True if the fused kernel handles these options (else the dispatcher uses the reference).
bool fused_supports(const SdpaOptions& options);
SdpaResult flash_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                         const SdpaOptions& options, const detail::SdpaProblem& problem);
SdpaGrads flash_backward(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                         const TensorView& v, const SdpaResult& forward, const SdpaOptions& options,
                         const detail::SdpaProblem& problem);
}  // namespace attn::cpu

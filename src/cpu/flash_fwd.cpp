// Placeholder until the fused kernel lands: the fused backend reports no support, so kAuto
// uses the reference path.
#include "common/sdpa_backends.hpp"

namespace attn::cpu {

bool fused_supports(const SdpaOptions&) { return false; }

SdpaResult flash_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                         const SdpaOptions& options, const detail::SdpaProblem& problem) {
  return reference::sdpa_forward(q, k, v, options, problem);
}

}  // namespace attn::cpu

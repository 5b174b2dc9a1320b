// The kernels behind attn::scaled_dot_product_attention, as one table, and the choice among them.
//
// Each kernel states what it needs (CPU features its compile flags assume, element types) and,
// as PyTorch's sdp_utils_cpp.cpp does for its backends, says in one line why it refuses a
// problem, so that a forced kernel fails with the reason and an impossible call lists every
// kernel's. Forward and backward are registered together: a kernel that computes a forward
// computes its gradients, and the backward goes through the same choice. Every kernel receives
// arguments already validated by check_sdpa (src/sdpa/problem.cpp).
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "attn/dtype.hpp"
#include "attn/sdpa.hpp"
#include "sdpa/cpu/cpu_features.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/problem.hpp"

namespace attn::detail {

struct SdpaKernel {
  std::string_view name;          // "reference", "cpu.flash.avx512", "cpu.flash.avx2", ...
  SdpaBackend family;             // kReference or kFused: what SdpaOptions::backend filters on
  cpu::CpuFeatureMask needs;      // every feature its compile flags assume
  std::span<const DType> dtypes;  // element types it computes in
  int priority;                   // kAuto takes the highest-priority kernel that accepts
  // Constraints beyond features and dtypes: "" if the kernel takes the problem, else a one-line
  // reason. May be nullptr (no further constraint).
  std::string (*why_not)(const SdpaKernel&, const SdpaProblem&, const SdpaOptions&);
  SdpaResult (*forward)(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SdpaOptions& options, const SdpaProblem& problem);
  SdpaGrads (*backward)(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                        const TensorView& v, const SdpaSaved& forward,
                        const SdpaOptions& options, const SdpaProblem& problem);
  // "" if kAuto (and a backend family) may choose this kernel on this CPU, else why it prefers
  // another one that is faster here (the kernel can still be forced by name). May be nullptr.
  std::string (*auto_declines)();
  // Takes float32 queries against bfloat16/float16 keys and values (SdpaProblem::kv_dtype).
  bool mixed_kv = false;
  // The split-KV decode builds: their table, which paged_attention runs directly.
  const cpu::DecodeKernel& (*decode)() = nullptr;
  // Also takes float32 q, k, v where SdpaProblem::f32_precision is kHigh or kMedium (the AMX
  // kernel, on bf16 terms); float32 is then not in `dtypes`, which lists what it always takes.
  bool reduced_float32 = false;
};

// The decode build paged_attention runs: `name` if not empty (ValueError if it is no decode
// kernel or this CPU cannot run it), else the highest-priority one this CPU runs.
const cpu::DecodeKernel& select_decode_kernel(std::string_view name, std::string_view caller);

// Every registered kernel, highest priority first (the order sdpa_kernels() reports).
std::span<const SdpaKernel> sdpa_registry();

// "" if `kernel` can run `problem` with `options` on this CPU, else the first reason it cannot:
// missing CPU features, then an unsupported dtype, then the kernel's own why_not.
std::string kernel_why_not(const SdpaKernel& kernel, const SdpaProblem& problem,
                           const SdpaOptions& options);

// Whether the native low-precision forwards (cpu.flash.amx_bf16, cpu.flash.avx512_bf16) take
// these values: false for a V holding NaN/Inf (their products cannot skip a zero weight) and, where
// values are split into several bf16 terms (fp16; float32 at "high"), for NaN/Inf in q or k.
// Such calls run on the float32 AVX-512 kernel instead, with the same result as kAuto's float32
// path.
bool tiles_take_values(const TensorView& q, const TensorView& k, const TensorView& v, const SdpaProblem& p,
                       int threads = 1);

// The kernel a call runs: options.kernel if set (ValueError if unknown or if it refuses the
// problem), else the highest-priority kernel of options.backend's family that accepts (ValueError
// listing every kernel's reason if none does). `caller` starts the error messages
// ("scaled_dot_product_attention" or "scaled_dot_product_attention_backward").
const SdpaKernel& select_sdpa_kernel(const SdpaProblem& problem, const SdpaOptions& options,
                                     std::string_view caller);

}  // namespace attn::detail

// The kernels' entry points, registered in registry.cpp.
namespace attn::reference {
SdpaResult sdpa_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SdpaOptions& options, const detail::SdpaProblem& problem);
SdpaGrads sdpa_backward(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                        const TensorView& v, const SdpaSaved& forward, const SdpaOptions& options,
                        const detail::SdpaProblem& problem);
// The float64 reference (attn/sdpa.hpp's scaled_dot_product_attention_f64 and its backward) on
// an already validated problem, so that its bh_base reaches the Philox counters.
SdpaResultF64 scaled_dot_product_attention_f64(const TensorView& q, const TensorView& k,
                                               const TensorView& v, const SdpaOptions& options,
                                               const detail::SdpaProblem& problem);
SdpaGradsF64 scaled_dot_product_attention_backward_f64(const TensorView& grad_output,
                                                       const TensorView& q, const TensorView& k,
                                                       const TensorView& v,
                                                       const SdpaOptions& options,
                                                       const detail::SdpaProblem& problem);
}  // namespace attn::reference

namespace attn::cpu {
struct FlashKernel;
// The shared fused driver (flash_fwd.cpp, flash_bwd.cpp), run with one ISA build's functions.
SdpaResult flash_forward(const FlashKernel& kernel, const TensorView& q, const TensorView& k,
                         const TensorView& v, const SdpaOptions& options,
                         const detail::SdpaProblem& problem);
SdpaGrads flash_backward(const FlashKernel& kernel, const TensorView& grad_output,
                         const TensorView& q, const TensorView& k, const TensorView& v,
                         const SdpaSaved& forward, const SdpaOptions& options,
                         const detail::SdpaProblem& problem);
struct Bf16ForwardKernel;
// The low-precision forward (flash_fwd_bf16.cpp) with one kernel's functions (flash_bf16.hpp), and
// the check it needs: true if no element of a bf16 or fp16 tensor is NaN or Inf.
SdpaResult flash_forward_bf16(const Bf16ForwardKernel& kernel, const TensorView& q,
                              const TensorView& k, const TensorView& v, const SdpaOptions& options,
                              const detail::SdpaProblem& problem);
// bfloat16 or float16 (float32: flash_inputs.hpp's all_finite), rows on `threads` threads.
bool all_finite_16(const TensorView& t, int threads = 1);
struct Bf16BackwardKernel;
// The low-precision backward (flash_bwd.cpp) on bf16 inputs with finite values: gradients in
// the input dtype, float32 accumulation.
SdpaGrads flash_backward_bf16(const Bf16BackwardKernel& kernel, const TensorView& grad_output,
                              const TensorView& q, const TensorView& k, const TensorView& v,
                              const SdpaSaved& forward, const SdpaOptions& options,
                              const detail::SdpaProblem& problem);
}  // namespace attn::cpu

// The SDPA kernel table and the choice among its entries (see registry.hpp).
//
// One fused driver (src/sdpa/cpu/flash_fwd.cpp, flash_bwd.cpp) runs with the function table of
// one ISA build; each build is its own entry here so that it can be listed, forced by name and
// skipped with a reason when this CPU lacks a feature its compile flags assume. The `needs`
// masks must match the -m flags CMakeLists.txt gives each flash_<isa>.cpp.
#include "sdpa/registry.hpp"

#include <array>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "sdpa/cpu/flash_isa.hpp"

namespace attn::detail {
namespace {

constexpr std::array<DType, 1> kFloat32Only{DType::kFloat32};

std::string family_name(SdpaBackend b) {
  switch (b) {
    case SdpaBackend::kReference: return "reference";
    case SdpaBackend::kFused: return "fused";
    case SdpaBackend::kAuto: return "auto";
  }
  return "?";
}

// The fused kernels compute dropout from Philox counters; PyTorch's sequential stream depends on
// drawing every weight in memory order, which a tiled kernel cannot do.
std::string flash_why_not(const SdpaKernel&, const SdpaProblem&, const SdpaOptions& options) {
  if (options.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kTorch) {
    return "dropout with DropoutRng::kTorch (PyTorch's sequential stream) is reference-only; use "
           "DropoutRng::kPhilox";
  }
  return "";
}

template <const cpu::FlashKernel& (*Table)()>
SdpaResult fused_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                         const SdpaOptions& options, const SdpaProblem& problem) {
  return cpu::flash_forward(Table(), q, k, v, options, problem);
}

template <const cpu::FlashKernel& (*Table)()>
SdpaGrads fused_backward(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                         const TensorView& v, const SdpaResult& forward,
                         const SdpaOptions& options, const SdpaProblem& problem) {
  return cpu::flash_backward(Table(), grad_output, q, k, v, forward, options, problem);
}

using namespace attn::cpu;  // the feature bits

// Highest priority first. Priorities leave room for builds between the present ones.
const SdpaKernel kKernels[] = {
#if defined(ATTN_HAVE_X86_KERNELS)
    {"cpu.flash.avx512", SdpaBackend::kFused, kAvx512f | kAvx512vl | kAvx512dq | kFma,
     kFloat32Only, 300, flash_why_not, fused_forward<flash_kernel_avx512>,
     fused_backward<flash_kernel_avx512>},
    {"cpu.flash.avx2", SdpaBackend::kFused, kAvx2 | kFma, kFloat32Only, 200, flash_why_not,
     fused_forward<flash_kernel_avx2>, fused_backward<flash_kernel_avx2>},
#endif
    {"cpu.flash.generic", SdpaBackend::kFused, 0, kFloat32Only, 100, flash_why_not,
     fused_forward<flash_kernel_generic>, fused_backward<flash_kernel_generic>},
    {"reference", SdpaBackend::kReference, 0, kFloat32Only, 0, nullptr, reference::sdpa_forward,
     reference::sdpa_backward},
};

// "" if this CPU has every feature the kernel's build assumes, else which ones it lacks.
std::string missing_features(const SdpaKernel& kernel) {
  const cpu::CpuFeatures& cpu = cpu::cpu_features();
  if (cpu.has(kernel.needs)) return "";
  return fmt::format("needs CPU features {} (this CPU: {})",
                     cpu::feature_names(kernel.needs & ~cpu.mask), cpu.describe());
}

std::string known_names() {
  std::string s;
  for (const SdpaKernel& k : kKernels) s += fmt::format("{}{}", s.empty() ? "" : ", ", k.name);
  return s;
}

}  // namespace

std::span<const SdpaKernel> sdpa_registry() { return kKernels; }

std::string kernel_why_not(const SdpaKernel& kernel, const SdpaProblem& problem,
                           const SdpaOptions& options) {
  if (std::string missing = missing_features(kernel); !missing.empty()) return missing;
  bool dtype_ok = false;
  std::string takes;
  for (DType d : kernel.dtypes) {
    dtype_ok = dtype_ok || d == problem.dtype;
    takes += fmt::format("{}{}", takes.empty() ? "" : ", ", dtype_name(d));
  }
  if (!dtype_ok) return fmt::format("dtype {} not supported (takes {})", dtype_name(problem.dtype), takes);
  return kernel.why_not != nullptr ? kernel.why_not(kernel, problem, options) : "";
}

const SdpaKernel& select_sdpa_kernel(const SdpaProblem& problem, const SdpaOptions& options,
                                     std::string_view caller) {
  if (!options.kernel.empty()) {
    for (const SdpaKernel& k : kKernels) {
      if (k.name != options.kernel) continue;
      if (options.backend != SdpaBackend::kAuto && options.backend != k.family) {
        throw ValueError(fmt::format(
            "{}: kernel '{}' is a {} kernel but options.backend asks for {} (leave backend at "
            "kAuto when naming a kernel)",
            caller, k.name, family_name(k.family), family_name(options.backend)));
      }
      const std::string reason = kernel_why_not(k, problem, options);
      if (!reason.empty()) {
        throw ValueError(fmt::format("{}: kernel '{}' cannot take this problem: {}", caller,
                                     k.name, reason));
      }
      return k;
    }
    throw ValueError(fmt::format("{}: unknown kernel '{}' (registered: {})", caller,
                                 options.kernel, known_names()));
  }

  for (const SdpaKernel& k : kKernels) {  // highest priority first
    if (options.backend != SdpaBackend::kAuto && options.backend != k.family) continue;
    if (kernel_why_not(k, problem, options).empty()) return k;
  }
  // The message callers have relied on since kFused existed.
  if (options.backend == SdpaBackend::kFused && options.dropout_p > 0.0f &&
      options.dropout_rng == DropoutRng::kTorch) {
    throw ValueError(fmt::format(
        "{}: backend kFused does not support dropout with DropoutRng::kTorch (PyTorch's "
        "sequential stream); use DropoutRng::kPhilox or kAuto",
        caller));
  }
  std::string reasons;
  for (const SdpaKernel& k : kKernels) {
    const std::string r = (options.backend != SdpaBackend::kAuto && options.backend != k.family)
                              ? fmt::format("not of backend {}", family_name(options.backend))
                              : kernel_why_not(k, problem, options);
    reasons += fmt::format("; {}: {}", k.name, r);
  }
  throw ValueError(fmt::format("{}: no kernel can take this problem (backend {}){}", caller,
                               family_name(options.backend), reasons));
}

}  // namespace attn::detail

namespace attn {

std::vector<SdpaKernelInfo> sdpa_kernels() {
  std::vector<SdpaKernelInfo> out;
  for (const detail::SdpaKernel& k : detail::sdpa_registry()) {
    SdpaKernelInfo info;
    info.name = std::string(k.name);
    info.family = k.family;
    info.dtypes.assign(k.dtypes.begin(), k.dtypes.end());
    info.reason_if_not = detail::missing_features(k);
    info.runs_on_this_cpu = info.reason_if_not.empty();
    out.push_back(std::move(info));
  }
  return out;
}

std::string cpu_description() {
  const cpu::CpuFeatures& cpu = cpu::cpu_features();
  return fmt::format("{} [{}]", cpu.model.empty() ? "unknown CPU" : cpu.model, cpu.describe());
}

}  // namespace attn

// The x86 features of this CPU that the kernel registry (src/sdpa/registry.cpp) matches against
// the compile flags of each kernel build, detected once per process.
//
// A feature counts as present only when the CPU reports it (CPUID) AND the operating system
// saves its register state (XGETBV: XCR0 bits 1-2 for YMM, 5-7 for ZMM, 17-18 for AMX tiles);
// AMX additionally needs Linux's per-process permission (arch_prctl ARCH_REQ_XCOMP_PERM), asked
// for once. As in ggml's cpu-feats, a kernel build runs only if the CPU has every feature its
// compiler flags assume: the compiler may use any of them anywhere in the file. On non-x86
// builds every feature is absent.
#pragma once

#include <cstdint>
#include <string>

namespace attn::cpu {

using CpuFeatureMask = uint32_t;

enum CpuFeature : CpuFeatureMask {
  kAvx2 = 1u << 0,
  kFma = 1u << 1,
  kF16c = 1u << 2,
  kAvx512f = 1u << 3,
  kAvx512dq = 1u << 4,
  kAvx512bw = 1u << 5,
  kAvx512vl = 1u << 6,
  kAvx512Bf16 = 1u << 7,
  kAvx512Fp16 = 1u << 8,
  kAmxTile = 1u << 9,
  kAmxBf16 = 1u << 10,
  kAmxFp16 = 1u << 11,
};

struct CpuFeatures {
  CpuFeatureMask mask = 0;
  std::string model;  // CPUID brand string (leaves 0x80000002-4), trimmed; "" if unavailable

  bool has(CpuFeatureMask m) const { return (mask & m) == m; }
  // The present features by name in a fixed order, e.g. "avx2 fma f16c avx512f ... amx_bf16";
  // "none" when there are none.
  std::string describe() const;
};

// Detected on first call (thread-safe function-local static), then reused: never per call.
const CpuFeatures& cpu_features();

// Names of the features in `m`, space-separated in the order of CpuFeature ("" for 0).
std::string feature_names(CpuFeatureMask m);

}  // namespace attn::cpu

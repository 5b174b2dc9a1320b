// CPUID / XGETBV feature detection for the kernel registry (see cpu_features.hpp).
//
// Compiled without any -m flag: it must run on every CPU, including the ones it reports as
// lacking AVX. XGETBV is issued as inline assembly for the same reason (the _xgetbv intrinsic
// needs -mxsave), and only after CPUID says the OS enabled it (OSXSAVE).
#include "sdpa/cpu/cpu_features.hpp"

#include <array>
#include <cstring>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define ATTN_X86 1
#endif

namespace attn::cpu {
namespace {

constexpr std::array<std::pair<CpuFeatureMask, const char*>, 12> kNames{{
    {kAvx2, "avx2"},
    {kFma, "fma"},
    {kF16c, "f16c"},
    {kAvx512f, "avx512f"},
    {kAvx512dq, "avx512dq"},
    {kAvx512bw, "avx512bw"},
    {kAvx512vl, "avx512vl"},
    {kAvx512Bf16, "avx512_bf16"},
    {kAvx512Fp16, "avx512_fp16"},
    {kAmxTile, "amx_tile"},
    {kAmxBf16, "amx_bf16"},
    {kAmxFp16, "amx_fp16"},
}};

#if defined(ATTN_X86)
bool bit(uint32_t reg, int b) { return ((reg >> b) & 1u) != 0; }

uint64_t xgetbv0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux hands out the 8 KiB AMX tile state only on request; without it the first tile
// instruction faults, so AMX without permission is AMX absent.
bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

std::string brand_string() {
  uint32_t r[4];
  if (__get_cpuid_max(0x80000000u, nullptr) < 0x80000004u) return "";
  char brand[49] = {};
  for (uint32_t leaf = 0; leaf < 3; ++leaf) {
    __cpuid(0x80000002u + leaf, r[0], r[1], r[2], r[3]);
    std::memcpy(brand + 16 * leaf, r, 16);
  }
  std::string s(brand);
  const size_t first = s.find_first_not_of(' ');
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(' ') - first + 1);
}

CpuFeatures detect() {
  CpuFeatures f;
  f.model = brand_string();
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 1) return f;
  uint32_t a1, b1, c1, d1;
  __cpuid(1, a1, b1, c1, d1);
  if (!bit(c1, 27)) return f;  // no OSXSAVE: the OS saves no vector state beyond SSE
  const uint64_t xcr0 = xgetbv0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;
  const bool os_tile = (xcr0 & 0x60000) == 0x60000;

  uint32_t b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  if (max_leaf >= 7) {
    uint32_t a7;
    __cpuid_count(7, 0, a7, b7, c7, d7);
    uint32_t b71, c71, d71;
    if (a7 >= 1) __cpuid_count(7, 1, a71, b71, c71, d71);
  }
  CpuFeatureMask m = 0;
  if (os_ymm) {
    if (bit(c1, 28)) {  // AVX: FMA and F16C operate on YMM state
      if (bit(c1, 12)) m |= kFma;
      if (bit(c1, 29)) m |= kF16c;
    }
    if (bit(b7, 5)) m |= kAvx2;
  }
  if (os_zmm) {
    if (bit(b7, 16)) m |= kAvx512f;
    if (bit(b7, 17)) m |= kAvx512dq;
    if (bit(b7, 30)) m |= kAvx512bw;
    if (bit(b7, 31)) m |= kAvx512vl;
    if (bit(a71, 5)) m |= kAvx512Bf16;
    if (bit(d7, 23)) m |= kAvx512Fp16;
    // Every AVX-512 extension presupposes the foundation.
    if ((m & kAvx512f) == 0) m &= ~(kAvx512dq | kAvx512bw | kAvx512vl | kAvx512Bf16 | kAvx512Fp16);
  }
  if (os_tile && bit(d7, 24) && amx_permitted()) {
    m |= kAmxTile;
    if (bit(d7, 22)) m |= kAmxBf16;
    if (bit(a71, 21)) m |= kAmxFp16;
  }
  f.mask = m;
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

}  // namespace

std::string feature_names(CpuFeatureMask m) {
  std::string out;
  for (const auto& [bitmask, name] : kNames) {
    if ((m & bitmask) == 0) continue;
    if (!out.empty()) out += ' ';
    out += name;
  }
  return out;
}

std::string CpuFeatures::describe() const {
  const std::string s = feature_names(mask);
  return s.empty() ? "none" : s;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace attn::cpu

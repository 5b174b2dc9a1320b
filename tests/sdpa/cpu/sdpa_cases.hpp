// The shapes and options every fused-kernel test sweeps (forward and backward), and the error
// measure of the "fused error <= 2x the reference fp32 error, both against float64" rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn::test {

enum class MaskKind { kNone, kBool, kAdditive, kBoolBroadcast, kCausalTopLeft, kCausalBottomRight };

struct Case {
  int64_t B, Hq, Hkv, L, S, E, Ev;
  MaskKind mask;
  float dropout;
};

inline std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + " Hq" + std::to_string(c.Hq) + " Hkv" + std::to_string(c.Hkv) +
         " L" + std::to_string(c.L) + " S" + std::to_string(c.S) + " E" + std::to_string(c.E) +
         " Ev" + std::to_string(c.Ev) + " mask" + std::to_string(static_cast<int>(c.mask)) +
         " p" + std::to_string(c.dropout);
}

inline double max_abs_err(const TensorView& a, const std::vector<double>& truth) {
  const std::vector<float> v = a.to_vector();
  double m = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double x = v[i], t = truth[i];
    if (std::isnan(x) || std::isnan(t)) {
      if (std::isnan(x) != std::isnan(t)) return INFINITY;  // NaN must match NaN
      continue;
    }
    if (x == t) continue;  // also equal infinities (LSE of a fully masked row)
    m = std::max(m, std::fabs(x - t));
  }
  return m;
}

struct Inputs {
  Tensor q, k, v, mask;
  SdpaOptions options;
};

inline Inputs make_inputs(const Case& c, uint64_t seed) {
  manual_seed(seed);
  Inputs in;
  in.q = randn({c.B, c.Hq, c.L, c.E});
  in.k = randn({c.B, c.Hkv, c.S, c.E});
  in.v = randn({c.B, c.Hkv, c.S, c.Ev});
  in.options.enable_gqa = c.Hq != c.Hkv;
  switch (c.mask) {
    case MaskKind::kNone:
      break;
    case MaskKind::kBool:  // per (batch, head), about 1 in 4 positions masked
      in.mask = rand({c.B, c.Hq, c.L, c.S});
      for (int64_t i = 0; i < in.mask.numel(); ++i) in.mask.data()[i] = in.mask.data()[i] > 0.25f ? 1.0f : 0.0f;
      in.options.attn_mask = AttnMask::boolean(in.mask);
      break;
    case MaskKind::kAdditive:  // broadcast over batch and heads
      in.mask = randn({c.L, c.S});
      in.options.attn_mask = AttnMask::additive(in.mask);
      break;
    case MaskKind::kBoolBroadcast:  // (B, 1, L, S), with some fully masked rows
      in.mask = rand({c.B, 1, c.L, c.S});
      for (int64_t i = 0; i < in.mask.numel(); ++i) in.mask.data()[i] = in.mask.data()[i] > 0.5f ? 1.0f : 0.0f;
      for (int64_t j = 0; j < c.S; ++j) in.mask.at({0, 0, c.L - 1, j}) = 0.0f;
      in.options.attn_mask = AttnMask::boolean(in.mask);
      break;
    case MaskKind::kCausalTopLeft:
      in.options.is_causal = true;
      break;
    case MaskKind::kCausalBottomRight:
      in.options.is_causal = true;
      in.options.causal_alignment = CausalAlignment::kBottomRight;
      break;
  }
  if (c.dropout > 0.0f) {
    in.options.dropout_p = c.dropout;
    in.options.dropout_rng = DropoutRng::kPhilox;
    in.options.dropout_seed = 1234 + seed;
    in.options.dropout_offset = 7;
  }
  in.options.need_lse = true;
  return in;
}

inline std::vector<Case> sweep() {
  std::vector<Case> cases;
  const int64_t Ls[] = {1, 7, 97, 257, 1025};
  const int64_t Es[] = {1, 3, 64, 80, 128, 256};
  const MaskKind masks[] = {MaskKind::kNone,          MaskKind::kCausalTopLeft, MaskKind::kBool,
                            MaskKind::kCausalBottomRight, MaskKind::kAdditive, MaskKind::kBoolBroadcast};
  int n = 0;
  for (int64_t L : Ls) {
    for (int64_t E : Es) {
      if (L == 1025 && E != 64 && E != 128) continue;  // keep the float64 truth affordable
      const int64_t group = int64_t{1} << (n % 3);   // GQA ratios 1, 2, 4
      const int64_t S = (n % 4 == 1) ? L + 13 : (n % 4 == 3 && L > 7) ? L / 2 + 1 : L;
      const int64_t Ev = (n % 5 == 2) ? E + 5 : E;
      const float p = (n % 7 == 3) ? 0.2f : 0.0f;
      const int64_t B = L >= 1025 ? 1 : 2;
      cases.push_back({B, 2 * group, 2, L, S, E, Ev, masks[n % 6], p});
      ++n;
    }
  }
  // Every mask kind at one mid-size shape, and the fast paths at E = 64 and 128.
  for (MaskKind m : masks) cases.push_back({2, 4, 2, 97, 131, 64, 64, m, 0.0f});
  for (MaskKind m : masks) cases.push_back({1, 2, 1, 130, 130, 128, 128, m, 0.1f});
  return cases;
}

inline void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

// A sweep case's name ends in "_large" when its work (B Hq L S (E + Ev): the float64 truth's and
// the kernels' multiply-adds) passes this bound. CTest labels such tests "heavy"
// (tests/label_heavy.cmake): the sanitizer runs skip them, where they cost 10x, and the README's
// test command runs them. Every sweep keeps smaller cases on the same code paths (masks, GQA,
// head dims, key splits), so the sanitizers still see each path.
constexpr int64_t kLargeCaseWork = 10'000'000;
inline std::string large_tag(int64_t work) { return work > kLargeCaseWork ? "_large" : ""; }
inline int64_t case_work(const Case& c) { return c.B * c.Hq * c.L * c.S * (c.E + c.Ev); }
inline std::string case_name(const Case& c, size_t index) {
  return "case" + std::to_string(index) + large_tag(case_work(c));
}

// The float32 fused kernels of the registry that this CPU runs: the sweeps force each by name
// (SdpaOptions::kernel). A kernel it cannot run is reported once on stdout with the reason, so
// a machine without AVX-512 says what it did not test instead of passing silently.
inline const std::vector<std::string>& runnable_fused_kernels() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      if (k.family != SdpaBackend::kFused) continue;
      bool f32 = false;  // the float32 sweeps; tests/sdpa/test_low_precision.cpp runs the others
      for (DType d : k.dtypes) f32 = f32 || d == DType::kFloat32;
      if (!f32) continue;
      if (k.runs_on_this_cpu) {
        out.push_back(k.name);
      } else {
        std::printf("[ SKIPPED  ] kernel %s on this CPU: %s\n", k.name.c_str(), k.reason_if_not.c_str());
      }
    }
    return out;
  }();
  return names;
}

// Kernels that take `dtype` and run here; prints the others with the reason.
inline std::vector<std::string> runnable_kernels_for(DType dtype) {
  std::vector<std::string> out;
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    bool takes = false;
    for (DType d : k.dtypes) takes = takes || d == dtype;
    if (!takes) continue;
    if (k.runs_on_this_cpu) {
      out.push_back(k.name);
    } else {
      std::printf("[ SKIPPED  ] %s kernel %s on this CPU: %s\n", std::string(dtype_name(dtype)).c_str(),
                  k.name.c_str(), k.reason_if_not.c_str());
    }
  }
  return out;
}

// The registered kernels whose name starts with `prefix` that this CPU runs (e.g. the decode
// builds, "cpu.decode."); one it cannot run is reported on stdout with the reason.
inline std::vector<std::string> runnable_kernels_named(const std::string& prefix) {
  std::vector<std::string> out;
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    if (!k.name.starts_with(prefix)) continue;
    if (k.runs_on_this_cpu) {
      out.push_back(k.name);
    } else {
      std::printf("[ SKIPPED  ] kernel %s on this CPU: %s\n", k.name.c_str(), k.reason_if_not.c_str());
    }
  }
  return out;
}

// The decode kernels take short inference problems only (at most 16 queries per head, no
// weights, no dropout): a sweep that forces every kernel skips a decode kernel where it refuses
// (tests/sdpa/cpu/test_decode.cpp checks that it refuses exactly those). Every other kernel
// must take every problem of the sweeps.
inline bool decode_refuses(const std::string& kernel, const TensorView& q, const TensorView& k,
                           const TensorView& v, const SdpaOptions& options) {
  if (kernel.rfind("cpu.decode.", 0) != 0) return false;
  SdpaOptions o = options;
  o.kernel = kernel;
  try {
    (void)sdpa_kernel_name(q, k, v, o);
    return false;
  } catch (const ValueError&) {
    return true;
  }
}

}  // namespace attn::test

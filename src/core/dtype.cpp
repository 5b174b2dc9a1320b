// Scalar conversions between the tensor dtypes (attn/dtype.hpp) and the bulk conversion that
// Tensor::to and the low-precision SDPA paths use. Kernels convert in their own SIMD code; this
// is the portable definition they are tested against.
#include "core/convert.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attn/error.hpp"
#include "sdpa/cpu/cpu_features.hpp"

namespace attn {

float half_to_float(float16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float32
    const float v = static_cast<float>(m) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

float16 float_to_half(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t x = u & 0x7fffffffu;
  if (x > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN (c10's bits)
  if (x >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), units of 2^-24
    // a * 2^24 is exact; nearbyint rounds it to nearest even in the default rounding mode.
    const float a = std::bit_cast<float>(x) * 0x1p24f;
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a)))};
  }
  const uint32_t mant = x & 0x7fffffu;
  uint32_t h = (((x >> 23) - 112u) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return {static_cast<uint16_t>(sign | h)};
}

namespace detail {

namespace {

double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const bfloat16*>(p)[i]);
    case DType::kFloat16: return half_to_float(static_cast<const float16*>(p)[i]);
    case DType::kFloat64: return static_cast<const double*>(p)[i];
    case DType::kInt8: return static_cast<const int8_t*>(p)[i];
    case DType::kInt32: return static_cast<const int32_t*>(p)[i];
  }
  return 0;
}

template <typename I>
I to_integer(double v, DType to) {
  // Exactly representable bounds: anything in (min - 1, max + 1) truncates into range.
  const double lo = static_cast<double>(std::numeric_limits<I>::min()) - 1.0;
  const double hi = static_cast<double>(std::numeric_limits<I>::max()) + 1.0;
  if (!(v > lo && v < hi)) {
    throw ValueError(fmt::format("to({}): value {} is NaN, infinite or out of the range of {}",
                                 dtype_name(to), v, dtype_name(to)));
  }
  return static_cast<I>(v);
}

}  // namespace

namespace {

// The conversions the 16-bit SDPA paths run on every call (inputs widened, outputs rounded) are
// loops the compiler vectorises, or F16C where the CPU has it; the generic path below goes
// through double one element at a time.
void bf16_to_f32(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = std::bit_cast<float>(static_cast<uint32_t>(s[i]) << 16);
}

void f32_to_bf16(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(s[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = half_to_float(float16{s[i]});
}

// vcvtps2ph rounds to nearest even and keeps subnormals; a NaN stays a NaN (its payload
// truncated, where c10 writes 0x7E00: both are NaN, PyTorch's own paths differ likewise).
__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = float_to_half(s[i]).bits;
}

// From the registry's detection (CPUID and the OS's YMM state): clang 14's
// __builtin_cpu_supports knows no "f16c".
bool have_f16c() { return cpu::cpu_features().has(cpu::kF16c); }
#endif

// One of the fast pairs, on a chunk; false if (from, to) is not one of them.
bool convert_fast(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == DType::kBFloat16 && to == DType::kFloat32) {
    bf16_to_f32(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
    return true;
  }
  if (from == DType::kFloat32 && to == DType::kBFloat16) {
    f32_to_bf16(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
    return true;
  }
#if defined(__x86_64__)
  if (have_f16c() && from == DType::kFloat16 && to == DType::kFloat32) {
    f16_to_f32_f16c(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
    return true;
  }
  if (have_f16c() && from == DType::kFloat32 && to == DType::kFloat16) {
    f32_to_f16_f16c(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
    return true;
  }
#endif
  return false;
}

}  // namespace

void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(from)));
    return;
  }
  // Large arrays in chunks over the OpenMP threads (memory-bound: two threads nearly double it).
  constexpr int64_t kChunk = int64_t{1} << 16;
  const auto* s8 = static_cast<const uint8_t*>(src);
  auto* d8 = static_cast<uint8_t*>(dst);
  const int64_t sin = dtype_size(from), sout = dtype_size(to);
  if (convert_fast(src, from, dst, to, 0)) {
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    // One chunk (a row of a kernel's output, say) never enters OpenMP: even a parallel region
    // with a false if-clause starts a team, inside a kernel's region a nested one, with a
    // malloc and a free each time (measured: 15 us of a 16-bit decode call at S = 64).
    if (chunks <= 1) {
      convert_fast(src, from, dst, to, n);
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t i0 = c * kChunk, m = std::min(kChunk, n - i0);
      convert_fast(s8 + i0 * sin, from, d8 + i0 * sout, to, m);
    }
    return;
  }
  // float64 -> 16-bit goes through float32, as c10::BFloat16(double) and c10::Half(double) do.
  for (int64_t i = 0; i < n; ++i) {
    const double v = load(src, from, i);
    switch (to) {
      case DType::kFloat32: static_cast<float*>(dst)[i] = static_cast<float>(v); break;
      case DType::kBFloat16: static_cast<bfloat16*>(dst)[i] = float_to_bf16(static_cast<float>(v)); break;
      case DType::kFloat16: static_cast<float16*>(dst)[i] = float_to_half(static_cast<float>(v)); break;
      case DType::kFloat64: static_cast<double*>(dst)[i] = v; break;
      case DType::kInt8: static_cast<int8_t*>(dst)[i] = to_integer<int8_t>(v, to); break;
      case DType::kInt32: static_cast<int32_t*>(dst)[i] = to_integer<int32_t>(v, to); break;
    }
  }
}

double element_as_double(const void* data, DType dtype, int64_t offset) {
  return load(data, dtype, offset);
}

}  // namespace detail
}  // namespace attn

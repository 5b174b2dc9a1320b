// Scalar conversions between the tensor dtypes (attn/dtype.hpp) and the bulk conversion that
// Tensor::to and the low-precision SDPA paths use. Kernels convert in their own SIMD code; this
// is the portable definition they are tested against.
#include "core/convert.hpp"

#include <cmath>
#include <fmt/format.h>

#include "attn/error.hpp"

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

void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(from)));
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

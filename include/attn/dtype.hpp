// Element types of attn::Tensor, named as PyTorch names them (torch.float32, torch.bfloat16, ...).
//
// bfloat16 and float16 are stored as their 16 bits. Conversion from float32 rounds to nearest,
// ties to even, overflow gives +-inf, and a NaN stays a NaN with c10's bits (bfloat16: 0x7FC0;
// float16: 0x7E00 with the sign kept), so a round trip matches PyTorch bit for bit. Conversion
// to float32 is exact.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace attn {

enum class DType : uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat64,
  kInt8,   // quantised KV caches
  kInt32,  // index tensors (cumulative sequence lengths, token ids)
};

// Bytes per element.
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt8: return 1;
    case DType::kInt32: return 4;
  }
  return 0;
}

// "float32", "bfloat16", "float16", "float64", "int8", "int32" (torch.<name>).
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat64: return "float64";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
  }
  return "?";
}

constexpr bool is_floating(DType t) { return t != DType::kInt8 && t != DType::kInt32; }
// bfloat16 or float16: computed in float32, output rounded to 16 bits.
constexpr bool is_sixteen_bit_float(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

// The 16 bits of a bfloat16 value: float32's sign, exponent and top 7 mantissa bits.
struct bfloat16 {
  uint16_t bits = 0;
};
// The 16 bits of an IEEE 754 binary16 value: 5 exponent bits, 10 mantissa bits.
struct float16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bfloat16 h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16);
}

inline bfloat16 float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fc0};  // c10::BFloat16's NaN
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // nearest, ties to even
  return {static_cast<uint16_t>(rounded >> 16)};
}

float half_to_float(float16 h);  // exact
float16 float_to_half(float f);  // nearest-even, NaN kept, overflow to inf, subnormals kept

// The C++ type stored for each dtype, for TensorView::data_as<T>().
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <> constexpr DType dtype_of<bfloat16>() { return DType::kBFloat16; }
template <> constexpr DType dtype_of<float16>() { return DType::kFloat16; }
template <> constexpr DType dtype_of<double>() { return DType::kFloat64; }
template <> constexpr DType dtype_of<int8_t>() { return DType::kInt8; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kInt32; }

// How float32 matrix products may be computed: torch.set_float32_matmul_precision's three
// levels, for float32 attention (scaled_dot_product_attention and everything built on it).
//   kHighest: float32 multiply-adds (the default; the float32 kernels).
//   kHigh:    each float32 value split exactly into three bf16 terms and the six largest of
//             their nine cross products summed in float32 (PyTorch's bf16x3): on a matrix
//             engine (AMX-BF16) several times the float32 FMA rate, error within about twice
//             the float32 kernels' (docs/API.md has the measured errors).
//   kMedium:  plain bf16 products of the rounded values, float32 sums: bf16 accuracy.
// As in PyTorch the level is a permission, not a demand: a CPU without a kernel for it computes
// at kHighest. kDefault (SdpaOptions' default) means the process-wide level below.
enum class Float32MatmulPrecision : uint8_t { kDefault, kHighest, kHigh, kMedium };

// The process-wide level (kHighest until set; thread-safe). Setting kDefault restores kHighest.
void set_float32_matmul_precision(Float32MatmulPrecision precision);
// "highest", "high" or "medium" (PyTorch's names), else ValueError naming the argument.
void set_float32_matmul_precision(std::string_view precision);
Float32MatmulPrecision get_float32_matmul_precision();
// "highest", "high", "medium" ("default" for kDefault).
std::string_view float32_matmul_precision_name(Float32MatmulPrecision precision);

}  // namespace attn

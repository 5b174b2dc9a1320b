// Element conversion between dtypes (internal): what Tensor::to does for contiguous memory, and
// what the low-precision SDPA paths use to widen inputs and round outputs.
#pragma once

#include <cstdint>

#include "attn/dtype.hpp"

namespace attn::detail {

// dst[i] = src[i] converted, for i < n; both arrays contiguous. Rounding as Tensor::to.
void convert_elements(const void* src, DType from, void* dst, DType to, int64_t n);

// The element at `offset` (in elements) as a double.
double element_as_double(const void* data, DType dtype, int64_t offset);

}  // namespace attn::detail

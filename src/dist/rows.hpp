// Row copies and float32 accumulation on (..., rows, X) views of any dtype and strides: what the
// distributed attention does between kernel calls (packing blocks to send, merging partials).
#pragma once

#include <cstdint>
#include <cstring>

#include "attn/tensor.hpp"

namespace attn::dist::detail {

// dst = src (same shape and dtype; any strides).
inline void copy_rows(const TensorView& src, const TensorView& dst) {
  const int64_t es = src.element_size(), X = src.size(-1), n = src.size(-2);
  const int64_t lead = n == 0 || X == 0 ? 0 : src.numel() / (n * X);
  const int nd = src.dim();
  for (int64_t b = 0; b < lead; ++b) {
    int64_t so = 0, d_o = 0, rem = b;
    for (int d = nd - 3; d >= 0; --d) {
      const int64_t i = rem % src.size(d);
      rem /= src.size(d);
      so += i * src.stride(d), d_o += i * dst.stride(d);
    }
    for (int64_t r = 0; r < n; ++r) {
      const char* s = static_cast<const char*>(src.raw_data()) + (so + r * src.stride(-2)) * es;
      char* t = static_cast<char*>(dst.raw_data()) + (d_o + r * dst.stride(-2)) * es;
      if (src.stride(-1) == 1 && dst.stride(-1) == 1) {
        std::memcpy(t, s, static_cast<size_t>(X * es));
      } else {
        for (int64_t x = 0; x < X; ++x) std::memcpy(t + x * dst.stride(-1) * es, s + x * src.stride(-1) * es, static_cast<size_t>(es));
      }
    }
  }
}

// acc[..., row0 + r, :] += part[..., r, :] for a contiguous float32 acc and a contiguous part.
inline void add_rows(Tensor& acc, int64_t row0, const TensorView& part_any) {
  const Tensor part = part_any.dtype() == DType::kFloat32 ? Tensor() : part_any.to(DType::kFloat32);
  const float* p = part.defined() ? part.data() : part_any.data();
  const int64_t N = acc.size(-2), X = acc.size(-1), n = part_any.size(-2);
  const int64_t lead = N == 0 || X == 0 ? 0 : acc.numel() / (N * X);
  for (int64_t b = 0; b < lead; ++b) {
    float* a = acc.data() + (b * N + row0) * X;
    const float* q = p + b * n * X;
    for (int64_t i = 0; i < n * X; ++i) a[i] += q[i];
  }
}

}  // namespace attn::dist::detail

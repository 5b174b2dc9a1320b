// Strided traversal shared by the elementwise code (not part of the public API).
#pragma once

#include <cstdint>

namespace attn {

template <typename F>
void for_each_offset(const TensorView& v, F&& f) {
  const int n = v.dim();
  const int64_t total = v.numel();
  if (total == 0) return;
  if (n == 0) {
    f(int64_t{0});
    return;
  }
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  int64_t offset = 0;
  const int last = n - 1;
  const int64_t inner = v.size(last), inner_stride = v.stride(last);
  for (int64_t done = 0; done < total; done += inner) {
    for (int64_t i = 0; i < inner; ++i) f(offset + i * inner_stride);
    // Odometer increment over the outer dims.
    for (int d = last - 1; d >= 0; --d) {
      offset += v.stride(d);
      if (++idx[d] < v.size(d)) break;
      offset -= v.stride(d) * v.size(d);
      idx[d] = 0;
    }
  }
}

}  // namespace attn

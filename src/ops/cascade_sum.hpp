// PyTorch's float32 summation order (ATen/native/cpu/SumKernel.cpp, "cascade sum"), so sums,
// means and softmax-style normalisations print PyTorch's last digit: the chapter's "Sum:
// tensor(1.)" versus "tensor(1.0000)" depends on it.
//
// A row is read as 4 interleaved partial sums (ILP), each a small cascade of 4 levels that
// flushes every 2^k terms; contiguous rows of >= 8 values are first split into 8-float
// vectors (AVX2's Vectorized<float>), the tail summed in order, then the 8 lanes added in order.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace attn::detail {

template <int W>
using Lanes = std::array<float, W>;

template <int W>
inline void add_into(Lanes<W>& a, const Lanes<W>& b) {
  for (int l = 0; l < W; ++l) a[l] += b[l];
}

inline int64_t ceil_log2(int64_t x) {
  int64_t r = 0;
  while ((int64_t{1} << r) < x) ++r;
  return r;
}

// multi_row_sum: `size` steps, each adding one W-wide value to each of 4 accumulators.
// load(i, k) returns the W lanes of step i, accumulator k.
template <int W, typename Load>
std::array<Lanes<W>, 4> multi_row_sum(int64_t size, Load load) {
  constexpr int64_t kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  std::array<std::array<Lanes<W>, 4>, kLevels> acc{};
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int k = 0; k < 4; ++k) add_into<W>(acc[0][k], load(i, k));
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        add_into<W>(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes<W>{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int k = 0; k < 4; ++k) add_into<W>(acc[0][k], load(i, k));
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int k = 0; k < 4; ++k) add_into<W>(acc[0][k], acc[j][k]);
  }
  return acc[0];
}

// row_sum over n W-wide values: value(i) returns the lanes of value i.
template <int W, typename Value>
Lanes<W> row_sum(int64_t n, Value value) {
  const int64_t n_ilp = n / 4;
  auto partial = multi_row_sum<W>(n_ilp, [&](int64_t i, int k) { return value(i * 4 + k); });
  for (int64_t i = n_ilp * 4; i < n; ++i) add_into<W>(partial[0], value(i));
  for (int k = 1; k < 4; ++k) add_into<W>(partial[0], partial[k]);
  return partial[0];
}

// Sum of x[0], x[stride], ..., x[(n-1)*stride] in PyTorch's order.
inline float cascade_sum(const float* x, int64_t n, int64_t stride) {
  constexpr int kVec = 8;
  if (stride != 1 || n < kVec) {
    return row_sum<1>(n, [&](int64_t i) { return Lanes<1>{x[i * stride]}; })[0];
  }
  const int64_t nvec = n / kVec;
  const Lanes<kVec> v = row_sum<kVec>(nvec, [&](int64_t i) {
    Lanes<kVec> l;
    std::copy_n(x + i * kVec, kVec, l.begin());
    return l;
  });
  float total = 0.0f;
  for (int64_t k = nvec * kVec; k < n; ++k) total += x[k];
  for (int l = 0; l < kVec; ++l) total += v[l];
  return total;
}

}  // namespace attn::detail

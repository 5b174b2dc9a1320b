// How the fused backward (flash_bwd.cpp) cuts each key/value head's S keys into key ranges, its
// work items being (key/value head, key range).
//
// Shapes: a head has S keys; the kernel (flash_bwd_kernel.hpp) walks them in key groups of
// kFlashBwdKeyGroup keys (4 blocks of 64), so range boundaries fall on group boundaries and the
// dK, dV of a key row are computed exactly as with a single range. Every range after the first
// costs one partial dQ, (L, E) floats per query head of the group, written once by its item and
// read once by the fixed-order reduction, plus re-packing Q^T, dO^T and D for the head: O(L E)
// against the range's O(5 L E keys) products, under 1% at 256 keys or more.
//
// The rule depends only on the problem (S, kv_heads, key group), never on the thread count, so
// the partial sums, and hence the gradients, are the same bits on any number of threads:
//   unit   = kMinRangeKeys rounded up to whole key groups (256 keys)
//   ranges = min(ceil(kTargetItems / kv_heads), floor(S / unit)), at least 1
// Many kv heads (>= kTargetItems) or short sequences (S < 2 units) keep one range per head: no
// partial dQ, no reduction, the same bits as an unsplit head. Otherwise the ceil(S / unit) units
// are dealt out evenly, the remainder to the last ranges: every range holds >= unit keys, and
// under causal masking, where the first keys are seen by the most queries, the longer ranges
// are the cheaper late ones. The partial dQ memory is (ranges - 1) dQ-sized buffers per head,
// bounded by kTargetItems - 1 times the whole dQ (one kv head, S >= 8 units).
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::cpu {

constexpr int64_t kFlashBwdKeyGroup = 256;  // keys per kernel key group (kKeyGroup * kBK)
constexpr int64_t kMinRangeKeys = 256;      // keeps the O(L E) per-range overhead small
constexpr int64_t kTargetItems = 8;         // kv_heads * ranges aimed for when heads are few

struct FlashBwdKeySplit {
  int64_t ranges = 1;
  int64_t units = 1;      // ceil(S / unit_keys)
  int64_t unit_keys = 0;  // a whole number of key groups

  // First key of range r (r == ranges gives S): units/ranges each, the last (units % ranges)
  // ranges one more.
  int64_t begin(int64_t r, int64_t S) const {
    const int64_t base = units / ranges, extra = units % ranges;
    const int64_t u = r * base + std::max<int64_t>(0, r - (ranges - extra));
    return std::min(S, u * unit_keys);
  }
};

inline FlashBwdKeySplit flash_bwd_key_split(int64_t S, int64_t kv_heads, int64_t key_group = kFlashBwdKeyGroup) {
  FlashBwdKeySplit s;
  s.unit_keys = (kMinRangeKeys + key_group - 1) / key_group * key_group;
  s.units = std::max<int64_t>(1, (S + s.unit_keys - 1) / s.unit_keys);
  const int64_t wanted = (kTargetItems + std::max<int64_t>(1, kv_heads) - 1) / std::max<int64_t>(1, kv_heads);
  s.ranges = std::max<int64_t>(1, std::min(wanted, S / s.unit_keys));
  return s;
}

}  // namespace attn::cpu

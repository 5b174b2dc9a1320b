// Row-at-a-time Philox dropout mask for the reference SDPA paths (contract: attn/philox.hpp).
//
// The float32 and float64 references both take their keep decisions from here, so they drop
// exactly the same weights by construction; tests compare this row against the per-element
// philox_dropout_keep, which the fused kernel calls, so all backends share one mask.
#include "attn/philox.hpp"

namespace attn {

void philox_dropout_keep_row(uint64_t seed, uint64_t offset, int64_t bh, int64_t i, float p,
                             std::span<uint8_t> keep, int64_t j0) {
  if (p >= 1.0f) {  // F.dropout(p=1) drops everything; no threshold could express that
    for (uint8_t& k : keep) k = 0;
    return;
  }
  const uint32_t threshold = philox_dropout_threshold(p);
  const std::array<uint32_t, 2> key = philox_dropout_key(seed);
  const size_t lane = static_cast<size_t>(i & 3);
  for (size_t j = 0; j < keep.size(); ++j) {
    const std::array<uint32_t, 4> w =
        philox4x32_10(philox_dropout_counter(offset, bh, i, j0 + static_cast<int64_t>(j)), key);
    keep[j] = w[lane] >= threshold ? 1 : 0;
  }
}

}  // namespace attn

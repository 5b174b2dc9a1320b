// Philox4x32-10: the counter-based random function behind DropoutRng::kPhilox.
//
// Philox (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11;
// the Random123 library) maps a 128-bit counter and a 64-bit key to 128 random bits with ten
// rounds of a multiply/xor Feistel network. It has no state: any element's random number is a
// pure function of its coordinates, so a tiled kernel, the reference and any thread count
// draw exactly the same dropout mask. PyTorch's CUDA dropout uses the same generator (with a
// different counter layout, so the masks are not PyTorch's).
//
// Dropout mask, the contract every backend follows (src/sdpa/reference and src/sdpa/cpu both
// call philox_dropout_keep or philox_dropout_keep_row below):
//   key     = { uint32(seed), uint32(seed >> 32) }
//   counter = { uint32(i >> 2), uint32(j), uint32(bh), uint32(offset) }
//   word    = philox4x32_10(counter, key)[i & 3]
//   keep    = word >= philox_dropout_threshold(p)       (never, when p >= 1)
// where bh is the flat batch*head index of the QUERY head (row-major over the output's leading
// dims; with GQA several query heads share a key/value head but still draw their own masks),
// i the query row and j the key column. One Philox call thus serves four consecutive query rows
// at the same key. Kept weights are scaled by 1 / (1 - p).
// The threshold is floor(p * 2^32) (capped at 2^32 - 1), so the keep probability is 1 - p to
// within 2^-32. Only the low 32 bits of `offset`, i and j, and of bh take part: advance `offset`
// by one per call for a fresh mask; masks repeat after 2^32 offsets, and tensors with more than
// 2^32 rows, keys or batch*heads would reuse counters.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace attn {

namespace detail {
// 32 x 32 -> 64-bit product split into its high and low words (Philox's "mulhilo").
inline void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t prod = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(prod >> 32);
  lo = static_cast<uint32_t>(prod);
}
}  // namespace detail

// Philox4x32 with R rounds (Random123's philox4x32_R). The key is bumped by the Weyl constants
// between rounds, so round 1 uses the key as given. R = 10 is the recommended strength and the
// one dropout uses; other round counts exist only so tests can check Random123's 7-round
// known answers too.
template <int R>
inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (golden ratio, sqrt 3)
  for (int r = 0; r < R; ++r) {
    if (r > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    detail::philox_mulhilo(kM0, ctr[0], hi0, lo0);
    detail::philox_mulhilo(kM1, ctr[2], hi1, lo1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

inline std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  return philox4x32<10>(ctr, key);
}

// Words >= this are kept: min(floor(p * 2^32), 2^32 - 1). p <= 0 gives 0 (keep all). p >= 1
// must be handled by the caller as "never keep", since even 2^32 - 1 lets one word through.
// p * 2^32 is exact in double for every float p, and the conversion truncates, i.e. floors.
inline uint32_t philox_dropout_threshold(float p) {
  if (!(p > 0.0f)) return 0;
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// The Philox counter and key of element (bh, i, j); see the contract above.
inline std::array<uint32_t, 4> philox_dropout_counter(uint64_t offset, int64_t bh, int64_t i, int64_t j) {
  return {static_cast<uint32_t>(static_cast<uint64_t>(i) >> 2), static_cast<uint32_t>(j),
          static_cast<uint32_t>(bh), static_cast<uint32_t>(offset)};
}
inline std::array<uint32_t, 2> philox_dropout_key(uint64_t seed) {
  return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
}

// Whether attention weight (bh, i, j) survives dropout with probability p of being dropped.
inline bool philox_dropout_keep(uint64_t seed, uint64_t offset, int64_t bh, int64_t i, int64_t j,
                                float p) {
  if (p >= 1.0f) return false;
  const std::array<uint32_t, 4> w =
      philox4x32_10(philox_dropout_counter(offset, bh, i, j), philox_dropout_key(seed));
  return w[static_cast<size_t>(i & 3)] >= philox_dropout_threshold(p);
}

// keep[j] = philox_dropout_keep(seed, offset, bh, i, j, p) for j in [0, keep.size()): one
// query row of the mask, as the reference paths use it (src/core/philox.cpp).
// j0 shifts the keys: keep[j] is key j0 + j's (a slice of a longer sequence).
void philox_dropout_keep_row(uint64_t seed, uint64_t offset, int64_t bh, int64_t i, float p,
                             std::span<uint8_t> keep, int64_t j0 = 0);

}  // namespace attn

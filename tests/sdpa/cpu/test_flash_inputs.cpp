// The input preparation of the fused kernels (src/sdpa/cpu/flash_inputs.hpp, all_finite_16):
// rows walked in memory order must still visit every row once, copy it to its own place, and
// see every non-finite element, on the layouts projections give: (B, T, H, E) viewed as
// (B, H, T, E), and a slice of a fused QKV row.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "attn/attn.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/registry.hpp"

namespace attn {
namespace {

// (B, T, 3H, E) holding q, k, v of a fused projection; part i as (B, H, T, E).
TensorView qkv_part(const Tensor& x, int64_t H, int i) { return TensorView(x).slice(2, i * H, (i + 1) * H).transpose(1, 2); }

TEST(FlashInputs, RowWalkVisitsEveryRowOnceWithItsOwnOffsets) {
  const Tensor x = randn({2, 5, 9, 4});
  const TensorView t = qkv_part(x, 3, 1);  // (2, 3, 5, 4), strides (180, 4, 36, 1)
  const cpu::RowWalk walk(t);
  std::set<int64_t> seen;
  int64_t last_from = -1;
  bool ascending = true;
  for (int64_t r = 0; r < 2 * 3 * 5; ++r) {
    int64_t from, to;
    walk.at(r, from, to);
    // `to` names the row (b, h, s) of the contiguous copy; `from` must be that row's offset in t.
    const int64_t b = to / 60, h = to / 20 % 3, s = to / 4 % 5;
    ASSERT_EQ(to % 4, 0);
    EXPECT_EQ(from, b * t.stride(0) + h * t.stride(1) + s * t.stride(2)) << "row " << r;
    EXPECT_TRUE(seen.insert(to).second) << "row " << r << " visited twice";
    ascending = ascending && from > last_from;
    last_from = from;
  }
  EXPECT_EQ(seen.size(), 30u);
  EXPECT_TRUE(ascending) << "the walk is not in memory order";
}

TEST(FlashInputs, CopyRowsOfAProjectionSliceEqualsTheGather) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor x = randn({2, 70, 3 * 4, 16}).to(dt);
    for (int i = 0; i < 3; ++i) {
      const TensorView t = qkv_part(x, 4, i);
      const Tensor copy = cpu::copy_rows(t, 2), gather = t.contiguous();
      ASSERT_TRUE(copy.shape() == gather.shape());
      EXPECT_EQ(std::memcmp(copy.raw_data(), gather.raw_data(), static_cast<size_t>(gather.numel() * gather.element_size())), 0)
          << dtype_name(dt) << " part " << i;
    }
  }
}

TEST(FlashInputs, NonFiniteCheckSeesEveryElementOfAStridedView) {
  // 2 * 4 * 700 * 32 elements: above the size where the check goes parallel.
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      for (int64_t at_token : {int64_t{0}, int64_t{333}, int64_t{699}}) {
        Tensor x = randn({2, 700, 3 * 4, 32});
        const auto check = [&](const Tensor& xt) {
          const TensorView v = qkv_part(xt, 4, 2);
          return dt == DType::kFloat32 ? cpu::all_finite(v, 2) : cpu::all_finite_16(v, 2);
        };
        EXPECT_TRUE(check(x.to(dt))) << dtype_name(dt);
        // Element (b 1, h 3, token at_token, e 31) of v, outside q and k.
        x.data()[((1 * 700 + at_token) * 12 + 8 + 3) * 32 + 31] = bad;
        EXPECT_FALSE(check(x.to(dt))) << dtype_name(dt) << " " << bad << " at token " << at_token;
        // The same value in q (part 0) is not v's.
        Tensor y = randn({2, 700, 3 * 4, 32});
        y.data()[((1 * 700 + at_token) * 12 + 3) * 32 + 31] = bad;
        EXPECT_TRUE(check(y.to(dt))) << dtype_name(dt);
      }
    }
  }
}

}  // namespace
}  // namespace attn

// The NaN/Inf policy of docs/NUMERICS.md, checked on both backends (and the float64 truth where
// it follows the same rule). The single-backend tests that the document also cites live in
// tests/sdpa/cpu/test_flash_fwd.cpp (FlashForwardNumerics.*) and tests/sdpa/reference/test_sdpa.cpp
// (SdpaFullyMaskedRows.*, SdpaNaN.*, SdpaLse.*); this file closes the gaps between them: weights
// of fully masked rows on the fused kernel, dropout-zeroed values, additive -inf next to a NaN
// score, weights that underflow to 0, dropout_p = 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr SdpaBackend kBackends[] = {SdpaBackend::kFused, SdpaBackend::kReference};

const char* name_of(SdpaBackend b) { return b == SdpaBackend::kFused ? "fused" : "reference"; }

SdpaResult run(const TensorView& q, const TensorView& k, const TensorView& v, SdpaOptions o, SdpaBackend b) {
  o.backend = b;
  return scaled_dot_product_attention(q, k, v, o);
}

bool row_is(const TensorView& t, std::initializer_list<int64_t> row_index, float value) {
  // t (..., n): every element of the row selected by the leading indices equals value.
  TensorView r = t;
  for (int64_t i : row_index) r = r.select(0, i);
  for (float x : r.to_vector()) {
    if (!(x == value)) return false;
  }
  return true;
}

bool row_all(const TensorView& t, std::initializer_list<int64_t> row_index, bool (*pred)(float)) {
  TensorView r = t;
  for (int64_t i : row_index) r = r.select(0, i);
  for (float x : r.to_vector()) {
    if (!pred(x)) return false;
  }
  return true;
}

bool finite(float x) { return std::isfinite(x); }
bool nan(float x) { return std::isnan(x); }

// ---- fully masked rows ---------------------------------------------------------------------------

TEST(NumericsPolicy, FullyMaskedRowsGiveZeroOutputZeroWeightsAndLseMinusInfOnEveryBackend) {
  manual_seed(301);
  Tensor q = randn({1, 2, 40, 8}), k = randn({1, 2, 70, 8}), v = randn({1, 2, 70, 8});
  // Non-finite keys and values where only the dead row could have seen them.
  k.at({0, 1, 69, 0}) = std::nanf("");
  v.at({0, 1, 69, 3}) = kInf;

  Tensor keep = Tensor::ones({1, 2, 40, 70});
  for (int64_t j = 0; j < 70; ++j) keep.at({0, 1, 17, j}) = 0.0f;      // boolean: all excluded
  for (int64_t i = 0; i < 40; ++i) keep.at({0, 1, i, 69}) = 0.0f;      // key 69 hidden from all
  Tensor add = Tensor::zeros({40, 70});
  for (int64_t j = 0; j < 70; ++j) add.at({5, j}) = -kInf;             // additive: all -inf
  for (int64_t i = 0; i < 40; ++i) add.at({i, 69}) = -kInf;            // key 69 hidden from all

  struct Setup {
    const char* what;
    SdpaOptions o;
    std::vector<int64_t> dead_rows;  // (head 1 for the boolean mask, every head otherwise)
  };
  std::vector<Setup> setups(3);
  setups[0].what = "boolean mask";
  setups[0].o.attn_mask = AttnMask::boolean(keep);
  setups[0].dead_rows = {17};
  setups[1].what = "causal bottom-right, L > S";
  setups[1].o.is_causal = true;
  setups[1].o.causal_alignment = CausalAlignment::kBottomRight;
  setups[1].dead_rows = {0, 1, 2};
  setups[2].what = "additive mask, all -inf";
  setups[2].o.attn_mask = AttnMask::additive(add);
  setups[2].dead_rows = {5};

  for (Setup& s : setups) {
    s.o.need_weights = s.o.need_lse = true;
    Tensor kk = k, vv = v;
    TensorView kv = kk, vv_view = vv;
    if (s.o.is_causal) {  // keys 0..36: S = 37 < L = 40, so rows 0..2 see no key
      kv = kk.slice(2, 0, 37);
      vv_view = vv.slice(2, 0, 37);
    }
    // An additive -inf does not exclude a NaN score (see below): only the Inf value stays there.
    if (s.o.attn_mask && s.o.attn_mask->kind == AttnMask::Kind::kAdditive) kk.at({0, 1, 69, 0}) = 0.5f;
    const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, kv, vv_view, s.o);
    for (SdpaBackend b : kBackends) {
      const SdpaResult r = run(q, kv, vv_view, s.o, b);
      const std::string where = std::string(s.what) + ", " + name_of(b);
      for (int64_t h = 0; h < 2; ++h) {
        const bool head_has_dead_rows = s.o.attn_mask && s.o.attn_mask->kind == AttnMask::Kind::kBool ? h == 1 : true;
        for (int64_t i = 0; i < 40; ++i) {
          const bool dead = head_has_dead_rows &&
                            std::find(s.dead_rows.begin(), s.dead_rows.end(), i) != s.dead_rows.end();
          if (dead) {
            EXPECT_TRUE(row_is(r.output, {0, h, i}, 0.0f)) << where << " output row " << h << "," << i;
            EXPECT_TRUE(row_is(r.attn_weights, {0, h, i}, 0.0f)) << where << " weights row " << h << "," << i;
            EXPECT_EQ(r.lse.at({0, h, i}), -kInf) << where << " lse row " << h << "," << i;
            const size_t row = static_cast<size_t>(h * 40 + i);
            EXPECT_EQ(t.lse[row], -std::numeric_limits<double>::infinity()) << where;
            for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(t.output[row * 8 + static_cast<size_t>(e)], 0.0) << where;
          } else {
            EXPECT_TRUE(row_all(r.output, {0, h, i}, finite)) << where << " output row " << h << "," << i;
            EXPECT_TRUE(std::isfinite(r.lse.at({0, h, i}))) << where << " lse row " << h << "," << i;
          }
        }
      }
    }
  }
}

// ---- excluded positions --------------------------------------------------------------------------

TEST(NumericsPolicy, NonFiniteValuesAtDroppedPositionsDoNotReachTheOutput) {
  manual_seed(302);
  Tensor q = randn({1, 1, 24, 8}), k = randn({1, 1, 24, 8}), v = randn({1, 1, 24, 4});
  for (int64_t e = 0; e < 4; ++e) v.at({0, 0, 11, e}) = e % 2 == 0 ? std::nanf("") : kInf;
  SdpaOptions o;
  o.dropout_p = 0.5f;
  o.dropout_rng = DropoutRng::kPhilox;
  o.dropout_seed = 77;
  o.need_weights = true;
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  for (SdpaBackend b : kBackends) {
    const SdpaResult r = run(q, k, v, o, b);
    int dropped = 0, kept = 0;
    for (int64_t i = 0; i < 24; ++i) {
      const bool is_dropped = r.attn_weights.at({0, 0, i, 11}) == 0.0f;
      (is_dropped ? dropped : kept) += 1;
      for (int64_t e = 0; e < 4; ++e) {
        const float x = r.output.at({0, 0, i, e});
        const double x64 = t.output[static_cast<size_t>(i * 4 + e)];
        if (is_dropped) {
          EXPECT_TRUE(std::isfinite(x)) << name_of(b) << " row " << i << " dropped key 11";
          EXPECT_TRUE(std::isfinite(x64)) << "f64 row " << i;
        } else {
          EXPECT_FALSE(std::isfinite(x)) << name_of(b) << " row " << i << " kept key 11: propagates";
        }
      }
    }
    EXPECT_GT(dropped, 0) << name_of(b);
    EXPECT_GT(kept, 0) << name_of(b);
  }
}

TEST(NumericsPolicy, NanKeyAtADroppedPositionStillMakesItsRowNaN) {
  // Dropout acts on the weights after the softmax and multiplies the dropped ones by 0 (as in
  // PyTorch), so a row whose softmax is NaN stays NaN whichever keys are dropped, even all of
  // them (p = 1): dropout excludes values, not keys. The LSE is NaN too.
  manual_seed(303);
  Tensor q = randn({1, 1, 12, 8}), k = randn({1, 1, 12, 8}), v = randn({1, 1, 12, 4});
  k.at({0, 0, 5, 2}) = std::nanf("");
  for (float p : {0.5f, 1.0f}) {
    SdpaOptions o;
    o.dropout_p = p;
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 78;
    o.need_lse = o.need_weights = true;
    const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
    for (double x : t.output) EXPECT_TRUE(std::isnan(x)) << "f64, p " << p;
    for (SdpaBackend b : kBackends) {
      const SdpaResult r = run(q, k, v, o, b);
      for (int64_t i = 0; i < 12; ++i) {
        EXPECT_TRUE(row_all(r.output, {0, 0, i}, nan)) << name_of(b) << " p " << p << " row " << i;
        EXPECT_TRUE(row_all(r.attn_weights, {0, 0, i}, nan)) << name_of(b) << " p " << p << " weights row " << i;
        EXPECT_TRUE(std::isnan(r.lse.at({0, 0, i}))) << name_of(b) << " p " << p << " lse row " << i;
      }
    }
  }
}

TEST(NumericsPolicy, BooleanMaskExcludesANanScoreButAdditiveMinusInfDoesNot) {
  // Boolean masks and is_causal exclude a position outright; an additive mask is added, and
  // NaN + -inf = NaN (as in PyTorch, where only a boolean mask is applied with masked_fill).
  manual_seed(304);
  Tensor q = randn({6, 8}), k = randn({6, 8}), v = randn({6, 3});
  k.at({4, 0}) = std::nanf("");  // key 4
  Tensor keep = Tensor::ones({6, 6}), add = Tensor::zeros({6, 6});
  for (int64_t i = 0; i < 6; ++i) {
    keep.at({i, 4}) = 0.0f;
    add.at({i, 4}) = -kInf;
  }
  SdpaOptions by_bool, by_add;
  by_bool.attn_mask = AttnMask::boolean(keep);
  by_add.attn_mask = AttnMask::additive(add);
  const reference::SdpaResultF64 t_bool = reference::scaled_dot_product_attention_f64(q, k, v, by_bool);
  const reference::SdpaResultF64 t_add = reference::scaled_dot_product_attention_f64(q, k, v, by_add);
  for (double x : t_bool.output) EXPECT_TRUE(std::isfinite(x));
  for (double x : t_add.output) EXPECT_TRUE(std::isnan(x));
  for (SdpaBackend b : kBackends) {
    const SdpaResult rb = run(q, k, v, by_bool, b), ra = run(q, k, v, by_add, b);
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_TRUE(row_all(rb.output, {i}, finite)) << name_of(b) << " boolean, row " << i;
      EXPECT_TRUE(row_all(ra.output, {i}, nan)) << name_of(b) << " additive, row " << i;
    }
  }
}

TEST(NumericsPolicy, WeightsThatUnderflowToZeroSkipNonFiniteValuesInFloat32) {
  // Key 1 scores 200 below key 0: exp(-200) is 0 in float32 on both backends, and a zero weight
  // never multiplies a value, so its NaN stays out (PyTorch's matmul would give 0 * NaN = NaN).
  // The float64 truth does not underflow there (exp(-200) = 1.4e-87) and propagates the NaN.
  Tensor q = Tensor::of({2, 1}, {1.0f, 1.0f}), k = Tensor::of({2, 1}, {0.0f, -200.0f});
  Tensor v = Tensor::of({2, 2}, {1.0f, 2.0f, std::nanf(""), -kInf});
  SdpaOptions o;
  o.scale = 1.0;
  o.need_weights = true;
  for (SdpaBackend b : kBackends) {
    const SdpaResult r = run(q, k, v, o, b);
    EXPECT_EQ(r.attn_weights.at({0, 1}), 0.0f) << name_of(b);
    EXPECT_EQ(r.output.at({0, 0}), 1.0f) << name_of(b);
    EXPECT_EQ(r.output.at({1, 1}), 2.0f) << name_of(b);
  }
  const reference::SdpaResultF64 t = reference::scaled_dot_product_attention_f64(q, k, v, o);
  EXPECT_TRUE(std::isnan(t.output[0]));
}

TEST(NumericsPolicy, DropoutProbabilityOneGivesZeroOutputAndWeightsNotNaN) {
  manual_seed(305);
  Tensor q = randn({1, 2, 9, 8}), k = randn({1, 2, 13, 8}), v = randn({1, 2, 13, 5});
  v.at({0, 1, 3, 2}) = kInf;  // dropped like everything else
  SdpaOptions o;
  o.dropout_p = 1.0f;
  o.need_weights = o.need_lse = true;
  SdpaOptions plain = o;
  plain.dropout_p = 0.0f;
  for (DropoutRng rng : {DropoutRng::kPhilox, DropoutRng::kTorch}) {
    o.dropout_rng = rng;
    for (SdpaBackend b : kBackends) {
      if (rng == DropoutRng::kTorch && b == SdpaBackend::kFused) continue;  // reference only
      const SdpaResult r = run(q, k, v, o, b);
      const SdpaResult p = run(q, k, v, plain, b);
      for (float x : r.output.to_vector()) ASSERT_EQ(x, 0.0f) << name_of(b);
      for (float x : r.attn_weights.to_vector()) ASSERT_EQ(x, 0.0f) << name_of(b);
      EXPECT_EQ(r.lse.to_vector(), p.lse.to_vector()) << name_of(b) << ": LSE is taken before dropout";
    }
  }
}

}  // namespace
}  // namespace attn

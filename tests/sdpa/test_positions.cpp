// SdpaOptions::query_pos_offset / key_pos_offset: a slice of a longer sequence, computed with its
// global positions, is exactly its part of the whole call. This is what context parallelism
// (attn::dist) rests on, so it is checked here on one process, on every kernel:
//   1. the weights of a (query slice, key slice) call, renormalised by the LSEs, are the whole
//      call's weights there (causal, window, ALiBi and Philox dropout all see global positions);
//   2. key slices merged through their LSEs give the whole call's output rows;
//   3. backward calls over (query slice, key slice) pairs, fed the whole forward's output and
//      LSE, sum to the whole call's gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

constexpr int64_t kB = 1, kH = 2, kN = 61, kE = 16;

struct Problem {
  Tensor q, k, v, dout, slopes;
  SdpaOptions options(bool dropout) const {
    SdpaOptions o;
    o.is_causal = true;
    o.window_size = {20, 3};
    o.softcap = 4.0;
    o.alibi_slopes = slopes;
    if (dropout) {
      o.dropout_p = 0.25f;
      o.dropout_rng = DropoutRng::kPhilox;
      o.dropout_seed = 77;
      o.dropout_offset = 5;
    }
    return o;
  }
};

Problem make_problem() {
  manual_seed(17);
  Problem p{randn({kB, kH, kN, kE}), randn({kB, kH, kN, kE}), randn({kB, kH, kN, kE}),
            randn({kB, kH, kN, kE}), Tensor::empty({kH})};
  p.slopes.data()[0] = 0.3f, p.slopes.data()[1] = 0.05f;
  return p;
}

TensorView rows(const TensorView& t, std::pair<int64_t, int64_t> r) { return t.slice(2, r.first, r.second); }

std::vector<std::string> kernels_for(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const SdpaOptions& o) {
  std::vector<std::string> ks;
  for (const std::string& name : test::runnable_fused_kernels()) {
    if (!test::decode_refuses(name, Tensor(q.contiguous()), Tensor(k.contiguous()), Tensor(v.contiguous()), o)) {
      ks.push_back(name);
    }
  }
  ks.push_back("reference");
  return ks;
}

// Merges a slice call's (output, LSE) of n query rows into float64 (acc, lse) through the LSEs.
void merge_into(std::vector<double>& acc, std::vector<double>& lse, int64_t n, const SdpaResult& r) {
  for (int64_t h = 0; h < kH; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      double& m = lse[static_cast<size_t>(h * n + i)];
      const double l = r.lse.at({0, h, i});
      if (l == -INFINITY) continue;
      const double merged = m == -INFINITY ? l : std::max(m, l) + std::log1p(std::exp(-std::fabs(m - l)));
      const double a = m == -INFINITY ? 0.0 : std::exp(m - merged), b = std::exp(l - merged);
      for (int64_t e = 0; e < kE; ++e) {
        double& x = acc[static_cast<size_t>((h * n + i) * kE + e)];
        x = x * a + r.output.at({0, h, i, e}) * b;
      }
      m = merged;
    }
  }
}

TEST(PositionOffsets, SliceWeightsRenormalisedAreTheWholeCallsWeights) {
  const Problem pr = make_problem();
  for (bool dropout : {false, true}) {
    SdpaOptions whole = pr.options(dropout);
    whole.kernel = "reference";
    whole.need_weights = whole.need_lse = true;
    const SdpaResult w = scaled_dot_product_attention(pr.q, pr.k, pr.v, whole);
    const std::pair<int64_t, int64_t> qs{23, 40}, ks{9, 37};
    SdpaOptions o = whole;
    o.query_pos_offset = qs.first;
    o.key_pos_offset = ks.first;
    const SdpaResult s = scaled_dot_product_attention(rows(pr.q, qs), rows(pr.k, ks), rows(pr.v, ks), o);
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t i = 0; i < qs.second - qs.first; ++i) {
        const float ls = s.lse.at({0, h, i}), lw = w.lse.at({0, h, qs.first + i});
        for (int64_t j = 0; j < ks.second - ks.first; ++j) {
          const float got = ls == -INFINITY ? 0.0f : s.attn_weights.at({0, h, i, j}) * std::exp(ls - lw);
          ASSERT_NEAR(got, w.attn_weights.at({0, h, qs.first + i, ks.first + j}), 1e-6f)
              << "dropout " << dropout << " head " << h << " row " << i << " key " << j;
        }
      }
    }
  }
}

TEST(PositionOffsets, KeySlicesMergedThroughTheirLseAreTheWholeCallOnEveryKernel) {
  const Problem pr = make_problem();
  const std::vector<std::pair<int64_t, int64_t>> key_slices = {{0, 20}, {20, 41}, {41, kN}};
  // 13 query rows: short enough for the decode kernels too (when there is no dropout).
  const std::pair<int64_t, int64_t> qs{23, 36};
  for (bool dropout : {false, true}) {
    SdpaOptions whole = pr.options(dropout);
    whole.kernel = "reference";
    const Tensor want = scaled_dot_product_attention(pr.q, pr.k, pr.v, whole).output;
    SdpaOptions probe = pr.options(dropout);
    probe.query_pos_offset = qs.first;
    for (const std::string& kernel : kernels_for(rows(pr.q, qs), pr.k, pr.v, probe)) {
      const int64_t n = qs.second - qs.first;
      std::vector<double> acc(static_cast<size_t>(kH * n * kE), 0.0);
      std::vector<double> lse(static_cast<size_t>(kH * n), -INFINITY);
      for (const auto& ks : key_slices) {
        SdpaOptions o = pr.options(dropout);
        o.kernel = kernel;
        o.need_lse = true;
        o.query_pos_offset = qs.first;
        o.key_pos_offset = ks.first;
        const SdpaResult r = scaled_dot_product_attention(rows(pr.q, qs), rows(pr.k, ks), rows(pr.v, ks), o);
        merge_into(acc, lse, n, r);
      }
      for (int64_t h = 0; h < kH; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t e = 0; e < kE; ++e) {
            ASSERT_NEAR(acc[static_cast<size_t>((h * n + i) * kE + e)], want.at({0, h, qs.first + i, e}), 2e-5)
                << kernel << " dropout " << dropout << " head " << h << " row " << i;
          }
        }
      }
    }
  }
}

// Every (query slice, key slice) pair of a zigzag split over 3 ranks (chunks of 8 and 7 tokens),
// the key slice before, around or after the query slice, causal or with a two-sided window:
// merged through their LSEs they give the whole call, on every kernel that takes the block.
TEST(PositionOffsets, ZigzagSlicePairsMergeToTheWholeCallOnEveryKernel) {
  constexpr int64_t kL = 43;
  manual_seed(5);
  const Tensor q = randn({1, kH, kL, kE}), k = randn({1, kH, kL, kE}), v = randn({1, kH, kL, kE});
  const Problem pr = make_problem();
  const std::vector<std::pair<int64_t, int64_t>> chunks = {{0, 8}, {8, 15}, {15, 22}, {22, 29}, {29, 36}, {36, 43}};
  for (bool causal : {false, true}) {
    SdpaOptions whole = pr.options(false);
    whole.is_causal = causal;
    whole.window_size = {11, causal ? 0 : 5};
    whole.kernel = "reference";
    const Tensor want = scaled_dot_product_attention(q, k, v, whole).output;
    // Query slices as the ring cuts them (pieces of at most 5 rows): 1 to 5 rows, so the decode
    // kernels take them too.
    std::vector<std::pair<int64_t, int64_t>> q_slices;
    for (const auto& c : chunks) {
      for (int64_t b = c.first; b < c.second; b += 5) q_slices.emplace_back(b, std::min(b + 5, c.second));
    }
    for (const auto& qs : q_slices) {
      SdpaOptions probe = whole;
      probe.kernel = SdpaOptions{}.kernel;
      probe.query_pos_offset = qs.first;
      for (const std::string& kernel : kernels_for(rows(q, qs), k, v, probe)) {
        const int64_t n = qs.second - qs.first;
        std::vector<double> acc(static_cast<size_t>(kH * n * kE), 0.0), lse(static_cast<size_t>(kH * n), -INFINITY);
        for (const auto& ks : chunks) {
          SdpaOptions o = whole;
          o.kernel = kernel;
          o.need_lse = true;
          o.query_pos_offset = qs.first;
          o.key_pos_offset = ks.first;
          const SdpaResult r = scaled_dot_product_attention(rows(q, qs), rows(k, ks), rows(v, ks), o);
          merge_into(acc, lse, n, r);
        }
        for (int64_t h = 0; h < kH; ++h) {
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t e = 0; e < kE; ++e) {
              ASSERT_NEAR(acc[static_cast<size_t>((h * n + i) * kE + e)], want.at({0, h, qs.first + i, e}), 2e-5)
                  << kernel << " causal " << causal << " query slice [" << qs.first << ", " << qs.second << ") head " << h
                  << " row " << i;
            }
          }
        }
      }
    }
  }
}

TEST(PositionOffsets, BackwardOverSlicePairsSumsToTheWholeCallsGradients) {
  const Problem pr = make_problem();
  const std::vector<std::pair<int64_t, int64_t>> q_slices = {{0, 30}, {30, kN}}, k_slices = {{0, 25}, {25, kN}};
  for (bool dropout : {false, true}) {
    SdpaOptions whole = pr.options(dropout);
    whole.kernel = "reference";
    whole.need_lse = true;
    const SdpaResult fwd = scaled_dot_product_attention(pr.q, pr.k, pr.v, whole);
    const SdpaGrads want = scaled_dot_product_attention_backward(pr.dout, pr.q, pr.k, pr.v, fwd, whole);
    std::vector<std::string> kernels = test::runnable_kernels_named("cpu.flash.");
    std::erase_if(kernels, [](const std::string& k) { return k.find("bf16") != std::string::npos; });
    kernels.push_back("reference");
    for (const std::string& kernel : kernels) {
      Tensor dq = Tensor::zeros(pr.q.shape()), dk = Tensor::zeros(pr.k.shape()), dv = Tensor::zeros(pr.v.shape());
      for (const auto& qs : q_slices) {
        for (const auto& ks : k_slices) {
          SdpaOptions o = pr.options(dropout);
          o.kernel = kernel;
          o.query_pos_offset = qs.first;
          o.key_pos_offset = ks.first;
          const SdpaSaved saved(fwd.output.slice(2, qs.first, qs.second), fwd.lse.slice(2, qs.first, qs.second));
          const SdpaGrads g = scaled_dot_product_attention_backward(
              rows(pr.dout, qs), rows(pr.q, qs), rows(pr.k, ks), rows(pr.v, ks), saved, o);
          const auto add = [](const Tensor& into, std::pair<int64_t, int64_t> r, const Tensor& part) {
            for (int64_t h = 0; h < kH; ++h) {
              for (int64_t i = r.first; i < r.second; ++i) {
                for (int64_t e = 0; e < kE; ++e) into.at({0, h, i, e}) += part.at({0, h, i - r.first, e});
              }
            }
          };
          add(dq, qs, g.grad_query);
          add(dk, ks, g.grad_key);
          add(dv, ks, g.grad_value);
        }
      }
      const std::pair<const Tensor*, const Tensor*> pairs[] = {{&dq, &want.grad_query}, {&dk, &want.grad_key}, {&dv, &want.grad_value}};
      for (const auto& [got, ref] : pairs) {
        const std::vector<float> a = got->to_vector(), b = ref->to_vector();
        for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 5e-5) << kernel << " dropout " << dropout << " at " << i;
      }
    }
  }
}

TEST(PositionOffsets, OffsetsOnlyMoveTheBandSoZeroOffsetsChangeNothing) {
  const Problem pr = make_problem();
  SdpaOptions a = pr.options(true), b = pr.options(true);
  b.query_pos_offset = b.key_pos_offset = 1000;  // equal shifts: same relative positions, other dropout mask
  const Tensor x = scaled_dot_product_attention(pr.q, pr.k, pr.v, a).output;
  const Tensor y = scaled_dot_product_attention(pr.q, pr.k, pr.v, b).output;
  SdpaOptions c = b;
  c.dropout_p = 0.0f;
  SdpaOptions d = pr.options(false);
  EXPECT_NE(x.to_vector(), y.to_vector()) << "the dropout mask must follow the global positions";
  EXPECT_EQ(scaled_dot_product_attention(pr.q, pr.k, pr.v, c).output.to_vector(),
            scaled_dot_product_attention(pr.q, pr.k, pr.v, d).output.to_vector());
}

TEST(PositionOffsets, BadOffsetsAreValueErrorsNamingTheOption) {
  const Problem pr = make_problem();
  const auto expect = [&](SdpaOptions o, const std::string& what) {
    try {
      (void)scaled_dot_product_attention(pr.q, pr.k, pr.v, o);
      FAIL() << "no error for " << what;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  SdpaOptions o;
  o.query_pos_offset = -1;
  expect(o, "query_pos_offset must be >= 0");
  o = {};
  o.key_pos_offset = (int64_t{1} << 32) - kN + 1;
  expect(o, "key_pos_offset");
}

}  // namespace
}  // namespace attn

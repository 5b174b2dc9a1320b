// Gradient checking: central finite differences of float64 computations, compared with the
// float32 analytic gradients of the backward functions.
//
// Tolerance (kGradTol, applied as |analytic - fd| <= kGradTol * (1 + |fd|)):
//  * the finite difference is of a float64 function with h = 1e-6: truncation error
//    h^2 / 6 * |f'''| ~ 1e-12 for the O(1)..O(10) inputs the tests use, rounding error
//    ~ eps64 * |L| / h ~ 2.2e-16 * 1e2 / 1e-6 ~ 2e-8; so the reference is good to ~1e-7;
//  * the analytic gradient is float32: each element comes from at most K ~ 64 rounded
//    operations on values of magnitude <= ~10, bounded by K * u * sum|terms| with
//    u = 2^-24 ~ 6e-8, i.e. ~ 64 * 6e-8 * 10 ~ 4e-5 in the worst case (typically sqrt(K) * u).
//  Measured: the worst scaled error of any op or module FD test here is 2e-7, so 1e-4 sits
//  above the worst-case bound and 500x above what is observed, while a wrong formula (a missing term,
//  a wrong sign, an off-by-one index, a forgotten scale) errs by O(1e-2..1) and fails; the
//  test GradCheck.DetectsAGradientWrongByOnePerMille shows the check is that sharp.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::test {

inline constexpr double kGradTol = 1e-4;

using F64 = std::vector<double>;

inline F64 to_f64(const TensorView& t) {
  const std::vector<float> v = t.to_vector();
  return F64(v.begin(), v.end());
}

// dL/d(args[which]) by central differences: (L(a + h e_i) - L(a - h e_i)) / 2h per element.
inline F64 finite_diff(const std::function<double(const std::vector<F64>&)>& loss,
                       std::vector<F64> args, size_t which, double h = 1e-6) {
  F64 grad(args[which].size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const double saved = args[which][i];
    args[which][i] = saved + h;
    const double up = loss(args);
    args[which][i] = saved - h;
    const double down = loss(args);
    args[which][i] = saved;
    grad[i] = (up - down) / (2.0 * h);
  }
  return grad;
}

// sum(out * r): the scalar loss whose gradient with respect to out is r.
inline double weighted_sum(const F64& out, const F64& r) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * r[i];
  return s;
}

// |analytic - expected| <= tol * (1 + |expected|) everywhere; reports the worst element.
inline ::testing::AssertionResult grads_close(const std::string& what, const std::vector<float>& analytic,
                                              const F64& expected, double tol = kGradTol) {
  if (analytic.size() != expected.size()) {
    return ::testing::AssertionFailure() << what << ": " << analytic.size() << " elements, expected "
                                         << expected.size();
  }
  double worst = 0.0;
  size_t worst_i = 0, bad = 0;
  for (size_t i = 0; i < analytic.size(); ++i) {
    const double excess = std::abs(analytic[i] - expected[i]) / (1.0 + std::abs(expected[i]));
    if (!(excess <= tol)) ++bad;
    if (!(excess <= worst)) {
      worst = excess;
      worst_i = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << analytic.size() << " elements outside " << tol
         << "; worst at [" << worst_i << "]: got " << analytic[worst_i] << " want "
         << expected[worst_i] << " (scaled error " << worst << ")";
}

}  // namespace attn::test

#!/usr/bin/env python3
"""Fits the polynomial of the float32 kernels' exp2v (src/sdpa/cpu/flash_kernel.hpp).

2^f on [-0.5, 0.5] is written 1 + f g(f) so that f = 0 gives exactly 1; g, degree 5, fits
(2^f - 1) / f weighted by f / 2^f, i.e. for the relative error of 2^f, by least squares whose
weights are raised where the error peaks (a Lawson-style iteration towards the minimax fit).
Prints the coefficients rounded to float32 (highest degree first, as the kernel's Horner
steps use them), the fit's relative error in float64 and the error of float32 Horner evaluation
with fused multiply-adds against float64's exp2, in units of the result's last place.
Needs numpy. Usage: python3 scripts/exp2_fit.py
"""
import math

import numpy as np

DEG = 6  # of 2^f = 1 + f g(f); g has DEG coefficients


def target(x):
    return math.expm1(x * math.log(2.0)) / x if x != 0.0 else math.log(2.0)


def fit():
    n = 4000
    xs = np.cos(np.pi * (np.arange(n) + 0.5) / n) * 0.5  # Chebyshev nodes on [-0.5, 0.5]
    t = np.array([target(x) for x in xs])
    w = np.abs(xs) / np.exp2(xs)  # relative error of 1 + f g(f)
    a = np.vstack([xs**k for k in range(DEG)]).T
    lawson = np.ones_like(xs)
    for _ in range(60):
        c, *_ = np.linalg.lstsq(a * (w * lawson)[:, None], t * w * lawson, rcond=None)
        err = (a @ c - t) * w
        lawson *= (np.abs(err) / np.abs(err).max()) ** 0.3 + 1e-3
        lawson /= lawson.max()
    return c, np.abs(err).max()


def horner_f32(c32, f):
    # float32 Horner with FMA: the float64 product-sum of float32 values, rounded once.
    g = np.full_like(f, c32[-1])
    for k in range(DEG - 2, -1, -1):
        g = (g.astype(np.float64) * f + np.float64(c32[k])).astype(np.float32)
    return (g.astype(np.float64) * f + 1.0).astype(np.float32)


def main():
    c, fit_err = fit()
    c32 = [np.float32(v) for v in c]
    f = np.linspace(-0.5, 0.5, 400001).astype(np.float32)
    p = horner_f32(c32, f).astype(np.float64)
    exact = np.exp2(f.astype(np.float64))
    ulp = np.ldexp(1.0, np.floor(np.log2(exact)).astype(int) - 23)
    print(f"fit relative error (float64): {fit_err:.3e}")
    print(f"float32 Horner, worst error on [-0.5, 0.5]: {np.max(np.abs(p - exact) / ulp):.3f} ulp")
    print("coefficients of g, highest degree first:")
    for v in reversed(c32):
        print(f"  {float(v)!r}f")


if __name__ == "__main__":
    main()

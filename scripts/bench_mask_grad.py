#!/usr/bin/env python3
"""A learned attention bias (a float attn_mask that requires grad, T5's relative positions,
Swin's): forward + backward through torch.nn.functional.scaled_dot_product_attention, PyTorch's
own against attn's (attn.torch.patch()), and attn's with the bias detached (what the mask's
gradient costs attn).

PyTorch's CPU SDPA runs its math backend for a mask that requires grad (its flash kernel
computes no mask gradient); attn runs its fused backward with SdpaOptions::need_attn_mask_grad.
Shapes: B=1, H=12, E=64, a (1, H, T, T) bias, T in --seq; float32 and bfloat16. The three calls
are interleaved for --reps rounds; each figure is the median of its rounds, and the ratios are
of medians measured in the same run.

Run it alone on the machine (two cores: anything else running skews every ratio):

    .cache/torch-venv/bin/python scripts/bench_mask_grad.py            # T 512, 1024, 2048
    .cache/torch-venv/bin/python scripts/bench_mask_grad.py --seq 256 --reps 3

--backward-kernels K1,K2 times the backward alone instead (the forward run once, outside the
timing), on each named attn kernel forced, with and without the bias's gradient, interleaved:

    .cache/torch-venv/bin/python scripts/bench_mask_grad.py --seq 1024 --reps 15 \
        --dtype bfloat16 --backward-kernels cpu.flash.avx512_bf16,cpu.flash.avx512

Needs torch >= 2.4 in that venv and attn installed there (pip install .).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attn.torch as at


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def step(q, k, v, bias, g):
    out = F.scaled_dot_product_attention(q, k, v, bias)
    want = (q, k, v, bias) if bias.requires_grad else (q, k, v)
    torch.autograd.grad(out, want, g)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--backward-kernels", default="",
                    help="comma-separated attn kernels: time the backward alone on each")
    ap.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                    help="with --backward-kernels: the dtype (default: both)")
    args = ap.parse_args()
    if args.backward_kernels:
        backward_only(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU: {cpu_model()}")
    print("| dtype | T | PyTorch (math) ms | attn ms | attn, bias detached ms | PyTorch / attn | "
          "attn's mask-gradient overhead |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for T in args.seq:
            gen = torch.Generator().manual_seed(T)
            shape = (1, args.heads, T, args.dim)
            q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
            bias = torch.randn(1, args.heads, T, T, generator=gen).to(dtype).requires_grad_()
            g = torch.randn(shape, generator=gen).to(dtype)
            fixed = bias.detach()
            calls = {
                "torch": lambda: step(q, k, v, bias, g),
                "attn": lambda: _patched(q, k, v, bias, g),
                "detached": lambda: _patched(q, k, v, fixed, g),
            }
            for fn in calls.values():  # warm-up (and a check that attn ran without falling back)
                fn()
            times = {name: [] for name in calls}
            for _ in range(args.reps):
                for name, fn in calls.items():
                    times[name].append(timed(fn))
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {str(dtype).replace('torch.', '')} | {T} | {med['torch']:.1f} | {med['attn']:.1f} | "
                  f"{med['detached']:.1f} | {med['torch'] / med['attn']:.2f}x | "
                  f"{med['attn'] / med['detached']:.2f}x |", flush=True)


def backward_only(args) -> None:
    kernels = args.backward_kernels.split(",")
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU: {cpu_model()}")
    print("| dtype | T | kernel | backward ms, bias requires grad | backward ms, detached | overhead |")
    print("|---|---|---|---|---|---|")
    for dtype in dtypes:
        for T in args.seq:
            gen = torch.Generator().manual_seed(T)
            shape = (1, args.heads, T, args.dim)
            q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
            bias = torch.randn(1, args.heads, T, T, generator=gen).to(dtype)
            g = torch.randn(shape, generator=gen).to(dtype)

            def run(kernel, need):
                b = bias.detach().requires_grad_(need)
                out = at.scaled_dot_product_attention(q, k, v, b, kernel=kernel)
                return timed(lambda: torch.autograd.grad(out, (q, k, v, b) if need else (q, k, v), g))

            configs = [(kernel, need) for kernel in kernels for need in (True, False)]
            for c in configs:
                run(*c)
            times = {c: [] for c in configs}
            for _ in range(args.reps):
                for c in configs:
                    times[c].append(run(*c))
            for kernel in kernels:
                with_g = statistics.median(times[(kernel, True)])
                without = statistics.median(times[(kernel, False)])
                print(f"| {str(dtype).replace('torch.', '')} | {T} | {kernel} | {with_g:.1f} | {without:.1f} | "
                      f"{with_g / without:.2f}x |", flush=True)


def _patched(q, k, v, bias, g):
    at.reset_call_counts()
    with at.patch():
        step(q, k, v, bias, g)
    counts = at.call_counts()
    assert counts["fallback"] == 0 and counts["sdpa_backward"] == 1, counts


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""attn against PyTorch's CPU SDPA call by call, in one process, on the standard shapes.

scripts/bench_suite.py times attn (`attn bench`) and PyTorch (a fresh Python process) one after
the other: on a shared host whose speed moves between stretches of seconds (on the AMD Zen 3 of
docs/PERFORMANCE-amd-zen3.md the same call's time switched between ~40 and ~55 ms within one run
while an FMA probe did not move), its "vs torch" can be off by a third either way. Here the two
calls alternate (attn, torch, attn, torch, ...) on the same tensors in one process, and each row
reports the median of the per-pair time ratios with its quartiles: a slow stretch slows both
calls of a pair.

attn runs through attn.torch.scaled_dot_product_attention (zero-copy on torch tensors, the same
kernels as `attn bench`), PyTorch through torch.nn.functional.scaled_dot_product_attention, both
on --threads threads (torch.set_num_threads; attn.torch follows it). Forward: under
torch.inference_mode(). Backward: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
after one forward of each, i.e. the backward alone. Inputs: random normal (B=1, H=12, L, E), S = L,
drawn in float32 and rounded to the dtype.

    .cache/bench-venv/bin/python scripts/bench_pairs.py                  # standard shapes, f32
    .cache/bench-venv/bin/python scripts/bench_pairs.py --dtypes float32,bfloat16 --pairs 9
    .cache/bench-venv/bin/python scripts/bench_pairs.py --quick          # L 256, 3 pairs

Prints a Markdown table (torch ms / attn ms: above 1x attn is faster). Needs torch and attn
installed in the interpreter's environment (pip install . in the venv). Run it alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attn.torch as at


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def pair_row(L: int, E: int, causal: bool, backward: bool, dtype: torch.dtype, pairs: int) -> dict:
    g = torch.Generator().manual_seed(L * 1000 + E * 10 + causal)
    shape = (1, 12, L, E)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    calls = {"attn": at.scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
    if backward:
        dout = torch.randn(shape, generator=g).to(dtype)
        runs = {}
        for name, f in calls.items():
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
            out = f(qq, kk, vv, is_causal=causal)
            runs[name] = (lambda out=out, qq=qq, kk=kk, vv=vv:
                          torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True))
    else:
        def fwd(f):
            def run():
                with torch.inference_mode():
                    f(q, k, v, is_causal=causal)
            return run
        runs = {name: fwd(f) for name, f in calls.items()}
    for run in runs.values():  # warm-up
        run()
    times = {"attn": [], "torch": []}
    for i in range(pairs):
        order = ("attn", "torch") if i % 2 == 0 else ("torch", "attn")  # neither always goes first
        for name in order:
            times[name].append(timed(runs[name]))
    ratios = [t / a for t, a in zip(times["torch"], times["attn"])]
    return {"attn_ms": statistics.median(times["attn"]), "torch_ms": statistics.median(times["torch"]),
            "ratio": quartiles(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seqs = (256,) if args.quick else (1024, 4096)
    pairs = 3 if args.quick else args.pairs
    print(f"torch {torch.__version__}, {args.threads} threads, {pairs} pairs per row, "
          "B=1 H=12 S=L; torch / attn per pair: median (quartiles)\n")
    print("| pass | dtype | L | E | causal | attn ms | torch ms | torch / attn |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    ratios = []
    for backward in (False, True):
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            for L in seqs:
                for E in (64, 128):
                    for causal in (False, True):
                        r = pair_row(L, E, causal, backward, dtype, pairs)
                        lo, med, hi = r["ratio"]
                        ratios.append(med)
                        print(f"| {'backward' if backward else 'forward'} | {name} | {L} | {E} | "
                              f"{'yes' if causal else 'no'} | {r['attn_ms']:.2f} | {r['torch_ms']:.2f} | "
                              f"{med:.2f}x ({lo:.2f}-{hi:.2f}) |", flush=True)
    print(f"\ngeometric mean of the rows' medians: {statistics.geometric_mean(ratios):.2f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Runs attn's standard attention benchmark suite and writes docs/PERFORMANCE.md.

For every configuration (B=1, H=12, L in {512..8192}, E in {64, 128}, causal or not, 1 and 2
threads; the backward pass for L in {1024, 2048, 4096}) it times, one after the other:
  * `attn bench --impl fused --json` and `attn bench --impl reference --json` (the reference
    only up to --reference-max-seq: it materialises H * L * L floats of scores);
  * PyTorch's torch.nn.functional.scaled_dot_product_attention on the CPU, same shapes and
    thread count, in a fresh Python process per configuration so its peak RSS is its own.
Backward rows time `attn bench --backward` and torch.autograd.grad of PyTorch's SDPA output
(after one forward whose graph is kept), i.e. the backward alone, FLOPs counted as 2.5x the
forward's (FlashAttention's convention).
PyTorch comes from PyPI into a virtual environment under .cache/bench-venv, created on first
use. The FMA peak is measured by `attn bench --peak-only` (and again inside every attn run, whose
own figure gives its "% of peak"). On a shared machine the peak measured just before each run
also tells whether another process had the cores: such a run is retried once, then marked `*`.

    scripts/bench_suite.py            # full suite -> docs/PERFORMANCE.md (about 20-25 minutes)
    scripts/bench_suite.py --quick    # a few small shapes, table on stdout only (smoke test)
    scripts/bench_suite.py --standard --dtypes f32,bf16,f16 --threads 2 --reference-max-seq 0
                                      # the standard shapes (B=1, H=12, L in {1024, 4096},
                                      # E in {64, 128}, causal and not, forward and backward)
                                      # in every dtype against PyTorch's same dtype

--dtypes runs each configuration with q, k, v in each dtype (`attn bench --dtype`, and PyTorch's
tensors converted to torch.bfloat16 / torch.float16); the reference runs in float32 only. The
pseudo-dtype bf16r is bf16 with `attn bench --allow-fp16-bf16-reduction` (FlashAttention's and
PyTorch's CPU flash kernel's numerics, docs/NUMERICS.md; PyTorch's side is its plain bf16), on the
backward rows only: the option changes nothing in the forward.

    scripts/bench_suite.py --decode   # decoding shapes (issue 14) -> the "Decode" section of
                                      # docs/PERFORMANCE.md (the rest of the file is kept)

--decode times one new token (L=1, and one 16-token row, causal bottom-right) against S cached keys:
B in {1, 8}, H_q=32, H_kv in {8, 32}, E in {128, 64}, S in {1024, 8192, 32768}, K/V in each of
--dtypes (default f32,bf16,f16; q in float32, or in the K/V dtype where attn takes no mixed call;
and the target shape B=1 H_kv=8 E=128 S=8192 once more with q in bf16 against the bf16 K/V),
2 threads unless --threads. `attn bench` reports GB/s of K/V read (B*H_kv*S*2E*sizeof, each kv head
once) against the read bandwidth its probe measures in the same run; PyTorch's SDPA (enable_gqa,
bottom-right causal as an explicit boolean mask, q in the K/V dtype as it takes no mixed dtypes)
rotates among as many K/V copies as attn so both read K/V from memory. Shapes whose K/V copy
exceeds --decode-max-gib (6) are skipped and listed. ggml's figures: scripts/bench_ggml.sh.

Exit status: 0 if every run succeeded, 1 if some run failed (the table marks it and still gets
written), 2 for usage errors or a missing attn binary.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH, HEADS = 1, 12
FULL_SEQS = (512, 1024, 2048, 4096, 8192)
FULL_DIMS = (64, 128)
# (timed repeats, warmup runs) per sequence length: fewer at large L keeps the suite short.
FULL_REPEATS = {512: (10, 2), 1024: (10, 2), 2048: (5, 1), 4096: (3, 1), 8192: (2, 1)}
QUICK_SHAPES = ((512, 64, False), (512, 64, True), (1024, 64, False), (1024, 128, True))
BACKWARD_SEQS = (1024, 2048, 4096)
# The reference backward takes ~10 s per call at L=4096: fewer runs keep the suite short.
BACKWARD_REPEATS = {1024: (5, 1), 2048: (3, 1), 4096: (2, 1)}
QUICK_BACKWARD_SHAPES = ((512, 64, True),)
QUICK_REPEATS = (3, 1)
RUN_TIMEOUT_S = 900
# A run whose own FMA peak is below this fraction of the best one seen for its thread count shared
# the cores with something else: it is retried (--retries) and, if it stays so, marked.
BUSY_PEAK_FRACTION = 0.9
# FMA throughput scales with physical cores: N threads on N free cores reach at least this share of
# N times the 1-thread peak (all-core clocks are a little lower), which also catches a suite that
# never saw the N-thread peak (a core busy throughout).
CORE_SCALING = 0.9


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- PyTorch -------------------------------------------------------------------------------------

def torch_worker(spec: dict) -> None:
    """Runs in the venv's Python: times one configuration and prints one JSON object."""
    import resource
    import warnings

    warnings.filterwarnings("ignore", message=".*NumPy.*")  # torch works without numpy
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(spec["threads"])
    if spec.get("decode"):
        print(json.dumps(torch_decode(torch, F, spec)))
        return
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, l, s, e = (spec[k] for k in ("batch", "heads", "kv_heads", "seq", "seq_kv", "dim"))
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "bf16r": torch.bfloat16,
             "f16": torch.float16}[spec.get("dtype", "f32")]
    q = torch.randn((b, h, l, e), generator=gen).to(dtype)
    k = torch.randn((b, hkv, s, e), generator=gen).to(dtype)
    v = torch.randn((b, hkv, s, e), generator=gen).to(dtype)
    kwargs = {"is_causal": spec["causal"]}
    if hkv != h:
        kwargs["enable_gqa"] = True
    times = []
    if spec.get("backward"):
        # The backward alone: one forward keeps its graph, then dQ, dK, dV are taken again and again.
        for t in (q, k, v):
            t.requires_grad_(True)
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        dout = torch.randn(out.shape, generator=gen).to(dtype)
        for i in range(spec["warmup"] + spec["repeats"]):
            start = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            if i >= spec["warmup"]:
                times.append((time.perf_counter() - start) * 1e3)
    else:
        with torch.inference_mode():
            for _ in range(spec["warmup"]):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
            for _ in range(spec["repeats"]):
                start = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, **kwargs)
                times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "torch_version": torch.__version__,
        "times_ms": times,
    }))


def torch_decode(torch, F, spec: dict) -> dict:
    """A decode configuration in PyTorch, timed as `attn bench` times it: calls rotating among
    spec["copies"] copies of K/V (each rolled, so no two share a page's contents), then warm calls
    on copy 0. q is in the K/V dtype (torch's SDPA takes no mixed dtypes)."""
    import resource

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, l, s, e = (spec[k] for k in ("batch", "heads", "kv_heads", "seq", "seq_kv", "dim"))
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[spec["kv_dtype"]]
    q = torch.randn((b, h, l, e), generator=gen).to(dtype)
    ks = [torch.randn((b, hkv, s, e), generator=gen).to(dtype)]
    vs = [torch.randn((b, hkv, s, e), generator=gen).to(dtype)]
    for i in range(1, spec["copies"]):
        ks.append(torch.roll(ks[0].flatten(), i * 4099).view(ks[0].shape))
        vs.append(torch.roll(vs[0].flatten(), i * 4099).view(vs[0].shape))
    kwargs = {}
    if hkv != h:
        kwargs["enable_gqa"] = True
    if spec["causal"]:
        if spec.get("causal_align") == "bottom-right":
            # query i sees keys j <= i + S - L (torch.nn.attention.bias.causal_lower_right)
            kwargs["attn_mask"] = torch.ones((l, s), dtype=torch.bool).tril(diagonal=s - l)
        else:
            kwargs["is_causal"] = True

    def timed(i: int) -> float:
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, ks[i % len(ks)], vs[i % len(vs)], **kwargs)
        return (time.perf_counter() - start) * 1e3

    with torch.inference_mode():
        calls = 0
        for _ in range(spec["warmup"]):
            timed(calls)
            calls += 1
        times = []
        for _ in range(spec["repeats"]):
            times.append(timed(calls))
            calls += 1
        timed(0)
        warm = [timed(0) for _ in range(spec["repeats"])]
    kv_bytes = spec["kv_bytes"]
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "kv_gbps": kv_bytes / (statistics.median(times) * 1e-3) * 1e-9,
        "warm_median_ms": statistics.median(warm),
        "warm_kv_gbps": kv_bytes / (statistics.median(warm) * 1e-3) * 1e-9,
        "copies": len(ks),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "torch_version": torch.__version__,
        "times_ms": times,
        "warm_times_ms": warm,
    }


def ensure_torch(venv: Path) -> tuple[Path, str]:
    """The venv's python with torch importable (installing it from PyPI if needed), and torch's
    version."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import warnings; warnings.simplefilter('ignore'); "
             "import torch; print(torch.__version__)"]
    if python.exists():
        r = subprocess.run(probe, capture_output=True, text=True)
        if r.returncode == 0:
            return python, r.stdout.strip()
    log(f"bench_suite: installing torch from PyPI into {venv} (a few GB; takes minutes) ...")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "torch"], check=True)
    r = subprocess.run(probe, capture_output=True, text=True, check=True)
    log(f"bench_suite: torch {r.stdout.strip()} installed in {time.monotonic() - start:.0f} s")
    return python, r.stdout.strip()


# ---- runs ----------------------------------------------------------------------------------------

def run_json(cmd: list[str]) -> dict:
    """Runs a command that prints one JSON object last; {"error": ...} if it fails."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RUN_TIMEOUT_S} s"}
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {r.returncode}"}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"unreadable output: {r.stdout.strip()[:200]!r}"}


def run_attn(attn: Path, impl: str, cfg: dict) -> dict:
    cmd = [str(attn), "bench", "--json", "--impl", impl, "--batch", str(cfg["batch"]),
           "--heads", str(cfg["heads"]), "--kv-heads", str(cfg["kv_heads"]),
           "--seq", str(cfg["seq"]), "--seq-kv", str(cfg["seq_kv"]), "--dim", str(cfg["dim"]),
           "--threads", str(cfg["threads"]), "--repeats", str(cfg["repeats"]),
           "--warmup", str(cfg["warmup"])]
    dtype = cfg.get("dtype", "f32")
    cmd += ["--dtype", "bf16", "--allow-fp16-bf16-reduction"] if dtype == "bf16r" else ["--dtype", dtype]
    if "kv_dtype" in cfg:
        cmd += ["--kv-dtype", cfg["kv_dtype"]]
    if cfg["causal"]:
        cmd.append("--causal")
        if cfg.get("causal_align", "top-left") != "top-left":
            cmd += ["--causal-align", cfg["causal_align"]]
    if cfg.get("backward"):
        cmd.append("--backward")
    if cfg.get("page_size"):
        cmd += ["--page-size", str(cfg["page_size"])]
    return run_json(cmd)


def run_torch(python: Path, cfg: dict) -> dict:
    return run_json([str(python), str(Path(__file__).resolve()), "--torch-worker", json.dumps(cfg)])


def run_peak(attn: Path, threads: int) -> dict:
    return run_json([str(attn), "bench", "--peak-only", "--json", "--threads", str(threads)])


class BusyGuard:
    """Detects runs that shared the cores with another process (on a shared machine) from the
    peak measured just before them, and retries them. Peaks are compared per unit: a run of
    attn's native bf16 kernel measures the BF16 dot unit ("unit": "bf16-dot", twice the FMA rate
    on AMD Zen 4), which says nothing about what the FMA units should reach."""

    def __init__(self, peaks: dict, retries: int, cores: int):
        self.retries, self.cores = retries, cores
        self.best = {("fma", t): p["peak_gflops"] for t, p in peaks.items() if "error" not in p}

    def expected(self, threads: int, unit: str = "fma") -> float:
        """The peak `threads` threads reach on free cores: the best seen, or what the 1-thread
        peak implies."""
        best = self.best.get((unit, threads), 0.0)
        if (unit, 1) in self.best and threads <= self.cores:
            best = max(best, CORE_SCALING * threads * self.best[(unit, 1)])
        return best

    def busy(self, threads: int, peak: dict) -> bool:
        if "error" in peak:
            return False
        key = (peak.get("unit", "fma"), threads)
        self.best[key] = max(self.best.get(key, 0.0), peak["peak_gflops"])
        return peak["peak_gflops"] < BUSY_PEAK_FRACTION * self.expected(threads, key[0])

    def run(self, what: str, cfg: dict, run, peak_of) -> dict:
        """run() -> result; peak_of(result) -> the peak measured with it ({"error"} if none)."""
        for attempt in range(self.retries + 1):
            r = run()
            if "error" in r or not self.busy(cfg["threads"], peak_of(r)):
                return r
            if attempt < self.retries:
                unit = peak_of(r).get("unit", "fma")
                log(f"  {what}: the cores were busy ({unit} peak {peak_of(r)['peak_gflops']:.0f} "
                    f"GFLOP/s, expected {self.expected(cfg['threads'], unit):.0f}); retrying in 3 s")
                time.sleep(3)
        r["busy"] = True
        return r

    def mark_again(self, rows: list[dict]) -> None:
        """Marks, against the best peaks of the whole suite, runs that looked fine when they ran
        (the suite may have started on busy cores)."""
        for row in rows:
            t = row["config"]["threads"]
            for impl in ("fused", "reference", "torch"):
                r = row.get(impl)
                if r is None or "error" in r:
                    continue
                peak = r["peak"] if impl == "torch" else r
                if "error" in peak:
                    continue
                if peak["peak_gflops"] < BUSY_PEAK_FRACTION * self.expected(t, peak.get("unit", "fma")):
                    r["busy"] = True


STANDARD_SEQS = (1024, 4096)
STANDARD_REPEATS = {1024: (5, 1), 4096: (3, 1)}


def configurations(quick: bool, threads: list[int], backward: bool = True,
                   standard: bool = False, dtypes: tuple[str, ...] = ("f32",)) -> list[dict]:
    if standard:
        shapes = [(l, e, c, b, *STANDARD_REPEATS[l])
                  for b in (False, True) for l in STANDARD_SEQS for e in FULL_DIMS for c in (False, True)]
    elif quick:
        shapes = [(l, e, c, False, *QUICK_REPEATS) for l, e, c in QUICK_SHAPES]
        shapes += [(l, e, c, True, *QUICK_REPEATS) for l, e, c in QUICK_BACKWARD_SHAPES]
    else:
        shapes = [(l, e, c, False, *FULL_REPEATS[l])
                  for l in FULL_SEQS for e in FULL_DIMS for c in (False, True)]
        shapes += [(l, e, c, True, *BACKWARD_REPEATS[l])
                   for l in BACKWARD_SEQS for e in FULL_DIMS for c in (False, True)]
    return [{"batch": BATCH, "heads": HEADS, "kv_heads": HEADS, "seq": l, "seq_kv": l, "dim": e,
             "causal": c, "backward": b, "threads": t, "repeats": r, "warmup": w, "dtype": d}
            for l, e, c, b, r, w in shapes for t in threads for d in dtypes
            if (backward or not b) and (b or d != "bf16r")]


# ---- decode (issue 14) ---------------------------------------------------------------------------

DECODE_BATCHES = (1, 8)
DECODE_HEADS = 32
DECODE_KV_HEADS = (8, 32)
DECODE_DIMS = (128, 64)
DECODE_SEQS_KV = (1024, 8192, 32768)
# The several-new-tokens row: (B, H_kv, E, S, L), causal with bottom-right alignment.
DECODE_MULTI_QUERY = (1, 8, 128, 8192, 16)
QUICK_DECODE_SHAPES = ((1, 8, 64, 1024, 1), (1, 8, 64, 1024, 16))
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "int8": 1}
# The paged-cache rows: the target shape (B, H_kv, E, S, L) from an attn::PagedKvCache.
DECODE_PAGED_SHAPE = (1, 8, 128, 8192, 1)
DECODE_PAGE_SIZE = 16
MIB = 1 << 20


def decode_repeats(kv_bytes: int) -> tuple[int, int]:
    """(timed repeats, warmup runs): fewer for large caches keeps the suite short."""
    if kv_bytes <= 64 * MIB:
        return 20, 3
    if kv_bytes <= 1024 * MIB:
        return 10, 2
    return 5, 1


def decode_configurations(quick: bool, threads: list[int], kv_dtypes: tuple[str, ...],
                          max_gib: float) -> tuple[list[dict], list[str]]:
    """The decode rows, and a line for each shape skipped because one K/V copy exceeds max_gib.
    Every row has a "layout" naming the attn run it times (DECODE_RUNNERS)."""
    if quick:
        shapes = list(QUICK_DECODE_SHAPES)
    else:
        shapes = [(b, hkv, e, s, 1) for b in DECODE_BATCHES for hkv in DECODE_KV_HEADS
                  for e in DECODE_DIMS for s in DECODE_SEQS_KV]
        shapes.append(DECODE_MULTI_QUERY)
    configs, skipped = [], []
    for b, hkv, e, s, l in shapes:
        for d in kv_dtypes:
            kv_bytes = b * hkv * s * 2 * e * DTYPE_BYTES[d]
            label = f"B={b} H_kv={hkv} E={e} S={s} L={l} {d}"
            if kv_bytes > max_gib * 1024 * MIB:
                skipped.append(f"{label}: one K/V copy is {kv_bytes / MIB / 1024:.1f} GiB "
                               f"(over --decode-max-gib {max_gib:g})")
                continue
            repeats, warmup = decode_repeats(kv_bytes)
            for t in threads:
                configs.append({
                    "layout": "contiguous", "decode": True, "batch": b, "heads": DECODE_HEADS,
                    "kv_heads": hkv, "seq": l, "seq_kv": s, "dim": e, "causal": l > 1,
                    "causal_align": "bottom-right", "backward": False, "threads": t,
                    "repeats": repeats, "warmup": warmup, "dtype": "f32", "kv_dtype": d,
                    "kv_bytes": kv_bytes})
    if not quick:  # the paged cache on the target shape: f32 and bf16 against contiguous, and int8
        b, hkv, e, sk, l = DECODE_PAGED_SHAPE
        for d in ("f32", "bf16", "int8"):
            kv_bytes = b * hkv * sk * (2 * e * DTYPE_BYTES[d] + (8 if d == "int8" else 0))
            repeats, warmup = decode_repeats(kv_bytes)
            for t in threads:
                configs.append({
                    "layout": f"paged{DECODE_PAGE_SIZE}", "decode": True, "batch": b,
                    "heads": DECODE_HEADS, "kv_heads": hkv, "seq": l, "seq_kv": sk, "dim": e,
                    "causal": False, "causal_align": "top-left", "backward": False, "threads": t,
                    "repeats": repeats, "warmup": warmup, "dtype": "f32", "kv_dtype": d,
                    "kv_bytes": kv_bytes, "page_size": DECODE_PAGE_SIZE})
        # A bf16 model's own call on the target shape: q in bf16 too (the dot unit's path where
        # the CPU has one; PyTorch's row is the same call).
        if "bf16" in kv_dtypes:
            kv_bytes = b * hkv * sk * 2 * e * DTYPE_BYTES["bf16"]
            repeats, warmup = decode_repeats(kv_bytes)
            for t in threads:
                configs.append({
                    "layout": "contiguous", "decode": True, "batch": b, "heads": DECODE_HEADS,
                    "kv_heads": hkv, "seq": l, "seq_kv": sk, "dim": e, "causal": False,
                    "causal_align": "top-left", "backward": False, "threads": t,
                    "repeats": repeats, "warmup": warmup, "dtype": "bf16", "kv_dtype": "bf16",
                    "kv_bytes": kv_bytes})
    return configs, skipped


def system_llc_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (as `attn bench` reads it), 0 if none."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return best


def kv_copies(copy_bytes: int) -> int:
    """The number of K/V copies `attn bench` rotates among (cli/bench.hpp, kv_copies), for a
    PyTorch run whose attn run gave none."""
    llc = system_llc_bytes() or 512 * MIB
    rotation = 8 * llc  # cli/bench.hpp's kRotationLlcs
    if copy_bytes >= rotation:
        return 1
    wanted = max(-(-rotation // copy_bytes) + 1, 2)
    try:
        with open("/proc/meminfo") as f:
            available = 1024 * int(next(l for l in f if l.startswith("MemAvailable")).split()[1])
        return max(1, min(wanted, available // 2 // copy_bytes))
    except (OSError, StopIteration, ValueError):
        return wanted


# The attn run of a decode row, by layout. A paged-cache row would add its own entry (and set
# "layout" in decode_configurations); the table and the PyTorch comparison take any layout.
DECODE_RUNNERS = {
    "contiguous": lambda attn, cfg: run_attn(attn, "auto", cfg),
    f"paged{DECODE_PAGE_SIZE}": lambda attn, cfg: run_attn(attn, "auto", cfg),
}


def run_decode_row(attn: Path, python: Path | None, guard: "BusyGuard", cfg: dict) -> dict:
    runner = DECODE_RUNNERS[cfg["layout"]]
    fused = guard.run("attn", cfg, lambda: runner(attn, cfg), lambda r: r)
    if "error" in fused and "--kv-dtype" in fused["error"] and cfg["dtype"] != cfg["kv_dtype"]:
        # No kernel takes float32 queries against this K/V dtype yet: q in the K/V dtype.
        log(f"  attn: {fused['error']}; q in {cfg['kv_dtype']} instead")
        cfg = {**cfg, "dtype": cfg["kv_dtype"]}
        fused = guard.run("attn", cfg, lambda: runner(attn, cfg), lambda r: r)
    row = {"config": cfg, "fused": fused}
    if python is not None and cfg["kv_dtype"] != "int8":  # PyTorch's SDPA has no int8 K/V
        spec = {**cfg, "copies": fused.get("decode", {}).get("kv_copies") or kv_copies(cfg["kv_bytes"])}

        def torch_run():
            peak = run_peak(attn, cfg["threads"])
            return {**run_torch(python, spec), "peak": peak}
        row["torch"] = guard.run("torch", cfg, torch_run, lambda r: r["peak"])
    return row


def mark_low_bandwidth(rows: list[dict], peaks: dict) -> dict:
    """Marks busy the runs whose own bandwidth probe (attn's, in the run; torch's, just before it)
    read below BUSY_PEAK_FRACTION of the best seen for its thread count (another process was using
    the memory bus), and attn's runs whose probe moved between before and after the timed runs
    (`bandwidth_moved`: the host's bandwidth changed); returns the best bandwidth per thread count."""
    best = {}
    def probe(impl: str, r: dict) -> float | None:
        src = r.get("decode", {}) if impl == "fused" else r.get("peak", {})
        return src.get("bandwidth_gbps")
    for t, p in peaks.items():
        if "error" not in p and p.get("bandwidth_gbps"):
            best[t] = max(best.get(t, 0.0), p["bandwidth_gbps"])
    for row in rows:
        for impl in ("fused", "torch"):
            r = row.get(impl)
            if r and "error" not in r and probe(impl, r):
                t = row["config"]["threads"]
                best[t] = max(best.get(t, 0.0), probe(impl, r))
    for row in rows:
        for impl in ("fused", "torch"):
            r = row.get(impl)
            if r and "error" not in r and probe(impl, r):
                if probe(impl, r) < BUSY_PEAK_FRACTION * best[row["config"]["threads"]]:
                    r["busy"] = True
                if r.get("decode", {}).get("bandwidth_moved"):  # attn's probe after the timed runs
                    r["busy"] = True
    return best


def gbps(r: dict | None, key: str = "kv_gbps") -> str:
    if not r or "error" in r:
        return "n/a"
    value = r.get("decode", r).get(key)
    return "n/a" if value is None else f"{value:.2f}" + (" *" if r.get("busy") else "")


def decode_table(rows: list[dict]) -> str:
    layouts = len({r["config"]["layout"] for r in rows}) > 1
    header = (["layout"] if layouts else []) + [
        "B", "H_q/H_kv", "E", "S", "L", "threads", "K/V", "q", "K/V MiB", "copies", "kernel",
        "attn ms", "attn GB/s", "bandwidth GB/s", "% of bandwidth", "attn warm GB/s", "torch ms",
        "torch GB/s", "attn / torch"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in rows:
        cfg, fused, torch = row["config"], row["fused"], row.get("torch")
        ok = "error" not in fused
        d = fused.get("decode", {}) if ok else {}
        copies = str(d.get("kv_copies", "n/a"))
        if d and not d.get("from_memory", True):
            copies += f" (of {d['kv_copies_wanted']})"
        cells = ([cfg["layout"]] if layouts else []) + [
            cfg["batch"], f"{cfg['heads']}/{cfg['kv_heads']}", cfg["dim"], cfg["seq_kv"],
            f"{cfg['seq']}" + (" causal (bottom-right)" if cfg["causal"] else ""), cfg["threads"],
            cfg["kv_dtype"], cfg["dtype"], f"{cfg['kv_bytes'] / MIB:.0f}", copies,
            fused.get("kernel", "n/a") if ok else "n/a", ms(fused), gbps(fused),
            f"{d['bandwidth_gbps']:.1f}" if d else "n/a",
            f"{100 * d['bandwidth_ratio']:.1f}" if d else "n/a",
            gbps(fused, "warm_kv_gbps"),
            ms(torch) if torch is not None else "skipped",
            gbps(torch) if torch is not None else "skipped",
            ratio(torch, fused)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def paged_vs_contiguous(rows: list[dict]) -> list[str]:
    """A line per paged row whose run also timed the dense K/V: paged ms, contiguous ms, ratio."""
    lines = []
    for row in rows:
        cfg, fused = row["config"], row["fused"]
        d = fused.get("decode", {}) if "error" not in fused else {}
        if not cfg["layout"].startswith("paged") or not d.get("contiguous_median_ms"):
            continue
        lines.append(f"{cfg['layout']}, B={cfg['batch']} H_q/H_kv={cfg['heads']}/{cfg['kv_heads']} "
                     f"E={cfg['dim']} S={cfg['seq_kv']} {cfg['kv_dtype']} K/V, {cfg['threads']} "
                     f"thread{'s' if cfg['threads'] > 1 else ''}: {fused['median_ms']:.3f} ms against "
                     f"{d['contiguous_median_ms']:.3f} ms contiguous, "
                     f"{100 * (d['paged_over_contiguous'] - 1):+.1f} %")
    return lines


DECODE_BEGIN = "<!-- decode: written by scripts/bench_suite.py --decode, kept by the other modes -->"
DECODE_END = "<!-- end of decode -->"


def render_decode(args, rows, skipped, bandwidth, torch_version, machine, started, elapsed_s,
                  command) -> str:
    llc = system_llc_bytes()
    bw = ", ".join(f"{v:.1f} GB/s on {t} thread{'s' if t > 1 else ''}"
                   for t, v in sorted(bandwidth.items())) or "n/a"
    out = [
        DECODE_BEGIN,
        "## Decode (memory-bound)",
        "",
        "Generated by `scripts/bench_suite.py --decode`"
        + (" in quick mode (a few small shapes)" if args.quick else "")
        + "; do not edit by hand, run the script again.",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (took {elapsed_s / 60:.1f} min); command: `{command}`",
        f"- attn: commit {git_revision()}; PyTorch: {torch_version or 'not run (--no-torch)'}",
        f"- machine: {machine['model']}, {machine.get('cores') or machine.get('cpus')} cores, "
        f"last-level cache {llc / MIB:.0f} MiB, {machine.get('memory_gib', 0):.1f} GiB; "
        f"memory read bandwidth (best probe of the run): {bw}",
        "",
        "Method:",
        "",
        "- One new token (L=1), or L=16 new tokens causal with bottom-right alignment (the last "
        "query sees every key), against S cached keys: q (B, H_q, L, E), k and v (B, H_kv, S, E), "
        "random normal drawn in float32 and rounded to the K/V dtype. q is float32 (the decode "
        "kernel's mixed call); where no attn kernel takes it, q is in the K/V dtype (column q). "
        "One more row, the target shape (B=1, H 32/8, E 128, S 8192) with q in bf16 against the "
        "bf16 K/V, is a bf16 model's own call. "
        "PyTorch takes no mixed dtypes: its q is always in the K/V dtype.",
        "- GB/s = K/V bytes per call / median time, the bytes counted once per kv head "
        "(B·H_kv·S·2E·sizeof): under GQA a kernel that re-reads K/V for every query head gets no "
        "credit for it.",
        "- K/V from memory: the timed calls rotate call by call among `copies` copies of K/V "
        "(ceil(8·LLC / copy) + 1, at least 2, or one copy when it alone is ≥ 8·LLC; each copy's "
        "bytes rotated so no two share a page), for attn and PyTorch alike. 8x, not 2x: an LLC "
        "with adaptive replacement keeps a share of a cyclic working set larger than itself "
        "(one 64 MiB copy on a 32 MiB LLC read 1.2 ms per call where three took 1.5-1.7). "
        "`attn warm` reads the same copy on every call (partly from the cache).",
        "- bandwidth: `attn bench`'s read probe in the same run, same threads (STREAM-like vector "
        "sum over an array of 8× the LLC, median of 7 passes; `attn bench --peak-only`); % of "
        "bandwidth = attn GB/s / that. attn / torch = torch ms / attn ms: above 1x attn is faster.",
        "- ggml (`test-backend-ops perf -o FLASH_ATTN_EXT`, and a rotating-copies program for the "
        "shapes it lacks): `scripts/bench_ggml.sh`, not in this table.",
        "",
        decode_table(rows),
    ]
    paged = paged_vs_contiguous(rows)
    if paged:
        out += ["", "Paged against contiguous in the same run (`attn bench --page-size`: each paged "
                "call followed by one on the same K/V as dense tensors, so both see the same state "
                "of the host's memory; medians):", ""] + [f"- {p}" for p in paged]
    if any(r.get(i, {}).get("busy") for r in rows for i in ("fused", "torch")):
        out += ["", f"\\* The bandwidth probe of this run (or the FMA peak) read below "
                f"{BUSY_PEAK_FRACTION:.0%} of the best of the suite (another process was using the "
                "machine), or attn's probe moved by more than 15 % between before and after the timed "
                "runs (the host's bandwidth changed): the figure is unreliable."]
    if skipped:
        out += ["", "Skipped (`--decode-max-gib`):", ""] + [f"- {s}" for s in skipped]
    failed = failures(rows)
    if failed:
        out += ["", "Failed runs (n/a above):", ""] + [f"- {f}" for f in failed]
    return "\n".join(out + [DECODE_END]) + "\n"


def decode_section(text: str) -> str | None:
    """The decode section of a PERFORMANCE.md, markers included, or None."""
    start, end = text.find(DECODE_BEGIN), text.find(DECODE_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(DECODE_END)] + "\n"


# The sections other runs write into the same report (bench_suite --decode, bench_variants.py,
# bench_torch.py), each between its markers.
KEPT_MARKERS = (DECODE_BEGIN, "<!-- variants:begin -->", "<!-- torch:begin -->")


def kept_tail(text: str) -> str | None:
    """What a --standard run keeps of an existing report: everything from the first section
    another run wrote (and the hand-written notes among them) to the end, or None."""
    starts = [i for i in (text.find(m) for m in KEPT_MARKERS) if i >= 0]
    return text[min(starts):] if starts else None


def splice_decode(text: str, section: str) -> str:
    """text with its decode section replaced by `section` (appended if it has none)."""
    old = decode_section(text)
    if old is not None:
        return text.replace(old, section)
    return text.rstrip("\n") + ("\n\n" if text.strip() else "") + section


# ---- report --------------------------------------------------------------------------------------

def machine_info() -> dict:
    info = {"model": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    try:
        fields = dict(line.split(":", 1) for line in
                      subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["model"] = fields.get("Model name", info["model"])
        if "CPU family" in fields and "Model" in fields:
            info["model"] += f" (family {fields['CPU family']}, model {fields['Model']})"
        if "Hypervisor vendor" in fields:
            info["hypervisor"] = fields["Hypervisor vendor"]
        sockets = int(fields.get("Socket(s)", "1"))
        info["cores"] = sockets * int(fields.get("Core(s) per socket", "0"))
        info["threads_per_core"] = int(fields.get("Thread(s) per core", "1"))
        for key in ("L2 cache", "L3 cache"):
            if key in fields:
                info[key] = fields[key]
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["memory_gib"] = kib / 2**20
    except (OSError, StopIteration, ValueError):
        pass
    try:
        info["loadavg"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" with local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ms(r: dict | None) -> str:
    if not r or "error" in r:
        return "n/a"
    return f"{r['median_ms']:.2f}" + (" *" if r.get("busy") else "")


def mib(r: dict | None) -> str:
    return "n/a" if not r or "error" in r else f"{r['max_rss_mib']:.0f}"


def ratio(slow: dict | None, fast: dict | None) -> str:
    if not slow or not fast or "error" in slow or "error" in fast:
        return "n/a"
    return f"{slow['median_ms'] / fast['median_ms']:.2f}x"


def results_table(rows: list[dict]) -> str:
    """The forward table, then the backward one (if any backward rows)."""
    fwd = [r for r in rows if not r["config"].get("backward")]
    bwd = [r for r in rows if r["config"].get("backward")]
    out = one_table(fwd) if fwd else ""
    if bwd:
        out += ("\n\n" if out else "") + "Backward (dQ, dK, dV; GFLOP/s counted as 2.5x the forward's):\n\n"
        out += one_table(bwd)
    return out


def one_table(rows: list[dict]) -> str:
    header = ["L", "E", "causal", "threads", "dtype", "kernel", "fused ms", "fused GFLOP/s", "% of peak",
              "reference ms", "torch ms", "vs torch", "vs reference",
              "fused MiB", "reference MiB", "torch MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in rows:
        cfg, fused, ref, torch = row["config"], row["fused"], row.get("reference"), row.get("torch")
        ok = "error" not in fused
        kernel = fused.get("kernel", "n/a") if ok else "n/a"
        if ok and fused.get("unit") == "bf16-dot":
            kernel += " (of BF16 dot peak)"
        if ok and fused.get("unit") == "amx-bf16":
            kernel += " (of AMX-BF16 tile peak)"
        cells = [cfg["seq"], cfg["dim"], "yes" if cfg["causal"] else "no", cfg["threads"],
                 cfg.get("dtype", "f32"), kernel, ms(fused), f"{fused['gflops']:.1f}" if ok else "n/a",
                 f"{100 * fused['peak_ratio']:.1f}" if ok else "n/a",
                 ms(ref) if ref is not None else "skipped",
                 ms(torch) if torch is not None else "skipped",
                 ratio(torch, fused), ratio(ref, fused),
                 mib(fused), mib(ref) if ref is not None else "skipped",
                 mib(torch) if torch is not None else "skipped"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def failures(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        cfg = row["config"]
        for impl in ("fused", "reference", "torch"):
            r = row.get(impl)
            if r is not None and "error" in r and cfg.get("decode"):
                out.append(f"{cfg['layout']} B={cfg['batch']} H_kv={cfg['kv_heads']} "
                           f"S={cfg['seq_kv']} L={cfg['seq']} E={cfg['dim']} K/V {cfg['kv_dtype']} "
                           f"q {cfg['dtype']} threads={cfg['threads']}, {impl}: {r['error']}")
            elif r is not None and "error" in r:
                out.append(f"L={cfg['seq']} E={cfg['dim']} causal={cfg['causal']} "
                           f"backward={cfg.get('backward', False)} "
                           f"threads={cfg['threads']}, {impl}: {r['error']}")
    return out


def render(args, rows, peaks, torch_version, machine, started, elapsed_s, command) -> str:
    first_ok = next((r[i] for r in rows for i in ("fused", "reference")
                     if r.get(i) and "error" not in r[i]), None)
    blas = (f"{first_ok['blas_config']} (core {first_ok['blas_core']})"
            if first_ok else "unknown")
    cores = machine.get("cores") or machine.get("cpus")
    cpu = f"{machine['model']}, {cores} cores"
    if machine.get("threads_per_core", 1) > 1:
        cpu += f" ({machine['threads_per_core']} hardware threads per core)"
    if "hypervisor" in machine:
        cpu += f", virtual machine ({machine['hypervisor']})"
    caches = ", ".join(f"{k} {machine[k]}" for k in ("L2 cache", "L3 cache") if k in machine)
    seqs = sorted({r["config"]["seq"] for r in rows})
    def reps_of(backward: bool) -> str:
        chosen = {row["config"]["seq"]: row for row in rows if row["config"].get("backward") == backward}
        return ", ".join(f"L={r['config']['seq']}: {r['config']['repeats']} (+{r['config']['warmup']} "
                         f"warmup)" for r in chosen.values())
    reps = reps_of(False) + ("; backward " + reps_of(True) if any(
        r["config"].get("backward") for r in rows) else "")
    out = [
        "# Performance",
        "",
        "Generated by `scripts/bench_suite.py`"
        + (" in quick mode (a few small shapes)" if args.quick else "")
        + "; do not edit by hand, run the script again.",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (suite took {elapsed_s / 60:.1f} min)",
        f"- command: `{command}`",
        f"- attn: commit {git_revision()}",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {cpu} |",
    ]
    if caches:
        out.append(f"| caches | {caches} |")
    if "memory_gib" in machine:
        out.append(f"| memory | {machine['memory_gib']:.1f} GiB |")
    if "loadavg" in machine:
        out.append(f"| load average before the suite (1 min) | {machine['loadavg']:.2f} |")
    for t, p in sorted(peaks.items()):
        if "error" in p:
            value = f"n/a ({p['error']})"
        else:
            value = f"{p['peak_gflops']:.1f} GFLOP/s ({p['simd']}, {p['lanes']} float lanes)"
            if p["peak_gflops"] < BUSY_PEAK_FRACTION * p.get("expected_gflops", 0.0):
                value += (f"; never reached {CORE_SCALING:.0%} of {t} x the 1-thread peak in this "
                          "suite: some core was busy with another process throughout")
        out.append(f"| FMA peak, {t} thread{'s' if t > 1 else ''} | {value} |")
    out.append(f"| BLAS (reference path) | {blas} |")
    out.append(f"| PyTorch | {torch_version or 'not run (--no-torch)'} |")
    out += [
        "",
        "## Method",
        "",
        f"- Inputs: random normal q (B, H, L, E), k and v (B, H, S, E) with B={BATCH}, "
        f"H={HEADS}, S=L; L in {seqs}; drawn in float32 and rounded to the row's dtype "
        "(bf16, f16) for attn and PyTorch alike. kernel: the attn kernel that ran "
        "(`attn kernels`); a float32 kernel on 16-bit inputs computes them widened. dtype bf16r: "
        "bf16 with SdpaOptions::allow_fp16_bf16_reduction (backward rows only; PyTorch's side is its "
        "plain bf16, whose CPU flash kernel has those numerics).",
        "- % of peak: against the FMA peak, except for `cpu.flash.avx512_bf16`, whose roof is the "
        "BF16 dot unit's peak (vdpbf16ps), and `cpu.flash.amx_bf16`, whose roof is the AMX tiles' "
        "(tdpbf16ps), each measured in the same `attn bench` run.",
        "- Time: median of the timed runs after warmup runs, per L: " + reps + ". "
        "Configurations run one after another (fused, reference, torch), never concurrently.",
        "- GFLOP/s = 4·B·H·L·S·E / median time, halved when causal (FlashAttention's count). "
        "% of peak divides it by the FMA peak that the same `attn bench` run measured on the "
        "same number of threads (`attn bench --peak-only`: independent vector FMA chains on "
        "every thread, 2 flops per lane, best of 3 x 0.2 s). The machine's peaks above are the "
        "best measured anywhere in the suite.",
        "- vs torch = torch ms / fused ms, vs reference = reference ms / fused ms: above 1x the "
        "fused kernel is faster.",
        f"- reference: run up to L={args.reference_max_seq} (`--reference-max-seq`); it "
        "materialises the H x L x L score matrix.",
        "- torch: `torch.nn.functional.scaled_dot_product_attention` under `torch.inference_mode()`"
        " with `torch.set_num_threads(threads)`, each configuration in a fresh process.",
        f"- Backward rows (L in {list(BACKWARD_SEQS)}): `attn bench --backward` times "
        "`scaled_dot_product_attention_backward` (dQ, dK, dV from the saved output and LSE, and "
        "for 16-bit inputs the output's float32 residual, as training saves it: "
        "`need_output_residual`) after one untimed forward; torch times `torch.autograd.grad(out, (q, k, v), dout, "
        "retain_graph=True)` after one forward, i.e. its backward alone. GFLOP/s = 2.5x the "
        "forward's count / time (FlashAttention's convention: five matmuls instead of two).",
        "- MiB: peak resident set (`getrusage` ru_maxrss) of the process that ran the "
        "configuration; torch's includes the few hundred MiB of loading torch itself.",
        "",
        "## Results",
        "",
        results_table(rows),
    ]
    if any(r.get(i, {}).get("busy") for r in rows for i in ("fused", "reference", "torch")):
        out += ["", f"\\* The FMA peak measured just before this run was below "
                f"{BUSY_PEAK_FRACTION:.0%} of the best one for its thread count (or of "
                f"{CORE_SCALING:.0%} of threads x the 1-thread peak), even after "
                f"{args.retries} retr{'y' if args.retries == 1 else 'ies'}: another process was "
                "using the cores, so the time is unreliable."]
    failed = failures(rows)
    if failed:
        out += ["", "Failed runs (n/a above):", ""] + [f"- {f}" for f in failed]
    return "\n".join(out) + "\n"


# ---- main ----------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small shapes (smoke test)")
    parser.add_argument("--attn", type=Path, default=ROOT / "build" / "attn",
                        help="the attn binary (default: build/attn; scripts/build.sh builds it)")
    parser.add_argument("--threads", default=None,
                        help="comma-separated thread counts (default 1,2; --decode: 2)")
    parser.add_argument("--reference-max-seq", type=int, default=4096,
                        help="run the reference only up to this L (default 4096)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    parser.add_argument("--no-backward", action="store_true", help="skip the backward rows")
    parser.add_argument("--standard", action="store_true",
                        help="the standard shapes only: L in {1024, 4096}, E in {64, 128}, "
                             "causal and not, forward and backward")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated dtypes of q, k, v: f32, bf16, bf16r (bf16 with "
                             "--allow-fp16-bf16-reduction, backward rows only), f16 (default f32); "
                             "--decode: of k, v (default f32,bf16,f16)")
    parser.add_argument("--decode", action="store_true",
                        help="the decoding shapes of issue 14 (L <= 16, GB/s of K/V read) into "
                             "the Decode section of the report")
    parser.add_argument("--decode-max-gib", type=float, default=6.0,
                        help="--decode: skip shapes whose K/V copy exceeds this (default 6)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".cache" / "bench-venv",
                        help="virtual environment for torch (created on first use)")
    parser.add_argument("--output", type=Path, default=None,
                        help="markdown report (default: docs/PERFORMANCE.md; none with --quick)")
    parser.add_argument("--json-out", type=Path, default=None, help="also save raw results here")
    parser.add_argument("--retries", type=int, default=1,
                        help="re-runs of a configuration that found the cores busy (default 1)")
    parser.add_argument("--torch-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.torch_worker:
        torch_worker(json.loads(args.torch_worker))
        return 0
    # On SIGTERM, unwind like Ctrl-C: subprocess.run then ends the run in flight as well.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.threads is None:
        args.threads = "2" if args.decode else "1,2"
    if args.dtypes is None:
        args.dtypes = "f32,bf16,f16" if args.decode else "f32"
    try:
        threads = [int(t) for t in args.threads.split(",")]
        if not threads or min(threads) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--threads must be positive integers separated by commas, got {args.threads!r}")
    if not args.attn.is_file():
        log(f"bench_suite: {args.attn} not found; build it first (scripts/build.sh)")
        return 2
    output = args.output or (None if args.quick else ROOT / "docs" / "PERFORMANCE.md")

    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_info()
    python, torch_version = (None, None) if args.no_torch else ensure_torch(args.venv)
    t0_suite = time.monotonic()

    peaks = {}
    for t in threads:
        peaks[t] = run_peak(args.attn, t)
        if "error" not in peaks[t]:
            log(f"FMA peak, {t} thread(s): {peaks[t]['peak_gflops']:.1f} GFLOP/s ({peaks[t]['simd']})")

    guard = BusyGuard(peaks, max(args.retries, 0), machine.get("cores") or os.cpu_count() or 1)
    rows = []
    dtypes = tuple(args.dtypes.split(","))
    allowed = ("f32", "bf16", "f16") + (() if args.decode else ("bf16r",))
    if not dtypes or any(d not in allowed for d in dtypes):
        parser.error(f"--dtypes must be {', '.join(allowed)} separated by commas, got {args.dtypes!r}")
    if args.decode:
        return decode_main(args, output, threads, dtypes, python, torch_version, machine, started,
                           t0_suite, peaks, guard)
    configs = configurations(args.quick, threads, not args.no_backward, args.standard, dtypes)
    for n, cfg in enumerate(configs, 1):
        def attn_run(impl):
            # attn bench measures the peak itself, just before timing.
            return guard.run(impl, cfg, lambda: run_attn(args.attn, impl, cfg), lambda r: r)

        row = {"config": cfg, "fused": attn_run("fused")}
        if cfg["seq"] <= args.reference_max_seq and cfg["dtype"] == "f32":
            row["reference"] = attn_run("reference")
        if python is not None:
            # torch's run is checked by a peak measured just before it.
            def torch_run():
                peak = run_peak(args.attn, cfg["threads"])
                return {**run_torch(python, cfg), "peak": peak}
            row["torch"] = guard.run("torch", cfg, torch_run, lambda r: r["peak"])
        rows.append(row)
        log(f"[{n}/{len(configs)}] {cfg['dtype']} {'backward' if cfg['backward'] else 'forward'} "
            f"L={cfg['seq']} E={cfg['dim']} causal={cfg['causal']} "
            f"threads={cfg['threads']}: fused {ms(row['fused'])} ms, reference "
            f"{ms(row['reference']) + ' ms' if 'reference' in row else 'skipped'}, torch "
            f"{ms(row['torch']) + ' ms' if 'torch' in row else 'skipped'} "
            f"({time.monotonic() - t0_suite:.0f} s)")

    guard.mark_again(rows)
    for t, p in peaks.items():  # the machine's peak: the best measured anywhere in the suite
        if "error" not in p:
            p["peak_gflops"] = guard.best[("fma", t)]
            p["expected_gflops"] = guard.expected(t)
    elapsed = time.monotonic() - t0_suite
    command = shlex.join(["scripts/bench_suite.py", *sys.argv[1:]])
    report = render(args, rows, peaks, torch_version, machine, started, elapsed, command)
    print(results_table(rows))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        kept = kept_tail(output.read_text()) if output.is_file() else None
        output.write_text(report if kept is None else report.rstrip("\n") + "\n\n" + kept)
        log(f"bench_suite: wrote {output}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"peaks": peaks, "rows": rows, "torch": torch_version},
                                            indent=1) + "\n")
    failed = failures(rows)
    for f in failed:
        log(f"bench_suite: failed: {f}")
    return 1 if failed else 0


def decode_main(args, output, threads, dtypes, python, torch_version, machine, started, t0_suite,
                peaks, guard) -> int:
    configs, skipped = decode_configurations(args.quick, threads, dtypes, args.decode_max_gib)
    for line in skipped:
        log(f"bench_suite: skipped {line}")
    rows = []
    for n, cfg in enumerate(configs, 1):
        row = run_decode_row(args.attn, python, guard, cfg)
        rows.append(row)
        log(f"[{n}/{len(configs)}] {cfg['layout']} B={cfg['batch']} H={cfg['heads']}/{cfg['kv_heads']} "
            f"E={cfg['dim']} S={cfg['seq_kv']} L={cfg['seq']} K/V {cfg['kv_dtype']} q {cfg['dtype']} "
            f"threads={cfg['threads']}: attn {gbps(row['fused'])} GB/s, torch "
            f"{gbps(row.get('torch')) if 'torch' in row else 'skipped'} GB/s "
            f"({time.monotonic() - t0_suite:.0f} s)")
    guard.mark_again(rows)
    bandwidth = mark_low_bandwidth(rows, peaks)
    elapsed = time.monotonic() - t0_suite
    command = shlex.join(["scripts/bench_suite.py", *sys.argv[1:]])
    section = render_decode(args, rows, skipped, bandwidth, torch_version, machine, started,
                            elapsed, command)
    print(decode_table(rows))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(splice_decode(output.read_text() if output.is_file() else "", section))
        log(f"bench_suite: wrote the decode section of {output}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"peaks": peaks, "rows": rows, "skipped": skipped,
                                             "torch": torch_version}, indent=1) + "\n")
    failed = failures(rows)
    for f in failed:
        log(f"bench_suite: failed: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
tensors converted to torch.bfloat16 / torch.float16); the reference runs in float32 only.

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
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, l, s, e = (spec[k] for k in ("batch", "heads", "kv_heads", "seq", "seq_kv", "dim"))
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[spec.get("dtype", "f32")]
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
           "--warmup", str(cfg["warmup"]), "--dtype", cfg.get("dtype", "f32")]
    if cfg["causal"]:
        cmd.append("--causal")
    if cfg.get("backward"):
        cmd.append("--backward")
    return run_json(cmd)


def run_torch(python: Path, cfg: dict) -> dict:
    return run_json([str(python), str(Path(__file__).resolve()), "--torch-worker", json.dumps(cfg)])


def run_peak(attn: Path, threads: int) -> dict:
    return run_json([str(attn), "bench", "--peak-only", "--json", "--threads", str(threads)])


class BusyGuard:
    """Detects runs that shared the cores with another process (on a shared machine) from the
    FMA peak measured just before them, and retries them."""

    def __init__(self, peaks: dict, retries: int, cores: int):
        self.retries, self.cores = retries, cores
        self.best = {t: p["peak_gflops"] for t, p in peaks.items() if "error" not in p}

    def expected(self, threads: int) -> float:
        """The peak `threads` threads reach on free cores: the best seen, or what the 1-thread
        peak implies."""
        best = self.best.get(threads, 0.0)
        if 1 in self.best and threads <= self.cores:
            best = max(best, CORE_SCALING * threads * self.best[1])
        return best

    def busy(self, threads: int, peak: dict) -> bool:
        if "error" in peak:
            return False
        self.best[threads] = max(self.best.get(threads, 0.0), peak["peak_gflops"])
        return peak["peak_gflops"] < BUSY_PEAK_FRACTION * self.expected(threads)

    def run(self, what: str, cfg: dict, run, peak_of) -> dict:
        """run() -> result; peak_of(result) -> the peak measured with it ({"error"} if none)."""
        for attempt in range(self.retries + 1):
            r = run()
            if "error" in r or not self.busy(cfg["threads"], peak_of(r)):
                return r
            if attempt < self.retries:
                log(f"  {what}: the cores were busy (FMA peak {peak_of(r)['peak_gflops']:.0f} "
                    f"GFLOP/s, expected {self.expected(cfg['threads']):.0f}); retrying in 3 s")
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
                if "error" not in peak and peak["peak_gflops"] < BUSY_PEAK_FRACTION * self.expected(t):
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
            for l, e, c, b, r, w in shapes for t in threads for d in dtypes if backward or not b]


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
            if r is not None and "error" in r:
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
        "(`attn kernels`); a float32 kernel on 16-bit inputs computes them widened.",
        "- % of peak: against the FMA peak, except for `cpu.flash.avx512_bf16`, whose roof is the "
        "BF16 dot unit's peak (vdpbf16ps, `attn bench --peak-only`), measured in the same run.",
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
        "`scaled_dot_product_attention_backward` (dQ, dK, dV from the saved output and LSE) after "
        "one untimed forward; torch times `torch.autograd.grad(out, (q, k, v), dout, "
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
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--reference-max-seq", type=int, default=4096,
                        help="run the reference only up to this L (default 4096)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    parser.add_argument("--no-backward", action="store_true", help="skip the backward rows")
    parser.add_argument("--standard", action="store_true",
                        help="the standard shapes only: L in {1024, 4096}, E in {64, 128}, "
                             "causal and not, forward and backward")
    parser.add_argument("--dtypes", default="f32",
                        help="comma-separated dtypes of q, k, v: f32, bf16, f16 (default f32)")
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
    if not dtypes or any(d not in ("f32", "bf16", "f16") for d in dtypes):
        parser.error(f"--dtypes must be f32, bf16 or f16 separated by commas, got {args.dtypes!r}")
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
            p["peak_gflops"] = guard.best[t]
            p["expected_gflops"] = guard.expected(t)
    elapsed = time.monotonic() - t0_suite
    command = shlex.join(["scripts/bench_suite.py", *sys.argv[1:]])
    report = render(args, rows, peaks, torch_version, machine, started, elapsed, command)
    print(results_table(rows))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(report)
        log(f"bench_suite: wrote {output}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"peaks": peaks, "rows": rows, "torch": torch_version},
                                            indent=1) + "\n")
    failed = failures(rows)
    for f in failed:
        log(f"bench_suite: failed: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

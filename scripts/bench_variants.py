#!/usr/bin/env python3
"""Times the attention variants (issue 15) and writes the "Variants" section of docs/PERFORMANCE.md.

1. Overhead of each option over the plain fused kernel, B=1 H=12 L=4096, E in {64, 128}, causal
   and not, forward and backward, 2 threads: `attn bench --json` for the plain call and for
   --window-left/right 4095 (a window that hides nothing: the band's bookkeeping alone), --alibi,
   --softcap 50 (Gemma 2's cap), --sinks. The runs are interleaved (plain, each option, plain, ...)
   for --rounds rounds and each figure is the median of all its timed calls, so that a slow
   stretch of a shared machine hits every column alike.
2. A causal sliding window of 4096 at L = 32768 (H=4, E=64) against full causal attention, forward
   and backward, with the ideal ratio: the fraction of (query, key) pairs inside the band,
   (L w - w^2 / 2) / (L^2 / 2) for w = 4096 (0.234).
3. Varlen (`attn bench --varlen`, when the binary has it): a batch of sequences with lengths drawn
   from 64..4096 against the same sequences padded to the longest.

    scripts/bench_variants.py                 # all of it -> docs/PERFORMANCE.md (~25 minutes)
    scripts/bench_variants.py --quick         # small shapes, table on stdout only
    scripts/bench_variants.py --rounds 4 --skip window,varlen   # one part again; the others' tables kept
Exit status 0, or 1 if a run failed (the table says which).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- variants:begin -->", "<!-- variants:end -->"
OPTIONS = {  # column -> extra `attn bench` flags
    "plain": [],
    "window (4095, 4095)": ["--window-left", "4095", "--window-right", "4095"],
    "alibi": ["--alibi"],
    "softcap 50": ["--softcap", "50"],
    "sinks": ["--sinks"],
}
TARGET = {"plain": None, "window (4095, 4095)": 1.10, "alibi": 1.10, "softcap 50": 1.15, "sinks": 1.10}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def bench(attn: Path, args: list[str]) -> dict:
    r = subprocess.run([str(attn), "bench", "--json", *args], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def overhead_rows(attn: Path, quick: bool, rounds: int, threads: int) -> tuple[list[str], bool]:
    seq, reps = (512, ["--repeats", "3", "--warmup", "1"]) if quick else (4096, ["--repeats", "3", "--warmup", "1"])
    lines = ["| E | causal | pass | plain ms | " + " | ".join(f"{k} (x plain)" for k in OPTIONS if k != "plain") + " |",
             "|---|---|---|---|" + "---|" * (len(OPTIONS) - 1)]
    ok = True
    for dim in (64, 128):
        for causal in (False, True):
            for backward in (False, True):
                base = ["--heads", "12", "--seq", str(seq), "--dim", str(dim), "--threads", str(threads), *reps]
                base += ["--causal"] if causal else []
                base += ["--backward"] if backward else []
                times: dict[str, list[float]] = {k: [] for k in OPTIONS}
                for _ in range(rounds):
                    for name, extra in OPTIONS.items():
                        r = bench(attn, base + extra)
                        if "error" in r:
                            print(f"  {name}: {r['error']}", file=sys.stderr)
                            ok = False
                            continue
                        times[name] += r["times_ms"]
                med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
                cells = []
                for name in OPTIONS:
                    if name == "plain":
                        continue
                    ratio = med[name] / med["plain"]
                    mark = "" if ratio <= TARGET[name] else " (over)"
                    cells.append(f"{ratio:.3f}{mark}")
                row = f"| {dim} | {'yes' if causal else 'no'} | {'backward' if backward else 'forward'} | {med['plain']:.1f} | " + " | ".join(cells) + " |"
                print(row, flush=True)
                lines.append(row)
    return lines, ok


def window_rows(attn: Path, quick: bool, threads: int) -> tuple[list[str], bool]:
    L, w = (4096, 512) if quick else (32768, 4096)
    ideal = (L * w - w * w / 2) / (L * L / 2)
    lines = [f"Causal, B=1 H=4 E=64 L=S={L}, window (w - 1, 0) with w = {w} (Hugging Face's sliding_window = {w});"
             f" ideal ratio = pairs in the band / causal pairs = {ideal:.3f}; target <= 1.3 x ideal = {1.3 * ideal:.3f}.",
             "", "| pass | full causal ms | window ms | window / causal | / ideal |", "|---|---|---|---|---|"]
    ok = True
    for backward in (False, True):
        base = ["--heads", "4", "--seq", str(L), "--dim", "64", "--causal", "--threads", str(threads),
                "--repeats", "2", "--warmup", "0"] + (["--backward"] if backward else [])
        full = bench(attn, base)
        win = bench(attn, base + ["--window-left", str(w - 1), "--window-right", "0"])
        if "error" in full or "error" in win:
            ok = False
            lines.append(f"| {'backward' if backward else 'forward'} | failed: {full.get('error') or win.get('error')} | | | |")
            continue
        ratio = win["median_ms"] / full["median_ms"]
        row = (f"| {'backward' if backward else 'forward'} | {full['median_ms']:.0f} | {win['median_ms']:.0f} | "
               f"{ratio:.3f} | {ratio / ideal:.2f} |")
        print(row, flush=True)
        lines.append(row)
    return lines, ok


def varlen_rows(attn: Path, quick: bool, threads: int) -> tuple[list[str], bool]:
    probe = subprocess.run([str(attn), "bench", "--help"], capture_output=True, text=True).stdout
    if "--varlen" not in probe:
        return ["(this attn binary has no `bench --varlen`)"], True
    n = "4" if quick else "16"
    lines = ["Ideal = N * Lmax^2 / sum L_i^2, the ratio of (query, key) pairs the two calls compute; target: padded / varlen >= 1.8.",
             "", "| causal | pass | sequences | tokens | varlen ms | padded ms | padded / varlen | ideal |",
             "|---|---|---|---|---|---|---|---|"]
    ok = True
    for causal in (True, False):
        for backward in (False, True):
            args = ["--varlen", n, "--heads", "12", "--dim", "64", "--threads", str(threads), "--repeats", "3",
                    "--warmup", "1"] + (["--causal"] if causal else []) + (["--backward"] if backward else [])
            r = bench(attn, args)
            if "error" in r:
                ok = False
                lines.append(f"| {causal} | {backward} | failed: {r['error']} | | | | |")
                continue
            v = r["varlen"]
            lens = v["lengths"]
            ideal = len(lens) * max(lens) ** 2 / sum(x * x for x in lens)
            row = (f"| {'yes' if causal else 'no'} | {'backward' if backward else 'forward'} | {v['sequences']} | "
                   f"{v['tokens']} (padded {v['padded_tokens']}) | {v['varlen_ms']:.1f} | {v['padded_ms']:.1f} | "
                   f"{v['padded_ms'] / v['varlen_ms']:.2f} | {ideal:.2f} |")
            print(row, flush=True)
            lines.append(row)
    return lines, ok


def previous_parts(section: str, titles: dict[str, str]) -> dict[str, list[str]]:
    """The tables of an existing Variants section by part, so that --skip keeps them."""
    parts, name = {}, None
    by_title = {f"### {t}": n for n, t in titles.items()}
    for line in section.splitlines():
        if line.startswith("### "):
            name = by_title.get(line.strip())
            if name:
                parts[name] = []
        elif name and not line.startswith("(kept from"):
            parts[name].append(line)
        if line.startswith("<!--"):
            name = None
    return {n: _trim(lines) for n, lines in parts.items()}


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", type=Path, default=ROOT / "build" / "attn")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    p.add_argument("--skip", default="",
                   help="comma list of parts to skip: overhead,window,varlen (their last tables are kept)")
    a = p.parse_args()
    if not a.attn.exists():
        print(f"bench_variants: {a.attn} not found (build first)", file=sys.stderr)
        return 2
    skip = set(filter(None, a.skip.split(",")))
    cpu = bench(a.attn, ["--peak-only", "--threads", str(a.threads)])
    titles = {"overhead": "Cost of each option over the plain fused kernel (B=1 H=12 L=4096; time ratio, target <= 1.10, softcap <= 1.15)",
              "window": "Sliding window at long context", "varlen": "Varlen against padding"}
    text = a.output.read_text() if a.output.exists() else ""
    start, end = text.find(BEGIN), text.find(END)
    kept = previous_parts(text[start:end] if 0 <= start < end else "", titles)
    parts, ok = [], True
    for name, fn in (("overhead", lambda: overhead_rows(a.attn, a.quick, a.rounds, a.threads)),
                     ("window", lambda: window_rows(a.attn, a.quick, a.threads)),
                     ("varlen", lambda: varlen_rows(a.attn, a.quick, a.threads))):
        if name in skip:
            if name in kept and not a.quick:  # the last run's table stays, marked as such
                parts.append((name, ["(kept from the previous run of this script)", "", *kept[name]]))
            continue
        print(f"== {name}", flush=True)
        lines, good = fn()
        ok = ok and good
        parts.append((name, [f"{a.rounds} interleaved rounds.", "", *lines] if name == "overhead" else lines))
    body = [BEGIN, "## Variants (issue 15)", "",
            f"`scripts/bench_variants.py` ({a.threads} threads; CPU: {cpu_model()}; "
            f"FMA peak {cpu.get('peak_gflops', 0):.0f} GFLOP/s measured in the same run).", ""]
    for name, lines in parts:
        body += [f"### {titles[name]}", "", *_trim(lines), ""]
    body.append(END)
    section = "\n".join(body) + "\n"
    if a.quick:
        print(section)
        return 0 if ok else 1
    if start >= 0 and end > start:
        text = text[:start] + section + text[end + len(END) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    a.output.write_text(text)
    print(f"bench_variants: wrote {a.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

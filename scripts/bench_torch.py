#!/usr/bin/env python3
"""attn inside PyTorch (issue 16): a Hugging Face GPT-2-small-shaped model with and without
attn.torch.patch(), writing the "Inside PyTorch" section of docs/PERFORMANCE.md.

The model: GPT2LMHeadModel from a config (12 layers, 12 heads, n_embd 768, n_positions raised
to 2048, dropout 0, attn_implementation="sdpa"), random weights, batch 1, in float32 and
bfloat16. For each T in {512, 2048} and each pass (forward under no_grad; forward + backward of
the LM loss), the calls with PyTorch's own SDPA and with attn's are interleaved for --reps
rounds, and each figure is the median of its rounds:

- end to end: the wall time of the whole call;
- attention: from one extra profiled round (torch.profiler, CPU), the total time of the
  attention ops: PyTorch's aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward), or
  the math path's ops if that ran, against attn.sdpa_forward (+ attn.sdpa_backward).

Decoding (its own section, "Decoding inside PyTorch"): a prompt of --prompt tokens through the
model once (KV cache), then --new-tokens greedy steps of one token each, every step one L = 1
SDPA call per layer against the growing cache: the decode loop's wall time per token and the
wall time of its F.scaled_dot_product_attention calls (a timing wrapper, not the profiler, whose
per-op overhead swamps calls this small), with and without the patch (interleaved), and whether
the two picked the same tokens. A full run writes this section with --reps rounds too; the doc's
table came from `--decode --reps 15`. Here attn's fixed cost per call matters, not its
kernels' speed on long rows.

Run it alone on the machine (two cores: anything else running skews every ratio):

    .cache/bench-venv/bin/python scripts/bench_torch.py            # -> docs/PERFORMANCE.md (~7 min)
    .cache/bench-venv/bin/python scripts/bench_torch.py --quick    # T=128, 2 layers, stdout only
    .cache/bench-venv/bin/python scripts/bench_torch.py --decode   # the decoding section only
    .cache/bench-venv/bin/python scripts/bench_torch.py --bf16-step 10   # bf16 training step only
    .cache/bench-venv/bin/python scripts/bench_torch.py --dtypes bfloat16 --output F   # one dtype

The ~7 min is the Intel Xeon's; an AVX2-only CPU without a BF16 unit takes over 45 (PyTorch's
bfloat16 matmuls are slow there). The doc is rewritten after each training row, so a run stopped
part-way keeps the rows it measured (the section then says so).

Needs torch >= 2.4 and transformers in that venv (pip install torch transformers) and attn
installed there (pip install .).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import attn.torch as at

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- torch:begin -->", "<!-- torch:end -->"
DECODE_BEGIN, DECODE_END = "<!-- torch-decode:begin -->", "<!-- torch-decode:end -->"
TORCH_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
             "aten::_scaled_dot_product_attention_math")
ATTN_OPS = ("attn.sdpa_forward", "attn.sdpa_backward")  # attn.torch's record_function names


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers: "AMD EPYC" alone names Zen 4 and
    Zen 5 alike, whose kernels and figures differ."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor's block is enough
    name = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def make_model(dtype, layers):
    config = transformers.GPT2Config(n_positions=2048, n_embd=768, n_layer=layers, n_head=12,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def step(model, ids, backward):
    if backward:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with torch.no_grad():
            model(input_ids=ids)


# The ways a step runs: PyTorch's own SDPA, attn's under the patch, and (bf16 training only)
# attn's with allow_fp16_bf16_reduction, PyTorch's CPU flash kernel's numerics.
TORCH, ATTN, ATTN_REDUCED = "torch", "attn", "attn, allow_fp16_bf16_reduction"


def patch_for(variant):
    return at.patch(variant != TORCH, allow_fp16_bf16_reduction=variant == ATTN_REDUCED)


def attention_ms(model, ids, backward, variant) -> float:
    with patch_for(variant):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(model, ids, backward)
    names = TORCH_OPS if variant == TORCH else ATTN_OPS
    total_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key in names)
    return total_us / 1e3


def measure(model, ids, backward, reps, variants, profile=True):
    times = {v: [] for v in variants}
    for v in variants:  # warm up every path
        with patch_for(v):
            step(model, ids, backward)
    for _ in range(reps):
        for v in variants:
            with patch_for(v):
                t0 = time.perf_counter()
                step(model, ids, backward)
                times[v].append(time.perf_counter() - t0)
    e2e = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    attn_t = {v: attention_ms(model, ids, backward, v) for v in variants} if profile else {}
    return e2e, attn_t


def decode_loop(model, prompt, new_tokens, patched):
    """Greedy decoding after a prefill of `prompt`: (wall ms of the decode steps, ms spent in
    F.scaled_dot_product_attention during them, the tokens picked). The SDPA calls are timed
    by a wrapper around whichever function F.scaled_dot_product_attention is (PyTorch's or
    the patch's; ~0.2 us a call on both): the profiler's per-op overhead swamps calls this small."""
    with at.patch(patched), torch.no_grad():
        inner = torch.nn.functional.scaled_dot_product_attention
        spent = [0.0]

        def timed(*a, **kw):
            t = time.perf_counter()
            r = inner(*a, **kw)
            spent[0] += time.perf_counter() - t
            return r

        out = model(input_ids=prompt, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        picked = [token]
        torch.nn.functional.scaled_dot_product_attention = timed
        try:
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                out = model(input_ids=token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                picked.append(token)
            wall = (time.perf_counter() - t0) * 1e3
        finally:
            torch.nn.functional.scaled_dot_product_attention = inner
    return wall, spent[0] * 1e3, torch.cat(picked, 1)


def setup(args, layers) -> str:
    return (f"CPU: {cpu_model()}, {args.threads} threads; torch {torch.__version__}, "
            f"transformers {transformers.__version__}; GPT-2 small shape ({layers} layers, "
            f"12 heads, n_embd 768), batch 1")


def decode_rows(args, layers) -> list:
    lines = [f"{setup(args, layers)}; a {args.prompt}-token prompt, then "
             f"{args.new_tokens} greedy steps (L = 1 against {args.prompt + 1}-"
             f"{args.prompt + args.new_tokens} cached keys); per generated token, median of "
             f"{args.reps} interleaved rounds; attention: the wall time of the "
             f"F.scaled_dot_product_attention calls in the same rounds.",
             "",
             "| dtype | attention: torch ms | attention: attn ms | attention speed-up "
             "| step: torch ms | step: attn ms | step speed-up | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype, layers)
        prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt),
                               generator=torch.Generator().manual_seed(args.prompt))
        for patched in (False, True):  # warm up both paths
            decode_loop(model, prompt, 4, patched)
        walls, sdpa = {False: [], True: []}, {False: [], True: []}
        tokens = {}
        for _ in range(args.reps):
            for patched in (False, True):
                wall, spent, tokens[patched] = decode_loop(model, prompt, args.new_tokens, patched)
                walls[patched].append(wall / args.new_tokens)
                sdpa[patched].append(spent / args.new_tokens)
        att = {p: statistics.median(v) for p, v in sdpa.items()}
        step_ms = {p: statistics.median(v) for p, v in walls.items()}
        row = (f"| {str(dtype).split('.')[-1]} | {att[False]:.3f} | {att[True]:.3f} "
               f"| {att[False] / att[True]:.2f}x | {step_ms[False]:.2f} | {step_ms[True]:.2f} "
               f"| {step_ms[False] / step_ms[True]:.2f}x "
               f"| {'yes' if torch.equal(tokens[False], tokens[True]) else 'no'} |")
        print(row, flush=True)
        lines.append(row)
    return lines


def splice(text: str, begin: str, end: str, section: str) -> str:
    if begin in text:
        return text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", action="store_true", help="the decoding section only")
    ap.add_argument("--prompt", type=int, default=512, help="decoding: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="decoding: generated tokens")
    ap.add_argument("--bf16-step", type=int, metavar="ROUNDS",
                    help="only the bfloat16 T=2048 training step, end to end: ROUNDS alternating "
                         "rounds of torch, attn and attn with allow_fp16_bf16_reduction (stdout)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="model dtypes of the training table, comma-separated (float32, bfloat16)")
    ap.add_argument("--output", type=Path, default=ROOT / "docs" / "PERFORMANCE.md",
                    help="the report whose Inside PyTorch section is written (default: "
                         "docs/PERFORMANCE.md; docs/PERFORMANCE-amd-epyc.md on the AMD machine)")
    args = ap.parse_args()
    known = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    names = [d.strip() for d in args.dtypes.split(",")]
    if any(d not in known for d in names):
        ap.error(f"--dtypes: expected float32 and/or bfloat16, got {args.dtypes!r}")
    dtypes = [known[d] for d in names]
    torch.set_num_threads(args.threads)
    seqs, layers = ([128], 2) if args.quick else ([512, 2048], 12)
    if args.bf16_step:
        model = make_model(torch.bfloat16, layers)
        T = seqs[-1]
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        e2e, _ = measure(model, ids, True, args.bf16_step, [TORCH, ATTN, ATTN_REDUCED], profile=False)
        for v in (ATTN, ATTN_REDUCED):
            print(f"bfloat16 T={T} fwd+bwd, {v}: torch {e2e[TORCH]:.0f} ms, attn {e2e[v]:.0f} ms, "
                  f"{e2e[TORCH] / e2e[v]:.2f}x (median of {args.bf16_step} rounds)")
        return 0
    if args.quick:
        args.prompt, args.new_tokens = 32, 8
    decode_section = "\n".join([DECODE_BEGIN, "## Decoding inside PyTorch (issue 16)", "",
                                "Generated by `scripts/bench_torch.py --decode` (see its docstring): "
                                "Hugging Face GPT-2 generation with and without `attn.torch.patch()`.",
                                "", *decode_rows(args, layers), DECODE_END])
    if args.quick:
        print(decode_section)
    else:  # written before the training table, so a run stopped later keeps it
        args.output.write_text(splice(args.output.read_text(), DECODE_BEGIN, DECODE_END, decode_section))
        if args.decode:
            print(f"wrote {args.output}")
            return 0

    lines = [f"{setup(args, layers)}, causal; median of {args.reps} interleaved rounds.",
             "",
             "| dtype | T | pass | attention: torch ms | attention: attn ms | attention speed-up "
             "| end to end: torch ms | end to end: attn ms | end-to-end speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dtype in dtypes:
        model = make_model(dtype, layers)
        for T in seqs:
            ids = torch.randint(0, model.config.vocab_size, (1, T),
                                generator=torch.Generator().manual_seed(T))
            for backward in (False, True):
                # The reduction changes only the 16-bit backward (the forward's bits are the same).
                variants = [TORCH, ATTN] + ([ATTN_REDUCED] if backward and dtype == torch.bfloat16 else [])
                e2e, att = measure(model, ids, backward, args.reps, variants)
                for v in variants[1:]:
                    name = str(dtype).split('.')[-1] + (" (allow_fp16_bf16_reduction)" if v == ATTN_REDUCED else "")
                    row = (f"| {name} | {T} | {'fwd+bwd' if backward else 'fwd'} "
                           f"| {att[TORCH]:.1f} | {att[v]:.1f} | {att[TORCH] / att[v]:.2f}x "
                           f"| {e2e[TORCH]:.0f} | {e2e[v]:.0f} | {e2e[TORCH] / e2e[v]:.2f}x |")
                    print(row, flush=True)
                    lines.append(row)
                    if not args.quick:  # row by row: a run stopped later keeps the rows it measured
                        write_section(args.output, lines, done=False)
    if args.quick:
        print(section_text(lines, done=True))
        return 0
    write_section(args.output, lines, done=True)
    print(f"wrote {args.output}")
    return 0


def section_text(lines: list, done: bool) -> str:
    return "\n".join([BEGIN, "## Inside PyTorch (issue 16)", "",
                      "Generated by `scripts/bench_torch.py` (see its docstring); targets at "
                      "T=2048, fwd+bwd: attention >= 1.3x (float32) and >= 2x (bfloat16), end "
                      "to end >= 1.1x and >= 1.3x. Rows marked allow_fp16_bf16_reduction run "
                      "attn with that option (FlashAttention's and PyTorch's CPU flash kernel's "
                      "bf16 numerics; docs/NUMERICS.md), in the same rounds as the unmarked row "
                      "above them, against the same PyTorch figures.", "", *lines,
                      *([] if done else ["", "(The run was still going when this was written: "
                                             "the rows above are the ones it had measured.)"]), END])


def write_section(doc: Path, lines: list, done: bool) -> None:
    doc.write_text(splice(doc.read_text(), BEGIN, END, section_text(lines, done)))


if __name__ == "__main__":
    sys.exit(main())

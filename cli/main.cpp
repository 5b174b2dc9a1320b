// The `attn` command-line tool. Subcommands are thin: they parse arguments (CLI11) and call the
// library; every exception (attn::Error or any other std::exception) becomes one line on stderr,
// "attn: error: ...", and exit code 1, never an uncaught exception and its abort.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <exception>
#include <functional>
#include <fmt/format.h>
#include <iostream>
#include <string>

#include "attn/error.hpp"
#include "bench.hpp"
#include "demo.hpp"
#include "gpt_commands.hpp"
#ifdef ATTN_HAVE_DIST
#include "ring.hpp"
#endif

namespace {

std::string step_list() {
  std::string s;
  for (const attn::demo::Step& step : attn::demo::steps()) {
    s += fmt::format("  {:<22} {}\n", step.name, step.title);
  }
  return s;
}

int run_demo(const std::string& step_name, bool list) {
  if (list) {
    std::cout << step_list();
    return 0;
  }
  if (step_name.empty()) {
    attn::demo::run_all(std::cout);
    return 0;
  }
  const attn::demo::Step* step = attn::demo::find_step(step_name);
  if (step == nullptr) {
    std::cerr << "attn demo: unknown step '" << step_name << "'; the steps are:\n" << step_list();
    return 2;
  }
  std::cout << attn::demo::run_step(*step);
  return 0;
}

// The one-line report of an exception that reached main: newlines folded so that the message
// stays on one line whatever threw it.
void report_error(const char* what) {
  std::string msg = what != nullptr && *what != '\0' ? what : "unknown error";
  for (char& c : msg) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::cerr << "attn: error: " << msg << std::endl;
}

int run(int argc, char** argv) {
  CLI::App app{
      "attn: attention mechanisms of transformer language models, with PyTorch's numbers.\n"
      "Run `attn demo` to walk through chapter 3 of \"Build a Large Language Model (From\n"
      "Scratch)\": every tensor printed is the one PyTorch prints for the same code and seed.\n"
      "Run `attn bench` to time the attention kernels against the machine's FMA peak, or when\n"
      "decoding (L <= 16) against its memory bandwidth (`attn kernels` lists the kernels and\n"
      "whether this CPU runs each).\n"
      "Run `attn train` to train a tiny GPT on a task that needs attention, then `attn generate`\n"
      "and `attn heatmap` to decode with a paged KV cache and to see where its heads look\n"
      "(`attn eval` measures what a bf16 or int8 KV cache changes in its predictions)."};
  app.require_subcommand(1);
  app.footer(
      "Each subcommand has its own --help. Tensors are printed in PyTorch's format; seeds give\n"
      "PyTorch's weights and dropout masks (x86 AVX2 kernels, torch 1.13). Errors are reported\n"
      "on one line with exit code 1; usage errors exit with 2.");

  std::string step;
  bool list = false;
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Walk through the chapter step by step on \"Your journey starts with one step\":\n"
      "dot-product scores, naive and stable softmax, context vectors, trainable weights\n"
      "(SelfAttention v1/v2), causal masks, dropout, CausalAttention, multi-head attention,\n"
      "embeddings from a vocabulary and the variance argument for 1/sqrt(d_k).");
  demo->add_option("--step", step, "Print only this step (see --list)");
  demo->add_flag("--list", list, "List the steps and exit");
  demo->footer("Steps:\n" + step_list());

  attn::bench::BenchConfig bench_config;
  int64_t kv_heads = 0, seq_kv = 0;
  int threads = 0;
  std::string kv_dtype;
  double softcap = 0.0;
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Time scaled_dot_product_attention on random q (B, H, L, E) and k, v (B, Hkv, S, E):\n"
      "median and min of the timed runs, GFLOP/s (4*B*H*L*S*E, halved when causal), the FMA\n"
      "peak measured in the same run on the same threads, peak RSS and the BLAS core.\n"
      "Decode mode, L <= 16 (forward): the K/V bytes read per second (B*Hkv*S*(E+Ev) elements\n"
      "per call: each kv head once, also under GQA) against the read bandwidth measured in the\n"
      "same run (STREAM-like sum over an array of 8x the last-level cache) and their ratio; the\n"
      "timed calls rotate among enough copies of K/V (8x the last-level cache and more) that K/V\n"
      "come from memory, and a warm figure (one copy every call) is shown beside it. The probe is\n"
      "read again after the timed runs (probe after); if the two differ by more than 15 %, the\n"
      "machine's bandwidth changed during the run and the ratio is flagged unreliable.\n"
      "Decoding several new tokens: --seq 16 --seq-kv 8192 --causal --causal-align bottom-right.");
  bench->add_option("--batch", bench_config.batch, "Batch size B")->capture_default_str();
  bench->add_option("--heads", bench_config.heads, "Query heads H")->capture_default_str();
  CLI::Option* kv_heads_opt =
      bench->add_option("--kv-heads", kv_heads, "Key/value heads Hkv (default: H; GQA if fewer)");
  bench->add_option("--seq", bench_config.seq, "Query length L")->capture_default_str();
  CLI::Option* seq_kv_opt = bench->add_option("--seq-kv", seq_kv, "Key/value length S (default: L)");
  bench->add_option("--dim", bench_config.dim, "Head dimension E")->capture_default_str();
  bench->add_flag("--causal", bench_config.causal,
                  "Causal mask (top-left, as PyTorch's is_causal, unless --causal-align)");
  bench->add_option("--causal-align", bench_config.causal_align,
                    "Where the causal diagonal sits when L != S: top-left (PyTorch's is_causal) or "
                    "bottom-right (decoding with a KV cache: the last query sees every key; "
                    "needs --causal)")
      ->capture_default_str();
  CLI::Option* threads_opt = bench->add_option(
      "--threads", threads, "OpenMP and OpenBLAS threads (default: every core)");
  bench->add_option("--repeats", bench_config.repeats, "Timed runs")->capture_default_str();
  bench->add_option("--warmup", bench_config.warmup, "Untimed runs first")->capture_default_str();
  bench->add_option("--impl", bench_config.impl,
                    "Kernel family: fused, reference or auto (the best kernel that takes the call)")
      ->capture_default_str();
  bench->add_option("--kernel", bench_config.kernel,
                    "Force one registered kernel by name (`attn kernels` lists them), e.g. "
                    "cpu.flash.avx2");
  bench->add_option("--dtype", bench_config.dtype,
                    "Element type of q, k, v: f32, bf16, f16 or f64 (16-bit inputs run on the "
                    "kernel `attn kernels` shows kAuto choosing: bf16 and f16 on the AMX tiles "
                    "where present, else native bf16 where this CPU's dot unit pays, else "
                    "widened on a float32 kernel)")
      ->capture_default_str();
  bench->add_option("--precision", bench_config.precision,
                    "With --dtype f32: float32_matmul_precision, as torch.set_float32_matmul_precision: "
                    "highest (float32 FMA kernels), high (bf16x3 on the AMX tiles) or medium (bf16 "
                    "products on them); high and medium run float32 on the FMA kernels where the CPU "
                    "has no AMX")
      ->capture_default_str();
  CLI::Option* kv_dtype_opt = bench->add_option(
      "--kv-dtype", kv_dtype,
      "Element type of k, v: f32, bf16 or f16 (default: --dtype). Another dtype than q's (e.g. "
      "f32 queries against a bf16 cache) needs a kernel that takes it; if none does, the "
      "library's reason is a usage error");
  bench->add_option("--page-size", bench_config.page_size,
                    "Decode from a paged KV cache (attn::PagedKvCache, pages of this many tokens, "
                    "the sequences' pages interleaved in the pool) through paged_attention; "
                    "--kv-dtype may then also be int8. Also measures the read probe in the pool's "
                    "pattern (a sequence's pages, each holding every kv head, in block-table "
                    "order) and, for a float cache, the same K/V as dense tensors, each call right "
                    "after a paged one (contiguous; paged / contiguous)");
  bench->add_option("--window-left", bench_config.window_left,
                    "Sliding window: keys before the (aligned) diagonal each query sees (-1: all)")
      ->capture_default_str();
  bench->add_option("--window-right", bench_config.window_right,
                    "Sliding window: keys after the diagonal each query sees (-1: all)")
      ->capture_default_str();
  CLI::Option* softcap_opt = bench->add_option("--softcap", softcap, "Logit softcapping c > 0");
  bench->add_flag("--alibi", bench_config.alibi, "ALiBi biases (slopes 2^(-8(h+1)/H))");
  bench->add_flag("--sinks", bench_config.sinks, "Learnable attention sinks (random logits)");
  bench->add_option("--varlen", bench_config.varlen,
                    "Time varlen_attn on N packed sequences against the same padded (0: off)");
  bench->add_option("--varlen-min", bench_config.varlen_min, "Shortest --varlen sequence")
      ->capture_default_str();
  bench->add_option("--varlen-max", bench_config.varlen_max, "Longest --varlen sequence")
      ->capture_default_str();
  bench->add_flag("--backward", bench_config.backward,
                  "Time the backward pass (dQ, dK, dV) instead of the forward; FLOPs counted as 2.5x "
                  "the forward's, as FlashAttention does");
  bench->add_flag("--no-residual", bench_config.no_residual,
                  "With --backward and 16-bit inputs: save no output_residual in the forward (by default "
                  "it is saved, as attn.torch and the modules do), so the backward re-derives the float32 "
                  "output");
  bench->add_flag("--allow-fp16-bf16-reduction", bench_config.reduction,
                  "16-bit inputs: SdpaOptions::allow_fp16_bf16_reduction, FlashAttention's numerics (P and dS "
                  "rounded to one 16-bit term in the backward; the forward's P in one term also when it saves "
                  "output_residual)");
  bench->add_flag("--json", bench_config.json, "Print one JSON object instead of the table");
  bench->add_flag("--peak-only", bench_config.peak_only,
                  "Only measure the FMA, BF16 dot and AMX tile peaks (where present) and the memory read bandwidth on "
                  "--threads threads");

  CLI::App* kernels = app.add_subcommand(
      "kernels", "List the SDPA kernels, their dtypes and whether they run on this CPU (and why not)");

  const std::function<int()> run_train = attn::cli::add_train_command(app);
  const std::function<int()> run_generate = attn::cli::add_generate_command(app);
  const std::function<int()> run_heatmap = attn::cli::add_heatmap_command(app);
  const std::function<int()> run_eval = attn::cli::add_eval_command(app);
#ifdef ATTN_HAVE_DIST
  const std::function<int()> run_ring = attn::cli::add_ring_command(app);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the help or the usage error
    return code == 0 ? 0 : 2;
  }
  try {
    if (demo->parsed()) return run_demo(step, list);
    if (app.got_subcommand("train")) return run_train();
    if (app.got_subcommand("generate")) return run_generate();
    if (app.got_subcommand("heatmap")) return run_heatmap();
    if (app.got_subcommand("eval")) return run_eval();
#ifdef ATTN_HAVE_DIST
    if (app.got_subcommand("ring")) return run_ring();
#endif
    if (kernels->parsed()) {
      std::cout << attn::bench::format_kernels();
      return 0;
    }
    if (bench->parsed()) {
      if (kv_heads_opt->count() > 0) bench_config.kv_heads = kv_heads;
      if (seq_kv_opt->count() > 0) bench_config.seq_kv = seq_kv;
      if (threads_opt->count() > 0) bench_config.threads = threads;
      if (kv_dtype_opt->count() > 0) bench_config.kv_dtype = kv_dtype;
      if (softcap_opt->count() > 0) bench_config.softcap = softcap;
      return attn::bench::run_bench_command(bench_config, std::cout, std::cerr);
    }
  } catch (const attn::Error& e) {
    report_error(e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // std::bad_alloc, std::system_error, fmt::format_error, ...
    report_error(e.what());
  } catch (...) {
    report_error("unknown exception");
  }
  return 1;
}

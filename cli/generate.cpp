// `attn generate`: continue prompts with a trained checkpoint, one token at a time, greedy or
// sampled, through the paged KV cache (default; several prompts decode together as one batch)
// or recomputing the whole sequence; --bench times both.
#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attn/gpt_train.hpp"
#include "gpt_commands.hpp"

namespace attn::cli {

namespace {

struct GenerateArgs {
  std::string checkpoint, prompts_file, kv_dtype = "f32";
  std::vector<std::string> prompts;
  gpt::SamplingOptions sampling;
  bool no_cache = false, bench = false, random = false;
  gpt::GPTConfig random_config{.vocab_size = 64, .context_length = 256, .d_model = 128,
                               .n_layers = 4, .n_heads = 4};
  int repeats = 3;
  int threads = 1;  // tiny models: more threads only add synchronisation
};

// Decode tokens/s of generating from a one-token prompt to the full context, best of `repeats`.
double decode_tokens_per_s(const gpt::GPTModel& model, gpt::SamplingOptions o, bool use_cache, int repeats,
                           int64_t* n) {
  o.temperature = 0.0f;
  o.max_new_tokens = model.config.context_length;
  o.use_cache = use_cache;
  const std::vector<int64_t> prompt{0};
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int64_t> out = gpt::generate(model, prompt, o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    *n = static_cast<int64_t>(out.size());
    best = std::max(best, static_cast<double>(out.size()) / s);
  }
  return best;
}

}  // namespace

std::optional<DType> parse_kv_dtype(const std::string& name) {
  if (name == "f32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "f16") return DType::kFloat16;
  if (name == "int8") return DType::kInt8;
  return std::nullopt;
}

namespace {

// --prompt (repeatable) then the lines of --prompts-file (blank lines skipped); false after a
// usage error printed.
bool collect_prompts(const GenerateArgs& a, std::vector<std::string>& out) {
  out = a.prompts;
  if (!a.prompts_file.empty()) {
    std::ifstream in(a.prompts_file);
    if (!in) {
      std::cerr << fmt::format("attn generate: cannot read --prompts-file '{}'\n", a.prompts_file);
      return false;
    }
    for (std::string line; std::getline(in, line);) {
      if (line.find_first_not_of(" \t\r") != std::string::npos) out.push_back(line);
    }
  }
  if (out.empty()) std::cerr << "attn generate: give a prompt (--prompt, repeatable, or --prompts-file)\n";
  return !out.empty();
}

int run_generate(GenerateArgs& a) {
  const std::optional<DType> kv_dtype = parse_kv_dtype(a.kv_dtype);
  if (!kv_dtype) {
    std::cerr << fmt::format("attn generate: --kv-dtype must be one of f32, bf16, f16, int8 (got '{}')\n",
                             a.kv_dtype);
    return 2;
  }
  a.sampling.kv_dtype = *kv_dtype;
  set_threads(a.threads);
  keep_freed_memory();
  std::unique_ptr<gpt::GPTModel> model;
  gpt::RecallTask task;
  if (a.random) {
    Generator gen(a.sampling.seed);
    model = std::make_unique<gpt::GPTModel>(a.random_config, gen);
    model->eval();
  } else {
    if (a.checkpoint.empty()) {
      std::cerr << "attn generate: --checkpoint is required (or --random --bench)\n";
      return 2;
    }
    model = gpt::load_model(a.checkpoint, &task);
  }
  if (a.bench) {
    int64_t n_cached = 0, n_full = 0;
    const double cached = decode_tokens_per_s(*model, a.sampling, true, a.repeats, &n_cached);
    const double full = decode_tokens_per_s(*model, a.sampling, false, a.repeats, &n_full);
    std::cout << fmt::format("model: {} ({} parameters)\n", model->config.describe(), model->num_parameters());
    std::cout << fmt::format("decode {} tokens, greedy, batch 1, best of {}:\n", n_cached, a.repeats);
    std::cout << fmt::format("  with KV cache ({}, pages of {}): {:10.1f} tokens/s\n", a.kv_dtype,
                             a.sampling.page_size, cached);
    std::cout << fmt::format("  without (recompute): {:8.1f} tokens/s\n", full);
    std::cout << fmt::format("  speed-up:          {:10.2f}x\n", cached / full);
    return 0;
  }
  if (a.random) {
    std::cerr << "attn generate: --random only goes with --bench\n";
    return 2;
  }
  std::vector<std::string> texts;
  if (!collect_prompts(a, texts)) return 2;
  std::vector<std::vector<int64_t>> prompts;
  for (const std::string& t : texts) prompts.push_back(task.encode(t));
  a.sampling.use_cache = !a.no_cache;
  const std::vector<std::vector<int64_t>> outs = gpt::generate_batch(*model, prompts, a.sampling);
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::cout << task.decode(prompts[i]) << " -> " << task.decode(outs[i]) << "\n";
  }
  return 0;
}

}  // namespace

std::function<int()> add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* g = app.add_subcommand(
      "generate",
      "Continue prompts with a checkpoint of `attn train`, one token at a time: each step feeds\n"
      "only the newest token and attends over the keys and values cached for the earlier ones in\n"
      "a paged KV cache (bottom-right causal alignment); several prompts decode together. Tokens are characters: letters a.., upper-case A.., and the\n"
      "separator |. A lookup checkpoint (the default task) answers --prompt\n"
      "\"pbkdgjcmfhnoleia|C\" with k (the 3rd letter); a copy checkpoint continues\n"
      "\"heecllogjmdgfnma|\" with the same 16 letters; a recall checkpoint answers \"aKbLcM|b\" with L.");
  g->add_option("--checkpoint", a->checkpoint, "Checkpoint written by `attn train`");
  g->add_option("--prompt", a->prompts, "Prompt text (spaces are ignored); repeat it to decode several "
                "prompts together as one batch")
      ->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  g->add_option("--prompts-file", a->prompts_file, "A file of prompts, one per line, decoded together with "
                "any --prompt");
  g->add_option("--kv-dtype", a->kv_dtype, "Element type of the paged KV cache: f32, bf16, f16 or int8 "
                "(per token and head scales)")->capture_default_str();
  g->add_option("--page-size", a->sampling.page_size, "Tokens per page of the KV cache")
      ->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--max-new-tokens", a->sampling.max_new_tokens, "Tokens to generate (stops at the context)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--temperature", a->sampling.temperature, "0: greedy; else sample from softmax(logits / T)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--top-k", a->sampling.top_k, "Sample among the k most likely tokens (0: all)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--seed", a->sampling.seed, "Sampling seed")->capture_default_str();
  g->add_flag("--no-cache", a->no_cache, "Recompute the whole sequence for every token (each prompt alone)");
  g->add_flag("--bench", a->bench, "Time decoding from one token to the full context, with and without the cache");
  g->add_flag("--random", a->random, "With --bench: a randomly initialised model of the shape below");
  g->add_option("--context", a->random_config.context_length, "--random: context length")->capture_default_str()
      ->check(CLI::PositiveNumber);
  g->add_option("--d-model", a->random_config.d_model, "--random: width")->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--layers", a->random_config.n_layers, "--random: blocks")->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--heads", a->random_config.n_heads, "--random: heads")->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--repeats", a->repeats, "--bench: runs per mode (best is reported)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  g->add_option("--threads", a->threads, "OpenMP and OpenBLAS threads")->capture_default_str()->check(CLI::PositiveNumber);
  return [a] { return run_generate(*a); };
}

}  // namespace attn::cli

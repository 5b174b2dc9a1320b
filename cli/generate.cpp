// `attn generate`: continue a prompt with a trained checkpoint, one token at a time, greedy or
// sampled, with the KV cache (default) or recomputing the whole sequence; --bench times both.
#include <chrono>
#include <algorithm>
#include <fmt/format.h>
#include <iostream>
#include <memory>
#include <string>

#include "attn/gpt_train.hpp"
#include "gpt_commands.hpp"

namespace attn::cli {

namespace {

struct GenerateArgs {
  std::string checkpoint, prompt;
  gpt::SamplingOptions sampling;
  bool no_cache = false, bench = false, random = false;
  gpt::GPTConfig random_config{.vocab_size = 64, .context_length = 256, .d_model = 128,
                               .n_layers = 4, .n_heads = 4};
  int repeats = 3;
  int threads = 1;  // tiny models: more threads only add synchronisation
};

// Decode tokens/s of generating from a one-token prompt to the full context, best of `repeats`.
double decode_tokens_per_s(const gpt::GPTModel& model, bool use_cache, int repeats, int64_t* n) {
  gpt::SamplingOptions o;
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

int run_generate(GenerateArgs& a) {
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
    const double cached = decode_tokens_per_s(*model, true, a.repeats, &n_cached);
    const double full = decode_tokens_per_s(*model, false, a.repeats, &n_full);
    std::cout << fmt::format("model: {} ({} parameters)\n", model->config.describe(), model->num_parameters());
    std::cout << fmt::format("decode {} tokens, greedy, batch 1, best of {}:\n", n_cached, a.repeats);
    std::cout << fmt::format("  with KV cache:     {:10.1f} tokens/s\n", cached);
    std::cout << fmt::format("  without (recompute): {:8.1f} tokens/s\n", full);
    std::cout << fmt::format("  speed-up:          {:10.2f}x\n", cached / full);
    return 0;
  }
  if (a.random) {
    std::cerr << "attn generate: --random only goes with --bench\n";
    return 2;
  }
  const std::vector<int64_t> prompt = task.encode(a.prompt);
  a.sampling.use_cache = !a.no_cache;
  const std::vector<int64_t> out = gpt::generate(*model, prompt, a.sampling);
  std::cout << task.decode(prompt) << " -> " << task.decode(out) << "\n";
  return 0;
}

}  // namespace

std::function<int()> add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* g = app.add_subcommand(
      "generate",
      "Continue a prompt with a checkpoint of `attn train`, one token at a time: each step feeds\n"
      "only the newest token and attends over the keys and values cached for the earlier ones\n"
      "(bottom-right causal alignment). Tokens are characters: letters a.., upper-case A.., and the\n"
      "separator |. A lookup checkpoint (the default task) answers --prompt\n"
      "\"pbkdgjcmfhnoleia|C\" with k (the 3rd letter); a copy checkpoint continues\n"
      "\"heecllogjmdgfnma|\" with the same 16 letters; a recall checkpoint answers \"aKbLcM|b\" with L.");
  g->add_option("--checkpoint", a->checkpoint, "Checkpoint written by `attn train`");
  g->add_option("--prompt", a->prompt, "Prompt text (spaces are ignored)");
  g->add_option("--max-new-tokens", a->sampling.max_new_tokens, "Tokens to generate (stops at the context)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--temperature", a->sampling.temperature, "0: greedy; else sample from softmax(logits / T)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--top-k", a->sampling.top_k, "Sample among the k most likely tokens (0: all)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  g->add_option("--seed", a->sampling.seed, "Sampling seed")->capture_default_str();
  g->add_flag("--no-cache", a->no_cache, "Recompute the whole sequence for every token");
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

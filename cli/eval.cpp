// `attn eval`: how much a KV cache in bfloat16, float16 or int8 changes a trained checkpoint's
// predictions. The held-out batches `attn train` evaluates on are fed token by token through a
// paged cache of each dtype (gpt::decode_logits: every key and value stored at the cache's
// precision, as generation sees them) and compared with a float32 cache: the largest logit
// difference, perplexity and accuracy on the scored answers, as a Markdown table.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attn/gpt_train.hpp"
#include "gpt_commands.hpp"

namespace attn::cli {

namespace {

struct EvalArgs {
  std::string checkpoint, kv_dtypes = "f32,bf16,f16,int8";
  int64_t batches = 4, page_size = 16;
  int threads = 1;
};

struct Row {
  std::string name;
  double max_diff = 0.0, mean_diff = 0.0;
  gpt::LossStats stats;
};

void accumulate(Row& row, const Tensor& logits, const Tensor& baseline, const gpt::RecallTask::Batch& b) {
  const std::vector<float> x = logits.to_vector(), y = baseline.to_vector();
  double sum = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = std::fabs(double(x[i]) - double(y[i]));
    row.max_diff = std::max(row.max_diff, d);
    sum += d;
  }
  row.mean_diff += sum / static_cast<double>(x.size());
  const gpt::LossStats s = gpt::masked_cross_entropy(logits, b.targets);
  row.stats.sum_nll += s.sum_nll;
  row.stats.count += s.count;
  row.stats.correct += s.correct;
}

int run_eval(const EvalArgs& a) {
  std::vector<std::string> names;
  std::vector<DType> dtypes;
  std::stringstream list(a.kv_dtypes);
  for (std::string name; std::getline(list, name, ',');) {
    const std::optional<DType> d = parse_kv_dtype(name);
    if (!d) {
      std::cerr << fmt::format("attn eval: --kv-dtype must list f32, bf16, f16 or int8 (got '{}')\n", name);
      return 2;
    }
    names.push_back(name);
    dtypes.push_back(*d);
  }
  set_threads(a.threads);
  keep_freed_memory();
  const gpt::TrainConfig cfg = gpt::TrainConfig::from_metadata(load_safetensors(a.checkpoint).metadata, a.checkpoint);
  const std::unique_ptr<gpt::GPTModel> model = gpt::load_model(a.checkpoint);
  // Row 0: the plain forward (no cache) against the float32 cache, the measure's floor.
  std::vector<Row> rows(dtypes.size() + 1);
  rows[0].name = "none (full forward)";
  for (size_t i = 0; i < dtypes.size(); ++i) rows[i + 1].name = names[i];
  for (int64_t i = 0; i < a.batches; ++i) {
    const gpt::RecallTask::Batch b = cfg.task.sample(cfg.batch_size, cfg.seed, 1, static_cast<uint64_t>(i));
    const Tensor f32 = gpt::decode_logits(*model, b.inputs, b.B, b.T, DType::kFloat32, a.page_size);
    accumulate(rows[0], model->forward(b.inputs, b.B, b.T), f32, b);
    for (size_t d = 0; d < dtypes.size(); ++d) {
      const Tensor got = dtypes[d] == DType::kFloat32
                             ? f32
                             : gpt::decode_logits(*model, b.inputs, b.B, b.T, dtypes[d], a.page_size);
      accumulate(rows[d + 1], got, f32, b);
    }
  }
  std::cout << fmt::format("model: {}; task: {}; {} held-out batches of {} sequences (seed {}), fed one token "
                           "per step, pages of {}\n\n", model->config.describe(), cfg.task.describe(), a.batches,
                           cfg.batch_size, cfg.seed, a.page_size);
  std::cout << "| KV cache | max abs logit diff vs f32 KV | mean abs logit diff | perplexity | "
               "perplexity change vs f32 KV | accuracy |\n";
  std::cout << "|---|---|---|---|---|---|\n";
  const double base = rows[0].stats.perplexity();  // the full forward's equals the f32 cache's
  for (const Row& r : rows) {
    std::cout << fmt::format("| {} | {:.3g} | {:.3g} | {:.6f} | {:+.2e} | {:.2f}% ({} of {}) |\n", r.name,
                             r.max_diff, r.mean_diff / static_cast<double>(a.batches), r.stats.perplexity(),
                             r.stats.perplexity() - base, 100.0 * r.stats.accuracy(), r.stats.correct,
                             r.stats.count);
  }
  return 0;
}

}  // namespace

std::function<int()> add_eval_command(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* e = app.add_subcommand(
      "eval",
      "Measure what a bfloat16, float16 or int8 KV cache changes in a checkpoint's predictions: the\n"
      "held-out batches of `attn train`, fed one token per step through a paged cache of each dtype,\n"
      "against a float32 cache (largest logit difference, perplexity, accuracy; a Markdown table).");
  e->add_option("--checkpoint", a->checkpoint, "Checkpoint written by `attn train`")->required();
  e->add_option("--kv-dtype", a->kv_dtypes, "Comma-separated KV cache dtypes: f32, bf16, f16, int8")
      ->capture_default_str();
  e->add_option("--batches", a->batches, "Held-out batches (of the checkpoint's batch size)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  e->add_option("--page-size", a->page_size, "Tokens per page")->capture_default_str()->check(CLI::PositiveNumber);
  e->add_option("--threads", a->threads, "OpenMP and OpenBLAS threads")->capture_default_str()
      ->check(CLI::PositiveNumber);
  return [a] { return run_eval(*a); };
}

}  // namespace attn::cli

// `attn train`: trains the tiny GPT on lookup, copying or associative recall with a progress bar, periodic held-out
// evaluation and atomic checkpoints; --resume continues a checkpoint exactly.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fmt/format.h>
#include <iostream>
#include <malloc.h>
#include <memory>
#include <omp.h>
#include <string>
#include <unistd.h>

#include "attn/error.hpp"
#include "attn/gpt_train.hpp"
#include "attn/safetensors.hpp"
#include "gpt_commands.hpp"

extern "C" {
__attribute__((weak)) void openblas_set_num_threads(int num_threads);
}

namespace attn::cli {

void keep_freed_memory() {
#ifdef __GLIBC__
  // Every step frees and allocates the same tensors again. Above glibc's mmap threshold each one
  // would be a fresh mapping whose pages fault in on first touch (a quarter of a training step's
  // time): keep them in the heap instead.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

void set_threads(int threads) {
  if (threads <= 0) return;
  omp_set_num_threads(threads);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(threads);
}

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_sigint(int) { g_interrupted = 1; }

struct TrainArgs {
  gpt::TrainConfig config;
  std::string attention = "softmax";
  std::string task = "lookup";
  std::string checkpoint = "gpt.safetensors";
  std::string resume;
  int64_t eval_every = 100;
  int threads = 1;  // tiny models: more threads only add synchronisation
  CLI::App* app = nullptr;
};

std::string clock_str(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

std::string eval_line(int64_t step, const gpt::LossStats& s) {
  return fmt::format("eval  step {:>5}  loss {:.4f}  perplexity {:.4f}  accuracy {:.2f}% ({} of {} answers)",
                     step, s.mean(), s.perplexity(), 100.0 * s.accuracy(), s.correct, s.count);
}

bool was_given(const CLI::App* app, const char* name) { return app->get_option(name)->count() > 0; }

int run_train(TrainArgs& a) {
  set_threads(a.threads);
  keep_freed_memory();
  gpt::TrainConfig cfg = a.config;
  cfg.model.attention = a.attention == "uniform" ? gpt::AttentionKind::kUniform : gpt::AttentionKind::kSoftmax;
  cfg.task.kind = gpt::RecallTask::kind_from_name(a.task);
  if (!a.resume.empty()) {
    // The checkpoint's configuration, with the options given on this command line on top (a
    // different model shape is then refused by Trainer::resume).
    const gpt::TrainConfig saved = gpt::TrainConfig::from_metadata(load_safetensors(a.resume).metadata, a.resume);
    gpt::TrainConfig merged = saved;
    // Every option given on the command line overrides the checkpoint's value; a task or model
    // shape that then differs is refused by Trainer::resume (naming both).
    const CLI::App* app = a.app;
    auto take = [&](const char* flag, auto member) {
      if (was_given(app, flag)) merged.*member = cfg.*member;
    };
    auto take_model = [&](const char* flag, auto member) {
      if (was_given(app, flag)) merged.model.*member = cfg.model.*member;
    };
    auto take_task = [&](const char* flag, auto member) {
      if (was_given(app, flag)) merged.task.*member = cfg.task.*member;
    };
    take("--steps", &gpt::TrainConfig::steps);
    take("--batch", &gpt::TrainConfig::batch_size);
    take("--lr", &gpt::TrainConfig::lr);
    take("--min-lr", &gpt::TrainConfig::min_lr);
    take("--warmup", &gpt::TrainConfig::warmup_steps);
    take("--weight-decay", &gpt::TrainConfig::weight_decay);
    take("--grad-clip", &gpt::TrainConfig::grad_clip);
    take("--eval-batches", &gpt::TrainConfig::eval_batches);
    take("--seed", &gpt::TrainConfig::seed);
    take_model("--d-model", &gpt::GPTConfig::d_model);
    take_model("--layers", &gpt::GPTConfig::n_layers);
    take_model("--heads", &gpt::GPTConfig::n_heads);
    take_model("--dropout", &gpt::GPTConfig::dropout);
    take_model("--tie-weights", &gpt::GPTConfig::tie_weights);
    take_model("--attention", &gpt::GPTConfig::attention);
    take_task("--task", &gpt::RecallTask::kind);
    take_task("--copy-length", &gpt::RecallTask::copy_length);
    take_task("--pairs", &gpt::RecallTask::num_pairs);
    take_task("--queries", &gpt::RecallTask::num_queries);
    take_task("--keys", &gpt::RecallTask::num_keys);
    take_task("--values", &gpt::RecallTask::num_values);
    if (!(merged.task == saved.task)) {  // before the sizes are checked against the model's
      throw ValueError(fmt::format("{}: the checkpoint was trained on {}, this run asks for {}", a.resume,
                                   saved.task.describe(), merged.task.describe()));
    }
    cfg = merged;
    if (!was_given(app, "--checkpoint")) a.checkpoint = a.resume;
  } else {
    cfg.model.vocab_size = cfg.task.vocab_size();
    cfg.model.context_length = cfg.task.context_length();
  }
  gpt::Trainer trainer(cfg);
  if (!a.resume.empty()) trainer.resume(a.resume);
  const int64_t params = trainer.model().num_parameters();
  std::cerr << fmt::format("attn train: {} parameters ({}), task: {}, {} steps of {} sequences, "
                           "seed {}\n", params, cfg.model.describe(), cfg.task.describe(), cfg.steps,
                           cfg.batch_size, cfg.seed);
  if (trainer.step() > 0) std::cerr << fmt::format("resumed from {} at step {}\n", a.resume, trainer.step());

  g_interrupted = 0;
  auto previous = std::signal(SIGINT, on_sigint);
  const bool tty = isatty(fileno(stderr)) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t first = trainer.step();
  int64_t tokens = 0, last_saved = -1;
  double ema = 0.0;
  auto last_draw = t0;
  auto checkpoint = [&] {
    trainer.save_checkpoint(a.checkpoint);
    last_saved = trainer.step();
  };
  while (trainer.step() < cfg.steps) {
    if (g_interrupted) break;
    const gpt::StepStats s = trainer.train_step();
    tokens += s.tokens;
    ema = s.step == first + 1 ? s.loss : 0.95 * ema + 0.05 * s.loss;
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - t0).count();
    const double per_step = elapsed / static_cast<double>(s.step - first);
    const bool eval_now = s.step % a.eval_every == 0 || s.step == cfg.steps;
    if ((tty && std::chrono::duration<double>(now - last_draw).count() > 0.1) || eval_now) {
      last_draw = now;
      const int width = 24, filled = static_cast<int>(width * s.step / cfg.steps);
      const std::string line = fmt::format(
          "step {:>5}/{} [{}{}] loss {:.4f} ppl {:.3f} | {:.0f} tok/s | lr {:.2e} | ETA {}", s.step,
          cfg.steps, std::string(static_cast<size_t>(filled), '#'),
          std::string(static_cast<size_t>(width - filled), '.'), ema, std::exp(ema),
          static_cast<double>(tokens) / elapsed, s.lr,
          clock_str(per_step * static_cast<double>(cfg.steps - s.step)));
      std::cerr << (tty ? "\r" + line + "\033[K" : line + "\n") << std::flush;
    }
    if (eval_now) {
      const gpt::LossStats e = trainer.evaluate(cfg.eval_batches);
      if (tty) std::cerr << "\n";
      std::cerr << eval_line(s.step, e) << "\n";
      checkpoint();
    }
  }
  std::signal(SIGINT, previous);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (g_interrupted) {
    if (tty) std::cerr << "\n";
    std::cerr << fmt::format("attn train: interrupted at step {}; {}\n", trainer.step(),
                             last_saved >= 0 || !a.resume.empty()
                                 ? fmt::format("the last checkpoint ({}) is intact: continue with "
                                               "--resume {}", a.checkpoint, a.checkpoint)
                                 : std::string("no checkpoint was written yet"));
    return 130;
  }
  if (last_saved != trainer.step()) checkpoint();
  std::cout << fmt::format("trained {} steps in {:.1f} s ({:.0f} tok/s); checkpoint: {}\n",
                           trainer.step() - first, elapsed,
                           static_cast<double>(tokens) / std::max(elapsed, 1e-9), a.checkpoint);
  return 0;
}

}  // namespace

std::function<int()> add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  gpt::TrainConfig& c = a->config;
  CLI::App* t = app.add_subcommand(
      "train",
      "Train a tiny GPT (token + position embeddings, pre-norm blocks of causal multi-head\n"
      "attention and a GELU MLP, AdamW with weight decay, gradient clipping, warm-up and cosine\n"
      "decay) on a task whose answers can only be read off the context.\n"
      "lookup (default): \"x1 ... xn | P1 y1 P2 y2 ...\", the n letters in random order, then\n"
      "positions named by upper-case letters ('A' is the first), each answered by the letter\n"
      "there (the ablation --attention uniform stays near chance on it). copy: \"x1 ... xn |\n"
      "x1 ... xn\", each copied token is the one n positions back. recall: \"k1 v1 k2 v2 ... |\n"
      "q1 a1 ...\", each answer is the value given earlier to the queried key. Prints step, loss,\n"
      "perplexity, tokens/s and ETA,\n"
      "evaluates on held-out sequences (loss, perplexity, accuracy) and writes a safetensors\n"
      "checkpoint (atomically) at every evaluation.");
  a->app = t;
  t->add_option("--steps", c.steps, "Optimisation steps")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--batch", c.batch_size, "Sequences per step")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--lr", c.lr, "Peak learning rate (after warm-up)")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--min-lr", c.min_lr, "Learning rate at the end of the cosine decay")->capture_default_str();
  t->add_option("--warmup", c.warmup_steps, "Linear warm-up steps")->capture_default_str()->check(CLI::NonNegativeNumber);
  t->add_option("--weight-decay", c.weight_decay, "AdamW decoupled weight decay (matrices and embeddings)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  t->add_option("--grad-clip", c.grad_clip, "Max global gradient norm (0: off)")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  t->add_option("--d-model", c.model.d_model, "Embedding width")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--layers", c.model.n_layers, "Transformer blocks")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--heads", c.model.n_heads, "Attention heads")->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--dropout", c.model.dropout, "Dropout on the attention weights")->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  t->add_flag("--tie-weights", c.model.tie_weights, "Output head shares tok_emb.weight");
  t->add_option("--attention", a->attention,
                "softmax, or uniform: the ablation averaging all previous positions equally")
      ->capture_default_str()->check(CLI::IsMember({"softmax", "uniform"}));
  t->add_option("--task", a->task, "lookup: n shuffled letters, then queried positions; copy: repeat n "
                "random tokens after '|'; recall: key-value pairs, then queried keys")
      ->capture_default_str()->check(CLI::IsMember({"lookup", "copy", "recall"}));
  t->add_option("--copy-length", c.task.copy_length, "copy, lookup: tokens before the separator")
      ->capture_default_str()->check(CLI::PositiveNumber);
  t->add_option("--pairs", c.task.num_pairs, "recall: key-value pairs per sequence")->capture_default_str()
      ->check(CLI::PositiveNumber);
  t->add_option("--queries", c.task.num_queries, "recall, lookup: queries per sequence")->capture_default_str()
      ->check(CLI::PositiveNumber);
  t->add_option("--keys", c.task.num_keys, "Key vocabulary (<= 26)")->capture_default_str()->check(CLI::Range(1, 26));
  t->add_option("--values", c.task.num_values, "Value vocabulary (<= 26)")->capture_default_str()->check(CLI::Range(1, 26));
  t->add_option("--seed", c.seed, "Seed of the weights, the data and dropout")->capture_default_str();
  t->add_option("--eval-every", a->eval_every, "Evaluate and checkpoint every N steps")->capture_default_str()
      ->check(CLI::PositiveNumber);
  t->add_option("--eval-batches", c.eval_batches, "Held-out batches per evaluation")->capture_default_str()
      ->check(CLI::PositiveNumber);
  t->add_option("--checkpoint", a->checkpoint, "Checkpoint file (safetensors)")->capture_default_str();
  t->add_option("--resume", a->resume, "Continue from this checkpoint (its configuration; "
                "--steps may extend it)");
  t->add_option("--threads", a->threads, "OpenMP and OpenBLAS threads")->capture_default_str()
      ->check(CLI::PositiveNumber);
  t->footer(
      "Perplexity = exp(mean cross-entropy) = exp(-(1/N) sum_i log p(answer_i | context_i)) over\n"
      "the N scored tokens: 1 is certainty, 16 (the number of letters the answer is drawn from) is\n"
      "guessing.\n"
      "Same seed and options give the same run; Ctrl-C stops it and leaves the last checkpoint\n"
      "intact (exit code 130).");
  return [a] { return run_train(*a); };
}

}  // namespace attn::cli

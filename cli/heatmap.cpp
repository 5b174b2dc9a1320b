// `attn heatmap`: attention weights as a PNG, one panel per head. --demo draws the chapter's
// mechanisms on "Your journey starts with one step"; --checkpoint draws every head of a trained
// model on an example of its task, with the cells the task needs outlined.
#include <algorithm>
#include <fmt/format.h>
#include <iostream>
#include <memory>
#include <string>

#include "attn/attn.hpp"
#include "attn/gpt_train.hpp"
#include "gpt_commands.hpp"
#include "heatmap_render.hpp"

namespace attn::cli {

namespace {

struct HeatmapArgs {
  bool demo = false;
  std::string checkpoint, prompt, out = "attention.png";
  uint64_t seed = 7;
  int64_t layer = 0;  // 1-based; 0 = every layer
};

const std::vector<std::string> kWords = {"Your", "journey", "starts", "with", "one", "step"};

// The chapter's inputs (cell 24), as `attn demo` uses them.
Tensor chapter_inputs() {
  return Tensor::of({6, 3}, {0.43f, 0.15f, 0.89f, 0.55f, 0.87f, 0.66f, 0.57f, 0.85f, 0.64f,
                             0.22f, 0.58f, 0.33f, 0.77f, 0.25f, 0.10f, 0.05f, 0.80f, 0.55f});
}

HeatPanel panel(std::string title, const TensorView& w, const std::vector<std::string>& labels) {
  // w (L, S) -> a panel labelled with the tokens
  HeatPanel p;
  p.title = std::move(title);
  p.rows = w.size(0);
  p.cols = w.size(1);
  p.weights = w.to_vector();
  p.row_labels = labels;
  p.col_labels = labels;
  return p;
}

std::vector<HeatPanel> demo_panels() {
  const Tensor x = chapter_inputs();
  std::vector<HeatPanel> panels;
  // 3.3: softmax(x x^T), no trainable weights.
  panels.push_back(panel("simplified: softmax(x x^T)", softmax(matmul(x, x.t()), -1), kWords));
  // 3.4: SelfAttention_v2 (seed 789): softmax(q k^T / sqrt(d_k)); 3.5.1: the same, causal.
  manual_seed(789);
  const nn::SelfAttentionV2 sa(3, 2);
  const Tensor q = sa.W_query.forward(x), k = sa.W_key.forward(x), v = sa.W_value.forward(x);
  SdpaOptions o;
  o.need_weights = true;
  panels.push_back(panel("self-attention v2", scaled_dot_product_attention(q, k, v, o).attn_weights, kWords));
  o.is_causal = true;
  panels.push_back(panel("causal", scaled_dot_product_attention(q, k, v, o).attn_weights, kWords));
  // 3.6.2: MultiHeadAttention(3, 2, 6, 0.0, num_heads=2) (seed 123): one panel per head.
  manual_seed(123);
  const nn::MultiHeadAttention mha(3, 2, 6, 0.0f, 2);
  auto heads = [&](const Tensor& t) { return t.view({6, 2, 1}).transpose(0, 1); };  // (H, T, hd)
  const Tensor mq = mha.W_query.forward(x), mk = mha.W_key.forward(x), mv = mha.W_value.forward(x);
  const Tensor w = scaled_dot_product_attention(heads(mq), heads(mk), heads(mv), o).attn_weights;
  for (int64_t h = 0; h < 2; ++h) {
    panels.push_back(panel(fmt::format("multi-head: head {}", h), w.select(0, h), kWords));
  }
  return panels;
}

int run_heatmap(const HeatmapArgs& a) {
  if (a.demo == !a.checkpoint.empty()) {
    std::cerr << "attn heatmap: give exactly one of --demo and --checkpoint\n";
    return 2;
  }
  std::vector<HeatPanel> panels;
  std::string title;
  int columns = 0;
  if (a.demo) {
    panels = demo_panels();
    columns = 5;
    title = "Attention weights on \"Your journey starts with one step\" (rows: queries, columns: keys)";
  } else {
    gpt::RecallTask task;
    const std::unique_ptr<gpt::GPTModel> model = gpt::load_model(a.checkpoint, &task);
    const gpt::GPTConfig& c = model->config;
    std::vector<int64_t> ids;
    if (!a.prompt.empty()) {
      ids = task.encode(a.prompt);
    } else {
      const gpt::RecallTask::Batch b = task.sample(1, a.seed, 2, 0);  // stream 2: neither train nor eval
      ids = b.inputs;
    }
    if (ids.empty()) throw ValueError("heatmap: the prompt must have at least one token");
    if (static_cast<int64_t>(ids.size()) > c.context_length) {
      throw ShapeError(fmt::format("heatmap: the prompt has {} tokens, more than the model's context "
                                   "length {}", ids.size(), c.context_length));
    }
    if (a.layer < 0 || a.layer > c.n_layers) {
      throw ValueError(fmt::format("heatmap: --layer must be in [1, {}] (or 0 for all), got {}",
                                   c.n_layers, a.layer));
    }
    gpt::KVCache cache(c, 1);
    std::vector<Tensor> weights;
    model->forward_cached(ids, 1, static_cast<int64_t>(ids.size()), cache, &weights);
    std::vector<std::string> labels;
    for (int64_t id : ids) labels.emplace_back(1, task.token_char(id));
    const auto lookups = task.sources(ids);
    // Where each scored position's answer is: the position the query names (lookup), the token
    // n back (copy), the value after the queried key (recall).
    const std::vector<std::pair<int64_t, int64_t>>& marks = lookups;
    std::cout << fmt::format("sequence: {}\n", task.decode(ids));
    for (int64_t l = 0; l < c.n_layers; ++l) {
      if (a.layer != 0 && l + 1 != a.layer) continue;
      for (int64_t h = 0; h < c.n_heads; ++h) {
        const Tensor w = weights[static_cast<size_t>(l)].select(0, 0).select(0, h).contiguous();
        HeatPanel p = panel(fmt::format("layer {} head {}", l + 1, h + 1), w, labels);
        p.marks = marks;
        // Also the key position with the largest mean weight over the scored rows: a head can
        // solve the task by reading something other than the answer's position.
        double on_source = 0.0, before = 0.0;
        std::vector<double> per_key(ids.size(), 0.0);
        for (const auto& [t, src] : lookups) {
          on_source += w.at({t, src});
          if (src > 0) before += w.at({t, src - 1});
          for (int64_t k = 0; k <= t; ++k) per_key[static_cast<size_t>(k)] += w.at({t, k});
        }
        const double n = std::max<double>(1.0, static_cast<double>(lookups.size()));
        const size_t top = static_cast<size_t>(std::max_element(per_key.begin(), per_key.end()) - per_key.begin());
        std::cout << fmt::format("layer {} head {}: at the {} scored positions, mean weight {:.3f} on "
                                 "the answer's position, {:.3f} on the one before it; most: {:.3f} on "
                                 "position {} ('{}')\n", l + 1, h + 1, lookups.size(), on_source / n,
                                 before / n, per_key[top] / n, top + 1, labels[top]);
        panels.push_back(std::move(p));
      }
    }
    columns = static_cast<int>(c.n_heads);
    title = fmt::format("{}: attention weights (rows: queries, columns: keys; red: where the "
                        "answer is)", a.checkpoint);
  }
  write_png(render_heatmaps(panels, columns, title), a.out);
  std::cout << fmt::format("wrote {} ({} panels)\n", a.out, panels.size());
  return 0;
}

}  // namespace

std::function<int()> add_heatmap_command(CLI::App& app) {
  auto a = std::make_shared<HeatmapArgs>();
  CLI::App* h = app.add_subcommand(
      "heatmap",
      "Render attention weights as a PNG heatmap, one panel per head, tokens on both axes (rows:\n"
      "queries, columns: keys). --demo: the chapter's mechanisms on \"Your journey starts with\n"
      "one step\" (simplified, self-attention v2, causal, both heads of MultiHeadAttention).\n"
      "--checkpoint: every head of a trained model on an example of its task; the cells holding\n"
      "each answer are outlined in red, and the weight each head puts there is printed.");
  h->add_flag("--demo", a->demo, "The chapter's example sentence");
  h->add_option("--checkpoint", a->checkpoint, "Checkpoint written by `attn train`");
  h->add_option("--prompt", a->prompt, "Sequence to show (default: a random example of the checkpoint's task)");
  h->add_option("--seed", a->seed, "Seed of the random example")->capture_default_str();
  h->add_option("--layer", a->layer, "Only this layer (1-based; 0: all)")->capture_default_str();
  h->add_option("--out", a->out, "Output PNG file")->capture_default_str();
  return [a] { return run_heatmap(*a); };
}

}  // namespace attn::cli

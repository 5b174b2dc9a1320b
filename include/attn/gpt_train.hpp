// Training the tiny GPT on its tasks (`attn train`), and checkpoints: one safetensors file
// with the model's state_dict under PyTorch-style names ("tok_emb.weight",
// "blocks.0.att.W_query.weight", ...), AdamW's moments under "optimizer.exp_avg.<name>" and
// "optimizer.exp_avg_sq.<name>", and the model, task and training configuration plus the step in
// the metadata. Files are written atomically (temp file, then rename), so an interrupted run
// leaves the previous checkpoint intact.
//
// Determinism: the initial weights come from Generator(seed), training batch s from the task
// stream (seed, 0, s), held-out batch i from (seed, 1, i), dropout masks at step s from
// Generator(mix(seed, s)); the fused attention kernel is bit-identical for any thread count. So
// the same configuration gives the same losses, and resuming from a checkpoint written at step
// s gives the same steps s + 1, ... as the uninterrupted run.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attn/gpt.hpp"
#include "attn/optim.hpp"
#include "attn/safetensors.hpp"

namespace attn::gpt {

struct TrainConfig {
  GPTConfig model;
  RecallTask task;
  int64_t steps = 500;
  int64_t batch_size = 32;
  int64_t warmup_steps = 50;
  double lr = 3e-3, min_lr = 3e-4;
  double weight_decay = 0.1;  // on 2-D weights (matrices, embeddings); not on biases and norms
  double beta1 = 0.9, beta2 = 0.98;
  double grad_clip = 1.0;     // max global gradient norm; 0 disables clipping
  int64_t eval_batches = 16;  // held-out batches of batch_size sequences per evaluation
  uint64_t seed = 1234;

  void validate() const;  // ValueError naming the field
  std::map<std::string, std::string> to_metadata() const;  // model, task and "train.*" keys
  static TrainConfig from_metadata(const std::map<std::string, std::string>& meta,
                                   const std::string& source);
};

struct StepStats {
  int64_t step = 0;      // steps done after this one
  double loss = 0.0;     // mean cross-entropy of the batch's scored tokens (before the update)
  double lr = 0.0;
  double grad_norm = 0.0;
  int64_t tokens = 0;    // tokens processed (B * T)
};

class Trainer {
 public:
  explicit Trainer(const TrainConfig& config);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  StepStats train_step();
  // Loss, perplexity and accuracy on the held-out batches (eval mode, no gradients).
  LossStats evaluate(int64_t num_batches);
  void save_checkpoint(const std::string& path);
  // Model, optimizer state and step from a checkpoint of this configuration: ValueError when its
  // model or task configuration differs, ShapeError / FormatError from the file itself.
  void resume(const std::string& path);

  int64_t step() const { return step_; }
  GPTModel& model() { return *model_; }
  const TrainConfig& config() const { return config_; }

 private:
  TrainConfig config_;
  std::unique_ptr<GPTModel> model_;
  std::vector<nn::ParameterWithGrad> params_;
  std::unique_ptr<optim::AdamW> optimizer_;
  Generator dropout_gen_;
  int64_t step_ = 0;
};

// Copies the model entries of a checkpoint into `model` (strict: every state_dict entry, no
// unknown model entry). A tensor whose shape differs throws ShapeError naming `source`, the
// entry and both shapes.
void load_weights(GPTModel& model, const Safetensors& file, const std::string& source);

// A model for inference from a checkpoint: its configuration from the metadata, then the
// weights. IoError (unreadable), FormatError (corrupt, truncated, not a checkpoint), ShapeError
// (tensors that do not fit the configuration). task, step: if non-null, the checkpoint's.
std::unique_ptr<GPTModel> load_model(const std::string& path, RecallTask* task = nullptr,
                                     int64_t* step = nullptr);

}  // namespace attn::gpt

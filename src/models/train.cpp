// The training loop's pieces (one step, held-out evaluation) and checkpoints
// (include/attn/gpt_train.hpp).
#include <charconv>
#include <cmath>
#include <fmt/format.h>
#include <utility>

#include "attn/error.hpp"
#include "attn/gpt_train.hpp"

namespace attn::gpt {

namespace {

constexpr const char* kFormat = "attn-gpt-checkpoint-v1";
constexpr const char* kOptPrefix = "optimizer.";

uint64_t mix(uint64_t x) {  // SplitMix64
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

const std::string& meta_str(const std::map<std::string, std::string>& meta, const std::string& key,
                            const std::string& source) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    throw FormatError(fmt::format("{}: metadata lacks '{}' (not a checkpoint written by `attn train`?)",
                                  source, key));
  }
  return it->second;
}

template <typename T>
T meta_num(const std::map<std::string, std::string>& meta, const std::string& key,
           const std::string& source) {
  const std::string& s = meta_str(meta, key, source);
  T v{};
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) {
    throw FormatError(fmt::format("{}: metadata '{}' must be a number, got '{}'", source, key, s));
  }
  return v;
}

void check_format(const Safetensors& file, const std::string& source) {
  auto it = file.metadata.find("format");
  if (it == file.metadata.end() || it->second != kFormat) {
    throw FormatError(fmt::format("{}: not an attn GPT checkpoint (metadata 'format' must be '{}')",
                                  source, kFormat));
  }
}

}  // namespace

// ---- TrainConfig ------------------------------------------------------------------------------------

void TrainConfig::validate() const {
  model.validate();
  task.validate();
  if (model.vocab_size != task.vocab_size() || model.context_length < task.context_length()) {
    throw ValueError(fmt::format("TrainConfig: the task needs vocab_size = {} and context_length >= {}, "
                                 "the model has {} and {}", task.vocab_size(), task.context_length(),
                                 model.vocab_size, model.context_length));
  }
  if (steps <= 0 || batch_size <= 0 || warmup_steps < 0 || eval_batches <= 0) {
    throw ValueError(fmt::format("TrainConfig: steps, batch_size, eval_batches must be positive and "
                                 "warmup_steps >= 0, got {}, {}, {}, {}", steps, batch_size,
                                 eval_batches, warmup_steps));
  }
  if (!(lr > 0.0) || !(min_lr >= 0.0) || !(weight_decay >= 0.0) || !(grad_clip >= 0.0)) {
    throw ValueError(fmt::format("TrainConfig: lr must be > 0 and min_lr, weight_decay, grad_clip >= 0, "
                                 "got {}, {}, {}, {}", lr, min_lr, weight_decay, grad_clip));
  }
}

std::map<std::string, std::string> TrainConfig::to_metadata() const {
  std::map<std::string, std::string> m = model.to_metadata();
  m.merge(task.to_metadata());
  m["train.steps"] = std::to_string(steps);
  m["train.batch_size"] = std::to_string(batch_size);
  m["train.warmup_steps"] = std::to_string(warmup_steps);
  m["train.lr"] = fmt::format("{}", lr);
  m["train.min_lr"] = fmt::format("{}", min_lr);
  m["train.weight_decay"] = fmt::format("{}", weight_decay);
  m["train.beta1"] = fmt::format("{}", beta1);
  m["train.beta2"] = fmt::format("{}", beta2);
  m["train.grad_clip"] = fmt::format("{}", grad_clip);
  m["train.eval_batches"] = std::to_string(eval_batches);
  m["train.seed"] = std::to_string(seed);
  return m;
}

TrainConfig TrainConfig::from_metadata(const std::map<std::string, std::string>& meta,
                                       const std::string& source) {
  TrainConfig c;
  c.model = GPTConfig::from_metadata(meta, source);
  c.task = RecallTask::from_metadata(meta, source);
  c.steps = meta_num<int64_t>(meta, "train.steps", source);
  c.batch_size = meta_num<int64_t>(meta, "train.batch_size", source);
  c.warmup_steps = meta_num<int64_t>(meta, "train.warmup_steps", source);
  c.lr = meta_num<double>(meta, "train.lr", source);
  c.min_lr = meta_num<double>(meta, "train.min_lr", source);
  c.weight_decay = meta_num<double>(meta, "train.weight_decay", source);
  c.beta1 = meta_num<double>(meta, "train.beta1", source);
  c.beta2 = meta_num<double>(meta, "train.beta2", source);
  c.grad_clip = meta_num<double>(meta, "train.grad_clip", source);
  c.eval_batches = meta_num<int64_t>(meta, "train.eval_batches", source);
  c.seed = meta_num<uint64_t>(meta, "train.seed", source);
  try {
    c.validate();
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: invalid training configuration: {}", source, e.what()));
  }
  return c;
}

// ---- Trainer ------------------------------------------------------------------------------------------

Trainer::Trainer(const TrainConfig& config) : config_(config) {
  config_.validate();
  Generator init(config_.seed);
  model_ = std::make_unique<GPTModel>(config_.model, init);
  params_ = model_->parameters_with_grads();
  optim::AdamWOptions o;
  o.lr = config_.lr;
  o.beta1 = config_.beta1;
  o.beta2 = config_.beta2;
  o.weight_decay = config_.weight_decay;
  // Decay matrices and embeddings, not biases and LayerNorm parameters (nanoGPT's grouping).
  optimizer_ = std::make_unique<optim::AdamW>(
      params_, o, [](const nn::ParameterWithGrad& p) { return p.param->dim() >= 2; });
  for (TransformerBlock& b : model_->blocks) b.att.dropout.generator = &dropout_gen_;
}

StepStats Trainer::train_step() {
  const TrainConfig& c = config_;
  const RecallTask::Batch batch = c.task.sample(c.batch_size, c.seed, 0, static_cast<uint64_t>(step_));
  dropout_gen_.manual_seed(mix(c.seed ^ mix(static_cast<uint64_t>(step_) + 7)));
  GPTModel& m = *model_;
  m.train();
  m.zero_grad();
  const Tensor logits = m.forward(batch.inputs, batch.B, batch.T);
  StepStats s;
  s.loss = masked_cross_entropy(logits, batch.targets).mean();
  m.backward(masked_cross_entropy_backward(logits, batch.targets));
  s.grad_norm = c.grad_clip > 0.0 ? optim::clip_grad_norm(params_, c.grad_clip) : 0.0;
  s.lr = optim::warmup_cosine_lr(step_, c.warmup_steps, c.steps, c.lr, c.min_lr);
  optimizer_->set_lr(s.lr);
  optimizer_->step();
  s.step = ++step_;
  s.tokens = batch.B * batch.T;
  return s;
}

LossStats Trainer::evaluate(int64_t num_batches) {
  const TrainConfig& c = config_;
  NoGradGuard no_grad;
  model_->eval();
  LossStats total;
  for (int64_t i = 0; i < num_batches; ++i) {
    const RecallTask::Batch batch = c.task.sample(c.batch_size, c.seed, 1, static_cast<uint64_t>(i));
    const Tensor logits = std::as_const(*model_).forward(batch.inputs, batch.B, batch.T);
    const LossStats s = masked_cross_entropy(logits, batch.targets);
    total.sum_nll += s.sum_nll;
    total.count += s.count;
    total.correct += s.correct;
  }
  model_->train();
  return total;
}

void Trainer::save_checkpoint(const std::string& path) {
  NamedViews views;
  for (auto& [name, t] : model_->state_dict()) views.emplace_back(name, *t);
  for (auto& [name, t] : optimizer_->state()) views.emplace_back(kOptPrefix + name, *t);
  std::map<std::string, std::string> meta = config_.to_metadata();
  meta["format"] = kFormat;
  meta["train.step"] = std::to_string(step_);
  save_safetensors(path, views, meta);
}

void Trainer::resume(const std::string& path) {
  const Safetensors file = load_safetensors(path);
  check_format(file, path);
  const GPTConfig theirs = GPTConfig::from_metadata(file.metadata, path);
  if (!(theirs == config_.model)) {
    throw ValueError(fmt::format("{}: the checkpoint holds a model with {}, this run has {}", path,
                                 theirs.describe(), config_.model.describe()));
  }
  const RecallTask task = RecallTask::from_metadata(file.metadata, path);
  if (!(task == config_.task)) {
    throw ValueError(fmt::format("{}: the checkpoint was trained on {}, this run asks for {}", path,
                                 task.describe(), config_.task.describe()));
  }
  const int64_t step = meta_num<int64_t>(file.metadata, "train.step", path);
  if (step < 0) throw FormatError(fmt::format("{}: metadata 'train.step' must be >= 0, got {}", path, step));
  std::vector<std::pair<std::string, Tensor>> opt;
  for (const auto& [name, t] : file.tensors) {
    if (name.rfind(kOptPrefix, 0) == 0) opt.emplace_back(name.substr(std::string(kOptPrefix).size()), t);
  }
  // Validate everything before changing anything: weights into a scratch model first.
  Generator scratch_gen;  // not the global generator: resuming must not disturb its stream
  GPTModel scratch(config_.model, scratch_gen);
  load_weights(scratch, file, path);
  try {
    optimizer_->load_state(step, opt);
  } catch (const Error& e) {
    throw FormatError(fmt::format("{}: {}", path, e.what()));
  }
  load_weights(*model_, file, path);
  step_ = step;
}

// ---- loading -------------------------------------------------------------------------------------------

void load_weights(GPTModel& model, const Safetensors& file, const std::string& source) {
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& [name, t] : file.tensors) {
    if (name.rfind(kOptPrefix, 0) != 0) weights.emplace_back(name, t);
  }
  try {
    nn::load_state_dict(model, weights, /*strict=*/true);
  } catch (const ShapeError& e) {
    throw ShapeError(fmt::format("{}: the checkpoint does not fit a model with {}: {}", source,
                                 model.config.describe(), e.what()));
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: {}", source, e.what()));
  }
}

std::unique_ptr<GPTModel> load_model(const std::string& path, RecallTask* task, int64_t* step) {
  const Safetensors file = load_safetensors(path);
  check_format(file, path);
  Generator init;  // overwritten by the weights; keeps the global generator untouched
  auto model = std::make_unique<GPTModel>(GPTConfig::from_metadata(file.metadata, path), init);
  load_weights(*model, file, path);
  model->eval();
  if (task != nullptr) *task = RecallTask::from_metadata(file.metadata, path);
  if (step != nullptr) *step = meta_num<int64_t>(file.metadata, "train.step", path);
  return model;
}

}  // namespace attn::gpt

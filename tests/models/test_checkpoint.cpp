// Checkpoints of the tiny GPT: round trip, resuming gives exactly the uninterrupted run, and bad
// input (corrupt, truncated, foreign or differently shaped files; prompts outside the vocabulary
// or the context) throws a clear error instead of crashing.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "attn/gpt_train.hpp"
#include "models/gpt_fixtures.hpp"

namespace attn {
namespace {

using test::OneThread;
class Checkpoint : public OneThread {};
class Generate : public OneThread {};

gpt::TrainConfig config() {
  gpt::TrainConfig c;
  c.task.kind = gpt::TaskKind::kCopy;
  c.task.copy_length = 6;
  c.model.vocab_size = c.task.vocab_size();
  c.model.context_length = c.task.context_length();
  c.model.d_model = 16;
  c.model.n_heads = 2;
  c.batch_size = 8;
  c.steps = 12;
  c.warmup_steps = 3;
  c.eval_batches = 1;
  return c;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          (name + "-" + std::to_string(::getpid()) + ".safetensors")).string();
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::vector<float> all_params(gpt::GPTModel& m) {
  std::vector<float> out;
  for (auto& [name, t] : m.named_parameters()) {
    const std::vector<float> v = t->to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

TEST_F(Checkpoint, RoundTripGivesTheSameLogits) {
  const std::string path = temp_path("gpt-roundtrip");
  gpt::Trainer t(config());
  for (int i = 0; i < 3; ++i) t.train_step();
  t.save_checkpoint(path);
  gpt::RecallTask task;
  int64_t step = -1;
  const std::unique_ptr<gpt::GPTModel> m = gpt::load_model(path, &task, &step);
  EXPECT_EQ(step, 3);
  EXPECT_EQ(task.copy_length, 6);
  const auto b = task.sample(2, 5, 1, 0);
  t.model().eval();
  const Tensor want = std::as_const(t.model()).forward(b.inputs, b.B, b.T);
  const Tensor got = std::as_const(*m).forward(b.inputs, b.B, b.T);
  EXPECT_EQ(got.to_vector(), want.to_vector());
  std::filesystem::remove(path);
}

TEST_F(Checkpoint, ResumeContinuesExactlyAsTheUninterruptedRun) {
  const std::string path = temp_path("gpt-resume");
  gpt::Trainer whole(config());
  std::vector<double> losses;
  for (int i = 0; i < 12; ++i) losses.push_back(whole.train_step().loss);

  gpt::Trainer first(config());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(first.train_step().loss, losses[static_cast<size_t>(i)]);
  first.save_checkpoint(path);
  gpt::Trainer second(config());
  second.resume(path);
  EXPECT_EQ(second.step(), 6);
  for (int i = 6; i < 12; ++i) EXPECT_EQ(second.train_step().loss, losses[static_cast<size_t>(i)]) << i;
  EXPECT_EQ(all_params(second.model()), all_params(whole.model()));
  std::filesystem::remove(path);
}

TEST_F(Checkpoint, BadFilesThrowClearErrors) {
  const std::string path = temp_path("gpt-bad"), bad = temp_path("gpt-bad2");
  gpt::Trainer t(config());
  t.save_checkpoint(path);
  const std::string bytes = read_all(path);

  EXPECT_THROW(gpt::load_model(temp_path("does-not-exist")), IoError);
  // Truncated: the data section ends early.
  write_all(bad, bytes.substr(0, bytes.size() / 2));
  EXPECT_THROW(gpt::load_model(bad), FormatError);
  // Truncated inside the header length.
  write_all(bad, bytes.substr(0, 5));
  EXPECT_THROW(gpt::load_model(bad), FormatError);
  // Corrupt header JSON.
  std::string corrupt = bytes;
  corrupt[10] = '#';
  corrupt[11] = '\x01';
  write_all(bad, corrupt);
  EXPECT_THROW(gpt::load_model(bad), FormatError);
  // A valid safetensors file that is not a checkpoint.
  Tensor x({2, 2});
  save_safetensors(bad, {{"x", x}});
  EXPECT_THROW(gpt::load_model(bad), FormatError);

  // A checkpoint of another shape: resuming with this configuration says both shapes.
  gpt::TrainConfig wide = config();
  wide.model.d_model = 32;
  gpt::Trainer w(wide);
  w.save_checkpoint(bad);
  try {
    t.resume(bad);
    ADD_FAILURE() << "resume accepted a d_model = 32 checkpoint";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("d_model=32"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("d_model=16"), std::string::npos) << e.what();
  }
  // Weights that do not fit the model: ShapeError naming the entry.
  try {
    gpt::load_weights(t.model(), load_safetensors(bad), bad);
    ADD_FAILURE() << "load_weights accepted wrong shapes";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("tok_emb.weight"), std::string::npos) << e.what();
  }
  // The metadata says one shape, the tensors another.
  Safetensors st = load_safetensors(bad);
  NamedViews views;
  for (auto& [name, tensor] : st.tensors) views.emplace_back(name, tensor);
  std::map<std::string, std::string> meta = st.metadata;
  meta["gpt.d_model"] = "16";
  save_safetensors(bad, views, meta);
  EXPECT_THROW(gpt::load_model(bad), ShapeError);
  // The failed resume left the trainer as it was.
  EXPECT_EQ(t.step(), 0);
  std::filesystem::remove(path);
  std::filesystem::remove(bad);
}

TEST_F(Checkpoint, ResumeRefusesAnotherTask) {
  const std::string path = temp_path("gpt-task");
  gpt::Trainer copy(config());
  copy.save_checkpoint(path);
  gpt::TrainConfig other = config();
  other.task.kind = gpt::TaskKind::kLookup;  // same vocabulary and context, another task
  other.task.num_queries = 3;
  ASSERT_EQ(other.task.context_length(), config().task.context_length());
  gpt::Trainer lookup(other);
  try {
    lookup.resume(path);
    ADD_FAILURE() << "resume accepted a checkpoint of another task";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("copy 6"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("lookup"), std::string::npos) << e.what();
  }
  EXPECT_EQ(lookup.step(), 0);
  std::filesystem::remove(path);
}

TEST_F(Generate, BadPromptsThrowClearErrors) {
  gpt::Trainer t(config());
  const gpt::GPTModel& m = t.model();
  const int64_t ctx = m.config.context_length, V = m.config.vocab_size;
  gpt::SamplingOptions o;
  EXPECT_THROW(gpt::generate(m, std::vector<int64_t>{}, o), ValueError);
  EXPECT_THROW(gpt::generate(m, std::vector<int64_t>{0, V}, o), IndexError);
  EXPECT_THROW(gpt::generate(m, std::vector<int64_t>{-1}, o), IndexError);
  EXPECT_THROW(gpt::generate(m, std::vector<int64_t>(static_cast<size_t>(ctx + 1), 0), o), ShapeError);
  o.temperature = -1.0f;
  EXPECT_THROW(gpt::generate(m, std::vector<int64_t>{0}, o), ValueError);
  // A prompt filling the context still yields one token (predicted at the last position).
  gpt::SamplingOptions one;
  one.max_new_tokens = 5;
  EXPECT_EQ(gpt::generate(m, std::vector<int64_t>(static_cast<size_t>(ctx), 0), one).size(), 1u);
}

}  // namespace
}  // namespace attn

// The tasks (lookup, copy, associative recall), generated on the fly from a seed, and the configurations' round
// trip through safetensors metadata (checkpoints carry the shape of the model they hold).
#include <algorithm>
#include <charconv>
#include <fmt/format.h>
#include <utility>

#include "attn/error.hpp"
#include "attn/gpt.hpp"

namespace attn::gpt {

namespace {

// SplitMix64: turns (seed, stream, index) into well-separated generator seeds.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform in [0, n) from one 32-bit draw (Lemire's multiply-shift; the bias is < n / 2^32).
int64_t below(Generator& gen, int64_t n) {
  return static_cast<int64_t>((static_cast<uint64_t>(gen.random()) * static_cast<uint64_t>(n)) >> 32);
}

int64_t meta_int(const std::map<std::string, std::string>& meta, const std::string& key,
                 const std::string& source) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    throw FormatError(fmt::format("{}: metadata lacks '{}' (not a checkpoint written by `attn train`?)",
                                  source, key));
  }
  int64_t v = 0;
  const char* end = it->second.data() + it->second.size();
  auto [p, ec] = std::from_chars(it->second.data(), end, v);
  if (ec != std::errc() || p != end) {
    throw FormatError(fmt::format("{}: metadata '{}' must be an integer, got '{}'", source, key, it->second));
  }
  return v;
}

void require_positive(int64_t v, const char* what, const char* field) {
  if (v <= 0) throw ValueError(fmt::format("{}: {} must be positive, got {}", what, field, v));
}

// The first k entries of a partial Fisher-Yates shuffle of 0 .. v.size() - 1: k distinct values.
void partial_shuffle(Generator& gen, std::vector<int64_t>& v, int64_t k) {
  const int64_t n = static_cast<int64_t>(v.size());
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  for (int64_t i = 0; i < k; ++i) {
    std::swap(v[static_cast<size_t>(i)], v[static_cast<size_t>(i + below(gen, n - i))]);
  }
}

}  // namespace

// ---- GPTConfig ----------------------------------------------------------------------------------------

void GPTConfig::validate() const {
  require_positive(vocab_size, "GPTConfig", "vocab_size");
  require_positive(context_length, "GPTConfig", "context_length");
  require_positive(d_model, "GPTConfig", "d_model");
  require_positive(n_layers, "GPTConfig", "n_layers");
  require_positive(n_heads, "GPTConfig", "n_heads");
  require_positive(mlp_ratio, "GPTConfig", "mlp_ratio");
  if (d_model % n_heads != 0) {
    throw ValueError(fmt::format("GPTConfig: d_model ({}) must be a multiple of n_heads ({})", d_model, n_heads));
  }
  if (!(dropout >= 0.0f && dropout < 1.0f)) {
    throw ValueError(fmt::format("GPTConfig: dropout must be in [0, 1), got {}", dropout));
  }
}

std::map<std::string, std::string> GPTConfig::to_metadata() const {
  return {{"gpt.vocab_size", std::to_string(vocab_size)},
          {"gpt.context_length", std::to_string(context_length)},
          {"gpt.d_model", std::to_string(d_model)},
          {"gpt.n_layers", std::to_string(n_layers)},
          {"gpt.n_heads", std::to_string(n_heads)},
          {"gpt.mlp_ratio", std::to_string(mlp_ratio)},
          {"gpt.dropout", fmt::format("{}", dropout)},
          {"gpt.tie_weights", tie_weights ? "1" : "0"},
          {"gpt.attention", attention == AttentionKind::kUniform ? "uniform" : "softmax"}};
}

GPTConfig GPTConfig::from_metadata(const std::map<std::string, std::string>& meta,
                                   const std::string& source) {
  GPTConfig c;
  c.vocab_size = meta_int(meta, "gpt.vocab_size", source);
  c.context_length = meta_int(meta, "gpt.context_length", source);
  c.d_model = meta_int(meta, "gpt.d_model", source);
  c.n_layers = meta_int(meta, "gpt.n_layers", source);
  c.n_heads = meta_int(meta, "gpt.n_heads", source);
  c.mlp_ratio = meta_int(meta, "gpt.mlp_ratio", source);
  c.tie_weights = meta_int(meta, "gpt.tie_weights", source) != 0;
  auto d = meta.find("gpt.dropout");
  if (d != meta.end()) {
    try {
      c.dropout = std::stof(d->second);
    } catch (const std::exception&) {
      throw FormatError(fmt::format("{}: metadata 'gpt.dropout' must be a number, got '{}'", source, d->second));
    }
  }
  auto a = meta.find("gpt.attention");
  if (a == meta.end() || (a->second != "softmax" && a->second != "uniform")) {
    throw FormatError(fmt::format("{}: metadata 'gpt.attention' must be 'softmax' or 'uniform'", source));
  }
  c.attention = a->second == "uniform" ? AttentionKind::kUniform : AttentionKind::kSoftmax;
  try {
    c.validate();
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: invalid model configuration: {}", source, e.what()));
  }
  return c;
}

std::string GPTConfig::describe() const {
  return fmt::format("vocab_size={} context_length={} d_model={} n_layers={} n_heads={} mlp_ratio={} "
                     "tie_weights={} attention={}", vocab_size, context_length, d_model, n_layers,
                     n_heads, mlp_ratio, tie_weights ? 1 : 0,
                     attention == AttentionKind::kUniform ? "uniform" : "softmax");
}

// ---- RecallTask -----------------------------------------------------------------------------------------

void RecallTask::validate() const {
  require_positive(copy_length, "RecallTask", "copy_length");
  require_positive(num_keys, "RecallTask", "num_keys");
  require_positive(num_values, "RecallTask", "num_values");
  require_positive(num_pairs, "RecallTask", "num_pairs");
  require_positive(num_queries, "RecallTask", "num_queries");
  if (num_keys > 26 || num_values > 26) {
    throw ValueError(fmt::format("RecallTask: at most 26 keys and 26 values (one letter each), got {} and {}",
                                 num_keys, num_values));
  }
  if (num_pairs > num_keys) {
    throw ValueError(fmt::format("RecallTask: num_pairs ({}) must not exceed num_keys ({}): keys are distinct",
                                 num_pairs, num_keys));
  }
  if (kind == TaskKind::kLookup) {
    if (copy_length > num_keys || copy_length > num_values) {
      throw ValueError(fmt::format("RecallTask: lookup needs copy_length ({}) <= num_keys ({}) (distinct "
                                   "letters) and <= num_values ({}) (one position letter each)",
                                   copy_length, num_keys, num_values));
    }
    if (num_queries > copy_length) {
      throw ValueError(fmt::format("RecallTask: lookup needs num_queries ({}) <= copy_length ({}): the "
                                   "queried positions are distinct", num_queries, copy_length));
    }
  }
}

const char* RecallTask::name() const {
  switch (kind) {
    case TaskKind::kLookup: return "lookup";
    case TaskKind::kCopy: return "copy";
    case TaskKind::kRecall: break;
  }
  return "recall";
}

TaskKind RecallTask::kind_from_name(std::string_view name) {
  if (name == "lookup") return TaskKind::kLookup;
  if (name == "copy") return TaskKind::kCopy;
  if (name == "recall") return TaskKind::kRecall;
  throw ValueError(fmt::format("task must be 'lookup', 'copy' or 'recall', got '{}'", name));
}

char RecallTask::token_char(int64_t id) const {
  if (id >= 0 && id < num_keys) return static_cast<char>('a' + id);
  if (id >= num_keys && id < num_keys + num_values) return static_cast<char>('A' + (id - num_keys));
  if (id == separator()) return '|';
  throw IndexError(fmt::format("RecallTask: token id must be in [0, {}), got {}", vocab_size(), id));
}

std::string RecallTask::decode(std::span<const int64_t> ids) const {
  std::string s;
  for (int64_t id : ids) s += token_char(id);
  return s;
}

std::vector<int64_t> RecallTask::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ' ') continue;
    if (c >= 'a' && c < 'a' + num_keys) {
      ids.push_back(c - 'a');
    } else if (c >= 'A' && c < 'A' + num_values) {
      ids.push_back(num_keys + (c - 'A'));
    } else if (c == '|') {
      ids.push_back(separator());
    } else {
      throw ValueError(fmt::format("prompt: character '{}' at offset {} is not in the vocabulary (keys "
                                   "'a'..'{}', values 'A'..'{}', separator '|')",
                                   c, i, static_cast<char>('a' + num_keys - 1),
                                   static_cast<char>('A' + num_values - 1)));
    }
  }
  return ids;
}

RecallTask::Batch RecallTask::sample(int64_t B, uint64_t seed, uint64_t stream, uint64_t index) const {
  validate();
  require_positive(B, "RecallTask.sample", "B");
  Generator gen(mix(mix(seed ^ mix(stream)) + index));
  const int64_t N = sequence_length(), T = N - 1;
  Batch batch{B, T, std::vector<int64_t>(static_cast<size_t>(B * T)),
              std::vector<int64_t>(static_cast<size_t>(B * T), -1)};
  std::vector<int64_t> seq(static_cast<size_t>(N)), keys(static_cast<size_t>(num_keys)),
      values(static_cast<size_t>(num_pairs));
  if (kind == TaskKind::kCopy) {
    const int64_t n = copy_length;
    for (int64_t b = 0; b < B; ++b) {
      int64_t* in = batch.inputs.data() + b * T;
      int64_t* targets = batch.targets.data() + b * T;
      for (int64_t i = 0; i < n; ++i) in[i] = below(gen, num_keys);
      in[n] = separator();
      for (int64_t i = 0; i < n; ++i) {
        targets[n + i] = in[i];                // position n + i predicts the i-th copy
        if (n + 1 + i < T) in[n + 1 + i] = in[i];
      }
    }
    return batch;
  }
  if (kind == TaskKind::kLookup) {
    const int64_t n = copy_length;
    std::vector<int64_t> letters(static_cast<size_t>(num_keys)), where(static_cast<size_t>(n));
    for (int64_t b = 0; b < B; ++b) {
      partial_shuffle(gen, letters, n);  // n distinct letters
      partial_shuffle(gen, where, num_queries);  // num_queries distinct positions
      std::copy_n(letters.begin(), n, seq.begin());
      int64_t t = n;
      seq[static_cast<size_t>(t++)] = separator();
      int64_t* targets = batch.targets.data() + b * T;
      for (int64_t q = 0; q < num_queries; ++q) {
        const int64_t p = where[static_cast<size_t>(q)];
        seq[static_cast<size_t>(t)] = num_keys + p;
        seq[static_cast<size_t>(t + 1)] = letters[static_cast<size_t>(p)];
        targets[t] = letters[static_cast<size_t>(p)];  // predicted at the query's position
        t += 2;
      }
      std::copy_n(seq.begin(), T, batch.inputs.begin() + b * T);
    }
    return batch;
  }
  for (int64_t b = 0; b < B; ++b) {
    // num_pairs distinct keys: the first entries of a partial Fisher-Yates shuffle.
    for (int64_t k = 0; k < num_keys; ++k) keys[static_cast<size_t>(k)] = k;
    for (int64_t i = 0; i < num_pairs; ++i) {
      std::swap(keys[static_cast<size_t>(i)], keys[static_cast<size_t>(i + below(gen, num_keys - i))]);
      values[static_cast<size_t>(i)] = num_keys + below(gen, num_values);
      seq[static_cast<size_t>(2 * i)] = keys[static_cast<size_t>(i)];
      seq[static_cast<size_t>(2 * i + 1)] = values[static_cast<size_t>(i)];
    }
    int64_t t = 2 * num_pairs;
    seq[static_cast<size_t>(t++)] = separator();
    int64_t* targets = batch.targets.data() + b * T;
    for (int64_t q = 0; q < num_queries; ++q) {
      const int64_t i = below(gen, num_pairs);
      seq[static_cast<size_t>(t)] = keys[static_cast<size_t>(i)];
      seq[static_cast<size_t>(t + 1)] = values[static_cast<size_t>(i)];
      targets[t] = values[static_cast<size_t>(i)];  // predicted at the query's position
      t += 2;
    }
    std::copy_n(seq.begin(), T, batch.inputs.begin() + b * T);
  }
  return batch;
}

std::vector<std::pair<int64_t, int64_t>> RecallTask::sources(std::span<const int64_t> ids) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t T = static_cast<int64_t>(ids.size());
  int64_t sep = -1;
  for (int64_t t = 0; t < T && sep < 0; ++t) {
    if (ids[static_cast<size_t>(t)] == separator()) sep = t;
  }
  if (sep < 0) return out;
  if (kind == TaskKind::kCopy) {
    for (int64_t t = sep; t < T && t - sep < sep; ++t) out.emplace_back(t, t - sep);
    return out;
  }
  if (kind == TaskKind::kLookup) {
    for (int64_t t = sep + 1; t < T; ++t) {
      const int64_t p = ids[static_cast<size_t>(t)] - num_keys;  // the position a query names
      if (p >= 0 && p < sep && ids[static_cast<size_t>(t)] != separator()) out.emplace_back(t, p);
    }
    return out;
  }
  for (int64_t t = sep + 1; t < T; ++t) {
    if (ids[static_cast<size_t>(t)] >= num_keys) continue;
    for (int64_t p = sep - 2; p >= 0; --p) {
      if (ids[static_cast<size_t>(p)] == ids[static_cast<size_t>(t)]) {
        out.emplace_back(t, p + 1);
        break;
      }
    }
  }
  return out;
}

std::string RecallTask::describe() const {
  if (kind == TaskKind::kCopy) return fmt::format("copy {} of {} tokens", copy_length, num_keys);
  if (kind == TaskKind::kLookup) {
    return fmt::format("lookup: {} distinct of {} letters, {} queried positions", copy_length, num_keys,
                       num_queries);
  }
  return fmt::format("recall with {} pairs and {} queries ({} keys, {} values)", num_pairs, num_queries,
                     num_keys, num_values);
}

std::map<std::string, std::string> RecallTask::to_metadata() const {
  return {{"task", name()},
          {"task.copy_length", std::to_string(copy_length)},
          {"task.num_keys", std::to_string(num_keys)},
          {"task.num_values", std::to_string(num_values)},
          {"task.num_pairs", std::to_string(num_pairs)},
          {"task.num_queries", std::to_string(num_queries)}};
}

RecallTask RecallTask::from_metadata(const std::map<std::string, std::string>& meta,
                                     const std::string& source) {
  RecallTask t;
  auto kind = meta.find("task");
  if (kind == meta.end()) throw FormatError(fmt::format("{}: metadata lacks 'task'", source));
  try {
    t.kind = kind_from_name(kind->second);
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: metadata: {}", source, e.what()));
  }
  t.copy_length = meta_int(meta, "task.copy_length", source);
  t.num_keys = meta_int(meta, "task.num_keys", source);
  t.num_values = meta_int(meta, "task.num_values", source);
  t.num_pairs = meta_int(meta, "task.num_pairs", source);
  t.num_queries = meta_int(meta, "task.num_queries", source);
  try {
    t.validate();
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: invalid task configuration: {}", source, e.what()));
  }
  return t;
}

}  // namespace attn::gpt

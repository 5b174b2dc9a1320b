// A tiny decoder-only transformer (GPT) built from attn's modules, KV caches (dense, and paged
// for batches of sequences of different lengths) for decoding one token at a time, and the
// associative-recall task it is trained on (`attn train`).
//
// Model (the book's GPTModel, chapter 4, with PyTorch-style state_dict names):
//   tok_emb (V, C) + pos_emb (ctx, C)
//   blocks.i: x + att(norm1(x)), then x + ff(norm2(x))   (pre-norm; att = nn::MultiHeadAttention,
//             causal; ff.layers.0 = Linear(C, r*C), GELU, ff.layers.2 = Linear(r*C, C))
//   final_norm, out_head (Linear(C, V), no bias; or tied: logits = x @ tok_emb.weight^T)
// With AttentionKind::kUniform every attention is replaced by the uniform average over the
// current and previous positions (the module's scale set to 0: all scores equal), the ablation
// showing that the task needs content-based attention.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attn/modules.hpp"

namespace attn::gpt {

enum class AttentionKind { kSoftmax, kUniform };

struct GPTConfig {
  int64_t vocab_size = 33;
  int64_t context_length = 32;
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t mlp_ratio = 4;  // hidden width of the MLP = mlp_ratio * d_model
  float dropout = 0.0f;   // on the attention weights (MultiHeadAttention's dropout)
  bool tie_weights = false;
  AttentionKind attention = AttentionKind::kSoftmax;

  // ValueError naming the field for a non-positive size or d_model % n_heads != 0.
  void validate() const;
  // As safetensors metadata ("gpt.d_model" -> "64", ...), and back: FormatError naming `source`
  // when a key is missing or not a number.
  std::map<std::string, std::string> to_metadata() const;
  static GPTConfig from_metadata(const std::map<std::string, std::string>& meta,
                                 const std::string& source);
  // "d_model=64 n_layers=2 ..." for messages.
  std::string describe() const;
  friend bool operator==(const GPTConfig&, const GPTConfig&) = default;
};

// Position-wise MLP: layers.0 (C -> rC), GELU, layers.2 (rC -> C), as the book's FeedForward.
class FeedForward : public nn::Module {
 public:
  FeedForward(int64_t d_model, int64_t hidden, Generator& gen);
  Tensor forward(const TensorView& x);  // (..., C) -> (..., C); saves for backward
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);
  nn::NamedTensors named_parameters() override;
  nn::NamedTensors named_grads() override;

  nn::Linear fc1;
  nn::GELU act;
  nn::Linear fc2;
};

// The model's KV cache: one nn::KVCacheLayer per block, each preallocated for the whole context
// ((B, H, context_length, head_dim) keys and values). `length` is the number of positions
// decoded; GPTModel::forward_cached sets every layer's length from it before a call, so
// rewinding `length` rewinds every layer.
struct KVCache {
  KVCache(const GPTConfig& config, int64_t batch);
  void reset() { length = 0; }

  int64_t batch, length = 0, capacity;
  std::vector<nn::KVCacheLayer> layers;
};

// The model's paged KV cache: one attn::PagedKvCache per block, every layer's pool of
// num_pages pages of page_size tokens in `dtype` (float32, bfloat16, float16 or int8), all
// driven by the same calls, so a sequence has the same id in every layer. Sequences of any
// lengths share the pools; a freed sequence's pages go to the next one.
struct PagedKVCache {
  // ValueError (from PagedKvCache) naming the field for a bad size or dtype.
  PagedKVCache(const GPTConfig& config, int64_t num_pages, int64_t page_size = 16,
               DType dtype = DType::kFloat32);
  // Pages for `sequences` sequences of up to `tokens` tokens each.
  static int64_t pages_for(int64_t sequences, int64_t tokens, int64_t page_size);

  int64_t add_sequence();               // the same new id in every layer
  void free_sequence(int64_t seq);      // IndexError for a dead id
  int64_t length(int64_t seq) const;    // positions decoded; IndexError for a dead id
  bool contains(int64_t seq) const;

  std::vector<PagedKvCache> layers;
};

class TransformerBlock : public nn::Module {
 public:
  TransformerBlock(const GPTConfig& config, Generator& gen);
  Tensor forward(const TensorView& x);  // (B, T, C) -> (B, T, C); saves for backward
  Tensor forward(const TensorView& x) const;
  Tensor backward(const TensorView& grad_output);  // -> dL/dx (B, T, C)
  // Inference on L new positions of x (B, L, C) at positions [cache.length, cache.length + L)
  // through att.forward_cached: appends their keys and values to this block's cache (which
  // advances by L) and attends over every cached position. weights: if non-null, gets the
  // attention weights (B, H, L, cache.length + L).
  Tensor forward_cached(const TensorView& x, nn::KVCacheLayer& cache, Tensor* weights) const;
  // The same over a paged cache: x (N, L, C) holds the L newest tokens of the sequences
  // seq_ids (att.forward_paged).
  Tensor forward_paged(const TensorView& x, PagedKvCache& cache, std::span<const int64_t> seq_ids) const;

  nn::NamedTensors named_parameters() override;
  nn::NamedTensors named_grads() override;
  nn::NamedTensors state_dict() override;
  void train(bool mode = true) override;

  AttentionKind attention;
  nn::LayerNorm norm1;
  nn::MultiHeadAttention att;  // kUniform: att.scale = 0
  nn::LayerNorm norm2;
  FeedForward ff;
};

class GPTModel : public nn::Module {
 public:
  explicit GPTModel(const GPTConfig& config, Generator& gen = default_generator());
  GPTModel(const GPTModel&) = delete;  // optimizers hold pointers into the parameters
  GPTModel& operator=(const GPTModel&) = delete;

  // ids: B*T token ids, row-major (B, T) -> logits (B, T, vocab). IndexError for an id outside
  // the vocabulary, ShapeError for T > context_length. The non-const one saves for backward.
  Tensor forward(std::span<const int64_t> ids, int64_t B, int64_t T);
  Tensor forward(std::span<const int64_t> ids, int64_t B, int64_t T) const;
  // grad_logits (B, T, vocab): adds every parameter's gradient into named_grads().
  void backward(const TensorView& grad_logits);
  // Incremental decoding: ids (B, L) at positions [cache.length, cache.length + L) ->
  // logits (B, L, vocab); appends to the cache and advances cache.length. ShapeError when the
  // cache would exceed context_length. attn_weights: if non-null, one (B, H, L, length + L)
  // tensor per layer.
  Tensor forward_cached(std::span<const int64_t> ids, int64_t B, int64_t L, KVCache& cache,
                        std::vector<Tensor>* attn_weights = nullptr) const;
  // Incremental decoding over a paged cache: ids (N, L) are the next L tokens of each of the N
  // distinct live sequences seq_ids, each at its own position cache.length(seq) -> logits
  // (N, L, vocab). Any L: more than 16 new tokens go through in chunks of 16 (paged_attention's
  // range). Errors, with the cache unchanged: ShapeError for a wrong id count or positions past
  // context_length, IndexError for an id outside the vocabulary or a dead or repeated sequence,
  // ValueError for too few free pages.
  Tensor forward_paged(std::span<const int64_t> ids, int64_t N, int64_t L, PagedKVCache& cache,
                       std::span<const int64_t> seq_ids) const;

  nn::NamedTensors named_parameters() override;
  nn::NamedTensors named_grads() override;
  nn::NamedTensors state_dict() override;
  void train(bool mode = true) override;

  GPTConfig config;
  nn::Embedding tok_emb, pos_emb;
  std::vector<TransformerBlock> blocks;
  nn::LayerNorm final_norm;
  std::optional<nn::Linear> out_head;  // absent when tie_weights

 private:
  Tensor embed(std::span<const int64_t> ids, int64_t B, int64_t T, int64_t start) const;
  Tensor head(const TensorView& x) const;
  std::optional<Tensor> saved_final_;  // final_norm's output, for the head's backward
};

// ---- loss and perplexity -------------------------------------------------------------------------

// Cross-entropy of logits (N, V) rows against targets (N); a target of -1 is not scored.
struct LossStats {
  double sum_nll = 0.0;  // sum over scored rows of -log softmax(logits)[target], in float64
  int64_t count = 0;     // scored rows
  int64_t correct = 0;   // scored rows whose argmax is the target
  double mean() const { return count > 0 ? sum_nll / static_cast<double>(count) : 0.0; }
  // exp(mean cross-entropy): the model is as unsure as a uniform choice among this many tokens.
  double perplexity() const;
  double accuracy() const { return count > 0 ? static_cast<double>(correct) / count : 0.0; }
};
LossStats masked_cross_entropy(const TensorView& logits, std::span<const int64_t> targets);
// d(mean loss)/d(logits) (N, V): (softmax - onehot) / count on scored rows, 0 elsewhere.
Tensor masked_cross_entropy_backward(const TensorView& logits, std::span<const int64_t> targets);

// ---- the tasks ---------------------------------------------------------------------------------------

// Synthetic tasks whose answers can only be read off the context, generated on the fly from a
// seed (README "Training a tiny GPT": which of them a uniform average instead of attention can
// still learn).
//
// kLookup (the default): "x1 x2 ... xn | P1 y1 P2 y2 ...": the n letters in a random order (a
// permutation: every letter once), a separator, then distinct positions named by upper-case
// letters ('A' is position 1) each followed by the letter found there; the answers y_i are
// scored. The answer is the token at the position the query names: one hop from the query's
// content to a key's position. Every sequence holds the same letters, so without knowing which
// letter sits where a model can only guess among those not yet answered (8.3 % for 16 letters
// and 8 queries, chance 6.25 %).
//
// kCopy: "x1 x2 ... xn | x1 x2 ... xn": n random keys (lower-case letters, with
// repetition), a separator, then the same n again; the n copied tokens are scored. The token to
// predict at position n + i is the one at position i: a head must look back exactly n positions.
//
// kRecall: "k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ...": n distinct keys (lower-case), each with a
// random value (upper-case), a separator, then queried keys (drawn from the n, with repetition),
// each followed by its value; only the answers a_i are scored. It needs two hops (a
// previous-token head, then a head matching the queried key: an induction head), which small
// models learn much more slowly.
//
// Values and copied tokens are random per sequence, so they can only be read off the context.
enum class TaskKind { kLookup, kCopy, kRecall };

struct RecallTask {
  TaskKind kind = TaskKind::kLookup;
  int64_t num_keys = 16, num_values = 16;
  int64_t num_pairs = 8;                   // kRecall
  int64_t num_queries = 8;                 // kRecall, kLookup
  int64_t copy_length = 16;                // kCopy, kLookup: letters before the separator

  // ValueError: sizes, at most 26 keys and values, num_pairs <= num_keys; kLookup:
  // num_queries <= copy_length <= min(num_keys, num_values).
  void validate() const;
  int64_t vocab_size() const { return num_keys + num_values + 1; }
  int64_t separator() const { return num_keys + num_values; }
  int64_t sequence_length() const {
    switch (kind) {
      case TaskKind::kCopy: return 2 * copy_length + 1;
      case TaskKind::kLookup: return copy_length + 1 + 2 * num_queries;
      case TaskKind::kRecall: break;
    }
    return 2 * num_pairs + 1 + 2 * num_queries;
  }
  int64_t context_length() const { return sequence_length() - 1; }  // model inputs per sequence
  const char* name() const;
  static TaskKind kind_from_name(std::string_view name);  // ValueError for another name
  std::string describe() const;

  // One character per token: 'a'.. keys, 'A'.. values (kLookup: positions), '|' separator.
  char token_char(int64_t id) const;
  std::string decode(std::span<const int64_t> ids) const;
  // Spaces are skipped; any other character outside the vocabulary: ValueError naming it.
  std::vector<int64_t> encode(std::string_view text) const;
  // For a sequence of this task: (position, source) for each position whose next token is found
  // at `source` (copy: the token n back; recall: the value after the queried key; lookup: the
  // position the query names).
  std::vector<std::pair<int64_t, int64_t>> sources(std::span<const int64_t> ids) const;

  struct Batch {
    int64_t B = 0, T = 0;
    std::vector<int64_t> inputs;   // (B, T)
    std::vector<int64_t> targets;  // (B, T): the next token where scored, else -1
  };
  // B sequences from a generator seeded by (seed, stream, index): training batches use stream
  // 0 and held-out batches stream 1, so the two never share a seed.
  Batch sample(int64_t B, uint64_t seed, uint64_t stream, uint64_t index) const;
  std::map<std::string, std::string> to_metadata() const;
  static RecallTask from_metadata(const std::map<std::string, std::string>& meta,
                                  const std::string& source);
  friend bool operator==(const RecallTask&, const RecallTask&) = default;
};

// ---- generation ------------------------------------------------------------------------------------

struct SamplingOptions {
  int64_t max_new_tokens = 16;
  float temperature = 0.0f;  // 0: greedy (argmax); else softmax(logits / temperature)
  int64_t top_k = 0;         // > 0: sample among the k most likely tokens only
  uint64_t seed = 0;
  bool use_cache = true;     // false: recompute the whole sequence for every new token
  // The paged KV cache's element type (float32, bfloat16, float16, int8) and tokens per page.
  DType kv_dtype = DType::kFloat32;
  int64_t page_size = 16;
};

// Generates up to max_new_tokens after `prompt` (stops at the context length), one token at a
// time, through a paged KV cache (use_cache) or recomputing the whole sequence. ValueError for
// an empty prompt, ShapeError for a prompt longer than the context, IndexError for an id outside
// the vocabulary. step_logits: if non-null, the (vocab) logits each new token was chosen from.
std::vector<int64_t> generate(const GPTModel& model, std::span<const int64_t> prompt,
                              const SamplingOptions& options,
                              std::vector<Tensor>* step_logits = nullptr);

// generate() for several prompts at once: each is a sequence of one paged cache, prefilled on
// its own, then every unfinished sequence decodes together, one forward_paged call per step.
// Each prompt samples from its own Generator(seed), so every result is what generate() gives
// for that prompt alone. Errors as generate()'s, naming prompts[i]; use_cache = false
// recomputes each prompt's sequence alone. step_logits: one list per prompt.
std::vector<std::vector<int64_t>> generate_batch(const GPTModel& model,
                                                 std::span<const std::vector<int64_t>> prompts,
                                                 const SamplingOptions& options,
                                                 std::vector<std::vector<Tensor>>* step_logits = nullptr);

// The logits (B, T, vocab) of B sequences of T tokens (ids row-major) fed one token per step
// through a paged cache of kv_dtype: what generation computes at each position, with every key
// and value stored at the cache's precision (`attn eval` compares KV dtypes with it).
Tensor decode_logits(const GPTModel& model, std::span<const int64_t> ids, int64_t B, int64_t T,
                     DType kv_dtype, int64_t page_size = 16);

// Checks ids against the model before anything runs: IndexError naming the position.
void check_ids(std::span<const int64_t> ids, int64_t vocab_size, const char* what);

}  // namespace attn::gpt

// The chapter, step by step. Each step mirrors one notebook cell of chapter 3 (or one cell of the
// seed notes) and prints what its `print(...)` calls print in PyTorch. Comments quote the Python
// each step reproduces so a learner can read the two side by side.
#include "demo.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <map>
#include <ostream>
#include <sstream>
#include <vector>

#include "attn/attn.hpp"

namespace attn::demo {
namespace {

// ---- Python's print() ---------------------------------------------------------------------------

std::string str(const std::string& s) { return s; }
std::string str(const char* s) { return s; }
std::string str(const Tensor& t) { return format_tensor(t); }
std::string str(const Shape& s) { return format_size(s); }
// repr() of a Python float: shortest round-trip digits, always with a '.' or an exponent.
std::string str(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

// print(a, b, ...): str() of each argument joined by spaces, then a newline.
template <typename... Args>
void print(std::ostream& out, const Args&... args) {
  const char* sep = "";
  ((out << sep << str(args), sep = " "), ...);
  out << "\n";
}

// ---- the chapter's data -------------------------------------------------------------------------

// "Your journey starts with one step", 3-D embeddings (cell 24).
Tensor chapter_inputs() {
  return Tensor::of({6, 3}, {0.43f, 0.15f, 0.89f,    // Your     (x^1)
                             0.55f, 0.87f, 0.66f,    // journey  (x^2)
                             0.57f, 0.85f, 0.64f,    // starts   (x^3)
                             0.22f, 0.58f, 0.33f,    // with     (x^4)
                             0.77f, 0.25f, 0.10f,    // one      (x^5)
                             0.05f, 0.80f, 0.55f});  // step     (x^6)
}

// attn_scores_2[i] = dot(x_i, x^(2)) (cell 28).
Tensor scores_query2(const Tensor& inputs) {
  const TensorView query = inputs.select(0, 1);
  Tensor scores = Tensor::empty({inputs.size(0)});
  for (int64_t i = 0; i < inputs.size(0); ++i) {
    scores.data()[i] = dot(inputs.select(0, i), query).item();
  }
  return scores;
}

// Cells 47-51: all scores and their softmax.
Tensor all_weights(const Tensor& inputs) { return softmax(matmul(inputs, inputs.t()), -1); }

// Cell 68: torch.manual_seed(123); W_query, W_key, W_value = torch.rand(d_in, d_out) x 3.
struct Weights {
  Tensor W_query, W_key, W_value;
};
Weights seeded_weights() {
  manual_seed(123);
  Weights w;
  w.W_query = rand({3, 2});
  w.W_key = rand({3, 2});
  w.W_value = rand({3, 2});
  return w;
}

// Cell 98: scaled, softmaxed scores of SelfAttention_v2 (seed 789).
struct V2Scores {
  Tensor attn_scores, attn_weights;
};
V2Scores v2_scores() {
  const Tensor inputs = chapter_inputs();
  manual_seed(789);
  const nn::SelfAttentionV2 sa_v2(3, 2);
  const Tensor queries = sa_v2.W_query.forward(inputs);
  const Tensor keys = sa_v2.W_key.forward(inputs);
  V2Scores s;
  s.attn_scores = matmul(queries, keys.t());
  s.attn_weights = softmax(div(s.attn_scores, std::sqrt(2.0f)), -1);
  return s;
}

// Cells 108-110: -inf above the diagonal, then softmax.
Tensor causal_weights() {
  const V2Scores s = v2_scores();
  const Tensor mask = triu(Tensor::ones({6, 6}), 1);
  const Tensor masked = masked_fill(s.attn_scores, mask, -INFINITY);
  return softmax(div(masked, std::sqrt(2.0f)), -1);
}

Tensor chapter_batch() {
  const Tensor inputs = chapter_inputs();
  const TensorView pair[2] = {inputs, inputs};
  return stack(pair, 0);
}

// ---- steps: simplified self-attention (3.3) -----------------------------------------------------

void step_inputs(std::ostream& out) { print(out, chapter_inputs()); }

void step_scores_query2(std::ostream& out) { print(out, scores_query2(chapter_inputs())); }

void step_dot_product(std::ostream& out) {
  // res = 0.; for idx, element in enumerate(inputs[0]): res += inputs[0][idx] * query[idx]
  const Tensor inputs = chapter_inputs();
  float res = 0.0f;
  for (int64_t idx = 0; idx < 3; ++idx) res += inputs.at({0, idx}) * inputs.at({1, idx});
  print(out, Tensor::scalar(res));
  print(out, dot(inputs.select(0, 0), inputs.select(0, 1)));
}

void step_naive_normalisation(std::ostream& out) {
  const Tensor scores = scores_query2(chapter_inputs());
  const Tensor w = div(scores, sum(scores));
  print(out, "Attention weights:", w);
  print(out, "Sum:", sum(w));
}

void step_softmax_naive(std::ostream& out) {
  const Tensor w = softmax_naive(scores_query2(chapter_inputs()), 0);
  print(out, "Attention weights:", w);
  print(out, "Sum:", sum(w));
}

void step_softmax(std::ostream& out) {
  const Tensor w = softmax(scores_query2(chapter_inputs()), 0);
  print(out, "Attention weights:", w);
  print(out, "Sum:", sum(w));
}

// context_vec_2 += attn_weights_2[i] * x_i (cell 40).
Tensor context_vector_2() {
  const Tensor inputs = chapter_inputs();
  const Tensor w = softmax(scores_query2(inputs), 0);
  Tensor context = Tensor::zeros({3});
  for (int64_t i = 0; i < inputs.size(0); ++i) {
    for (int64_t e = 0; e < 3; ++e) context.data()[e] += w.data()[i] * inputs.at({i, e});
  }
  return context;
}

void step_context_vector_2(std::ostream& out) { print(out, context_vector_2()); }

void step_scores_loop(std::ostream& out) {
  const Tensor inputs = chapter_inputs();
  Tensor scores = Tensor::empty({6, 6});
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t j = 0; j < 6; ++j) {
      scores.at({i, j}) = dot(inputs.select(0, i), inputs.select(0, j)).item();
    }
  }
  print(out, scores);
}

void step_scores_matmul(std::ostream& out) {
  const Tensor inputs = chapter_inputs();
  print(out, matmul(inputs, inputs.t()));
}

void step_weights(std::ostream& out) { print(out, all_weights(chapter_inputs())); }

void step_row_sums(std::ostream& out) {
  // sum([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]) in Python floats.
  double row_2_sum = 0.0;
  for (double v : {0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581}) row_2_sum += v;
  print(out, "Row 2 sum:", row_2_sum);
  print(out, "All row sums:", sum(all_weights(chapter_inputs()), -1));
}

void step_context_vectors(std::ostream& out) {
  const Tensor inputs = chapter_inputs();
  print(out, matmul(all_weights(inputs), inputs));
}

void step_previous_context(std::ostream& out) {
  print(out, "Previous 2nd context vector:", context_vector_2());
}

// ---- steps: trainable weights (3.4) -----------------------------------------------------------

void step_query_2(std::ostream& out) {
  const Weights w = seeded_weights();
  const Tensor inputs = chapter_inputs();
  print(out, matmul(inputs.select(0, 1), w.W_query));
}

void step_keys_values(std::ostream& out) {
  const Weights w = seeded_weights();
  const Tensor inputs = chapter_inputs();
  print(out, "keys.shape:", matmul(inputs, w.W_key).shape());
  print(out, "values.shape:", matmul(inputs, w.W_value).shape());
}

struct Query2 {
  Tensor query_2, keys, values;
};
Query2 query2_projections() {
  const Weights w = seeded_weights();
  const Tensor inputs = chapter_inputs();
  return {matmul(inputs.select(0, 1), w.W_query), matmul(inputs, w.W_key),
          matmul(inputs, w.W_value)};
}

void step_score_22(std::ostream& out) {
  const Query2 p = query2_projections();
  print(out, dot(p.query_2, p.keys.select(0, 1)));
}

void step_scores_2(std::ostream& out) {
  const Query2 p = query2_projections();
  print(out, matmul(p.query_2, p.keys.t()));
}

Tensor scaled_weights_2(const Query2& p) {
  const float d_k = static_cast<float>(p.keys.size(1));
  return softmax(div(matmul(p.query_2, p.keys.t()), std::sqrt(d_k)), -1);
}

void step_weights_2(std::ostream& out) { print(out, scaled_weights_2(query2_projections())); }

void step_context_2(std::ostream& out) {
  const Query2 p = query2_projections();
  print(out, matmul(scaled_weights_2(p), p.values));
}

void step_self_attention_v1(std::ostream& out) {
  manual_seed(123);
  const nn::SelfAttentionV1 sa_v1(3, 2);
  print(out, sa_v1.forward(chapter_inputs()));
}

void step_self_attention_v2(std::ostream& out) {
  manual_seed(789);
  const nn::SelfAttentionV2 sa_v2(3, 2);
  print(out, sa_v2.forward(chapter_inputs()));
}

// ---- steps: causal attention (3.5) --------------------------------------------------------------

void step_v2_weights(std::ostream& out) { print(out, v2_scores().attn_weights); }

void step_mask_simple(std::ostream& out) { print(out, tril(Tensor::ones({6, 6}))); }

void step_masked_simple(std::ostream& out) {
  print(out, mul(v2_scores().attn_weights, tril(Tensor::ones({6, 6}))));
}

void step_renormalised(std::ostream& out) {
  const Tensor masked_simple = mul(v2_scores().attn_weights, tril(Tensor::ones({6, 6})));
  const Tensor row_sums = sum(masked_simple, -1, /*keepdim=*/true);
  print(out, div(masked_simple, row_sums));
}

void step_masked_inf(std::ostream& out) {
  const Tensor mask = triu(Tensor::ones({6, 6}), 1);
  print(out, masked_fill(v2_scores().attn_scores, mask, -INFINITY));
}

void step_causal_weights(std::ostream& out) { print(out, causal_weights()); }

void step_dropout_ones(std::ostream& out) {
  manual_seed(123);
  const nn::Dropout dropout(0.5f);
  print(out, dropout.forward(Tensor::ones({6, 6})));
}

void step_dropout_weights(std::ostream& out) {
  const Tensor w = causal_weights();
  manual_seed(123);
  const nn::Dropout dropout(0.5f);
  print(out, dropout.forward(w));
}

void step_batch(std::ostream& out) { print(out, chapter_batch().shape()); }

// print(context_vecs); print("context_vecs.shape:", context_vecs.shape) for a module built
// after torch.manual_seed(123) (cells 121, 127, 131).
template <typename Module>
void print_on_batch(std::ostream& out, const Module& module) {
  const Tensor context_vecs = module.forward(chapter_batch());
  print(out, context_vecs);
  print(out, "context_vecs.shape:", context_vecs.shape());
}

void step_causal_attention(std::ostream& out) {
  manual_seed(123);
  print_on_batch(out, nn::CausalAttention(3, 2, /*context_length=*/6, 0.0f));
}

// ---- steps: multi-head attention (3.6) ----------------------------------------------------------

void step_mha_wrapper(std::ostream& out) {
  manual_seed(123);
  print_on_batch(out, nn::MultiHeadAttentionWrapper(3, 2, 6, 0.0f, /*num_heads=*/2));
}

void step_mha(std::ostream& out) {
  manual_seed(123);
  print_on_batch(out, nn::MultiHeadAttention(3, 2, 6, 0.0f, /*num_heads=*/2));
}

Tensor heads_example() {
  // (b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4)
  return Tensor::of({1, 2, 3, 4}, {0.2745f, 0.6584f, 0.2775f, 0.8573f,  //
                                   0.8993f, 0.0390f, 0.9268f, 0.7388f,  //
                                   0.7179f, 0.7058f, 0.9156f, 0.4340f,  //
                                   0.0772f, 0.3565f, 0.1479f, 0.5331f,  //
                                   0.4066f, 0.2318f, 0.4545f, 0.9737f,  //
                                   0.4606f, 0.5159f, 0.4220f, 0.5786f});
}

void step_batched_matmul(std::ostream& out) {
  const Tensor a = heads_example();
  print(out, matmul(a, a.transpose(2, 3)));
}

void step_per_head_matmul(std::ostream& out) {
  const Tensor a = heads_example();
  const TensorView first_head = a.select(0, 0).select(0, 0);
  print(out, "First head:\n", matmul(first_head, first_head.t()));
  const TensorView second_head = a.select(0, 0).select(0, 1);
  print(out, "\nSecond head:\n", matmul(second_head, second_head.t()));
}

// ---- steps from the seed notes ------------------------------------------------------------------

// Notes 001 print with torch.set_printoptions(precision=1, sci_mode=False, profile='short').
PrintOptions short_options() {
  PrintOptions o;
  o.precision = 1;
  o.edgeitems = 2;
  o.sci_mode = false;
  return o;
}

struct SentenceEmbedding {
  std::vector<std::string> words, sorted;
  std::vector<int64_t> ids;
  nn::Embedding embed;
  Tensor embedded;
};

// sentence -> sorted vocabulary -> ids -> nn.Embedding(6, 16), after torch.manual_seed(123).
SentenceEmbedding embed_sentence() {
  const std::vector<std::string> words = {"Playing", "music", "makes", "me", "very", "happy"};
  std::vector<std::string> sorted = words;
  std::sort(sorted.begin(), sorted.end());  // byte order, like Python's sorted(): 'P' < 'h'
  std::map<std::string, int64_t> vocab;
  for (size_t i = 0; i < sorted.size(); ++i) vocab[sorted[i]] = static_cast<int64_t>(i);
  std::vector<int64_t> ids;
  for (const std::string& w : words) ids.push_back(vocab[w]);
  manual_seed(123);
  nn::Embedding embed(6, 16);
  Tensor embedded = embed.forward(ids);
  return {words, sorted, ids, std::move(embed), std::move(embedded)};
}

std::string py_list(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", '" : "'") + v[i] + "'";
  return s + "]";
}

void step_embedding(std::ostream& out) {
  const SentenceEmbedding s = embed_sentence();
  print(out, py_list(s.words));
  print(out, py_list(s.sorted));
  std::string ids = "tensor([";
  for (size_t i = 0; i < s.ids.size(); ++i) ids += (i ? ", " : "") + std::to_string(s.ids[i]);
  print(out, ids + "])");
  print(out, format_tensor(s.embedded, short_options()));
  print(out, s.embedded.shape());
  print(out, "Parameter containing:");
  print(out, format_tensor(s.embed.weight, short_options(), "requires_grad=True"));
}

void step_projections(std::ostream& out) {
  // W_q (d_q x d), W_k (d_k x d), W_v (d_v x d) = torch.rand(...); q = W_q @ x (the transposed
  // convention of the notes: weights on the left, one column per token).
  const SentenceEmbedding s = embed_sentence();
  const int64_t d = 16, d_q = 24, d_k = 24, d_v = 28;
  const Tensor W_query = rand({d_q, d}), W_key = rand({d_k, d}), W_value = rand({d_v, d});
  const TensorView x_2 = s.embedded.select(0, 2);
  const Tensor query_2 = matmul(W_query, x_2);
  print(out, fmt::format("W_query has shape {}, x_2 has shape {} and resulting query_2 has shape: {}\n",
                         format_size(W_query.shape()), format_size(x_2.shape()),
                         format_size(query_2.shape())));
  print(out, "the resulting tensor is our query tensor for word at index 2:");
  const PrintOptions o = short_options();
  print(out, format_tensor(query_2, o));
  print(out, format_tensor(matmul(W_query, x_2), o));
  print(out, format_tensor(matmul(W_key, x_2), o));
  print(out, format_tensor(matmul(W_value, x_2), o));
  const Tensor keys = matmul(W_key, s.embedded.t()).t().contiguous();
  const Tensor values = matmul(W_value, s.embedded.t()).t().contiguous();
  print(out, "keys: \n" + format_tensor(keys, o));
  print(out, "values: \n " + format_tensor(values, o));
}

void step_softmax_scaling(std::ostream& out) {
  // Notes 003: exp overflow/saturation for large logits, and the effect of 1/sqrt(d_k).
  const Tensor logits_large = Tensor::of({3}, {10.0f, 20.0f, 30.0f});
  const float scaling_factor = std::sqrt(512.0f);
  print(out, "Softmax without scaling:", softmax_naive(logits_large, 0));
  print(out, "Softmax with scaling:", softmax_naive(div(logits_large, scaling_factor), 0));
}

void step_variance(std::ostream& out) {
  // Notes 003: seed_all(92); q, k ~ N(0, 1) of shape (B, H, L, d_k) = (4, 8, 32, 512).
  // Var(q . k) = d_k * sigma^4 = 512; dividing by sqrt(d_k) brings it back to 1.
  manual_seed(92);
  const Tensor Q = randn({4, 8, 32, 512});
  const Tensor K = randn({4, 8, 32, 512});
  const Tensor unscaled = matmul(Q, K.transpose(-2, -1));
  const float unscaled_variance = var(unscaled, /*unbiased=*/false).item();
  const Tensor scaled = div(unscaled, std::sqrt(512.0f));
  const float scaled_variance = var(scaled, /*unbiased=*/false).item();
  print(out, "Unscaled Variance: " + str(static_cast<double>(unscaled_variance)));
  print(out, "Scaled Variance: " + str(static_cast<double>(scaled_variance)));
}

constexpr Step kSteps[] = {
    {"inputs", "the example sentence as 3-D embeddings", 24, step_inputs},
    {"scores-query2", "attention scores of query x^(2): dot products with every input", 28, step_scores_query2},
    {"dot-product", "a dot product is a sum of elementwise products", 30, step_dot_product},
    {"naive-normalisation", "weights by dividing by the sum", 33, step_naive_normalisation},
    {"softmax-naive", "weights by the naive softmax exp(x)/sum(exp(x))", 35, step_softmax_naive},
    {"softmax", "weights by the stable torch.softmax", 37, step_softmax},
    {"context-vector-2", "context vector z^(2): weighted sum of the inputs", 40, step_context_vector_2},
    {"scores-loop", "all attention scores with two loops", 47, step_scores_loop},
    {"scores", "all attention scores as inputs @ inputs.T", 49, step_scores_matmul},
    {"weights", "all attention weights (softmax over each row)", 51, step_weights},
    {"row-sums", "each row of weights sums to 1", 53, step_row_sums},
    {"context-vectors", "all context vectors: weights @ inputs", 55, step_context_vectors},
    {"previous-context", "the same z^(2) as computed with the loop", 57, step_previous_context},
    {"query-2", "trainable weights (seed 123): query q^(2) = x^(2) @ W_query", 70, step_query_2},
    {"keys-values", "keys and values of every input", 72, step_keys_values},
    {"score-22", "unnormalised score omega_22 = q^(2) . k^(2)", 75, step_score_22},
    {"scores-2", "all scores of query 2: q^(2) @ keys.T", 77, step_scores_2},
    {"weights-2", "weights of query 2, scaled by 1/sqrt(d_k)", 80, step_weights_2},
    {"context-2", "context vector z^(2) = weights @ values", 83, step_context_2},
    {"self-attention-v1", "SelfAttention_v1 (nn.Parameter, seed 123)", 86, step_self_attention_v1},
    {"self-attention-v2", "SelfAttention_v2 (nn.Linear, seed 789)", 89, step_self_attention_v2},
    {"v2-weights", "the attention weights of SelfAttention_v2", 98, step_v2_weights},
    {"mask-simple", "a lower-triangular mask", 100, step_mask_simple},
    {"masked-simple", "weights times the mask: zeros above the diagonal", 102, step_masked_simple},
    {"renormalised", "masked weights renormalised so rows sum to 1", 105, step_renormalised},
    {"masked-inf", "the efficient way: -inf above the diagonal before softmax", 108, step_masked_inf},
    {"causal-weights", "softmax of the -inf-masked scores: the same weights", 110, step_causal_weights},
    {"dropout-ones", "dropout(0.5) on a matrix of ones (seed 123): kept entries scaled by 2", 115, step_dropout_ones},
    {"dropout-weights", "dropout(0.5) on the causal attention weights (seed 123)", 116, step_dropout_weights},
    {"batch", "a batch of two copies of the input", 120, step_batch},
    {"causal-attention", "CausalAttention on the batch (seed 123)", 121, step_causal_attention},
    {"mha-wrapper", "MultiHeadAttentionWrapper: two stacked CausalAttention heads (seed 123)", 127, step_mha_wrapper},
    {"multi-head-attention", "MultiHeadAttention: split heads, out_proj (seed 123)", 131, step_mha},
    {"batched-matmul", "batched matrix product over (batch, heads)", 138, step_batched_matmul},
    {"per-head-matmul", "the same product head by head", 140, step_per_head_matmul},
    {"embedding", "notes 001: sentence -> sorted vocabulary -> ids -> Embedding(6, 16)", 0, step_embedding},
    {"projections", "notes 001: q = W_q x with d_q = d_k = 24, d_v = 28", 0, step_projections},
    {"softmax-scaling", "notes 003: softmax saturates on large logits; 1/sqrt(d_k) helps", 0, step_softmax_scaling},
    {"variance", "notes 003: Var(q.k) ~ d_k = 512 unscaled, ~ 1 scaled", 0, step_variance},
};

}  // namespace

std::span<const Step> steps() { return kSteps; }

const Step* find_step(std::string_view name) {
  for (const Step& s : kSteps) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

std::string run_step(const Step& step) {
  std::ostringstream out;
  step.run(out);
  return out.str();
}

void run_all(std::ostream& out) {
  for (const Step& s : kSteps) {
    out << "== " << s.name << ": " << s.title;
    if (s.cell != 0) out << " (chapter 3, cell " << s.cell << ")";
    out << "\n" << run_step(s) << "\n";
  }
}

}  // namespace attn::demo

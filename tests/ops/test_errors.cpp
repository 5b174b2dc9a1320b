// Every bad input throws a typed attn::Error subclass whose message names the argument and the
// expected and actual shape or value, so an application can report it. Each check catches the
// specific type, then runs the call again and catches it as attn::Error.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/modules.hpp"
#include "attn/sdpa.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

// Expects f() to throw exactly-typed E (a subclass of attn::Error) with every `parts` substring
// in its message; also expects the same call to be catchable as attn::Error. gmock is not
// linked, so HasSubstr is spelled as std::string::find.
template <typename E>
void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts,
                  const char* what = "") {
  static_assert(std::is_base_of_v<Error, E>);
  std::string msg;
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    msg = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw the wrong type; message: " << e.what();
    return;
  }
  if (!thrown) {
    ADD_FAILURE() << what << ": nothing thrown";
    return;
  }
  for (const std::string& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << what << ": message lacks \"" << p << "\"\n  message: " << msg;
  }
  bool as_base = false;
  try {
    f();
  } catch (const Error& e) {
    as_base = std::string(e.what()) == msg;
  }
  EXPECT_TRUE(as_base) << what << ": not catchable as attn::Error with the same message";
}

Tensor randn_(Shape s) { return randn(s); }

// ---- module inputs: d_in mismatch -----------------------------------------------------------------

TEST(ErrorsModules, DInMismatchForEveryModule) {
  manual_seed(1);
  const Tensor x2 = randn_({6, 4}), x3 = randn_({2, 6, 4});
  nn::SelfAttentionV1 v1(3, 2);
  nn::SelfAttentionV2 v2(3, 2);
  nn::CausalAttention ca(3, 2, 6, 0.0f);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.0f, 2);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0f, 2);
  expect_error<ShapeError>([&] { v1.forward(x2); }, {"SelfAttentionV1", "x", "d_in = 3", "[6, 4]"}, "v1");
  expect_error<ShapeError>([&] { v2.forward(x2); }, {"SelfAttentionV2", "x", "d_in = 3", "[6, 4]"}, "v2");
  expect_error<ShapeError>([&] { ca.forward(x3); }, {"CausalAttention", "d_in = 3", "[2, 6, 4]"}, "ca");
  // The wrapper reports through its first head.
  expect_error<ShapeError>([&] { w.forward(x3); }, {"d_in = 3", "[2, 6, 4]"}, "wrapper");
  expect_error<ShapeError>([&] { mha.forward(x3); }, {"MultiHeadAttention", "d_in = 3", "[2, 6, 4]"}, "mha");
}

TEST(ErrorsModules, WrongRank) {
  manual_seed(2);
  nn::CausalAttention ca(3, 2, 6, 0.0f);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0f, 2);
  nn::SelfAttentionV1 v1(3, 2);
  // Batched modules need (b, num_tokens, d_in); the chapter's classes unpack `b, num_tokens, d_in`.
  expect_error<ShapeError>([&] { ca.forward(randn_({6, 3})); }, {"(b, num_tokens, d_in)", "[6, 3]"}, "ca 2-D");
  expect_error<ShapeError>([&] { mha.forward(randn_({1, 2, 6, 3})); }, {"(b, num_tokens, d_in)", "[1, 2, 6, 3]"}, "mha 4-D");
  expect_error<ShapeError>([&] { v1.forward(randn_({3})); }, {"SelfAttentionV1", "[3]"}, "v1 1-D");
  expect_error<ShapeError>([&] { v1.forward(Tensor()); }, {"SelfAttentionV1", "undefined"}, "v1 undefined");
}

TEST(ErrorsModules, EmptyInputs) {
  nn::SelfAttentionV2 v2(3, 2);
  nn::CausalAttention ca(3, 2, 6, 0.0f);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0f, 2);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.0f, 2);
  expect_error<ShapeError>([&] { v2.forward(Tensor::zeros({0, 3})); }, {"num_tokens > 0", "[0, 3]"}, "v2 T=0");
  expect_error<ShapeError>([&] { ca.forward(Tensor::zeros({2, 0, 3})); }, {"num_tokens > 0", "[2, 0, 3]"}, "ca T=0");
  expect_error<ShapeError>([&] { mha.forward(Tensor::zeros({0, 6, 3})); }, {"[0, 6, 3]"}, "mha b=0");
  expect_error<ShapeError>([&] { w.forward(Tensor::zeros({2, 0, 3})); }, {"[2, 0, 3]"}, "wrapper T=0");
}

TEST(ErrorsModules, NumTokensBeyondContextLength) {
  manual_seed(3);
  const Tensor x = randn_({2, 7, 3});
  nn::CausalAttention ca(3, 2, 6, 0.0f);
  nn::MultiHeadAttentionWrapper w(3, 2, 6, 0.0f, 2);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0f, 2);
  for (auto [name, f] : std::vector<std::pair<const char*, std::function<void()>>>{
           {"CausalAttention", [&] { ca.forward(x); }},
           {"wrapper", [&] { w.forward(x); }},
           {"MultiHeadAttention", [&] { mha.forward(x); }}}) {
    expect_error<ShapeError>(f, {"num_tokens = 7", "context_length = 6", "[2, 7, 3]"}, name);
  }
}

TEST(ErrorsModules, DOutNotDivisibleByNumHeads) {
  expect_error<ValueError>([] { nn::MultiHeadAttention(3, 5, 6, 0.0f, 2); },
                           {"MultiHeadAttention", "divisible", "d_out = 5", "num_heads = 2"}, "5 % 2");
  expect_error<ValueError>([] { nn::MultiHeadAttention(17, 24, 16, 0.0f, 5); },
                           {"d_out = 24", "num_heads = 5"}, "24 % 5");
}

TEST(ErrorsModules, NonPositiveSizes) {
  expect_error<ValueError>([] { nn::MultiHeadAttention(3, 4, 6, 0.0f, 0); }, {"num_heads", "got 0"}, "heads 0");
  expect_error<ValueError>([] { nn::MultiHeadAttention(3, 4, 0, 0.0f, 2); }, {"context_length", "got 0"}, "ctx 0");
  expect_error<ValueError>([] { nn::CausalAttention(3, 2, -1, 0.0f); }, {"context_length", "got -1"}, "ca ctx");
  expect_error<ValueError>([] { nn::MultiHeadAttentionWrapper(3, 2, 6, 0.0f, 0); }, {"num_heads", "got 0"}, "w heads");
  expect_error<ValueError>([] { nn::SelfAttentionV1(0, 2); }, {"d_in", "got 0"}, "v1 d_in");
  expect_error<ValueError>([] { nn::SelfAttentionV1(3, -2); }, {"d_out", "got -2"}, "v1 d_out");
  expect_error<ValueError>([] { nn::Linear(0, 2); }, {"in_features", "got 0"}, "linear in");
  expect_error<ValueError>([] { nn::Linear(2, 0); }, {"out_features", "got 0"}, "linear out");
  expect_error<ValueError>([] { nn::Embedding(0, 4); }, {"num_embeddings", "got 0"}, "emb num");
  expect_error<ValueError>([] { nn::Embedding(4, -1); }, {"embedding_dim", "got -1"}, "emb dim");
}

// ---- dropout probability --------------------------------------------------------------------------

TEST(ErrorsDropout, ModuleProbabilityOutsideUnitInterval) {
  for (float p : {-0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    const std::string got = p == p ? (p < 0 ? "-0.1" : "1.5") : "nan";
    expect_error<ValueError>([&] { nn::Dropout d(p); }, {"Dropout", "p", "[0, 1]", got}, "Dropout");
    expect_error<ValueError>([&] { nn::CausalAttention(3, 2, 6, p); }, {"[0, 1]", got}, "CausalAttention");
    expect_error<ValueError>([&] { nn::MultiHeadAttention(3, 4, 6, p, 2); }, {"[0, 1]", got}, "MHA");
    expect_error<ValueError>([&] { nn::MultiHeadAttentionWrapper(3, 2, 6, p, 2); }, {"[0, 1]", got}, "wrapper");
  }
  EXPECT_NO_THROW(nn::Dropout(0.0f));
  EXPECT_NO_THROW(nn::Dropout(1.0f));  // torch allows p = 1 (zeros)
}

TEST(ErrorsDropout, FunctionProbabilityOutsideUnitInterval) {
  const Tensor x = Tensor::ones({4});
  expect_error<ValueError>([&] { dropout(x, 1.5f); }, {"dropout", "p", "[0, 1]", "1.5"}, "1.5");
  expect_error<ValueError>([&] { dropout(x, -0.5f, false); }, {"dropout", "[0, 1]", "-0.5"}, "-0.5 eval");
  EXPECT_EQ(dropout(x, 1.0f).to_vector(), std::vector<float>(4, 0.0f));
}

TEST(ErrorsDropout, SdpaDropoutOutsideUnitInterval) {
  manual_seed(4);
  const Tensor q = randn_({2, 3, 4});
  for (float p : {1.5f, -0.1f}) {
    SdpaOptions o;
    o.dropout_p = p;
    expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, o); },
                             {"scaled_dot_product_attention", "dropout_p", "[0, 1]", "got"}, "sdpa p");
  }
  // p == 1 drops every weight, as F.dropout(p=1): output 0, no random numbers drawn.
  SdpaOptions o;
  o.dropout_p = 1.0f;
  const uint32_t before = Generator(default_generator()).random();
  EXPECT_EQ(scaled_dot_product_attention(q, q, q, o).output.to_vector(), std::vector<float>(24, 0.0f));
  EXPECT_EQ(Generator(default_generator()).random(), before);
}

// ---- scaled_dot_product_attention ---------------------------------------------------------------

TEST(ErrorsSdpa, QueryKeyEmbedDimMismatch) {
  manual_seed(5);
  const Tensor q = randn_({2, 4, 8}), k = randn_({2, 5, 7}), v = randn_({2, 5, 8});
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, k, v); },
                           {"key", "query's (8)", "[2, 5, 7]", "[2, 4, 8]"}, "E mismatch");
}

TEST(ErrorsSdpa, ValueLengthDiffersFromKeyLength) {
  manual_seed(6);
  const Tensor q = randn_({2, 4, 8}), k = randn_({2, 5, 8}), v = randn_({2, 6, 8});
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, k, v); },
                           {"value", "sequence length", "key's (5)", "[2, 6, 8]", "[2, 5, 8]"}, "S mismatch");
}

TEST(ErrorsSdpa, RankAndLeadingDims) {
  manual_seed(7);
  const Tensor q = randn_({2, 4, 8});
  expect_error<ShapeError>([&] { scaled_dot_product_attention(randn_({8}), q, q); },
                           {"query", "2 to 4 dims", "[8]"}, "1-D query");
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, randn_({4, 8}), q); },
                           {"same number of dims", "[2, 4, 8]", "[4, 8]"}, "rank mismatch");
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, randn_({3, 4, 8}), randn_({3, 4, 8})); },
                           {"leading", "[2]", "[3, 4, 8]"}, "batch mismatch");
  expect_error<ValueError>([&] { scaled_dot_product_attention(Tensor(), q, q); }, {"query", "undefined"}, "undefined");
}

TEST(ErrorsSdpa, EmptyTensors) {
  manual_seed(8);
  const Tensor q = randn_({2, 4, 8});
  expect_error<ShapeError>([&] { scaled_dot_product_attention(Tensor::zeros({2, 0, 8}), q, q); },
                           {"query", "empty", "[2, 0, 8]"}, "L = 0");
  expect_error<ShapeError>([&] {
    const Tensor e = Tensor::zeros({2, 0, 8});
    scaled_dot_product_attention(q, e, e);
  }, {"key", "empty", "[2, 0, 8]"}, "S = 0");
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, q, Tensor::zeros({2, 4, 0})); },
                           {"value", "empty", "[2, 4, 0]"}, "Ev = 0");
}

TEST(ErrorsSdpa, MaskThatDoesNotBroadcast) {
  manual_seed(9);
  const Tensor q = randn_({2, 4, 8}), k = randn_({2, 5, 8});
  for (Shape ms : {Shape{3, 5}, Shape{4, 4}, Shape{3, 4, 5}, Shape{2, 2, 4, 5}}) {
    SdpaOptions o;
    const Tensor m = Tensor::ones(ms);
    o.attn_mask = AttnMask::boolean(m);
    expect_error<ShapeError>([&] { scaled_dot_product_attention(q, k, k, o); },
                             {"attn_mask", ms.str(), "[2, 4, 5]"}, ms.str().c_str());
  }
  SdpaOptions o;  // a 0-D mask is rejected (PyTorch needs at least the (L, S) dims to mean anything)
  const Tensor s = Tensor::scalar(1.0f);
  o.attn_mask = AttnMask::additive(s);
  expect_error<ShapeError>([&] { scaled_dot_product_attention(q, k, k, o); }, {"attn_mask", "[]"}, "0-D");
}

TEST(ErrorsSdpa, AttnMaskTogetherWithIsCausal) {
  manual_seed(10);
  const Tensor q = randn_({4, 8});
  const Tensor m = Tensor::ones({4, 4});
  SdpaOptions o;
  o.attn_mask = AttnMask::boolean(m);
  o.is_causal = true;
  expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, o); }, {"attn_mask", "is_causal"}, "both");
}

TEST(ErrorsSdpa, NonFiniteScale) {
  const Tensor q = Tensor::ones({2, 3});
  SdpaOptions o;
  o.scale = std::numeric_limits<double>::infinity();
  expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, o); }, {"scale", "finite", "inf"}, "inf");
}

// ---- functional ---------------------------------------------------------------------------------

TEST(ErrorsFunctional, MatmulInnerDimMismatch) {
  expect_error<ShapeError>([] { matmul(Tensor::ones({2, 3}), Tensor::ones({4, 5})); },
                           {"matmul", "inner", "[2, 3]", "k = 3", "[4, 5]", "k = 4"}, "2-D");
  expect_error<ShapeError>([] { matmul(Tensor::ones({2, 6, 3}), Tensor::ones({2, 2, 6})); },
                           {"[2, 6, 3]", "[2, 2, 6]"}, "batched");
  expect_error<ShapeError>([] { matmul(Tensor::ones({3}), Tensor::ones({4})); }, {"[3]", "[4]"}, "1-D");
  expect_error<ShapeError>([] { matmul(Tensor::ones({2, 2, 3}), Tensor::ones({3, 3, 4})); },
                           {"matmul (batch dims)", "[2]", "[3]"}, "batch broadcast");
  expect_error<ShapeError>([] { matmul(Tensor::scalar(1.0f), Tensor::ones({3})); }, {"at least 1", "[]"}, "0-D");
  expect_error<ShapeError>([] { dot(Tensor::ones({3}), Tensor::ones({4})); }, {"dot", "[3]", "[4]"}, "dot");
}

TEST(ErrorsFunctional, EmbeddingIdOutOfRange) {
  const Tensor w = Tensor::ones({6, 4});
  const std::vector<int64_t> ids{0, 5, 6};
  expect_error<IndexError>([&] { embedding(ids, Shape{3}, w); }, {"embedding", "id 6", "position 2", "[0, 6)"}, "6");
  const std::vector<int64_t> neg{-1};
  expect_error<IndexError>([&] { embedding(neg, Shape{1}, w); }, {"id -1", "[0, 6)"}, "-1");
  nn::Embedding emb(6, 16);
  const std::vector<int64_t> sentence{2, 3, 1, 4, 5, 6};
  expect_error<IndexError>([&] { emb.forward(sentence); }, {"id 6", "position 5", "[0, 6)"}, "module");
  expect_error<ShapeError>([&] { embedding(ids, Shape{2, 2}, w); }, {"3 ids", "[2, 2]"}, "ids shape");
  expect_error<ShapeError>([&] { embedding(ids, Shape{3}, Tensor::ones({6})); }, {"weight", "2-D", "[6]"}, "1-D weight");
}

TEST(ErrorsFunctional, LinearBadWeightAndBias) {
  const Tensor x = Tensor::ones({2, 5, 3});
  expect_error<ShapeError>([&] { linear(x, Tensor::ones({4})); }, {"linear", "weight", "2-D", "[4]"}, "1-D weight");
  expect_error<ShapeError>([&] { linear(x, Tensor::ones({4, 2})); },
                           {"linear", "in_features = 2", "[4, 2]", "[2, 5, 3]"}, "in_features");
  expect_error<ShapeError>([&] { linear(x, Tensor::ones({4, 3}), Tensor::ones({3})); },
                           {"linear", "bias", "[4]", "got [3]"}, "bias length");
  expect_error<ShapeError>([&] { linear(x, Tensor::ones({4, 3}), Tensor::ones({1, 4})); },
                           {"bias", "[4]", "got [1, 4]"}, "bias rank");
  expect_error<ShapeError>([&] { linear(Tensor::scalar(1.0f), Tensor::ones({4, 3})); }, {"linear", "[]"}, "0-D x");
  nn::Linear lin(3, 4);
  expect_error<ShapeError>([&] { lin.forward(Tensor::ones({2, 5})); }, {"in_features = 3", "[2, 5]"}, "module");
}

TEST(ErrorsFunctional, SoftmaxDimOutOfRange) {
  const Tensor x = Tensor::ones({2, 3});
  expect_error<IndexError>([&] { softmax(x, 2); }, {"softmax", "dim 2", "2-D", "[-2, 1]"}, "2");
  expect_error<IndexError>([&] { softmax(x, -3); }, {"softmax", "dim -3", "[-2, 1]"}, "-3");
  expect_error<IndexError>([&] { softmax_naive(x, 5); }, {"dim 5"}, "naive");
  expect_error<IndexError>([&] { sum(x, 2); }, {"dim 2", "[-2, 1]"}, "sum");
}

TEST(ErrorsFunctional, BroadcastAndMaskedFill) {
  expect_error<ShapeError>([] { add(Tensor::ones({2, 3}), Tensor::ones({4, 3})); }, {"[2, 3]", "[4, 3]"}, "add");
  const Tensor x = Tensor::ones({4, 4});
  expect_error<ShapeError>([&] { masked_fill(x, Tensor::ones({6, 6}), -1.0f); }, {"masked_fill", "[6, 6]", "[4, 4]"}, "mask");
  expect_error<ShapeError>([&] { masked_fill(x, Tensor::ones({2, 4, 4}), -1.0f); },
                           {"masked_fill", "[2, 4, 4]", "[4, 4]"}, "mask grows x");
  expect_error<ShapeError>([] { triu(Tensor::ones({4}), 1); }, {"triu", "2 dimensions", "[4]"}, "triu");
  const Tensor a = Tensor::ones({2, 3}), b = Tensor::ones({2, 4});
  const TensorView ab[2] = {a, b};
  expect_error<ShapeError>([&] { cat(ab, 0); }, {"cat", "[2, 4]", "[2, 3]"}, "cat");
  expect_error<ShapeError>([&] { stack(ab, 0); }, {"stack", "[2, 4]", "[2, 3]"}, "stack");
}

// ---- tensors ------------------------------------------------------------------------------------

TEST(ErrorsTensor, TypedErrorsFromTensorCalls) {
  const Tensor t = Tensor::ones({2, 3});
  expect_error<IndexError>([&] { (void)t.at({2, 0}); }, {"at", "index 2", "size 2"}, "at");
  expect_error<ShapeError>([&] { t.t().view({6}); }, {"view", "not contiguous", "[3, 2]"}, "view");
  expect_error<ValueError>([] { (void)(Shape{int64_t{1} << 40, int64_t{1} << 40}.numel()); }, {"overflows"}, "numel");
  expect_error<ShapeError>([] { Shape s{1, 1, 1, 1, 1}; }, {"at most 4"}, "5-D");
  expect_error<IndexError>([&] { t.transpose(0, 2); }, {"transpose", "dim 2", "2-D"}, "transpose");
}


// ---- regressions found by the fuzz targets (tests/fuzz/, scripts/fuzz.sh) ------------------------

// fuzz_tensor_views: view() multiplied the given extents without an overflow check (signed
// overflow, undefined behaviour) before comparing the element count.
TEST(FuzzRegressions, ViewWithExtentsOverflowingInt64IsAShapeError) {
  const Tensor t = Tensor::ones({2, 3});
  expect_error<ShapeError>([&] { t.view({std::numeric_limits<int64_t>::max(), 6}); }, {"view", "too many elements"},
                           "view max*6");
  expect_error<ShapeError>([&] { t.view({int64_t{1} << 62, 4, -1}); }, {"view"}, "view 2^62*4 with -1");
}

// fuzz_tensor_views: slice() of a 0-D tensor returned it unchanged (writing an extent past the
// shape's rank); PyTorch: "slice() cannot be applied to a 0-dim tensor".
TEST(FuzzRegressions, SliceOfAZeroDimTensorIsAnIndexError) {
  const Tensor s = Tensor::scalar(1.5f);
  expect_error<IndexError>([&] { s.slice(0, 0, 1); }, {"slice", "0-D"}, "slice 0-D");
  expect_error<IndexError>([&] { s.slice(-1, 0, 0); }, {"slice", "0-D"}, "slice 0-D, dim -1");
}

// fuzz_tensor_views: row-major strides count a zero extent as 1, so an empty shape such as
// [3 * 2^61, 0, 4] has strides beyond int64 (signed overflow in contiguous_strides).
TEST(FuzzRegressions, EmptyShapeWhoseStridesOverflowIsAShapeError) {
  const int64_t huge = int64_t{3} << 61;
  expect_error<ShapeError>([&] { (void)Tensor::empty({huge, 0, 4}); }, {"strides overflow"}, "empty");
  const Tensor e = Tensor::zeros({0, 4});
  expect_error<ShapeError>([&] { e.view({huge, 0, 4}); }, {"strides overflow"}, "view of an empty tensor");
  EXPECT_NO_THROW((void)e.view({int64_t{1} << 40, 0}));  // fits: still a valid empty view
}

// fuzz_tensor_views: select/slice of an empty view with huge extents moved the data pointer far
// outside the allocation (UBSan: "pointer index expression overflowed"). Empty views keep it.
TEST(FuzzRegressions, EmptyViewsKeepTheirDataPointer) {
  const Tensor e = Tensor::zeros({0, 4});
  const TensorView v = e.view({0, int64_t{1} << 61, 2});  // strides [2^62, 2, 1]
  EXPECT_EQ(v.select(1, (int64_t{1} << 61) - 1).data(), e.data());
  EXPECT_EQ(v.slice(1, int64_t{1} << 60, int64_t{1} << 61).data(), e.data());
  EXPECT_EQ(v.select(2, 1).numel(), 0);
  // A non-empty slice that selects nothing keeps it too; a non-empty one still moves.
  const Tensor t = Tensor::ones({3, 4});
  EXPECT_EQ(t.slice(0, 3, 3).data(), t.data());
  EXPECT_EQ(t.slice(0, 1, 3).data(), t.data() + 4);
  EXPECT_EQ(t.select(1, 2).data(), t.data() + 2);
}

// fuzz_sdpa: a finite scale beyond float32's range (1e40) passed the "scale must be finite"
// check, and the kernels then multiplied by an infinite float32 scale (NaN for a zero score).
TEST(FuzzRegressions, SdpaScaleBeyondFloat32RangeIsAValueError) {
  const Tensor q = Tensor::zeros({2, 3});
  for (double s : {1e40, -3e38, std::numeric_limits<double>::max()}) {
    SdpaOptions o;
    o.scale = s;
    for (SdpaBackend b : {SdpaBackend::kReference, SdpaBackend::kFused}) {
      o.backend = b;
      expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, o); }, {"scale", "finite"}, "scale");
    }
  }
  SdpaOptions o;
  o.scale = 2e38;  // still fine: scale * log2(e) fits in float32
  for (SdpaBackend b : {SdpaBackend::kReference, SdpaBackend::kFused}) {
    o.backend = b;
    const SdpaResult r = scaled_dot_product_attention(q, q, q, o);
    for (float x : r.output.to_vector()) EXPECT_EQ(x, 0.0f);
  }
}

// fuzz_sdpa: the fused kernel's attention weights (need_weights) came out above 1 (1.00017 for
// scores near 1e3): its second pass read the LSE back from natural log (two roundings away from
// the base-2 value the forward pass used), and may recompute a score a few ulps higher than the
// forward pass did. Now the LSE stays in base 2 and exp2's argument is capped at 0.
TEST(FuzzRegressions, FusedWeightsNeverExceedOne) {
  manual_seed(17);
  for (float mag : {1.0f, 30.0f, 300.0f}) {
    for (CausalAlignment align : {CausalAlignment::kTopLeft, CausalAlignment::kBottomRight}) {
      const Tensor q = mul(randn({2, 3, 11, 8}), mag), k = mul(randn({2, 3, 9, 8}), mag);
      const Tensor v = randn({2, 3, 9, 4});
      SdpaOptions o;
      o.backend = SdpaBackend::kFused;
      o.is_causal = true;
      o.causal_alignment = align;
      o.need_weights = true;
      const SdpaResult r = scaled_dot_product_attention(q, k, v, o);
      for (float w : r.attn_weights.to_vector()) ASSERT_LE(w, 1.0f) << "magnitude " << mag;
      // A query that sees exactly one key gives it weight 1 exactly.
      const int64_t single_row = align == CausalAlignment::kTopLeft ? 0 : 11 - 9;
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t h = 0; h < 3; ++h) EXPECT_EQ(r.attn_weights.at({b, h, single_row, 0}), 1.0f) << "magnitude " << mag;
      }
    }
  }
}

// fuzz_fixture_parser: the fixture parser let std::stoll's std::invalid_argument and
// std::out_of_range escape on a malformed shape (e.g. "2,=" or "2,99999999999999999999").
// Malformed input now throws attn::FormatError "<source>:<line>: ...".
TEST(FuzzRegressions, FixtureParserRejectsMalformedInputWithFormatError) {
  const std::string h = "# attn-fixtures v1 test\n";
  const std::pair<std::string, std::string> bad[] = {
      {h + "x\t2,=\t1 2\n", "in:2: record 'x': bad extent '='"},
      {h + "x\t2,99999999999999999999\t1 2\n", "bad extent '99999999999999999999'"},
      {h + "x\t-2\t\n", "bad extent '-2'"},
      {h + "x\t1,1,1,1,1\t1\n", "more than 4 dims"},
      {h + "x\t4611686018427387904,4\t1\n", "too many elements"},
      {h + "x\t2\t1 2 3\n", "more than 2 values"},
      {h + "x\t2\t1 zwei\n", "bad value 'zwei'"},
      {h + "\nx\t1\t1\nx\t1\t2\n", "in:4: duplicate record 'x'"},
      {h + "@text t\nbody\n", "in:3: text record 't' (line 2) has no @end"},
      {"attn-fixtures v1\n", "in:1: expected header"},
      {"", "in:0: expected header"},
  };
  for (const auto& entry : bad) {  // no structured binding: clang 14 cannot capture one
    const std::string& text = entry.first;
    expect_error<FormatError>([&] { (void)test::parse_fixtures(text, "in"); }, {entry.second}, text.c_str());
  }
  // Well-formed input parses as before, from a string or a stream.
  const test::FixtureFile f = test::parse_fixtures(h + "s\t\t2.5\nm\t2,1\t1 -inf\n@text t\na\n\n@end\n");
  EXPECT_EQ(f.at("s").shape, Shape{});
  EXPECT_EQ(f.at("m").values[1], -std::numeric_limits<double>::infinity());
  EXPECT_EQ(f.text("t"), "a\n");
}

}  // namespace
}  // namespace attn

// PagedKvCache: round trips for every cache dtype (float32 exact, 16-bit as Tensor::to rounds,
// int8 within half a step), pages reused in any order after frees, ids reused, and every error
// of the header leaving the cache byte for byte as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn {
namespace {

PagedKvCacheOptions small_options(DType dtype, int64_t num_pages = 8) {
  PagedKvCacheOptions o;
  o.num_pages = num_pages;
  o.page_size = 4;
  o.heads_kv = 2;
  o.head_dim = 5;
  o.head_dim_v = 3;
  o.dtype = dtype;
  return o;
}

// (T, heads, dim) random tokens.
Tensor tokens(int64_t T, int64_t heads, int64_t dim, uint64_t seed) {
  Generator gen(seed);
  return randn({T, heads, dim}, gen);
}

// The dense (heads, T, dim) float32 a cache should return for tokens (T, heads, dim).
std::vector<float> dense(const TensorView& toks) { return toks.transpose(0, 1).to(DType::kFloat32).to_vector(); }

// Everything observable about a cache, to check that a rejected call changed nothing.
struct Snapshot {
  std::vector<int64_t> ids, lengths;
  std::vector<std::vector<int64_t>> tables;
  int64_t free_pages = 0;
  std::vector<uint8_t> bytes;

  explicit Snapshot(const PagedKvCache& c) : ids(c.sequences()), free_pages(c.free_pages()) {
    for (int64_t id : ids) {
      lengths.push_back(c.length(id));
      const std::span<const int64_t> t = c.block_table(id);
      tables.emplace_back(t.begin(), t.end());
    }
    for (const Tensor* t : {&c.key_pages(), &c.value_pages(), &c.key_scales(), &c.value_scales()}) {
      if (!t->defined()) continue;
      const auto* p = static_cast<const uint8_t*>(t->raw_data());
      bytes.insert(bytes.end(), p, p + t->numel() * t->element_size());
    }
  }
  bool operator==(const Snapshot&) const = default;
};

TEST(PagedKvCache, PoolLayoutFollowsTheHeader) {
  const PagedKvCache c(small_options(DType::kInt8));
  EXPECT_EQ(c.key_pages().shape(), (Shape{8, 2, 4, 5}));
  EXPECT_EQ(c.value_pages().shape(), (Shape{8, 2, 4, 3}));
  EXPECT_EQ(c.key_pages().dtype(), DType::kInt8);
  EXPECT_EQ(c.key_scales().shape(), (Shape{8, 2, 4}));
  EXPECT_EQ(c.value_scales().dtype(), DType::kFloat32);
  EXPECT_EQ(c.free_pages(), 8);
  PagedKvCacheOptions o = small_options(DType::kBFloat16);
  o.head_dim_v = 0;
  const PagedKvCache b(o);
  EXPECT_EQ(b.head_dim_v(), 5);
  EXPECT_EQ(b.value_pages().shape(), (Shape{8, 2, 4, 5}));
  EXPECT_FALSE(b.key_scales().defined());
}

TEST(PagedKvCache, Float32RoundTripIsExactAcrossPages) {
  PagedKvCache c(small_options(DType::kFloat32));
  const int64_t id = c.add_sequence();
  const Tensor k = tokens(11, 2, 5, 1), v = tokens(11, 2, 3, 2);
  // Appends of 3, 6 and 2 tokens: page boundaries fall inside appends.
  for (auto [a, b] : {std::pair{0, 3}, std::pair{3, 9}, std::pair{9, 11}}) {
    c.append(id, k.slice(0, a, b), v.slice(0, a, b));
  }
  EXPECT_EQ(c.length(id), 11);
  EXPECT_EQ(c.block_table(id).size(), 3u);
  EXPECT_EQ(c.free_pages(), 5);
  EXPECT_EQ(c.gather_keys(id).shape(), (Shape{2, 11, 5}));
  EXPECT_EQ(c.gather_keys(id).to_vector(), dense(k));
  EXPECT_EQ(c.gather_values(id).to_vector(), dense(v));
}

TEST(PagedKvCache, SixteenBitCachesRoundAsTensorTo) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    PagedKvCache c(small_options(dtype));
    const int64_t id = c.add_sequence();
    const Tensor k = tokens(6, 2, 5, 3), v = tokens(6, 2, 3, 4);
    // float32 then float64 input: both round to nearest even (float64 through float32, as c10).
    c.append(id, k.slice(0, 0, 4), v.slice(0, 0, 4));
    const Tensor k64 = k.slice(0, 4, 6).to(DType::kFloat64), v64 = v.slice(0, 4, 6).to(DType::kFloat64);
    c.append(id, k64, v64);
    EXPECT_EQ(c.gather_keys(id).to_vector(), dense(k.to(dtype))) << dtype_name(dtype);
    EXPECT_EQ(c.gather_values(id).to_vector(), dense(v.to(dtype))) << dtype_name(dtype);
  }
}

TEST(PagedKvCache, NonContiguousViewsAreRead) {
  PagedKvCache c(small_options(DType::kFloat16));
  const int64_t id = c.add_sequence();
  // (heads, T, dim) transposed to (T, heads, dim), and every other token of a longer tensor.
  Generator gen(5);
  const Tensor kt = randn({2, 7, 5}, gen), v = randn({14, 2, 3}, gen);
  const TensorView k = kt.transpose(0, 1), v_strided = TensorView(v).view({7, 2, 2, 3}).select(1, 0);
  ASSERT_FALSE(k.is_contiguous());
  ASSERT_FALSE(v_strided.is_contiguous());
  c.append(id, k, v_strided);
  EXPECT_EQ(c.gather_keys(id).to_vector(), dense(k.to(DType::kFloat16)));
  EXPECT_EQ(c.gather_values(id).to_vector(), dense(v_strided.to(DType::kFloat16)));
}

// Each element of `got` (heads, T, dim) within half a quantisation step of `toks` (T, heads, dim),
// and the stored scale of each (token, head) is its max |x| / 127.
void expect_within_half_a_step(const PagedKvCache& c, const Tensor& got, const Tensor& toks,
                               const Tensor& scales, int64_t id) {
  const int64_t T = toks.size(0), H = toks.size(1), D = toks.size(2), P = c.page_size();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      float amax = 0.0f;
      for (int64_t e = 0; e < D; ++e) amax = std::max(amax, std::fabs(toks.at({t, h, e})));
      const int64_t slot = (c.block_table(id)[static_cast<size_t>(t / P)] * H + h) * P + t % P;
      EXPECT_EQ(scales.data()[slot], amax / 127.0f) << "token " << t << " head " << h;
      for (int64_t e = 0; e < D; ++e) {
        EXPECT_LE(std::fabs(got.at({h, t, e}) - toks.at({t, h, e})), amax / 127.0f * 0.5f * (1.0f + 1e-5f))
            << "token " << t << " head " << h << " element " << e;
      }
    }
  }
}

TEST(PagedKvCache, Int8IsWithinHalfAStepAndScalesArePerTokenAndHead) {
  PagedKvCache c(small_options(DType::kInt8));
  const int64_t id = c.add_sequence();
  Tensor k = tokens(9, 2, 5, 6), v = tokens(9, 2, 3, 7);
  for (int64_t e = 0; e < 5; ++e) k.at({4, 1, e}) = 0.0f;  // an all-zero row: scale 0
  c.append(id, k, v);
  expect_within_half_a_step(c, c.gather_keys(id), k, c.key_scales(), id);
  expect_within_half_a_step(c, c.gather_values(id), v, c.value_scales(), id);
  for (int64_t e = 0; e < 5; ++e) EXPECT_EQ(c.gather_keys(id).at({1, 4, e}), 0.0f);
}

TEST(PagedKvCache, Int8IsExactOnTheGrid) {
  // scale * q with a power-of-two scale and max |q| = 127: max / 127 gives the scale back
  // exactly, and x / scale the integer.
  PagedKvCache c(small_options(DType::kInt8));
  const int64_t id = c.add_sequence();
  Tensor k({3, 2, 5}), v({3, 2, 3});
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < 2; ++h) {
      const float scale = std::ldexp(1.0f, static_cast<int>(t - 3 * h));
      for (int64_t e = 0; e < 5; ++e) k.at({t, h, e}) = scale * static_cast<float>(e == 2 ? -127 : 31 * e - 60);
      for (int64_t e = 0; e < 3; ++e) v.at({t, h, e}) = scale * static_cast<float>(e == 0 ? 127 : -e);
    }
  c.append(id, k, v);
  EXPECT_EQ(c.gather_keys(id).to_vector(), dense(k));
  EXPECT_EQ(c.gather_values(id).to_vector(), dense(v));
}

TEST(PagedKvCache, AppendQuantizedStoresWhatItIsGivenAndAcceptsZeroScales) {
  PagedKvCache c(small_options(DType::kInt8));
  const int64_t id = c.add_sequence();
  const Tensor k = Tensor::full({2, 2, 5}, 3.0f).to(DType::kInt8), v = Tensor::full({2, 2, 3}, -2.0f).to(DType::kInt8);
  const Tensor ks = Tensor::of({2, 2}, {0.5f, 0.0f, 0.25f, 1.0f}), vs = Tensor::of({2, 2}, {0.0f, 2.0f, 1.0f, 0.5f});
  c.append_quantized(id, k, ks, v, vs);
  EXPECT_EQ(c.gather_keys(id).to_vector(),
            (std::vector<float>{1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 0.75f, 0.75f, 0.75f, 0.75f, 0.75f,
                                0, 0, 0, 0, 0, 3, 3, 3, 3, 3}));
  EXPECT_EQ(c.gather_values(id).to_vector(), (std::vector<float>{0, 0, 0, -2, -2, -2, -4, -4, -4, -1, -1, -1}));
}

// Appends tokens to `id` and to the record of what it should hold.
void append_recorded(PagedKvCache& c, int64_t id, int64_t T, uint64_t seed, std::vector<Tensor>& ks,
                     std::vector<Tensor>& vs) {
  const Tensor k = tokens(T, 2, 5, seed), v = tokens(T, 2, 3, seed + 1);
  c.append(id, k, v);
  auto& K = ks[static_cast<size_t>(id)];
  auto& V = vs[static_cast<size_t>(id)];
  const std::vector<TensorView> kk{K, k}, vv{V, v};
  K = K.defined() ? cat(kk, 0) : k;
  V = V.defined() ? cat(vv, 0) : v;
}

TEST(PagedKvCache, FreedPagesAreReusedOutOfOrderAndDataStaysRight) {
  PagedKvCache c(small_options(DType::kFloat32, 12));
  const int64_t a = c.add_sequence(), b = c.add_sequence(), d = c.add_sequence();
  std::vector<Tensor> ks(3), vs(3);
  // Round-robin appends interleave the sequences' pages in the pool.
  for (uint64_t round = 0; round < 3; ++round) {
    for (int64_t id : {a, b, d}) append_recorded(c, id, 3, 100 * round + 10 * id, ks, vs);
  }
  EXPECT_EQ(std::vector<int64_t>(c.block_table(a).begin(), c.block_table(a).end()),
            (std::vector<int64_t>{0, 3, 6}));
  const std::vector<int64_t> freed(c.block_table(b).begin(), c.block_table(b).end());
  const int64_t free_before = c.free_pages();
  c.free_sequence(b);
  ks[b] = vs[b] = Tensor();
  EXPECT_EQ(c.free_pages(), free_before + static_cast<int64_t>(freed.size()));
  EXPECT_FALSE(c.contains(b));
  // d grows onto b's first page (below its own), then a new sequence takes the rest.
  append_recorded(c, d, 4, 500, ks, vs);
  const std::span<const int64_t> dt = c.block_table(d);
  EXPECT_EQ(dt.back(), freed.front());
  EXPECT_FALSE(std::is_sorted(dt.begin(), dt.end()));
  const int64_t e = c.add_sequence();
  EXPECT_EQ(e, b);  // the smallest free id
  append_recorded(c, e, 13, 600, ks, vs);
  const std::span<const int64_t> et = c.block_table(e);
  EXPECT_EQ(std::vector<int64_t>(et.begin(), et.begin() + 2),
            (std::vector<int64_t>{freed[1], freed[2]}));
  EXPECT_EQ(c.free_pages(), 12 - 3 - 4 - 4);
  for (int64_t id : {a, e, d}) {
    EXPECT_EQ(c.gather_keys(id).to_vector(), dense(ks[id])) << "seq " << id;
    EXPECT_EQ(c.gather_values(id).to_vector(), dense(vs[id])) << "seq " << id;
  }
}

TEST(PagedKvCache, IdsAreTheSmallestFreeAndSequencesAreAscending) {
  PagedKvCache c(small_options(DType::kFloat32));
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(c.add_sequence(), i);
  c.free_sequence(2);
  c.free_sequence(0);
  EXPECT_EQ(c.sequences(), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.add_sequence(), 0);
  EXPECT_EQ(c.add_sequence(), 2);
  EXPECT_EQ(c.add_sequence(), 4);
  EXPECT_EQ(c.sequences(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // A re-added sequence starts empty.
  c.append(1, tokens(5, 2, 5, 1), tokens(5, 2, 3, 2));
  c.free_sequence(1);
  EXPECT_EQ(c.add_sequence(), 1);
  EXPECT_EQ(c.length(1), 0);
  EXPECT_TRUE(c.block_table(1).empty());
  EXPECT_EQ(c.gather_keys(1).shape(), (Shape{2, 0, 5}));
  EXPECT_EQ(c.free_pages(), 8);
}

TEST(PagedKvCache, FillsThePoolExactly) {
  PagedKvCache c(small_options(DType::kBFloat16, 3));
  const int64_t a = c.add_sequence(), b = c.add_sequence();
  c.append(a, tokens(5, 2, 5, 1), tokens(5, 2, 3, 2));  // 2 pages
  c.append(b, tokens(4, 2, 5, 3), tokens(4, 2, 3, 4));  // 1 page
  EXPECT_EQ(c.free_pages(), 0);
  c.append(a, tokens(3, 2, 5, 5), tokens(3, 2, 3, 6));  // fills a's second page
  EXPECT_EQ(c.length(a), 8);
  c.append(a, tokens(0, 2, 5, 7), tokens(0, 2, 3, 8));  // nothing
  EXPECT_THROW(c.append(b, tokens(1, 2, 5, 9), tokens(1, 2, 3, 10)), ValueError);
}

// ---- errors ------------------------------------------------------------------------------------

// A cache with two live sequences (one freed between them) and data in it.
PagedKvCache busy_cache(DType dtype) {
  PagedKvCache c(small_options(dtype, 5));
  const int64_t a = c.add_sequence(), b = c.add_sequence(), d = c.add_sequence();
  c.append(a, tokens(6, 2, 5, 1), tokens(6, 2, 3, 2));
  c.append(b, tokens(2, 2, 5, 3), tokens(2, 2, 3, 4));
  c.append(d, tokens(5, 2, 5, 5), tokens(5, 2, 3, 6));
  c.free_sequence(b);
  return c;  // a: 2 pages, d: 2 pages, 1 free; id 1 freed, id 7 never added
}

template <typename E, typename F>
void expect_rejected_unchanged(PagedKvCache& c, F&& call, const std::string& fragment, const char* what) {
  const Snapshot before(c);
  try {
    call();
    ADD_FAILURE() << what << ": accepted";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong exception type: " << e.what();
  }
  EXPECT_TRUE(Snapshot(c) == before) << what << " changed the cache";
}

TEST(PagedKvCacheErrors, AppendErrorsAreTypedAndChangeNothing) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt8}) {
    PagedKvCache c = busy_cache(dtype);
    const Tensor k = tokens(3, 2, 5, 7), v = tokens(3, 2, 3, 8);
    expect_rejected_unchanged<IndexError>(c, [&] { c.append(1, k, v); }, "seq 1 is freed", "freed seq");
    expect_rejected_unchanged<IndexError>(c, [&] { c.append(7, k, v); }, "seq 7", "unknown seq");
    expect_rejected_unchanged<IndexError>(c, [&] { c.append(-1, k, v); }, "seq -1", "negative seq");
    expect_rejected_unchanged<ShapeError>(c, [&] { c.append(0, tokens(3, 3, 5, 1), v); }, "key", "key heads");
    expect_rejected_unchanged<ShapeError>(c, [&] { c.append(0, k, tokens(3, 2, 5, 1)); }, "value", "value dim");
    expect_rejected_unchanged<ShapeError>(c, [&] { c.append(0, k, tokens(2, 2, 3, 1)); }, "value", "value T");
    expect_rejected_unchanged<ShapeError>(c, [&] { c.append(0, k.view({3, 10}), v); }, "key", "key rank");
    expect_rejected_unchanged<ShapeError>(c, [&] { c.append(0, TensorView(), v); }, "undefined", "no key");
    expect_rejected_unchanged<DTypeError>(c, [&] { c.append(0, k.to(DType::kInt32), v); }, "int32", "int key");
    expect_rejected_unchanged<DTypeError>(c, [&] { c.append(0, k, v.to(DType::kInt8)); }, "value", "int8 value");
    // seq 0 holds 6 tokens in 2 pages: 8 more need 2 more pages, 1 free of 5.
    expect_rejected_unchanged<ValueError>(c, [&] { c.append(0, tokens(8, 2, 5, 1), tokens(8, 2, 3, 1)); },
                                          "needs 2 more pages, 1 free of 5", "past capacity");
  }
}

TEST(PagedKvCacheErrors, Int8RefusesNonFiniteValuesAndChangesNothing) {
  PagedKvCache c = busy_cache(DType::kInt8);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    Tensor k = tokens(3, 2, 5, 7), v = tokens(3, 2, 3, 8);
    v.at({2, 1, 2}) = bad;  // the last element: everything before it could have been written
    expect_rejected_unchanged<ValueError>(c, [&] { c.append(0, k, v); }, "value", "non-finite value");
    k.at({0, 0, 0}) = bad;
    expect_rejected_unchanged<ValueError>(c, [&] { c.append(0, k, v); }, "key", "non-finite key");
  }
  // Float caches keep them (the attention's NaN policy decides).
  PagedKvCache f = busy_cache(DType::kBFloat16);
  Tensor k = tokens(1, 2, 5, 7);
  k.at({0, 0, 0}) = std::numeric_limits<float>::quiet_NaN();
  f.append(0, k, tokens(1, 2, 3, 8));
  EXPECT_TRUE(std::isnan(f.gather_keys(0).at({0, 6, 0})));
}

TEST(PagedKvCacheErrors, AppendQuantizedChecksDtypeShapesAndScales) {
  PagedKvCache f = busy_cache(DType::kFloat32);
  const Tensor q = Tensor::ones({2, 2, 5}, DType::kInt8), qv = Tensor::ones({2, 2, 3}, DType::kInt8);
  const Tensor s = Tensor::ones({2, 2});
  expect_rejected_unchanged<DTypeError>(f, [&] { f.append_quantized(0, q, s, qv, s); }, "float32, not int8",
                                        "float cache");
  PagedKvCache c = busy_cache(DType::kInt8);
  expect_rejected_unchanged<IndexError>(c, [&] { c.append_quantized(1, q, s, qv, s); }, "seq 1", "freed seq");
  expect_rejected_unchanged<DTypeError>(c, [&] { c.append_quantized(0, q.to(DType::kFloat32), s, qv, s); },
                                        "key must be int8", "float key");
  expect_rejected_unchanged<DTypeError>(c, [&] { c.append_quantized(0, q, s.to(DType::kFloat64), qv, s); },
                                        "key_scale must be float32", "float64 scale");
  expect_rejected_unchanged<ShapeError>(c, [&] { c.append_quantized(0, q, Tensor::ones({2, 3}), qv, s); },
                                        "key_scale", "scale shape");
  expect_rejected_unchanged<ShapeError>(c, [&] { c.append_quantized(0, q, s, q, s); }, "value", "value dim");
  for (float bad : {-1.0f, -1e-30f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    Tensor b = Tensor::ones({2, 2});
    b.at({1, 1}) = bad;
    expect_rejected_unchanged<ValueError>(c, [&] { c.append_quantized(0, q, b, qv, s); }, "key_scale",
                                          "bad key scale");
    expect_rejected_unchanged<ValueError>(c, [&] { c.append_quantized(0, q, s, qv, b); }, "value_scale",
                                          "bad value scale");
  }
  const Tensor big = Tensor::ones({8, 2, 5}, DType::kInt8), bigv = Tensor::ones({8, 2, 3}, DType::kInt8);
  const Tensor bs = Tensor::ones({8, 2});
  expect_rejected_unchanged<ValueError>(c, [&] { c.append_quantized(0, big, bs, bigv, bs); },
                                        "needs 2 more pages, 1 free of 5", "past capacity");
  c.append_quantized(0, q, Tensor::zeros({2, 2}), qv, s);  // zero scales: all-zero rows
  EXPECT_EQ(c.length(0), 8);
}

TEST(PagedKvCacheErrors, LookupsOfDeadIdsAreIndexErrors) {
  PagedKvCache c = busy_cache(DType::kFloat16);
  for (int64_t id : {int64_t{1}, int64_t{7}, int64_t{-3}}) {
    expect_rejected_unchanged<IndexError>(c, [&] { c.free_sequence(id); }, "free_sequence", "free");
    expect_rejected_unchanged<IndexError>(c, [&] { (void)c.length(id); }, "length", "length");
    expect_rejected_unchanged<IndexError>(c, [&] { (void)c.block_table(id); }, "block_table", "block_table");
    expect_rejected_unchanged<IndexError>(c, [&] { (void)c.gather_keys(id); }, "gather_keys", "gather_keys");
    expect_rejected_unchanged<IndexError>(c, [&] { (void)c.gather_values(id); }, "gather_values", "gather_values");
    EXPECT_FALSE(c.contains(id));
  }
}

TEST(PagedKvCacheErrors, BadOptionsNameTheField) {
  const std::pair<const char*, void (*)(PagedKvCacheOptions&)> cases[] = {
      {"num_pages", [](PagedKvCacheOptions& o) { o.num_pages = 0; }},
      {"page_size", [](PagedKvCacheOptions& o) { o.page_size = -4; }},
      {"heads_kv", [](PagedKvCacheOptions& o) { o.heads_kv = 0; }},
      {"head_dim", [](PagedKvCacheOptions& o) { o.head_dim = 0; }},
      {"head_dim_v", [](PagedKvCacheOptions& o) { o.head_dim_v = -1; }},
      {"dtype", [](PagedKvCacheOptions& o) { o.dtype = DType::kFloat64; }},
      {"dtype", [](PagedKvCacheOptions& o) { o.dtype = DType::kInt32; }},
  };
  for (const auto& [field, edit] : cases) {
    PagedKvCacheOptions o = small_options(DType::kFloat32);
    edit(o);
    try {
      PagedKvCache c(o);
      ADD_FAILURE() << field << ": accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("options.") + field), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace attn

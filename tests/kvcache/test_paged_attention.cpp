// paged_attention against scaled_dot_product_attention on each sequence's gathered keys and
// values: within 2x the float32 reference's error against float64 (tests/sdpa/test_low_precision.cpp's
// rule), for sequences of different lengths whose pages interleave in the pool, GQA, causal
// bottom-right with several new tokens, every cache dtype; and every error of the header.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

struct DecodeCase {
  int64_t Hq, Hkv, E, Ev, L_q;
  bool causal;
  DType cache_dtype = DType::kFloat32;
  DType query_dtype = DType::kFloat32;
};

std::string describe(const DecodeCase& s) {
  return "Hq" + std::to_string(s.Hq) + " Hkv" + std::to_string(s.Hkv) + " E" + std::to_string(s.E) +
         " Ev" + std::to_string(s.Ev) + " Lq" + std::to_string(s.L_q) + (s.causal ? " causal" : "") +
         " cache " + std::string(dtype_name(s.cache_dtype)) + " query " + std::string(dtype_name(s.query_dtype));
}

// Sequences of lengths 37, L_q, 5 + L_q, 70 (ids 0, 2, 3, 4 after id 1 was freed), filled a few
// tokens at a time in turn, so that their pages interleave and reuse freed ones.
PagedKvCache filled_cache(const DecodeCase& s, std::vector<int64_t>& ids) {
  PagedKvCacheOptions o;
  o.num_pages = 64;
  o.page_size = 8;
  o.heads_kv = s.Hkv;
  o.head_dim = s.E;
  o.head_dim_v = s.Ev;
  o.dtype = s.cache_dtype;
  PagedKvCache c(o);
  for (int i = 0; i < 4; ++i) c.add_sequence();
  Generator gen(17);
  c.append(1, randn({20, s.Hkv, s.E}, gen), randn({20, s.Hkv, s.Ev}, gen));
  ids = {0, 2, 3, 4};
  const std::vector<int64_t> lengths{37, s.L_q, 5 + s.L_q, 70};
  for (int round = 0, busy = 1; busy || round < 3; ++round) {
    if (round == 2) {
      c.free_sequence(1);
      EXPECT_EQ(c.add_sequence(), 1);  // filler: takes freed pages too
      c.append(1, randn({9, s.Hkv, s.E}, gen), randn({9, s.Hkv, s.Ev}, gen));
      EXPECT_EQ(c.add_sequence(), 4);
    }
    busy = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!c.contains(ids[i])) continue;
      const int64_t n = std::min<int64_t>(6, lengths[i] - c.length(ids[i]));
      if (n > 0) c.append(ids[i], randn({n, s.Hkv, s.E}, gen), randn({n, s.Hkv, s.Ev}, gen));
      busy += n > 0 ? 1 : 0;
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(c.length(ids[i]), lengths[i]);
  return c;
}

// The variants of PagedAttentionOptions; slopes and sinks are filled per call (their shapes
// depend on N and H_q).
struct PagedVariant {
  const char* name;
  WindowSize window;
  std::optional<double> softcap;
  int alibi = 0;  // 0: none, 1: (H_q), 2: (N, H_q)
  bool sinks = false;
};

void expect_matches_dense_on(const DecodeCase& s, const std::string& kernel, const PagedVariant* var = nullptr) {
  std::vector<int64_t> ids;
  const PagedKvCache cache = filled_cache(s, ids);
  ids.push_back(0);  // a sequence may appear twice
  const int64_t N = static_cast<int64_t>(ids.size());
  Generator gen(23);
  const Tensor query = randn({N, s.L_q, s.Hq, s.E}, gen).to(s.query_dtype);
  PagedAttentionOptions po;
  po.is_causal = s.causal;
  po.need_lse = true;
  po.scale = 0.3;
  po.kernel = kernel;
  Tensor slopes, sinks;
  if (var != nullptr) {
    po.window_size = var->window;
    po.softcap = var->softcap;
    if (var->alibi != 0) {
      slopes = var->alibi == 1 ? Tensor::empty({s.Hq}) : Tensor::empty({N, s.Hq});
      for (int64_t h = 0; h < slopes.numel(); ++h) slopes.data()[h] = 0.05f * static_cast<float>(h % 7 + 1);
      po.alibi_slopes = slopes;
    }
    if (var->sinks) {
      sinks = randn({s.Hq}, gen);
      po.sinks = sinks;
    }
  }
  const SdpaResult got = paged_attention(query, cache, ids, po);
  ASSERT_EQ(got.output.shape(), (Shape{N, s.L_q, s.Hq, s.Ev})) << describe(s);
  ASSERT_EQ(got.output.dtype(), s.query_dtype);
  ASSERT_EQ(got.lse.shape(), (Shape{N, s.Hq, s.L_q}));
  ASSERT_EQ(got.lse.dtype(), DType::kFloat32);
  SdpaOptions o;
  o.enable_gqa = true;
  o.is_causal = s.causal;
  o.causal_alignment = CausalAlignment::kBottomRight;
  o.scale = 0.3;
  o.need_lse = true;
  o.backend = SdpaBackend::kReference;
  o.window_size = po.window_size;
  o.softcap = po.softcap;
  o.sinks = po.sinks;
  const Tensor q32 = query.to(DType::kFloat32);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t id = ids[static_cast<size_t>(i)];
    Tensor row_slopes;  // sequence i's (H_q) slopes
    if (slopes.defined()) {
      row_slopes = slopes.dim() == 1 ? slopes.contiguous() : slopes.select(0, i).contiguous();
      o.alibi_slopes = row_slopes;
    }
    const Tensor q = q32.select(0, i).transpose(0, 1).unsqueeze(0).contiguous();
    const Tensor k = cache.gather_keys(id).unsqueeze(0).contiguous(), v = cache.gather_values(id).unsqueeze(0).contiguous();
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(q, k, v, o);
    const double ref_err = test::max_abs_err(scaled_dot_product_attention(q, k, v, o).output.to(s.query_dtype), truth.output);
    const TensorView out_i = got.output.select(0, i).transpose(0, 1).unsqueeze(0);  // (1, H, L, Ev)
    const std::string what = describe(s) + (var != nullptr ? std::string(" ") + var->name : "");
    EXPECT_LE(test::max_abs_err(out_i, truth.output), 2.0 * ref_err + 1e-5)
        << what << " seq " << id << " (reference error " << ref_err << ")";
    EXPECT_LE(test::max_abs_err(got.lse.select(0, i).unsqueeze(0), truth.lse), 1e-4) << what << " lse";
  }
}

// The decode builds this CPU runs; the others are reported once as skipped, with the reason.
const std::vector<std::string>& decode_kernels() {
  static const std::vector<std::string> names = test::runnable_kernels_named("cpu.decode.");
  return names;
}

void expect_matches_dense(const DecodeCase& s) {
  for (const std::string& kernel : decode_kernels()) {
    SCOPED_TRACE("kernel " + kernel);
    expect_matches_dense_on(s, kernel);
  }
}

TEST(PagedAttention, EqualsDenseAttentionOnGatheredKv) {
  const DecodeCase setups[] = {
      {4, 4, 16, 16, 1, false},  {4, 4, 16, 16, 1, true},  {8, 2, 32, 24, 3, true},
      {4, 1, 8, 8, 16, true},    {6, 3, 16, 16, 5, false}, {2, 2, 64, 64, 16, false},
      {4, 4, 64, 64, 1, false},  {3, 3, 128, 128, 1, true},  // one row per kv head: the single-row path
  };
  for (const DecodeCase& s : setups) expect_matches_dense(s);
}

TEST(PagedAttention, EveryCacheAndQueryDtype) {
  for (DType cache : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt8}) {
    for (DType query : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      expect_matches_dense({8, 2, 16, 16, 4, true, cache, query});
      expect_matches_dense({4, 4, 64, 64, 1, false, cache, query});
      // Group 4, one query: the pipelined steps over pages, both kv heads per step (bf16 on a
      // bf16 cache: the dot unit's, E 128 permuted P.V, E 80 plain).
      expect_matches_dense({8, 2, 128, 128, 1, false, cache, query});
      expect_matches_dense({8, 2, 80, 80, 1, true, cache, query});
    }
  }
}

// Long sequences (split into several key ranges by the kernel) whose pages lie in the pool in
// shuffled order: the result equals the dense kernel on the gathered keys and values within
// float32 rounding, and is bit-identical for 1, 2 and 3 threads. The kernel reads a pool's kv
// heads together, a group of whole pages at a time: pages shorter than its chunk (16), longer
// (96: groups of 128 tokens, which pages do not align with), and with one kv head or three; and
// one query row per kv head (no GQA, L_q 1: the kernel's single-row path through the pages).
struct PagedLayout {
  int64_t page_size, Hkv, group, L_q;  // query heads: group * Hkv
};

class PagedLayouts : public ::testing::TestWithParam<PagedLayout> {};

TEST_P(PagedLayouts, LongShuffledSequencesSplitAcrossThreads) {
  const auto [page_size, Hkv, group, L_q] = GetParam();
  PagedKvCacheOptions o{.num_pages = 6400 / page_size, .page_size = page_size, .heads_kv = Hkv, .head_dim = 64};
  PagedKvCache c(o);
  Generator gen(31);
  // Interleave three sequences a page at a time, free one, so that the next grows into its pages.
  for (int i = 0; i < 3; ++i) c.add_sequence();
  for (int step = 0; step < 60; ++step) {
    for (int64_t id = 0; id < 3; ++id) c.append(id, randn({16, Hkv, 64}, gen), randn({16, Hkv, 64}, gen));
  }
  c.free_sequence(1);
  const int64_t grown = c.add_sequence();
  c.append(grown, randn({2100, Hkv, 64}, gen), randn({2100, Hkv, 64}, gen));
  const std::vector<int64_t> ids{0, grown, 2};
  const Tensor q = randn({3, L_q, group * Hkv, 64}, gen);
  PagedAttentionOptions po{.is_causal = true, .need_lse = true};
  for (const std::string& kernel : decode_kernels()) {
    po.kernel = kernel;
    po.num_threads = 1;
    const SdpaResult one = paged_attention(q, c, ids, po);
    for (int t : {2, 3}) {
      po.num_threads = t;
      const SdpaResult r = paged_attention(q, c, ids, po);
      EXPECT_EQ(one.output.to_vector(), r.output.to_vector()) << kernel << " threads " << t;
    }
    SdpaOptions so{.is_causal = true, .causal_alignment = CausalAlignment::kBottomRight, .enable_gqa = true};
    so.kernel = "cpu.flash.generic";
    for (int64_t n = 0; n < 3; ++n) {
      const Tensor qn = q.select(0, n).transpose(0, 1).unsqueeze(0).contiguous();
      const Tensor dense = scaled_dot_product_attention(qn, c.gather_keys(ids[n]).unsqueeze(0),
                                                        c.gather_values(ids[n]).unsqueeze(0), so).output;
      const std::vector<float> a = one.output.select(0, n).transpose(0, 1).contiguous().to_vector();
      const std::vector<float> b = dense.to_vector();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-6) << kernel << " seq " << ids[n] << " " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PagedAttention, PagedLayouts,
                         ::testing::Values(PagedLayout{16, 2, 4, 2}, PagedLayout{96, 3, 4, 2}, PagedLayout{16, 1, 4, 2},
                                           PagedLayout{16, 4, 1, 1}, PagedLayout{96, 2, 1, 1}),
                         [](const auto& info) {
                           const PagedLayout& l = info.param;
                           return "page" + std::to_string(l.page_size) + "_kvheads" + std::to_string(l.Hkv) + "_group" +
                                  std::to_string(l.group) + "_L" + std::to_string(l.L_q);
                         });

// One query row per kv head (the single-row path: steps that never cross a page, a page's steps
// head after head) over long sequences, for pages shorter than a step (16), longer and not a
// multiple of it (96, 100), with and without a sliding window that starts inside a page: within
// the float32 rule of the float64 truth, and the same bits for 1 and 2 threads.
TEST(PagedAttention, SingleRowsOverPagesOfEverySize) {
  for (const int64_t page_size : {16, 96, 100}) {
    for (const int64_t E : {64, 128}) {
      for (const WindowSize window : {WindowSize{-1, -1}, WindowSize{300, 0}}) {
        const int64_t Hkv = 3, lengths[] = {1500, 2100};
        PagedKvCacheOptions o{.num_pages = 4000 / page_size + 2, .page_size = page_size, .heads_kv = Hkv, .head_dim = E};
        PagedKvCache c(o);
        Generator gen(37);
        std::vector<Tensor> keys, values;  // each sequence's (S, Hkv, E), appended a page at a time in turn
        for (const int64_t S : lengths) {
          c.add_sequence();
          keys.push_back(randn({S, Hkv, E}, gen));
          values.push_back(randn({S, Hkv, E}, gen));
        }
        for (int64_t t0 = 0; t0 < 2100; t0 += page_size) {
          for (int64_t n = 0; n < 2; ++n) {
            const int64_t t1 = std::min(lengths[n], t0 + page_size);
            if (t0 < t1) c.append(n, keys[n].slice(0, t0, t1), values[n].slice(0, t0, t1));
          }
        }
        const std::vector<int64_t> ids{1, 0};
        const Tensor q = randn({2, 1, Hkv, E}, gen);
        PagedAttentionOptions po{.need_lse = true, .num_threads = 1};
        po.window_size = window;
        const SdpaResult one = paged_attention(q, c, ids, po);
        po.num_threads = 2;
        const SdpaResult two = paged_attention(q, c, ids, po);
        const std::string what = "page " + std::to_string(page_size) + " E " + std::to_string(E) + " window " +
                                 std::to_string(window.left);
        EXPECT_EQ(one.output.to_vector(), two.output.to_vector()) << what;
        SdpaOptions so{.causal_alignment = CausalAlignment::kBottomRight, .need_lse = true};
        so.window_size = window;
        so.backend = SdpaBackend::kReference;
        for (int64_t i = 0; i < 2; ++i) {
          const int64_t id = ids[static_cast<size_t>(i)];
          const Tensor qi = q.select(0, i).transpose(0, 1).unsqueeze(0).contiguous();
          const Tensor k = keys[id].transpose(0, 1).unsqueeze(0).contiguous(), v = values[id].transpose(0, 1).unsqueeze(0).contiguous();
          const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(qi, k, v, so);
          const double ref_err = test::max_abs_err(scaled_dot_product_attention(qi, k, v, so).output, truth.output);
          const TensorView out_i = one.output.select(0, i).transpose(0, 1).unsqueeze(0);
          EXPECT_LE(test::max_abs_err(out_i, truth.output), 2.0 * ref_err + 1e-6) << what << " seq " << id;
          EXPECT_LE(test::max_abs_err(one.lse.select(0, i).unsqueeze(0), truth.lse), 1e-4) << what << " seq " << id;
        }
      }
    }
  }
}

// ---- variants -----------------------------------------------------------------------------------

// Each variant (and pairs) equals scaled_dot_product_attention on the gathered keys and values
// with the same options (bottom-right), within the float32 rule, for sequences of lengths 37,
// L_q, 5 + L_q and 70 (a window of 5 hides most of the long ones), causal or not, GQA.
TEST(PagedAttentionVariants, EqualsDenseAttentionWithTheSameOptions) {
  const PagedVariant variants[] = {
      {"window_5_0", {5, 0}, {}, 0, false},    {"window_20_3", {20, 3}, {}, 0, false},
      {"window_right_1", {-1, 1}, {}, 0, false}, {"softcap", {}, 1.5, 0, false},
      {"alibi_h", {}, {}, 1, false},           {"alibi_nh", {}, {}, 2, false},
      {"sinks", {}, {}, 0, true},              {"window_sinks", {7, 0}, {}, 0, true},
      {"softcap_alibi", {}, 2.0, 2, false},    {"all", {12, 2}, 3.0, 1, true},
  };
  // {4, 4, 64, 64, 1} and {2, 2, 128, 128, 1}: one row per kv head, whose windows start inside a
  // page (the single-row path's steps, which never cross a page).
  const DecodeCase setups[] = {{8, 2, 32, 24, 3, true}, {4, 4, 16, 16, 1, false}, {4, 1, 16, 16, 16, true},
                               {8, 2, 16, 16, 4, false, DType::kBFloat16}, {8, 2, 16, 16, 2, true, DType::kInt8},
                               {4, 4, 64, 64, 1, true}, {2, 2, 128, 128, 1, false, DType::kBFloat16}};
  for (const DecodeCase& s : setups) {
    for (const PagedVariant& v : variants) {
      for (const std::string& kernel : decode_kernels()) {
        SCOPED_TRACE("kernel " + kernel);
        expect_matches_dense_on(s, kernel, &v);
      }
    }
  }
}

// A long sequence whose keys and values before a sliding window are NaN and Inf: the window's
// pages alone are read (and hidden keys never count), so the result is that of finite values,
// bit for bit, and the same for 1, 2 and 3 threads.
TEST(PagedAttentionVariants, PagesBeforeTheWindowChangeNothing) {
  const int64_t S = 3000, Lq = 4, window = 150;
  for (const auto [dt, page_size] : {std::pair{DType::kFloat32, int64_t{16}}, std::pair{DType::kBFloat16, int64_t{16}},
                                     std::pair{DType::kFloat32, int64_t{96}}}) {
    PagedKvCacheOptions o{.num_pages = 6400 / page_size, .page_size = page_size, .heads_kv = 2, .head_dim = 64, .dtype = dt};
    PagedKvCache clean(o), poisoned(o);
    Generator gen(41);
    const Tensor k = randn({S, 2, 64}, gen), v = randn({S, 2, 64}, gen);
    Tensor kp = k.contiguous(), vp = v.contiguous();
    for (int64_t j = 0; j < S - Lq - window; ++j) {
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t e = 0; e < 64; ++e) kp.at({j, h, e}) = NAN, vp.at({j, h, e}) = INFINITY;
      }
    }
    const std::vector<int64_t> ids{clean.add_sequence()};
    EXPECT_EQ(poisoned.add_sequence(), ids[0]);
    clean.append(ids[0], k, v);
    poisoned.append(ids[0], kp, vp);
    const Tensor q = randn({1, Lq, 8, 64}, gen);
    Tensor sinks = randn({8}, gen);
    PagedAttentionOptions po{.is_causal = true, .need_lse = true};
    po.window_size = {window, 0};
    po.sinks = sinks;
    po.softcap = 10.0;
    for (const std::string& kernel : decode_kernels()) {
      po.kernel = kernel;
      po.num_threads = 1;
      const SdpaResult a = paged_attention(q, clean, ids, po);
      for (int t : {1, 2, 3}) {
        po.num_threads = t;
        const SdpaResult b = paged_attention(q, poisoned, ids, po);
        EXPECT_EQ(a.output.to_vector(), b.output.to_vector()) << kernel << " " << dtype_name(dt) << " page " << page_size << " threads " << t;
        EXPECT_EQ(a.lse.to_vector(), b.lse.to_vector()) << kernel << " " << dtype_name(dt) << " page " << page_size << " threads " << t;
      }
    }
  }
}

TEST(PagedAttention, UnknownOrForeignKernelNamesAreRefused) {
  PagedKvCache c(PagedKvCacheOptions{.num_pages = 2, .page_size = 4, .heads_kv = 1, .head_dim = 4});
  const int64_t id = c.add_sequence();
  c.append(id, Tensor::ones({3, 1, 4}), Tensor::ones({3, 1, 4}));
  const std::vector<int64_t> ids{id};
  PagedAttentionOptions po;
  po.kernel = "cpu.flash.avx512";
  try {
    (void)paged_attention(Tensor::ones({1, 1, 1, 4}), c, ids, po);
    ADD_FAILURE() << "a prefill kernel was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("not a decode kernel"), std::string::npos) << e.what();
  }
}

TEST(PagedAttention, CausalBottomRightHidesLaterNewTokens) {
  // One sequence of 3 tokens whose values are 0, 1, 2 and equal keys: query i averages values
  // 0..i. Without is_causal every query averages all three.
  PagedKvCacheOptions o{.num_pages = 2, .page_size = 2, .heads_kv = 1, .head_dim = 2};
  PagedKvCache c(o);
  const int64_t id = c.add_sequence();
  c.append(id, Tensor::ones({3, 1, 2}), Tensor::of({3, 1, 2}, {0, 0, 1, 1, 2, 2}));
  const Tensor q = Tensor::ones({1, 2, 1, 2});  // the newest 2 tokens
  const std::vector<int64_t> ids{id};
  const Tensor causal = paged_attention(q, c, ids, {.is_causal = true}).output;
  EXPECT_NEAR(causal.at({0, 0, 0, 0}), 0.5f, 1e-6);  // sees tokens 0, 1
  EXPECT_NEAR(causal.at({0, 1, 0, 0}), 1.0f, 1e-6);  // sees 0, 1, 2
  const Tensor full = paged_attention(q, c, ids).output;
  EXPECT_NEAR(full.at({0, 0, 0, 1}), 1.0f, 1e-6);
}

TEST(PagedAttention, EmptyBatchGivesEmptyOutput) {
  PagedKvCache c(PagedKvCacheOptions{.num_pages = 1, .heads_kv = 2, .head_dim = 4, .head_dim_v = 3});
  const SdpaResult r = paged_attention(Tensor::zeros({0, 2, 4, 4}, DType::kBFloat16), c, {}, {.need_lse = true});
  EXPECT_EQ(r.output.shape(), (Shape{0, 2, 4, 3}));
  EXPECT_EQ(r.output.dtype(), DType::kBFloat16);
  EXPECT_EQ(r.lse.shape(), (Shape{0, 4, 2}));
}

// ---- errors ------------------------------------------------------------------------------------

template <typename E, typename F>
void expect_error(F&& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << fragment;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

TEST(PagedAttentionErrors, EveryBadArgumentIsTypedAndNamed) {
  PagedKvCache c(PagedKvCacheOptions{.num_pages = 4, .page_size = 4, .heads_kv = 2, .head_dim = 8});
  for (int i = 0; i < 3; ++i) c.add_sequence();
  c.append(0, Tensor::ones({5, 2, 8}), Tensor::ones({5, 2, 8}));
  c.append(1, Tensor::ones({2, 2, 8}), Tensor::ones({2, 2, 8}));
  c.free_sequence(2);
  const Tensor q = Tensor::ones({2, 2, 4, 8});
  const std::vector<int64_t> ok{0, 1}, freed{0, 2}, unknown{9, 0}, one{0};
  (void)paged_attention(q, c, ok);
  expect_error<ShapeError>([&] { (void)paged_attention(Tensor::ones({2, 4, 8}), c, ok); }, "query");
  expect_error<ShapeError>([&] { (void)paged_attention(TensorView(), c, ok); }, "undefined");
  expect_error<DTypeError>([&] { (void)paged_attention(q.to(DType::kFloat64), c, ok); }, "float64");
  expect_error<DTypeError>([&] { (void)paged_attention(q.to(DType::kInt32), c, ok); }, "query");
  expect_error<ShapeError>([&] { (void)paged_attention(q, c, one); }, "seq_ids");
  expect_error<ShapeError>([&] { (void)paged_attention(Tensor::ones({2, 2, 4, 6}), c, ok); }, "head_dim 8");
  expect_error<ShapeError>([&] { (void)paged_attention(Tensor::ones({2, 2, 3, 8}), c, ok); }, "heads_kv 2");
  expect_error<ValueError>([&] { (void)paged_attention(Tensor::ones({2, 17, 4, 8}), c, ok); }, "[1, 16]");
  expect_error<ValueError>([&] { (void)paged_attention(Tensor::ones({2, 0, 4, 8}), c, ok); }, "L_q");
  expect_error<IndexError>([&] { (void)paged_attention(q, c, freed); }, "seq_ids[1] = 2");
  expect_error<IndexError>([&] { (void)paged_attention(q, c, unknown); }, "seq_ids[0] = 9");
  // seq 1 holds 2 tokens: 3 new ones cannot all be in it.
  expect_error<ValueError>([&] { (void)paged_attention(Tensor::ones({2, 3, 4, 8}), c, ok); },
                           "seq_ids[1] = 1 holds 2 tokens, fewer than L_q = 3");
  expect_error<ValueError>([&] { (void)paged_attention(q, c, ok, {.scale = std::nan("")}); }, "options.scale");
  expect_error<ValueError>([&] { (void)paged_attention(q, c, ok, {.scale = 1e300}); }, "options.scale");
  expect_error<ValueError>([&] { (void)paged_attention(q, c, ok, {.num_threads = -1}); }, "num_threads");
}

TEST(PagedAttentionErrors, BadVariantsAreTypedAndNameTheArgumentExpectedAndActual) {
  PagedKvCache c(PagedKvCacheOptions{.num_pages = 4, .page_size = 4, .heads_kv = 2, .head_dim = 8});
  c.add_sequence();
  c.add_sequence();
  c.append(0, Tensor::ones({5, 2, 8}), Tensor::ones({5, 2, 8}));
  c.append(1, Tensor::ones({2, 2, 8}), Tensor::ones({2, 2, 8}));
  const Tensor q = Tensor::ones({2, 2, 4, 8});  // N = 2, H_q = 4
  const std::vector<int64_t> ids{0, 1};
  auto with = [&](auto set) {
    PagedAttentionOptions o;
    set(o);
    return [&c, &q, &ids, o] { (void)paged_attention(q, c, ids, o); };
  };
  expect_error<ValueError>(with([](PagedAttentionOptions& o) { o.window_size = {-2, 0}; }), "options.window_size");
  expect_error<ValueError>(with([](PagedAttentionOptions& o) { o.window_size = {3, -5}; }), "got (3, -5)");
  for (double bad : {0.0, -2.0, static_cast<double>(INFINITY), std::nan("")}) {
    expect_error<ValueError>(with([bad](PagedAttentionOptions& o) { o.softcap = bad; }), "options.softcap must be a finite value > 0");
  }
  const Tensor h3 = Tensor::zeros({3}), nh = Tensor::zeros({2, 4}), hn = Tensor::zeros({4, 2}), h4 = Tensor::zeros({4});
  const Tensor f64 = Tensor::zeros({4}).to(DType::kFloat64);
  expect_error<ShapeError>(with([&](PagedAttentionOptions& o) { o.alibi_slopes = h3; }),
                           "options.alibi_slopes must have shape [4] or [2, 4], got [3]");
  expect_error<ShapeError>(with([&](PagedAttentionOptions& o) { o.alibi_slopes = hn; }), "got [4, 2]");
  expect_error<DTypeError>(with([&](PagedAttentionOptions& o) { o.alibi_slopes = f64; }),
                           "options.alibi_slopes must be float32");
  expect_error<ShapeError>(with([&](PagedAttentionOptions& o) { o.sinks = nh; }), "options.sinks must have shape [4], got [2, 4]");
  expect_error<DTypeError>(with([&](PagedAttentionOptions& o) { o.sinks = f64; }), "float64");
  Tensor nan_sinks = Tensor::zeros({4});
  nan_sinks.data()[2] = NAN;
  expect_error<ValueError>(with([&](PagedAttentionOptions& o) { o.sinks = nan_sinks; }), "options.sinks must be finite, at most 2.359e+38 in magnitude (float32 range of value * log2(e)), got nan");
  Tensor inf_slopes = Tensor::zeros({2, 4});
  inf_slopes.data()[5] = INFINITY;
  expect_error<ValueError>(with([&](PagedAttentionOptions& o) { o.alibi_slopes = inf_slopes; }), "options.alibi_slopes must be finite");
  // The good shapes pass.
  EXPECT_NO_THROW(with([&](PagedAttentionOptions& o) { o.alibi_slopes = nh; o.sinks = h4; o.window_size = {2, 0}; o.softcap = 1.0; })());
}

}  // namespace
}  // namespace attn

// Weights saved by PyTorch (tests/fixtures/gen_safetensors.py) loaded into attn give PyTorch's
// outputs: the chapter's MultiHeadAttention and torch.nn.MultiheadAttention (attn::nn::
// MultiheadAttention) with every forward option, to 1e-6. Also: seeds give torch's initial
// weights bit for bit, and bad arguments are rejected with messages naming them.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "attn/attn.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("safetensors.txt");
  return f;
}

std::string fixture_path(const std::string& name) { return std::string(ATTN_FIXTURE_DIR) + "/" + name; }

void expect_close(const TensorView& got, const std::string& record, double tol = 1e-6) {
  const test::FixtureTensor& want = fx().at(record);
  ASSERT_EQ(got.shape(), want.shape) << record << ": shape " << got.shape().str() << " vs "
                                     << want.shape.str();
  const std::vector<float> g = got.to_vector();
  double worst = 0.0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - want.values[i]));
  EXPECT_LE(worst, tol) << record;
}

TEST(TorchWeights, ChapterMultiHeadAttentionFromSafetensors) {
  manual_seed(0);  // different weights than the file's, so loading must replace all of them
  nn::MultiHeadAttention m(6, 8, 10, 0.0f, 2, /*qkv_bias=*/true);
  nn::load_safetensors(m, fixture_path("chapter_mha.safetensors"));
  m.eval();
  expect_close(m.forward(fx().at("chapter/x").tensor()), "chapter/out");
}

TEST(TorchWeights, MultiheadAttentionSeedGivesTorchInit) {
  // kdim and/or vdim other than embed_dim: torch's separate q/k/v_proj_weight; then bias_k,
  // bias_v (add_bias_kv, with add_zero_attn).
  for (const auto& [c, seed, E, H, bias, kdim, vdim, extra] :
       {std::tuple{"init_seed7", 7, 8, 2, true, 0, 0, false}, std::tuple{"init_seed9", 9, 6, 3, false, 0, 0, false},
        std::tuple{"init_seed11", 11, 8, 2, true, 5, 3, false}, std::tuple{"init_seed13", 13, 6, 3, false, 0, 4, false},
        std::tuple{"init_seed15", 15, 8, 2, true, 0, 0, true}}) {
    manual_seed(static_cast<uint64_t>(seed));
    nn::MultiheadAttention m(E, H, 0.0f, bias, extra, extra, kdim, vdim);
    std::string keys;
    for (auto& [name, t] : m.state_dict()) {
      keys += (keys.empty() ? "" : "\n") + name;
      const test::FixtureTensor& want = fx().at(std::string(c) + "/param/" + name);
      EXPECT_EQ(t->to_vector(), want.tensor().to_vector()) << c << " " << name;  // bit for bit
    }
    EXPECT_EQ(keys, fx().text(std::string(c) + "/state_dict_keys"));
    EXPECT_EQ(rand({3}).to_vector(), fx().at(std::string(c) + "/after").tensor().to_vector()) << c;
  }
}

struct Case {
  const char* name;
  bool need_weights = true, average = true, is_causal = false;
};

TEST(TorchWeights, MultiheadAttentionMatchesTorchForEveryOption) {
  nn::MultiheadAttention m(8, 2, 0.0f, true, false, false, 0, 0, /*batch_first=*/true);
  nn::load_safetensors(m, fixture_path("torch_mha.safetensors"));
  m.eval();
  const Case cases[] = {{"self"},      {"cross"},        {"perhead", true, false},
                        {"kpm"},       {"mask_bool"},    {"mask_float3d"},
                        {"kpm_and_mask"}, {"causal", true, true, true}, {"unbatched"},
                        {"noweights", false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string n = c.name;
    const Tensor q = fx().at(n + "/query").tensor(), k = fx().at(n + "/key").tensor();
    Tensor kpm, mask;
    if (fx().tensors.count(n + "/key_padding_mask")) kpm = fx().at(n + "/key_padding_mask").tensor();
    // "causal": torch got the causal mask, attn is asked with is_causal instead.
    if (fx().tensors.count(n + "/attn_mask") && !c.is_causal) mask = fx().at(n + "/attn_mask").tensor();
    const bool mask_is_bool = n != "mask_float3d" && n != "kpm_and_mask";
    const auto r = m.forward(q, k, k, kpm, c.need_weights, mask, c.average, c.is_causal,
                             /*key_padding_mask_is_bool=*/true, mask_is_bool);
    expect_close(r.output, n + "/out");
    if (c.need_weights) {
      expect_close(r.attn_weights, n + "/weights");
    } else {
      EXPECT_FALSE(r.attn_weights.defined());
    }
  }
}

TEST(TorchWeights, MultiheadAttentionWithKdimAndVdimMatchesTorch) {
  manual_seed(0);  // other weights than the file's: loading must replace q_, k_ and v_proj_weight
  nn::MultiheadAttention m(8, 2, 0.0f, true, false, false, /*kdim=*/5, /*vdim=*/3, /*batch_first=*/true);
  EXPECT_FALSE(m.in_proj_weight.defined());
  EXPECT_EQ(m.k_proj_weight.shape(), Shape({8, 5}));
  EXPECT_EQ(m.v_proj_weight.shape(), Shape({8, 3}));
  nn::load_safetensors(m, fixture_path("torch_mha_kvdim.safetensors"));
  m.eval();
  const auto r = m.forward(fx().at("kvdim/query").tensor(), fx().at("kvdim/key").tensor(),
                           fx().at("kvdim/value").tensor(), fx().at("kvdim/key_padding_mask").tensor());
  expect_close(r.output, "kvdim/out");
  expect_close(r.attn_weights, "kvdim/weights");
  // key and value in each other's width, or of two lengths: named in the message.
  const Tensor q = Tensor::zeros({2, 4, 8}), k = Tensor::zeros({2, 6, 5}), v = Tensor::zeros({2, 6, 3});
  try {
    m.forward(q, v, k);
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "MultiheadAttention: key and value must be (N, S, dim) with N = 2, one S, dim = "
                           "kdim = 5 for key and dim = vdim = 3 for value, got key [2, 6, 3] and value [2, 6, 5]");
  }
  EXPECT_THROW(m.forward(q, k, Tensor::zeros({2, 7, 3})), ShapeError);
  EXPECT_THROW(nn::MultiheadAttention(8, 2, 0.0f, true, false, false, -1, 3), ValueError);
}

TEST(TorchWeights, MultiheadAttentionWithBiasKvAndZeroAttnMatchesTorch) {
  manual_seed(0);
  nn::MultiheadAttention m(8, 2, 0.0f, true, /*add_bias_kv=*/true, /*add_zero_attn=*/true);
  nn::load_safetensors(m, fixture_path("torch_mha_biaskv.safetensors"));
  m.eval();
  for (const std::string n : {"biaskv", "biaskv_masks", "biaskv_causal"}) {
    SCOPED_TRACE(n);
    const Tensor q = fx().at(n + "/query").tensor(), k = fx().at(n + "/key").tensor();
    Tensor kpm, mask;
    if (n == "biaskv_masks") kpm = fx().at(n + "/key_padding_mask").tensor(), mask = fx().at(n + "/attn_mask").tensor();
    // "biaskv_causal": torch got the causal mask (padded with 0 for the two extra keys), attn is_causal.
    const auto r = m.forward(q, k, k, kpm, true, mask, true, /*is_causal=*/n == "biaskv_causal", true,
                             /*attn_mask_is_bool=*/false);
    expect_close(r.output, n + "/out");
    expect_close(r.attn_weights, n + "/weights");  // (N, L, S + 2)
  }
  // No real key: the two extra keys alone, through masks with no column (torch takes it too).
  const Tensor q = fx().at("biaskv/query").tensor(), none = Tensor::zeros({0, 2, 8});
  const auto r = m.forward(q, none, none, Tensor::zeros({2, 0}), true, Tensor::zeros({4, 0}), true, true);
  EXPECT_EQ(r.attn_weights.shape(), Shape({2, 4, 2}));
  EXPECT_EQ(r.output.shape(), q.shape());
}

TEST(TorchWeights, MultiheadAttentionDropoutSequenceFirstMatchesTorch) {
  nn::MultiheadAttention m(8, 2, 0.25f, /*bias=*/false);
  nn::load_safetensors(m, fixture_path("torch_mha_nobias.safetensors"));
  m.train();
  manual_seed(5);
  const auto r = m.forward(fx().at("dropout/query").tensor(), fx().at("dropout/key").tensor(),
                           fx().at("dropout/key").tensor());
  expect_close(r.output, "dropout/out");
  expect_close(r.attn_weights, "dropout/weights");
  EXPECT_EQ(rand({3}).to_vector(), fx().at("dropout/after").tensor().to_vector());
}

TEST(TorchWeights, MultiheadAttentionRejectsBadArguments) {
  EXPECT_THROW(nn::MultiheadAttention(8, 3), ValueError);
  EXPECT_THROW(nn::MultiheadAttention(8, 2, 1.5f), ValueError);
  nn::MultiheadAttention m(8, 2);
  const Tensor x = Tensor::zeros({5, 2, 8});
  try {
    m.forward(Tensor::zeros({5, 2, 7}), x, x);
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "MultiheadAttention: query's last dim must be embed_dim = 8, got shape [5, 2, 7]");
  }
  EXPECT_THROW(m.forward(x, Tensor::zeros({5, 3, 8}), Tensor::zeros({5, 3, 8})), ShapeError);
  EXPECT_THROW(m.forward(x, x, x, Tensor::zeros({2, 4})), ShapeError);
  EXPECT_THROW(m.forward(x, x, x, {}, true, Tensor::zeros({5, 4})), ShapeError);
  EXPECT_THROW(m.forward(Tensor::zeros({8}), x, x), ShapeError);
}

}  // namespace
}  // namespace attn

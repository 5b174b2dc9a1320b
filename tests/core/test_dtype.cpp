// Tensor dtypes against PyTorch 1.13.1 (tests/fixtures/dtype.txt, from gen_dtype.py): float32 to
// bfloat16 / float16 rounding bit for bit (ties, subnormals, overflow), float64 to 16-bit,
// printing of every dtype, views and copies of 16-bit tensors, safetensors round trips with the
// dtype kept, and the DTypeError a float32-only op raises for another dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/print.hpp"
#include "attn/safetensors.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

const test::FixtureFile& fx() {
  static const test::FixtureFile f = test::load_fixtures("dtype.txt");
  return f;
}

Tensor fixture_as(const std::string& name, DType dtype) {
  const test::FixtureTensor& t = fx().at(name);
  Tensor f64 = Tensor::empty(t.shape, DType::kFloat64);
  std::copy(t.values.begin(), t.values.end(), f64.data_as<double>());  // also for no values
  return f64.to(dtype);
}

template <typename H>
uint16_t bits_at(const Tensor& t, int64_t i) {
  return t.data_as<H>()[i].bits;
}

TEST(DType, Float32ToBFloat16AndFloat16MatchPyTorchBitForBit) {
  const Tensor x = fx().at("conv/x").tensor();
  const Tensor bf = x.to(DType::kBFloat16), hf = x.to(DType::kFloat16);
  ASSERT_EQ(bf.dtype(), DType::kBFloat16);
  ASSERT_EQ(hf.dtype(), DType::kFloat16);
  const auto& want_bf = fx().at("conv/bf16_bits").values;
  const auto& want_hf = fx().at("conv/f16_bits").values;
  int bad = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = x.data()[i];
    if (std::isnan(v)) continue;  // NaN bits differ between torch's paths (gen_dtype.py)
    if (bits_at<bfloat16>(bf, i) != static_cast<uint16_t>(want_bf[i])) {
      ADD_FAILURE() << "bf16 of " << v << ": got " << bits_at<bfloat16>(bf, i) << " want " << want_bf[i];
      ++bad;
    }
    if (bits_at<float16>(hf, i) != static_cast<uint16_t>(want_hf[i])) {
      ADD_FAILURE() << "f16 of " << v << ": got " << bits_at<float16>(hf, i) << " want " << want_hf[i];
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(DType, Float64ToSixteenBitRoundsAsPyTorch) {
  const Tensor x = fixture_as("conv/x64", DType::kFloat64);
  const Tensor bf = x.to(DType::kBFloat16), hf = x.to(DType::kFloat16);
  const auto& want_bf = fx().at("conv/x64_bf16_bits").values;
  const auto& want_hf = fx().at("conv/x64_f16_bits").values;
  for (int64_t i = 0; i < x.numel(); ++i) {
    EXPECT_EQ(bits_at<bfloat16>(bf, i), static_cast<uint16_t>(want_bf[i])) << "element " << i;
    EXPECT_EQ(bits_at<float16>(hf, i), static_cast<uint16_t>(want_hf[i])) << "element " << i;
  }
}

TEST(DType, SixteenBitToFloat32IsExactAndNaNStaysNaN) {
  // Every one of the 65536 patterns: widening then rounding back gives the same value.
  Tensor bf = Tensor::empty({65536}, DType::kBFloat16), hf = Tensor::empty({65536}, DType::kFloat16);
  for (int i = 0; i < 65536; ++i) {
    bf.data_as<bfloat16>()[i].bits = static_cast<uint16_t>(i);
    hf.data_as<float16>()[i].bits = static_cast<uint16_t>(i);
  }
  const Tensor bf32 = bf.to(DType::kFloat32), hf32 = hf.to(DType::kFloat32);
  const Tensor bf_back = bf32.to(DType::kBFloat16), hf_back = hf32.to(DType::kFloat16);
  for (int i = 0; i < 65536; ++i) {
    if (std::isnan(bf32.data()[i])) {
      EXPECT_TRUE(std::isnan(bf16_to_float(bf_back.data_as<bfloat16>()[i])));
    } else {
      ASSERT_EQ(bits_at<bfloat16>(bf_back, i), i);
    }
    if (std::isnan(hf32.data()[i])) {
      EXPECT_TRUE(std::isnan(half_to_float(hf_back.data_as<float16>()[i])));
    } else {
      ASSERT_EQ(bits_at<float16>(hf_back, i), i);
    }
  }
  EXPECT_EQ(hf32.data()[1], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(hf32.data()[0x7bff], 65504.0f);
}

TEST(DType, PrintsAsPyTorchForEveryDtype) {
  for (const char* name : {"bf16_inputs", "f16_inputs", "f64_inputs", "bf16_sci", "f16_special",
                           "bf16_ints", "int32_vec", "int8_mat", "bf16_scalar", "bf16_empty",
                           "f64_wide"}) {
    SCOPED_TRACE(name);
    const std::string key = std::string("print/") + name;
    static constexpr DType kCodes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat64,
                                       DType::kInt32, DType::kInt8};
    const DType dtype = kCodes[static_cast<int>(fx().at(std::string("dtype/") + name).values[0])];
    const Tensor t = fixture_as(key, dtype);
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(format_tensor(t), fx().text(key));
  }
}

TEST(DType, ViewsOfSixteenBitTensorsAddressElementsNotFloats) {
  Tensor x = Tensor::empty({3, 4}, DType::kBFloat16);
  for (int i = 0; i < 12; ++i) x.data_as<bfloat16>()[i] = float_to_bf16(static_cast<float>(i));
  const TensorView col = x.select(1, 2);      // 2, 6, 10
  EXPECT_EQ(col.dtype(), DType::kBFloat16);
  EXPECT_EQ(col.to_vector(), (std::vector<float>{2, 6, 10}));
  EXPECT_EQ(x.t().contiguous().to_vector(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_EQ(x.slice(0, 1, 3).slice(1, 1, 3).to_vector(), (std::vector<float>{5, 6, 9, 10}));
  EXPECT_EQ(x.view({2, 6}).select(0, 1).select(0, 0).item(), 6.0f);
  const Tensor copy = x;  // value semantics keep the dtype
  EXPECT_EQ(copy.dtype(), DType::kBFloat16);
  EXPECT_EQ(copy.to_vector(), x.to_vector());
  EXPECT_EQ(Tensor::zeros({2}, DType::kFloat16).to_vector(), (std::vector<float>{0, 0}));
  EXPECT_EQ(Tensor::full({2}, 0.1f, DType::kBFloat16).to_vector()[0], bf16_to_float(float_to_bf16(0.1f)));
}

TEST(DType, FloatOnlyOpsRejectOtherDtypesWithDTypeError) {
  const Tensor x = Tensor::ones({2, 2}, DType::kBFloat16);
  try {
    (void)softmax(x, -1);
    FAIL() << "softmax took a bfloat16 tensor";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("expected a float32 tensor, got bfloat16"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)x.at({0, 0}), DTypeError);
  EXPECT_THROW((void)x.data_as<float16>(), DTypeError);
  EXPECT_NO_THROW((void)x.data_as<bfloat16>());
}

TEST(DType, ToIntegerRejectsNaNAndOutOfRangeAndTruncates) {
  EXPECT_EQ(Tensor::of({3}, {1.9f, -2.7f, 127.5f}).to(DType::kInt8).to_vector(),
            (std::vector<float>{1, -2, 127}));
  EXPECT_THROW((void)Tensor::of({1}, {128.0f}).to(DType::kInt8), ValueError);
  EXPECT_THROW((void)Tensor::of({1}, {std::nanf("")}).to(DType::kInt32), ValueError);
  EXPECT_EQ(Tensor::of({1}, {-3.0f}).to(DType::kInt32).data_as<int32_t>()[0], -3);
}

TEST(DType, SafetensorsKeepsEveryDtype) {
  const Tensor x = fx().at("conv/x").tensor();
  NamedViews views;
  const DType all[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64};
  std::vector<Tensor> keep;
  for (DType d : all) keep.push_back(x.to(d));
  keep.push_back(Tensor::of({3}, {1, -2, 100}).to(DType::kInt8));
  keep.push_back(Tensor::of({3}, {1, -2, 70000}).to(DType::kInt32));
  for (size_t i = 0; i < keep.size(); ++i) views.emplace_back("t" + std::to_string(i), keep[i]);
  views.emplace_back("strided", keep[1].slice(0, 1, 9).unsqueeze(0).transpose(0, 1));
  const Safetensors back = parse_safetensors(serialize_safetensors(views));
  ASSERT_EQ(back.tensors.size(), views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    SCOPED_TRACE(views[i].first);
    const Tensor& t = back.tensors[i].second;
    EXPECT_EQ(t.dtype(), views[i].second.dtype());
    EXPECT_EQ(t.shape(), views[i].second.shape());
    const Tensor want = views[i].second.contiguous();
    EXPECT_EQ(std::memcmp(t.raw_data(), want.raw_data(), static_cast<size_t>(t.numel() * t.element_size())), 0);
  }
}

}  // namespace
}  // namespace attn

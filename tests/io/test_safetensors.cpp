// safetensors reader and writer: round trips, PyTorch-written files (tests/fixtures/
// gen_safetensors.py), atomic writes, and one test per class of malformed file, each checking that
// the FormatError names the file and the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "attn/attn.hpp"
#include "fixture.hpp"

namespace attn {
namespace {

namespace fs = std::filesystem;

std::string fixture_path(const std::string& name) { return std::string(ATTN_FIXTURE_DIR) + "/" + name; }

// A file from a header and data, with the length prefix written for it.
std::string file_of(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string floats(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

// Runs parse_safetensors and returns the FormatError's message ("" if it parsed).
std::string format_error(const std::string& bytes) {
  try {
    parse_safetensors(bytes, "bad.safetensors");
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("attn_io_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

TEST(Safetensors, RoundTripKeepsNamesOrderShapesValuesAndMetadata) {
  const Tensor a = Tensor::of({2, 3}, {1, 2, 3, 4, 5, -6.5f});
  const Tensor s = Tensor::scalar(3.25f);
  const Tensor empty = Tensor::zeros({0, 4});
  const Tensor b = Tensor::of({3, 2}, {1, 2, 3, 4, 5, 6});
  const NamedViews in{{"z.weight", a}, {"scalar", s}, {"empty", empty}, {"b_T", b.t()}};
  const Safetensors out = parse_safetensors(serialize_safetensors(in, {{"format", "pt"}}));
  ASSERT_EQ(out.tensors.size(), 4u);
  EXPECT_EQ(out.tensors[0].first, "z.weight");
  EXPECT_EQ(out.tensors[0].second.to_vector(), a.to_vector());
  EXPECT_EQ(out.tensors[1].second.dim(), 0);
  EXPECT_EQ(out.tensors[1].second.item(), 3.25f);
  EXPECT_EQ(out.tensors[2].second.shape(), (Shape{0, 4}));
  EXPECT_EQ(out.tensors[3].second.shape(), (Shape{2, 3}));  // a transposed view, written row-major
  EXPECT_EQ(out.tensors[3].second.to_vector(), b.t().contiguous().to_vector());
  EXPECT_EQ(out.metadata.at("format"), "pt");
  ASSERT_NE(out.find("b_T"), nullptr);
  EXPECT_EQ(out.find("nope"), nullptr);
}

TEST(Safetensors, WriterAlignsDataAndEscapesNames) {
  const Tensor a = Tensor::of({1}, {1});
  const std::string bytes = serialize_safetensors({{"quote\"back\\slash\nnewline", a}});
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(parse_safetensors(bytes).tensors[0].first, "quote\"back\\slash\nnewline");
}

TEST(Safetensors, WriterRejectsDuplicateAndReservedNames) {
  const Tensor a = Tensor::of({1}, {1});
  EXPECT_THROW(serialize_safetensors({{"a", a}, {"a", a}}), ValueError);
  EXPECT_THROW(serialize_safetensors({{"__metadata__", a}}), ValueError);
}

TEST(Safetensors, ReadsOtherFloatDtypesAsFloat32) {
  const double d[2] = {1.5, -0.1};
  std::string f64(16, '\0');
  std::memcpy(f64.data(), d, 16);
  const uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7C00};  // 1, -2, smallest subnormal, inf
  std::string f16(8, '\0');
  std::memcpy(f16.data(), h, 8);
  const uint16_t bf[1] = {0x4049};  // 3.140625
  std::string bf16(2, '\0');
  std::memcpy(bf16.data(), bf, 2);
  const std::string header =
      R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
      R"("h":{"dtype":"F16","shape":[2,2],"data_offsets":[16,24]},)"
      R"("b":{"dtype":"BF16","shape":[],"data_offsets":[24,26]}})";
  const Safetensors st = parse_safetensors(file_of(header, f64 + f16 + bf16));
  EXPECT_EQ(st.find("d")->to_vector(), (std::vector<float>{1.5f, -0.1f}));
  const std::vector<float> hv = st.find("h")->to_vector();
  EXPECT_EQ(hv[0], 1.0f);
  EXPECT_EQ(hv[1], -2.0f);
  EXPECT_EQ(hv[2], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(hv[3]));
  EXPECT_EQ(st.find("b")->item(), 3.140625f);
}

TEST(Safetensors, ReadsPyTorchWrittenFiles) {
  const Safetensors st = load_safetensors(fixture_path("torch_mha.safetensors"));
  ASSERT_NE(st.find("in_proj_weight"), nullptr);
  EXPECT_EQ(st.find("in_proj_weight")->shape(), (Shape{24, 8}));
  EXPECT_EQ(st.find("out_proj.bias")->shape(), (Shape{8}));
  EXPECT_EQ(load_safetensors(fixture_path("chapter_mha.safetensors")).metadata.at("format"), "pt");
}

struct BadCase {
  const char* what;
  std::string bytes;
  const char* message;  // expected substring after "bad.safetensors: "
};

TEST(Safetensors, MalformedFilesThrowFormatErrorNamingFileAndProblem) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight = floats({1, 2});
  std::string huge_len(8, '\0');
  const uint64_t big = 1ull << 40;
  std::memcpy(huge_len.data(), &big, 8);
  std::string past_end(8, '\0');
  const uint64_t ten = 10;
  std::memcpy(past_end.data(), &ten, 8);
  past_end += "{}";
  const BadCase cases[] = {
      {"short", "abc", "too short for the 8-byte header length"},
      {"huge header", huge_len + "{}", "exceeds the limit"},
      {"header past end", past_end, "header length 10 exceeds the 2 bytes after it"},
      {"not an object", file_of("[1,2]"), "does not start with '{'"},
      {"bad json", file_of("{\"a\":}"), "header is not valid JSON"},
      {"trailing", file_of("{} x"), "header is not valid JSON: unexpected text"},
      {"deep", file_of("{\"a\":" + std::string(100, '[') + std::string(100, ']') + "}"), "nested too deeply"},
      {"entry not object", file_of(R"({"a":3})"), "tensor 'a': expected an object"},
      {"missing dtype", file_of(R"({"a":{"shape":[],"data_offsets":[0,4]}})"), "tensor 'a': missing \"dtype\""},
      {"bad dtype", file_of(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0')),
       "tensor 'a' has dtype \"I64\""},
      {"five dims", file_of(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1],"data_offsets":[0,4]}})", floats({1})),
       "tensor 'a' has 5 dimensions"},
      {"negative extent", file_of(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", floats({1})),
       "shape entries must be non-negative integers, got -1"},
      {"fraction extent", file_of(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", floats({1})),
       "got 1.5"},
      {"overflowing shape", file_of(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})"),
       "is too large"},
      {"offsets reversed", file_of(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})"), "end before they begin"},
      {"size mismatch", file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "span 8 bytes, but dtype F32 and shape [3] need 12"},
      {"gap", file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight), "(gap in the data)"},
      {"overlap", file_of("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "(overlaps the previous tensor)"},
      {"truncated data", file_of("{" + ok_entry + "}", floats({1})), "tensors cover 8 bytes of data, but the file has 4"},
      {"extra data", file_of("{" + ok_entry + "}", eight + "xx"), "but the file has 10"},
      {"duplicate", file_of("{" + ok_entry + "," + ok_entry + "}", eight), "has the key 'a' twice"},
      {"metadata not strings", file_of(R"({"__metadata__":{"k":1}})"), "value of 'k' must be a string"},
      {"bad escape", file_of(R"({"\x":1})"), "invalid escape"},
      {"lone surrogate", file_of(R"({"\ud800":1})"), "unpaired high surrogate"},
  };
  for (const BadCase& c : cases) {
    const std::string msg = format_error(c.bytes);
    EXPECT_EQ(msg.rfind("bad.safetensors: ", 0), 0u) << c.what << ": " << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.what << ": got \"" << msg << "\"";
  }
}

TEST(Safetensors, MissingFileIsIoErrorNamingIt) {
  try {
    load_safetensors("/nonexistent/x.safetensors");
    FAIL() << "no exception";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, SaveIsAtomicAndReplacesTheFile) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  const Tensor a = Tensor::of({2}, {1, 2});
  save_safetensors(path, {{"a", a}});
  save_safetensors(path, {{"b", a}});
  EXPECT_EQ(load_safetensors(path).tensors[0].first, "b");
  // Only the final file is left: no temporary beside it.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
  // A failed write (directory missing) throws IoError and leaves nothing behind.
  EXPECT_THROW(save_safetensors(dir.file("missing/w.safetensors"), {{"a", a}}), IoError);
  // A failed serialisation leaves the existing file untouched.
  EXPECT_THROW(save_safetensors(path, {{"x", a}, {"x", a}}), ValueError);
  EXPECT_EQ(load_safetensors(path).tensors[0].first, "b");
}

TEST(Safetensors, ModuleStateDictRoundTrip) {
  TempDir dir;
  manual_seed(1);
  nn::MultiHeadAttention a(4, 6, 5, 0.0f, 3, true);
  manual_seed(2);
  nn::MultiHeadAttention b(4, 6, 5, 0.0f, 3, true);
  nn::save_safetensors(a, dir.file("a.safetensors"));
  nn::load_safetensors(b, dir.file("a.safetensors"));
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_EQ(sa[i].second->to_vector(), sb[i].second->to_vector()) << sa[i].first;
  }
}

TEST(Safetensors, LoadStateDictChecksNamesAndShapesBeforeWriting) {
  manual_seed(1);
  nn::Linear lin(3, 2);
  const std::vector<float> before = lin.weight.to_vector();
  using Dict = std::vector<std::pair<std::string, Tensor>>;
  // Wrong shape: ShapeError naming the entry and both shapes; nothing written.
  Dict bad_shape{{"weight", Tensor::zeros({2, 3})}, {"bias", Tensor::zeros({3})}};
  try {
    nn::load_state_dict(lin, bad_shape);
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "state_dict['bias']: expected shape [2] (the module's), got [3]");
  }
  EXPECT_EQ(lin.weight.to_vector(), before);
  // Missing and unexpected keys: ValueError listing them (strict), ignored when not strict.
  Dict partial{{"weight", Tensor::zeros({2, 3})}, {"extra", Tensor::zeros({1})}};
  try {
    nn::load_state_dict(lin, partial);
    FAIL() << "no exception";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "state_dict: missing keys 'bias'; unexpected keys 'extra'");
  }
  EXPECT_EQ(lin.weight.to_vector(), before);
  nn::load_state_dict(lin, partial, /*strict=*/false);
  EXPECT_EQ(lin.weight.to_vector(), std::vector<float>(6, 0.0f));
}

}  // namespace
}  // namespace attn

// Tensor and TensorView: shapes, strides, views aliasing their tensor, copies, moves, alignment
// and the argument checks. Expected strides are PyTorch's (x.stride() in torch 1.13).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "attn/error.hpp"
#include "attn/functional.hpp"
#include "attn/tensor.hpp"

namespace attn {
namespace {

// 0, 1, 2, ... numel-1 in row-major order.
Tensor arange(Shape shape) {
  Tensor t(shape);
  std::iota(t.data(), t.data() + t.numel(), 0.0f);
  return t;
}

std::vector<float> range(float from, float to, float step = 1.0f) {
  std::vector<float> v;
  for (float x = from; x < to; x += step) v.push_back(x);
  return v;
}

}  // namespace

// gtest prints shapes as "[2, 6, 3]" instead of bytes (internal linkage: one per test file).
[[maybe_unused]] static void PrintTo(const Shape& s, std::ostream* os) { *os << s.str(); }

namespace {

bool aligned64(const float* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; }

// Runs f, expects exception type E and returns its message.
template <typename E, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception thrown";
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- Shape --------------------------------------------------------------------------------------

TEST(TensorShape, BasicsAndPrinting) {
  const Shape s{2, 6, 3};
  EXPECT_EQ(s.ndim(), 3);
  EXPECT_EQ(s[1], 6);
  EXPECT_EQ(s.numel(), 36);
  EXPECT_EQ(s.str(), "[2, 6, 3]");
  EXPECT_EQ(Shape{}.str(), "[]");
  EXPECT_EQ(Shape{}.numel(), 1);  // 0-D: one element
  EXPECT_EQ((Shape{4, 0, 2}).numel(), 0);
  EXPECT_TRUE((Shape{1, 2} == Shape{1, 2}));
  EXPECT_FALSE((Shape{1, 2} == Shape{1, 2, 1}));
  EXPECT_FALSE((Shape{1, 2} == Shape{2, 1}));
}

TEST(TensorShape, MoreThanFourDimsIsShapeError) {
  const std::string msg = message_of<ShapeError>([] { Shape s{1, 2, 3, 4, 5}; });
  EXPECT_TRUE(contains(msg, "at most 4")) << msg;
  EXPECT_TRUE(contains(msg, "got 5")) << msg;
  Shape s{1, 2, 3, 4};
  EXPECT_THROW(s.push_back(5), ShapeError);
  EXPECT_THROW(Tensor::zeros({1, 1, 1, 1, 1}), ShapeError);
  EXPECT_THROW(arange({2, 3, 4, 5}).unsqueeze(0), ShapeError);
}

TEST(TensorShape, NumelOverflowIsValueError) {
  const int64_t big = int64_t{1} << 32;
  const std::string msg = message_of<ValueError>([&] { (void)Shape{big, big}.numel(); });
  EXPECT_TRUE(contains(msg, "overflows")) << msg;
  EXPECT_TRUE(contains(msg, "[4294967296, 4294967296]")) << msg;
  EXPECT_THROW(Tensor::zeros({big, big, 4}), ValueError);
  EXPECT_THROW(Tensor::empty({std::numeric_limits<int64_t>::max()}), ValueError);  // bytes overflow
  EXPECT_THROW(Tensor::empty({std::numeric_limits<int64_t>::max() / 4}), ValueError);
  // The same errors are attn::Error for an application catching the base.
  EXPECT_THROW((void)(Shape{big, big}.numel()), Error);
}

TEST(TensorShape, NegativeExtentIsShapeError) {
  EXPECT_THROW((void)(Shape{2, -3}.numel()), ShapeError);
  EXPECT_THROW(Tensor::zeros({2, -3}), ShapeError);
}

TEST(TensorShape, ContiguousStridesFollowPyTorch) {
  EXPECT_EQ(contiguous_strides({2, 6, 3}), (Shape{18, 3, 1}));
  EXPECT_EQ(contiguous_strides({5}), (Shape{1}));
  EXPECT_EQ(contiguous_strides({}), (Shape{}));
  EXPECT_EQ(contiguous_strides({2, 0, 3}), (Shape{3, 3, 1}));  // torch.empty(2, 0, 3).stride()
}

TEST(TensorShape, BroadcastShapes) {
  EXPECT_EQ(broadcast_shapes({2, 1, 4}, {3, 1}, "t"), (Shape{2, 3, 4}));
  EXPECT_EQ(broadcast_shapes({}, {3}, "t"), (Shape{3}));
  EXPECT_EQ(broadcast_shapes({0, 1}, {1, 5}, "t"), (Shape{0, 5}));
  const std::string msg = message_of<ShapeError>([] { broadcast_shapes({2, 3}, {4, 3}, "my_op"); });
  EXPECT_TRUE(contains(msg, "my_op")) << msg;
  EXPECT_TRUE(contains(msg, "[2, 3]") && contains(msg, "[4, 3]")) << msg;
}

// ---- construction, copies, moves ------------------------------------------------------------------

TEST(TensorCreate, FactoriesShapesAndStrides) {
  const Tensor z = Tensor::zeros({2, 3}), o = Tensor::ones({4}), f = Tensor::full({2, 2}, 2.5f);
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.strides(), (Shape{3, 1}));
  EXPECT_EQ(z.dim(), 2);
  EXPECT_EQ(z.numel(), 6);
  EXPECT_TRUE(z.is_contiguous());
  EXPECT_TRUE(z.defined());
  EXPECT_EQ(z.to_vector(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(o.to_vector(), std::vector<float>(4, 1.0f));
  EXPECT_EQ(f.to_vector(), std::vector<float>(4, 2.5f));
  EXPECT_EQ(Tensor({3}).to_vector(), std::vector<float>(3, 0.0f));  // Tensor(shape) is zero-filled

  const Tensor t = Tensor::of({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(t.at({1, 0}), 4.0f);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.stride(0), 3);
  EXPECT_EQ(t.stride(-1), 1);
  const std::string msg = message_of<ShapeError>([] { Tensor::of({2, 3}, {1, 2, 3}); });
  EXPECT_TRUE(contains(msg, "[2, 3]") && contains(msg, "6") && contains(msg, "got 3")) << msg;
}

TEST(TensorCreate, DefaultIsUndefined) {
  const Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_FALSE(TensorView().defined());
}

TEST(TensorCreate, ZeroDimScalar) {
  const Tensor s = Tensor::scalar(3.5f);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.shape(), Shape{});
  EXPECT_EQ(s.strides(), Shape{});
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_EQ(s.item(), 3.5f);
  EXPECT_EQ(s.at({}), 3.5f);
  EXPECT_EQ(s.to_vector(), std::vector<float>{3.5f});
  EXPECT_EQ(s.view({1, 1}).shape(), (Shape{1, 1}));
  EXPECT_EQ(s.unsqueeze(0).shape(), (Shape{1}));
  EXPECT_EQ(s.contiguous().item(), 3.5f);
  // torch.tensor(3.5).size(0) raises "Dimension specified as 0 but tensor has no dimensions".
  EXPECT_THROW((void)s.size(0), IndexError);
  EXPECT_THROW((void)s.size(-1), IndexError);
  EXPECT_THROW((void)s.stride(0), IndexError);
}

TEST(TensorCreate, ItemNeedsExactlyOneElement) {
  EXPECT_EQ(Tensor::full({1, 1, 1}, 7.0f).item(), 7.0f);
  const std::string msg = message_of<ShapeError>([] { (void)Tensor::zeros({2, 3}).item(); });
  EXPECT_TRUE(contains(msg, "[2, 3]")) << msg;
}

TEST(TensorCreate, StorageIs64ByteAligned) {
  for (int64_t n : {0, 1, 3, 15, 16, 17, 1000, 4097}) {
    const Tensor t = Tensor::zeros({n});
    EXPECT_TRUE(aligned64(t.data())) << n;
    const Tensor c = t;  // copies allocate aligned storage too
    EXPECT_TRUE(aligned64(c.data())) << n;
    EXPECT_TRUE(aligned64(t.contiguous().data())) << n;
  }
  EXPECT_TRUE(aligned64(Tensor::scalar(1.0f).data()));
  EXPECT_TRUE(aligned64(arange({3, 5}).t().contiguous().data()));
}

TEST(TensorCreate, ZeroSizedTensorsAreDefinedAndEmpty) {
  const Tensor e = Tensor::zeros({3, 0});
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.to_vector().empty());
  EXPECT_EQ(e.contiguous().shape(), (Shape{3, 0}));
  EXPECT_TRUE(e.is_contiguous());
  EXPECT_TRUE(TensorView(e.data(), Shape{3, 0}, Shape{1, 1}).is_contiguous());  // torch: numel 0
  EXPECT_EQ(e.view({-1}).shape(), (Shape{0}));
  EXPECT_THROW(e.view({-1, 0}), ShapeError);  // -1 could be anything: torch refuses too
}

TEST(TensorCopy, CopyIsDeep) {
  Tensor a = arange({2, 3});
  Tensor b = a;
  EXPECT_NE(a.data(), b.data());
  EXPECT_EQ(b.shape(), a.shape());
  EXPECT_EQ(b.to_vector(), a.to_vector());
  b.at({0, 0}) = 100.0f;
  EXPECT_EQ(a.at({0, 0}), 0.0f);

  Tensor c = Tensor::zeros({7});
  c = a;  // copy-assign replaces shape and data
  EXPECT_EQ(c.shape(), (Shape{2, 3}));
  EXPECT_NE(c.data(), a.data());
  EXPECT_EQ(c.to_vector(), a.to_vector());
  a.at({1, 2}) = -1.0f;
  EXPECT_EQ(c.at({1, 2}), 5.0f);

  const Tensor& self = c;
  c = self;  // self-assignment keeps the data
  EXPECT_EQ(c.at({1, 2}), 5.0f);

  c = Tensor();  // assigning an undefined tensor makes it undefined
  EXPECT_FALSE(c.defined());
  const Tensor undefined;
  const Tensor d = undefined;
  EXPECT_FALSE(d.defined());
}

TEST(TensorCopy, CopyOfAViewIsContiguousInLogicalOrder) {
  const Tensor a = arange({2, 3});
  const Tensor t = a.t().contiguous();
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(t.strides(), (Shape{2, 1}));
  EXPECT_EQ(t.to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  const Tensor c = a.contiguous();  // always a copy, even when already contiguous
  EXPECT_NE(c.data(), a.data());
  EXPECT_EQ(c.to_vector(), a.to_vector());
}

TEST(TensorMove, MoveTransfersStorage) {
  Tensor a = arange({4, 5});
  const float* p = a.data();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.shape(), (Shape{4, 5}));
  EXPECT_EQ(b.at({3, 4}), 19.0f);
  EXPECT_FALSE(a.defined());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(a.dim(), 0);

  Tensor c = Tensor::ones({2});
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.shape(), (Shape{4, 5}));
  EXPECT_FALSE(b.defined());  // NOLINT(bugprone-use-after-move)

  std::vector<Tensor> v;
  v.push_back(std::move(c));
  v.emplace_back(Shape{3});
  v.reserve(100);  // reallocation moves, data pointers stay
  EXPECT_EQ(v[0].data(), p);
}

TEST(TensorMove, ViewsOfAMovedTensorStayValid) {
  Tensor a = arange({3, 3});
  const TensorView row = a.select(0, 1);
  Tensor b = std::move(a);
  EXPECT_EQ(row.to_vector(), (std::vector<float>{3, 4, 5}));
  b.at({1, 1}) = 42.0f;
  EXPECT_EQ(row.at({1}), 42.0f);
}

// ---- element access -----------------------------------------------------------------------------

TEST(TensorAt, BoundsAreIndexErrors) {
  const Tensor t = arange({2, 3});
  EXPECT_EQ(t.at({1, 2}), 5.0f);
  std::string msg = message_of<IndexError>([&] { (void)t.at({2, 0}); });
  EXPECT_TRUE(contains(msg, "index 2") && contains(msg, "dim 0") && contains(msg, "size 2")) << msg;
  msg = message_of<IndexError>([&] { (void)t.at({0, 3}); });
  EXPECT_TRUE(contains(msg, "index 3") && contains(msg, "dim 1") && contains(msg, "size 3")) << msg;
  EXPECT_THROW((void)t.at({-1, 0}), IndexError);  // at() does not wrap negative indices
  msg = message_of<IndexError>([&] { (void)t.at({1}); });
  EXPECT_TRUE(contains(msg, "1 indices") && contains(msg, "2-D")) << msg;
  EXPECT_THROW((void)t.at({0, 0, 0}), IndexError);
  EXPECT_THROW((void)t.at({0, 0, 0}), Error);
}

TEST(TensorAt, WritesThroughViews) {
  Tensor t = arange({2, 3});
  t.t().at({2, 1}) = -5.0f;  // element (1, 2)
  EXPECT_EQ(t.at({1, 2}), -5.0f);
}

TEST(TensorSize, DimsWrapAndAreChecked) {
  const Tensor t = arange({2, 3, 4});
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.stride(-2), 4);
  const std::string msg = message_of<IndexError>([&] { (void)t.size(3); });
  EXPECT_TRUE(contains(msg, "dim 3") && contains(msg, "3-D") && contains(msg, "[-3, 2]")) << msg;
  EXPECT_THROW((void)t.size(-4), IndexError);
  EXPECT_THROW((void)t.stride(5), IndexError);
}

// ---- views --------------------------------------------------------------------------------------

TEST(TensorView, ViewReshapesContiguousAndInfersMinusOne) {
  Tensor t = arange({2, 3, 4});
  const TensorView v = t.view({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(v.strides(), (Shape{4, 1}));
  EXPECT_EQ(v.data(), t.data());  // aliases: no copy
  v.at({5, 3}) = 99.0f;
  EXPECT_EQ(t.at({1, 2, 3}), 99.0f);
  EXPECT_EQ(t.view({-1}).shape(), (Shape{24}));
  EXPECT_EQ(t.view({2, -1, 2, 3}).shape(), (Shape{2, 2, 2, 3}));
  // The chapter's MHA split: (b, T, d_out) -> (b, T, H, hd).
  EXPECT_EQ(t.view({2, 3, 2, 2}).strides(), (Shape{12, 4, 2, 1}));
}

TEST(TensorView, ViewErrors) {
  const Tensor t = arange({2, 3, 4});
  std::string msg = message_of<ShapeError>([&] { t.transpose(1, 2).view({24}); });
  EXPECT_TRUE(contains(msg, "not contiguous") && contains(msg, "[2, 4, 3]") &&
              contains(msg, "contiguous()")) << msg;
  msg = message_of<ShapeError>([&] { t.view({5, -1}); });
  EXPECT_TRUE(contains(msg, "[5, -1]") && contains(msg, "24")) << msg;
  msg = message_of<ShapeError>([&] { t.view({5, 5}); });
  EXPECT_TRUE(contains(msg, "[5, 5]") && contains(msg, "24")) << msg;
  EXPECT_THROW(t.view({-1, -1}), ShapeError);
  EXPECT_THROW(t.view({-2, 12}), ShapeError);
  // A view of the non-contiguous tensor works after contiguous().
  EXPECT_EQ(t.transpose(1, 2).contiguous().view({24}).numel(), 24);
}

TEST(TensorView, ViewOfSizeOneDimsWithOddStridesIsContiguous) {
  // torch: size-1 dims do not affect contiguity.
  const Tensor t = arange({3, 4});
  const TensorView row = t.slice(0, 1, 2);  // (1, 4), stride (4, 1)
  EXPECT_TRUE(row.is_contiguous());
  EXPECT_EQ(row.view({4}).to_vector(), (std::vector<float>{4, 5, 6, 7}));
  const TensorView odd(t.data(), Shape{1, 4}, Shape{1000, 1});
  EXPECT_TRUE(odd.is_contiguous());
}

TEST(TensorView, TransposeSwapsSizesAndStrides) {
  Tensor t = arange({2, 3, 4});
  const TensorView v = t.transpose(0, 2);
  EXPECT_EQ(v.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(v.strides(), (Shape{1, 4, 12}));
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.at({3, 2, 1}), t.at({1, 2, 3}));
  EXPECT_EQ(t.transpose(-1, -2).shape(), (Shape{2, 4, 3}));
  EXPECT_EQ(t.transpose(1, 1).strides(), t.strides());
  EXPECT_TRUE(t.transpose(1, 1).is_contiguous());
  EXPECT_EQ(t.transpose(0, 2).transpose(0, 2).strides(), t.strides());
  EXPECT_THROW(t.transpose(0, 3), IndexError);
  EXPECT_THROW(t.transpose(-4, 0), IndexError);
  // The chapter's keys.transpose(1, 2) on a (b, T, d) tensor:
  const Tensor keys = arange({2, 6, 2});
  EXPECT_EQ(keys.transpose(1, 2).to_vector(),
            (std::vector<float>{0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11,
                                12, 14, 16, 18, 20, 22, 13, 15, 17, 19, 21, 23}));
}

TEST(TensorView, TOfMatricesVectorsAndScalars) {
  const Tensor m = arange({2, 3});
  EXPECT_EQ(m.t().shape(), (Shape{3, 2}));
  EXPECT_EQ(m.t().strides(), (Shape{1, 3}));
  EXPECT_EQ(m.t().to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  const Tensor v = arange({4});
  EXPECT_EQ(v.t().shape(), (Shape{4}));
  EXPECT_EQ(Tensor::scalar(2.0f).t().dim(), 0);
  const std::string msg = message_of<ShapeError>([] { arange({2, 3, 4}).t(); });
  EXPECT_TRUE(contains(msg, "<= 2") && contains(msg, "[2, 3, 4]")) << msg;
}

TEST(TensorView, SelectDropsTheDimAndWrapsNegativeIndices) {
  Tensor t = arange({2, 3, 4});
  const TensorView s = t.select(1, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.strides(), (Shape{12, 1}));
  EXPECT_EQ(s.to_vector(), (std::vector<float>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(t.select(1, -1).to_vector(), s.to_vector());
  EXPECT_EQ(t.select(-1, 0).to_vector(), (std::vector<float>{0, 4, 8, 12, 16, 20}));
  EXPECT_EQ(t.select(0, 1).select(0, 2).select(0, 3).dim(), 0);
  EXPECT_EQ(t.select(0, 1).select(0, 2).select(0, 3).item(), 23.0f);
  s.at({1, 0}) = -7.0f;  // aliases
  EXPECT_EQ(t.at({1, 2, 0}), -7.0f);
  // The chapter's inputs[1] (query) and heads_a[0, 1, :, :].
  const Tensor inputs = arange({6, 3});
  EXPECT_EQ(inputs.select(0, 1).to_vector(), (std::vector<float>{3, 4, 5}));

  std::string msg = message_of<IndexError>([&] { t.select(1, 3); });
  EXPECT_TRUE(contains(msg, "index 3") && contains(msg, "size 3")) << msg;
  EXPECT_THROW(t.select(1, -4), IndexError);
  EXPECT_THROW(t.select(3, 0), IndexError);
  EXPECT_THROW(Tensor::scalar(1.0f).select(0, 0), IndexError);
}

TEST(TensorView, SliceIsPythonSlicing) {
  Tensor t = arange({5, 4});
  TensorView s = t.slice(0, 1, 3);  // t[1:3]
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.data(), t.data() + 4);
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_EQ(s.to_vector(), range(4, 12));
  EXPECT_EQ(t.slice(0, -2, 5).to_vector(), range(12, 20));  // t[-2:]
  EXPECT_EQ(t.slice(0, 0, -3).to_vector(), range(0, 8));    // t[:-3]
  EXPECT_EQ(t.slice(0, 3, 100).shape(), (Shape{2, 4}));     // end clamps
  EXPECT_EQ(t.slice(0, -100, 1).shape(), (Shape{1, 4}));    // start clamps
  EXPECT_EQ(t.slice(0, 4, 2).shape(), (Shape{0, 4}));       // empty, not an error
  EXPECT_EQ(t.slice(0, 7, 9).shape(), (Shape{0, 4}));
  EXPECT_EQ(t.slice(0, 7, 9).numel(), 0);
  const TensorView cols = t.slice(1, 1, 3);  // t[:, 1:3]
  EXPECT_EQ(cols.shape(), (Shape{5, 2}));
  EXPECT_EQ(cols.strides(), (Shape{4, 1}));
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.select(0, 4).to_vector(), (std::vector<float>{17, 18}));
  EXPECT_THROW(t.slice(2, 0, 1), IndexError);
  EXPECT_EQ(t.slice(-1, -1, 4).to_vector(), (std::vector<float>{3, 7, 11, 15, 19}));
}

TEST(TensorView, ChaptersMaskTopLeftSlice) {
  // mask = torch.triu(torch.ones(context_length, context_length), diagonal=1); mask[:n, :n]
  const Tensor mask = triu(Tensor::ones({6, 6}), 1);
  for (int64_t n : {1, 4, 6}) {
    const TensorView m = mask.slice(0, 0, n).slice(1, 0, n);
    EXPECT_EQ(m.shape(), (Shape{n, n}));
    EXPECT_EQ(m.strides(), (Shape{6, 1}));
    EXPECT_EQ(m.data(), mask.data());
    EXPECT_EQ(m.is_contiguous(), n == 6 || n == 1);
    EXPECT_EQ(m.to_vector(), triu(Tensor::ones({n, n}), 1).to_vector()) << n;
  }
}

TEST(TensorView, UnsqueezeAndSqueeze) {
  const Tensor t = arange({2, 3});
  EXPECT_EQ(t.unsqueeze(0).shape(), (Shape{1, 2, 3}));
  EXPECT_EQ(t.unsqueeze(0).strides(), (Shape{6, 3, 1}));
  EXPECT_EQ(t.unsqueeze(1).shape(), (Shape{2, 1, 3}));
  EXPECT_EQ(t.unsqueeze(1).strides(), (Shape{3, 3, 1}));
  EXPECT_EQ(t.unsqueeze(2).shape(), (Shape{2, 3, 1}));
  EXPECT_EQ(t.unsqueeze(2).strides(), (Shape{3, 1, 1}));
  EXPECT_EQ(t.unsqueeze(-1).shape(), (Shape{2, 3, 1}));
  EXPECT_EQ(t.unsqueeze(-3).shape(), (Shape{1, 2, 3}));
  EXPECT_TRUE(t.unsqueeze(1).is_contiguous());
  EXPECT_EQ(t.t().unsqueeze(1).strides(), (Shape{1, 6, 3}));  // torch: x.t().unsqueeze(1).stride()
  EXPECT_THROW(t.unsqueeze(3), IndexError);
  EXPECT_THROW(t.unsqueeze(-4), IndexError);

  const Tensor u = arange({2, 1, 3});
  EXPECT_EQ(u.squeeze(1).shape(), (Shape{2, 3}));
  EXPECT_EQ(u.squeeze(1).to_vector(), u.to_vector());
  EXPECT_EQ(u.squeeze(0).shape(), (Shape{2, 1, 3}));  // not size 1: unchanged, as in PyTorch
  EXPECT_EQ(u.squeeze(-2).shape(), (Shape{2, 3}));
  EXPECT_THROW(u.squeeze(3), IndexError);
  EXPECT_EQ(Tensor::scalar(1.0f).squeeze(0).dim(), 0);
}

TEST(TensorView, ExpandUsesStrideZero) {
  Tensor col = Tensor::of({3, 1}, {1, 2, 3});
  const TensorView e = col.expand({2, 3, 4});
  EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_FALSE(e.is_contiguous());
  EXPECT_EQ(e.to_vector(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                               1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}));
  EXPECT_EQ(col.expand({-1, 5}).shape(), (Shape{3, 5}));  // -1 keeps the size
  EXPECT_EQ(col.expand({3, 1}).strides(), col.strides());
  col.at({1, 0}) = 20.0f;  // the expanded view aliases the column
  EXPECT_EQ(e.at({1, 1, 3}), 20.0f);
  const Tensor c = e.contiguous();  // materialises the broadcast
  EXPECT_EQ(c.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(c.at({1, 1, 3}), 20.0f);
  const std::string msg = message_of<ShapeError>([&] { col.expand({3, 4}).expand({2, 4}); });
  EXPECT_TRUE(contains(msg, "[3, 4]") && contains(msg, "[2, 4]")) << msg;
  EXPECT_THROW(col.expand({4}), ShapeError);  // fewer dims than the tensor
  EXPECT_EQ(Tensor::scalar(5.0f).expand({2, 2}).to_vector(), std::vector<float>(4, 5.0f));
}

TEST(TensorView, ContiguousCopiesInLogicalOrder) {
  const Tensor t = arange({2, 3, 4});
  const TensorView v = t.transpose(0, 2).slice(1, 1, 3);  // (4, 2, 2)
  ASSERT_EQ(v.shape(), (Shape{4, 2, 2}));
  const Tensor c = v.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.strides(), (Shape{4, 2, 1}));
  std::vector<float> want;
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      for (int64_t k = 0; k < 2; ++k) want.push_back(t.at({k, j + 1, i}));
    }
  }
  EXPECT_EQ(c.to_vector(), want);
  EXPECT_EQ(v.to_vector(), want);
  // A 4-D transpose(1, 2) as in the MHA head merge.
  const Tensor h = arange({2, 3, 2, 2});
  const Tensor m = h.transpose(1, 2).contiguous();
  EXPECT_EQ(m.shape(), (Shape{2, 2, 3, 2}));
  EXPECT_EQ(m.at({1, 1, 2, 0}), h.at({1, 2, 1, 0}));
  EXPECT_EQ(m.view({2, 2, 6}).at({0, 1, 5}), h.at({0, 2, 1, 1}));
}

TEST(TensorView, ForEachOffsetVisitsLogicalOrder) {
  const Tensor t = arange({3, 4});
  std::vector<int64_t> offs;
  for_each_offset(t.t(), [&](int64_t o) { offs.push_back(o); });
  EXPECT_EQ(offs, (std::vector<int64_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  int calls = 0;
  for_each_offset(Tensor::zeros({2, 0, 3}), [&](int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
  for_each_offset(Tensor::scalar(1.0f), [&](int64_t o) { calls += 1 + static_cast<int>(o); });
  EXPECT_EQ(calls, 1);
}

TEST(TensorView, ExplicitStridesMustMatchRank) {
  float buf[6] = {};
  EXPECT_THROW(TensorView(buf, Shape{2, 3}, Shape{3}), ShapeError);
  const TensorView v(buf, Shape{3, 2}, Shape{1, 3});
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_TRUE(v.t().is_contiguous());
}


TEST(TensorView, NegativeSizesAreShapeErrorsNamingTheShape) {
  float buf[6] = {};
  std::string msg = message_of<ShapeError>([&] { (void)TensorView(buf, Shape{2, -3}); });
  EXPECT_TRUE(contains(msg, "shape [2, -3]")) << msg;
  EXPECT_TRUE(contains(msg, "negative size -3 in dim 1")) << msg;
  msg = message_of<ShapeError>([&] { (void)TensorView(buf, Shape{-1, 3}, Shape{3, 1}); });
  EXPECT_TRUE(contains(msg, "shape [-1, 3]")) << msg;
  EXPECT_TRUE(contains(msg, "dim 0")) << msg;
  // Zero sizes stay valid (an empty view), as in PyTorch.
  EXPECT_NO_THROW((void)TensorView(buf, Shape{0, 3}));
  EXPECT_NO_THROW((void)TensorView(buf, Shape{2, 0}, Shape{1, 1}));
  // expand's target goes through the same check: -1 only means "keep" for existing dims.
  const Tensor t = arange({2, 3});
  EXPECT_THROW((void)t.expand({-1, 2, 3}), ShapeError);
}

TEST(TensorView, NegativeStridesAreShapeErrorsNamingTheStrides) {
  float buf[6] = {};
  std::string msg = message_of<ShapeError>([&] { (void)TensorView(buf + 5, Shape{2, 3}, Shape{-3, 1}); });
  EXPECT_TRUE(contains(msg, "strides [-3, 1]")) << msg;
  EXPECT_TRUE(contains(msg, "negative stride -3 in dim 0")) << msg;
  msg = message_of<ShapeError>([&] { (void)TensorView(buf, Shape{3, 2}, Shape{2, -1}); });
  EXPECT_TRUE(contains(msg, "strides [2, -1]")) << msg;
  EXPECT_TRUE(contains(msg, "dim 1")) << msg;
  // Stride 0 (broadcast) stays valid.
  const TensorView b(buf, Shape{4, 3}, Shape{0, 1});
  EXPECT_EQ(b.to_vector().size(), 12u);
  // Both are attn::Error for an application catching the base.
  EXPECT_THROW((void)TensorView(buf, Shape{1, 1}, Shape{-1, 1}), Error);
}

// Reading an undefined tensor (no memory: default-constructed, or a result field not asked for)
// is a ValueError naming the call, not a null dereference; an empty one reads as empty.
TEST(TensorView, ReadingAnUndefinedTensorIsValueError) {
  const Tensor none;
  ASSERT_FALSE(none.defined());
  auto expect_named = [](auto&& call, const std::string& what) {
    try {
      call();
      ADD_FAILURE() << what << " did not throw";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(what + ": the tensor is undefined"), std::string::npos) << e.what();
    }
  };
  expect_named([&] { (void)none.to_vector(); }, "to_vector");
  expect_named([&] { (void)none.to_double_vector(); }, "to_double_vector");
  expect_named([&] { (void)none.item(); }, "item");
  expect_named([&] { (void)none.at({}); }, "at");
  expect_named([&] { (void)none.contiguous(); }, "contiguous");
  expect_named([&] { (void)none.to(DType::kBFloat16); }, "to");
  EXPECT_TRUE(Tensor::zeros({0, 3}).to_vector().empty());
  EXPECT_TRUE(Tensor::zeros({2, 0}).to(DType::kBFloat16).to_double_vector().empty());
}

}  // namespace
}  // namespace attn

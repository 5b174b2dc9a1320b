// Tensors: an owning buffer (`Tensor`) and cheap non-owning strided views (`TensorView`), each
// with an element type (`DType`, attn/dtype.hpp): float32 by default; bfloat16, float16,
// float64, int8 and int32 for low-precision attention, float64 truth, quantised caches and index
// tensors. Most of the op library computes in float32 and reads elements through `data()`, which
// throws DTypeError for any other dtype; `to(dtype)` converts (PyTorch's `x.to(dtype)`).
//
// Layout follows PyTorch: up to 4 dimensions, sizes and strides counted in elements, row-major
// ("contiguous") when freshly allocated. A view never owns memory; it aliases the tensor it came
// from, exactly like the result of `x.transpose(0, 1)` or `x[:n, :n]` in PyTorch, and must not
// outlive it. `Tensor` *is a* view over its own 64-byte aligned storage, so every view method
// works on both, and any function taking a `TensorView` accepts a `Tensor`.
//
// Operations that need contiguous memory (`view`) say so by throwing `ShapeError`; the explicit
// `contiguous()` makes an owning row-major copy. Kernels read strides, so most functions accept
// transposed or sliced views without copying.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attn/dtype.hpp"

namespace attn {

inline constexpr int kMaxDims = 4;

// A small fixed-capacity list of extents (sizes or strides). 0-D (a scalar) has numel() == 1.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int ndim() const { return n_; }
  int64_t operator[](int i) const { return d_[i]; }
  int64_t& operator[](int i) { return d_[i]; }
  const int64_t* begin() const { return d_.data(); }
  const int64_t* end() const { return d_.data() + n_; }
  int64_t numel() const;  // product of the extents; throws ValueError on int64 overflow
  std::string str() const;  // "[2, 6, 3]", as torch.Size prints its list
  void push_back(int64_t v);

  friend bool operator==(const Shape& a, const Shape& b);

 private:
  std::array<int64_t, kMaxDims> d_{};
  int n_ = 0;
};

class Tensor;

namespace detail {
[[noreturn]] void throw_dtype_mismatch(DType expected, DType actual);
}  // namespace detail

class TensorView {
 public:
  TensorView() = default;
  // Sizes and strides must be >= 0 (ShapeError naming `shape` or `strides` otherwise); strides
  // must have the rank of the shape.
  TensorView(float* data, Shape shape);                  // row-major strides
  TensorView(float* data, Shape shape, Shape strides);
  // A view of any dtype over raw memory (`data` points at element 0).
  TensorView(void* data, DType dtype, Shape shape);
  TensorView(void* data, DType dtype, Shape shape, Shape strides);

  // float32 elements; DTypeError for any other dtype (every float32-only kernel reads through it).
  float* data() const {
    if (dtype_ != DType::kFloat32) [[unlikely]] detail::throw_dtype_mismatch(DType::kFloat32, dtype_);
    return static_cast<float*>(data_);
  }
  // Elements of type T (float, bfloat16, float16, double, int8_t, int32_t); DTypeError unless T is
  // this tensor's dtype.
  template <typename T>
  T* data_as() const {
    if (dtype_ != dtype_of<T>()) [[unlikely]] detail::throw_dtype_mismatch(dtype_of<T>(), dtype_);
    return static_cast<T*>(data_);
  }
  void* raw_data() const { return data_; }
  DType dtype() const { return dtype_; }
  int64_t element_size() const { return dtype_size(dtype_); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int dim() const { return shape_.ndim(); }
  int64_t numel() const { return shape_.numel(); }
  int64_t size(int dim) const;    // negative dims count from the end, as in PyTorch
  int64_t stride(int dim) const;
  bool defined() const { return data_ != nullptr; }
  bool is_contiguous() const;

  // Bounds-checked element access (for tests, examples and the demo, not for kernels). at() is
  // float32 only; item() converts any dtype's single element to float (exact but for float64).
  float& at(std::initializer_list<int64_t> index) const;
  float item() const;

  // Views (no copy). Each throws ShapeError/IndexError naming the bad argument.
  TensorView view(Shape shape) const;  // needs contiguous memory; one extent may be -1
  TensorView transpose(int dim0, int dim1) const;
  TensorView t() const;  // 2-D transpose (x.T of a matrix)
  TensorView select(int dim, int64_t index) const;  // x[index] along dim, drops that dim
  TensorView slice(int dim, int64_t start, int64_t end) const;  // x[start:end] along dim
  TensorView unsqueeze(int dim) const;
  TensorView squeeze(int dim) const;
  TensorView expand(Shape shape) const;  // broadcast size-1 dims with stride 0

  Tensor contiguous() const;  // always an owning row-major copy, same dtype
  // An owning row-major copy in `dtype` (torch's x.to(dtype)): floats round to nearest even with
  // NaN kept and overflow to +-inf (float64 -> 16-bit goes through float32, as c10 does);
  // to an integer dtype, values truncate toward zero and a NaN, Inf or out-of-range value throws
  // ValueError (PyTorch leaves that undefined).
  Tensor to(DType dtype) const;
  // Elements in logical (row-major) order, converted to float / double.
  std::vector<float> to_vector() const;
  std::vector<double> to_double_vector() const;

 protected:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  Shape strides_;
};

// Owning, 64-byte aligned, row-major tensor (float32 unless a dtype is given). Copying copies the data (value semantics);
// moving is cheap. Views taken from a Tensor alias its storage.
class Tensor : public TensorView {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape);  // zero-filled
  Tensor(Shape shape, std::span<const float> values);  // values.size() must equal numel
  Tensor(const Tensor& other);
  Tensor& operator=(const Tensor& other);
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  ~Tensor() = default;

  static Tensor zeros(Shape shape, DType dtype = DType::kFloat32);
  static Tensor ones(Shape shape, DType dtype = DType::kFloat32) { return full(shape, 1.0f, dtype); }
  static Tensor full(Shape shape, float value, DType dtype = DType::kFloat32);
  static Tensor empty(Shape shape, DType dtype = DType::kFloat32);  // uninitialised storage
  // A tensor from nested data written row-major, e.g. Tensor::of({6, 3}, {0.43f, 0.15f, ...}).
  static Tensor of(Shape shape, std::initializer_list<float> values);
  static Tensor scalar(float value);  // 0-D

 private:
  struct FreeAligned {
    std::size_t capacity;  // the block's bytes, for the reuse cache (attn/memory.hpp)
    void operator()(void* p) const;
  };
  std::unique_ptr<void, FreeAligned> storage_;
};

// Row-major strides for a shape.
Shape contiguous_strides(const Shape& shape);

// The shape two shapes broadcast to (NumPy/PyTorch rules); throws ShapeError naming `what`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* what);

// Calls f(offset) for every element of `v` in logical row-major order, with the element's
// offset from v.data(). The generic traversal used by elementwise code.
template <typename F>
void for_each_offset(const TensorView& v, F&& f);

}  // namespace attn

#include "attn/detail/tensor_iter.hpp"

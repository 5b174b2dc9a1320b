#include "attn/tensor.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "attn/error.hpp"
#include "core/allocator.hpp"
#include "core/convert.hpp"

namespace attn {

namespace detail {
void throw_dtype_mismatch(DType expected, DType actual) {
  throw DTypeError(fmt::format("expected a {} tensor, got {}; this operation computes in {} "
                               "(convert with .to(DType::kFloat32))",
                               dtype_name(expected), dtype_name(actual), dtype_name(expected)));
}
}  // namespace detail

// ---- Shape ------------------------------------------------------------------------------------

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxDims)) {
    throw ShapeError(fmt::format("shape: at most {} dimensions are supported, got {}", kMaxDims,
                                 dims.size()));
  }
  for (int64_t d : dims) push_back(d);
}

void Shape::push_back(int64_t v) {
  if (n_ == kMaxDims) {
    throw ShapeError(fmt::format("shape: at most {} dimensions are supported", kMaxDims));
  }
  d_[n_++] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < n_; ++i) {
    if (d_[i] < 0) throw ShapeError(fmt::format("shape {}: negative extent {}", str(), d_[i]));
    if (__builtin_mul_overflow(n, d_[i], &n)) {
      throw ValueError(fmt::format("shape {}: number of elements overflows int64", str()));
    }
  }
  return n;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(begin(), end(), ", "));
}

bool operator==(const Shape& a, const Shape& b) {
  return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
}

Shape contiguous_strides(const Shape& shape) {
  Shape s = shape;
  int64_t acc = 1;
  for (int i = shape.ndim() - 1; i >= 0; --i) {
    s[i] = acc;
    // Zero extents count as 1, so an empty shape can have huge extents: reject strides that
    // int64 cannot hold rather than overflow.
    if (__builtin_mul_overflow(acc, std::max<int64_t>(shape[i], 1), &acc)) {
      throw ShapeError(fmt::format("shape {}: strides overflow int64", shape.str()));
    }
  }
  return s;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* what) {
  const int n = std::max(a.ndim(), b.ndim());
  Shape out;
  for (int i = 0; i < n; ++i) out.push_back(1);
  for (int i = 0; i < n; ++i) {
    const int ia = a.ndim() - n + i, ib = b.ndim() - n + i;
    const int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      throw ShapeError(fmt::format("{}: shapes {} and {} do not broadcast (dim {}: {} vs {})",
                                   what, a.str(), b.str(), i, da, db));
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// ---- TensorView -------------------------------------------------------------------------------

namespace {
int wrap_dim(int dim, int ndim, const char* what) {
  const int lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  if (dim < lo || dim > hi) {
    throw IndexError(fmt::format("{}: dim {} out of range for a {}-D tensor (expected [{}, {}])",
                                 what, dim, ndim, lo, hi));
  }
  return dim < 0 ? dim + std::max(ndim, 1) : dim;
}

// Reading an element of a tensor without memory (default-constructed, or a result field that was
// not asked for, e.g. SdpaResult::lse without need_lse) would dereference null: its shape is
// 0-D, one element. An empty tensor (some extent 0) has nothing to read and passes.
void require_data(const void* data, int64_t numel, const char* what) {
  if (data == nullptr && numel != 0) {
    throw ValueError(fmt::format("{}: the tensor is undefined (no memory: a default-constructed Tensor, or a "
                                 "result field that was not requested, e.g. SdpaResult::lse without need_lse)",
                                 what));
  }
}
}  // namespace

namespace {
// Views index memory as data + sum(i_d * stride_d) with 0 <= i_d < size_d: a negative size has
// no meaning, and a negative stride (PyTorch has none either) would step before `data`.
void check_view_extents(const Shape& shape, const Shape* strides) {
  for (int d = 0; d < shape.ndim(); ++d) {
    if (shape[d] < 0) {
      throw ShapeError(fmt::format("TensorView: shape {} has a negative size {} in dim {}",
                                   shape.str(), shape[d], d));
    }
  }
  if (strides == nullptr) return;
  for (int d = 0; d < strides->ndim(); ++d) {
    if ((*strides)[d] < 0) {
      throw ShapeError(fmt::format(
          "TensorView: strides {} have a negative stride {} in dim {} (shape {}); negative strides "
          "are not supported", strides->str(), (*strides)[d], d, shape.str()));
    }
  }
}
}  // namespace

TensorView::TensorView(float* data, Shape shape) : TensorView(data, DType::kFloat32, shape) {}

TensorView::TensorView(float* data, Shape shape, Shape strides)
    : TensorView(data, DType::kFloat32, shape, strides) {}

TensorView::TensorView(void* data, DType dtype, Shape shape)
    : data_(data), dtype_(dtype), shape_(shape), strides_(contiguous_strides(shape)) {
  check_view_extents(shape, nullptr);
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides)
    : data_(data), dtype_(dtype), shape_(shape), strides_(strides) {
  if (shape.ndim() != strides.ndim()) {
    throw ShapeError(fmt::format("TensorView: shape {} and strides {} differ in rank", shape.str(),
                                 strides.str()));
  }
  check_view_extents(shape, &strides);
}

// A 0-D tensor has no extent to report (wrap_dim accepts dim 0/-1 for it, as transpose needs).
int64_t TensorView::size(int dim) const {
  if (this->dim() == 0) throw IndexError(fmt::format("size: dim {} given for a 0-D tensor", dim));
  return shape_[wrap_dim(dim, this->dim(), "size")];
}
int64_t TensorView::stride(int dim) const {
  if (this->dim() == 0) throw IndexError(fmt::format("stride: dim {} given for a 0-D tensor", dim));
  return strides_[wrap_dim(dim, this->dim(), "stride")];
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // as in PyTorch: an empty tensor is contiguous whatever its strides
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

float& TensorView::at(std::initializer_list<int64_t> index) const {
  require_data(data_, numel(), "at");
  if (static_cast<int>(index.size()) != dim()) {
    throw IndexError(fmt::format("at: {} indices given for a {}-D tensor", index.size(), dim()));
  }
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) {
    if (i < 0 || i >= shape_[d]) {
      throw IndexError(fmt::format("at: index {} out of range for dim {} of size {}", i, d,
                                   shape_[d]));
    }
    off += i * strides_[d];
    ++d;
  }
  return data()[off];
}

float TensorView::item() const {
  require_data(data_, numel(), "item");
  if (numel() != 1) {
    throw ShapeError(fmt::format("item: expected a tensor with one element, got shape {}",
                                 shape_.str()));
  }
  // Every index of a one-element tensor is 0.
  return static_cast<float>(detail::element_as_double(data_, dtype_, 0));
}

TensorView TensorView::view(Shape shape) const {
  if (!is_contiguous()) {
    throw ShapeError(fmt::format(
        "view: the tensor of shape {} with strides {} is not contiguous; call contiguous() first",
        shape_.str(), strides_.str()));
  }
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < shape.ndim(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) throw ShapeError("view: only one dimension can be inferred (-1)");
      infer = i;
    } else if (shape[i] < 0) {
      throw ShapeError(fmt::format("view: invalid extent {} in shape {}", shape[i], shape.str()));
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      throw ShapeError(fmt::format("view: shape {} is invalid for input of size {} (too many elements)",
                                   shape.str(), numel()));
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel() % known != 0) {
      throw ShapeError(fmt::format("view: shape {} is invalid for input of size {}", shape.str(),
                                   numel()));
    }
    shape[infer] = numel() / known;
  }
  if (shape.numel() != numel()) {
    throw ShapeError(fmt::format("view: shape {} is invalid for input of size {} (shape {})",
                                 shape.str(), numel(), shape_.str()));
  }
  return TensorView(data_, dtype_, shape);
}

TensorView TensorView::transpose(int dim0, int dim1) const {
  const int a = wrap_dim(dim0, dim(), "transpose (dim0)");
  const int b = wrap_dim(dim1, dim(), "transpose (dim1)");
  TensorView v = *this;
  if (dim() == 0) return v;
  std::swap(v.shape_[a], v.shape_[b]);
  std::swap(v.strides_[a], v.strides_[b]);
  return v;
}

TensorView TensorView::t() const {
  if (dim() > 2) {
    throw ShapeError(fmt::format("t: expects a tensor with <= 2 dimensions, got shape {}",
                                 shape_.str()));
  }
  return dim() < 2 ? *this : transpose(0, 1);
}

TensorView TensorView::select(int dim_, int64_t index) const {
  const int d = wrap_dim(dim_, dim(), "select");
  if (dim() == 0) throw IndexError("select: cannot index a 0-D tensor");
  const int64_t n = shape_[d];
  if (index < -n || index >= n) {
    throw IndexError(fmt::format("select: index {} out of range for dim {} of size {}", index, d, n));
  }
  if (index < 0) index += n;
  Shape shape, strides;
  for (int i = 0; i < dim(); ++i) {
    if (i == d) continue;
    shape.push_back(shape_[i]);
    strides.push_back(strides_[i]);
  }
  // An empty tensor can have extents and strides far beyond its storage: its views keep the
  // data pointer (never dereferenced) rather than form one outside the allocation.
  const int64_t offset = numel() == 0 ? 0 : index * strides_[d];
  return TensorView(static_cast<std::byte*>(data_) + offset * element_size(), dtype_, shape, strides);
}

TensorView TensorView::slice(int dim_, int64_t start, int64_t end) const {
  const int d = wrap_dim(dim_, dim(), "slice");
  if (dim() == 0) throw IndexError("slice: cannot slice a 0-D tensor");
  const int64_t n = shape_[d];
  // Python slice semantics: negative counts from the end, out-of-range clamps.
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  TensorView v = *this;
  v.shape_[d] = end - start;
  // An empty view keeps data_ (as select).
  if (v.numel() > 0) v.data_ = static_cast<std::byte*>(data_) + start * strides_[d] * element_size();
  return v;
}

TensorView TensorView::unsqueeze(int dim_) const {
  const int d = wrap_dim(dim_, dim() + 1, "unsqueeze");
  Shape shape, strides;
  for (int i = 0; i <= dim(); ++i) {
    if (i == d) {
      shape.push_back(1);
      strides.push_back(i < dim() ? strides_[i] * shape_[i] : 1);
    }
    if (i < dim()) {
      shape.push_back(shape_[i]);
      strides.push_back(strides_[i]);
    }
  }
  return TensorView(data_, dtype_, shape, strides);
}

TensorView TensorView::squeeze(int dim_) const {
  const int d = wrap_dim(dim_, dim(), "squeeze");
  if (dim() == 0 || shape_[d] != 1) return *this;
  return select(d, 0);
}

TensorView TensorView::expand(Shape shape) const {
  if (shape.ndim() < dim()) {
    throw ShapeError(fmt::format("expand: target shape {} has fewer dimensions than {}",
                                 shape.str(), shape_.str()));
  }
  Shape strides;
  const int lead = shape.ndim() - dim();
  for (int i = 0; i < shape.ndim(); ++i) {
    if (i < lead) {
      strides.push_back(0);
      continue;
    }
    const int64_t have = shape_[i - lead];
    if (shape[i] == -1) shape[i] = have;
    if (have == shape[i]) {
      strides.push_back(strides_[i - lead]);
    } else if (have == 1) {
      strides.push_back(0);
    } else {
      throw ShapeError(fmt::format("expand: shape {} cannot be expanded to {} (dim {}: {} vs {})",
                                   shape_.str(), shape.str(), i, have, shape[i]));
    }
  }
  return TensorView(data_, dtype_, shape, strides);
}

namespace {
template <typename T>
void gather(const TensorView& v, void* out) {
  const T* src = static_cast<const T*>(v.raw_data());
  T* dst = static_cast<T*>(out);
  for_each_offset(v, [&](int64_t off) { *dst++ = src[off]; });
}
}  // namespace

Tensor TensorView::contiguous() const {
  require_data(data_, numel(), "contiguous");
  Tensor out = Tensor::empty(shape_, dtype_);
  switch (element_size()) {
    case 1: gather<uint8_t>(*this, out.raw_data()); break;
    case 2: gather<uint16_t>(*this, out.raw_data()); break;
    case 4: gather<uint32_t>(*this, out.raw_data()); break;
    default: gather<uint64_t>(*this, out.raw_data()); break;
  }
  return out;
}

Tensor TensorView::to(DType dtype) const {
  require_data(data_, numel(), "to");
  if (dtype == dtype_) return contiguous();
  const Tensor src = is_contiguous() ? Tensor() : contiguous();
  const void* from = src.defined() ? src.raw_data() : data_;
  Tensor out = Tensor::empty(shape_, dtype);
  detail::convert_elements(from, dtype_, out.raw_data(), dtype, numel());
  return out;
}

std::vector<float> TensorView::to_vector() const {
  require_data(data_, numel(), "to_vector");
  std::vector<float> v;
  v.reserve(static_cast<size_t>(numel()));
  if (dtype_ == DType::kFloat32) {
    const float* p = static_cast<const float*>(data_);
    for_each_offset(*this, [&](int64_t off) { v.push_back(p[off]); });
  } else {
    for_each_offset(*this, [&](int64_t off) {
      v.push_back(static_cast<float>(detail::element_as_double(data_, dtype_, off)));
    });
  }
  return v;
}

std::vector<double> TensorView::to_double_vector() const {
  require_data(data_, numel(), "to_double_vector");
  std::vector<double> v;
  v.reserve(static_cast<size_t>(numel()));
  for_each_offset(*this, [&](int64_t off) { v.push_back(detail::element_as_double(data_, dtype_, off)); });
  return v;
}

// ---- Tensor -----------------------------------------------------------------------------------

void Tensor::FreeAligned::operator()(void* p) const { detail::free_block(p, capacity); }

Tensor Tensor::empty(Shape shape, DType dtype) {
  const int64_t n = shape.numel();
  constexpr int64_t kAlign = 64;
  const int64_t item = dtype_size(dtype);
  const int64_t max_elems = (INT64_MAX - kAlign) / item;
  if (n > max_elems) {
    throw ValueError(fmt::format("Tensor: shape {} needs more memory than can be addressed", shape.str()));
  }
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1) * item);  // never 0 bytes
  const detail::Block block = detail::allocate_block(bytes);  // large blocks reused (attn/memory.hpp)
  if (block.ptr == nullptr) {
    throw Error(fmt::format("Tensor: allocation of {} bytes for shape {} failed", bytes, shape.str()));
  }
  void* p = block.ptr;
  Tensor t;
  t.storage_ = std::unique_ptr<void, FreeAligned>(p, FreeAligned{block.capacity});
  static_cast<TensorView&>(t) = TensorView(p, dtype, shape);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.raw_data(), 0, static_cast<size_t>(t.numel() * t.element_size()));  // 0 bits = 0
  return t;
}

Tensor::Tensor(Shape shape) : Tensor(zeros(shape)) {}

Tensor::Tensor(Shape shape, std::span<const float> values) : Tensor(empty(shape)) {
  if (static_cast<int64_t>(values.size()) != numel()) {
    throw ShapeError(fmt::format("Tensor: shape {} needs {} values, got {}", shape.str(), numel(),
                                 values.size()));
  }
  std::copy(values.begin(), values.end(), data());
}

Tensor Tensor::full(Shape shape, float value, DType dtype) {
  if (dtype != DType::kFloat32) return full(shape, value).to(dtype);
  Tensor t = empty(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

Tensor Tensor::of(Shape shape, std::initializer_list<float> values) {
  return Tensor(shape, std::span<const float>(values.begin(), values.size()));
}

Tensor Tensor::scalar(float value) { return full(Shape{}, value); }

Tensor::Tensor(const Tensor& other) : TensorView() {
  if (other.defined()) *this = other.contiguous();
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) {
    if (other.defined()) {
      *this = other.contiguous();
    } else {
      storage_.reset();
      static_cast<TensorView&>(*this) = TensorView();
    }
  }
  return *this;
}

Tensor::Tensor(Tensor&& other) noexcept
    : TensorView(static_cast<const TensorView&>(other)), storage_(std::move(other.storage_)) {
  static_cast<TensorView&>(other) = TensorView();
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    storage_ = std::move(other.storage_);
    static_cast<TensorView&>(*this) = static_cast<const TensorView&>(other);
    static_cast<TensorView&>(other) = TensorView();
  }
  return *this;
}

}  // namespace attn

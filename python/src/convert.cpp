#include "convert.hpp"

#include <cstdint>
#include <cstring>
#include <memory>

#include "attn/error.hpp"

namespace attn::py {

namespace {

using dtype_code = nb::dlpack::dtype_code;

// DLPack device types that are host memory the CPU can read.
bool is_cpu_device(int device_type) { return device_type == 1 /* kDLCPU */ || device_type == 3 /* kDLCUDAHost */; }

const char* device_name(int device_type) {
  switch (device_type) {
    case 2: return "cuda";
    case 4: return "opencl";
    case 7: return "vulkan";
    case 8: return "metal";
    case 10: return "rocm";
    case 14: return "oneapi";
    default: return "a non-CPU device";
  }
}

// The ndarray behind `obj`, with the checks that must come before nanobind touches it.
nb::ndarray<nb::ro> read_array(nb::handle obj, const char* arg) {
  // A GPU tensor: refuse before asking for its data (the capsule would point to device memory).
  if (nb::hasattr(obj, "__dlpack_device__")) {
    nb::object dev = obj.attr("__dlpack_device__")();
    const int type = nb::cast<int>(dev[0]);
    if (!is_cpu_device(type)) {
      throw nb::type_error((std::string(arg) + ": expected an array in CPU memory, got a tensor on " +
                            device_name(type) + " (DLPack device type " + std::to_string(type) +
                            "); copy it to the CPU first, e.g. tensor.cpu()")
                               .c_str());
    }
  }
  if (nb::hasattr(obj, "requires_grad") && nb::hasattr(obj, "detach") &&
      nb::cast<bool>(obj.attr("requires_grad"))) {
    throw nb::type_error((std::string(arg) + ": the tensor requires grad, and attn does not track "
                          "gradients; pass tensor.detach()").c_str());
  }
  nb::ndarray<nb::ro> a;
  if (nb::try_cast(obj, a)) return a;
  // Tensors whose dtype DLPack cannot carry (torch < 2.0 exports no bool): their NumPy view.
  if (nb::hasattr(obj, "numpy") && nb::hasattr(obj, "__dlpack__")) {
    nb::object converted = obj.attr("numpy")();
    if (nb::try_cast(converted, a)) return a;
  }
  // Lists, tuples and scalars: NumPy decides their dtype (float64 for Python floats).
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj) ||
      nb::isinstance<nb::float_>(obj) || nb::isinstance<nb::int_>(obj) || nb::isinstance<nb::bool_>(obj)) {
    nb::object converted = nb::module_::import_("numpy").attr("asarray")(obj);
    if (nb::try_cast(converted, a)) return a;
  }
  throw nb::type_error((std::string(arg) + ": expected a NumPy array or a tensor supporting DLPack, got " +
                        nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())))))).c_str());
}

Shape shape_of(const nb::ndarray<nb::ro>& a, const char* arg) {
  if (a.ndim() > static_cast<size_t>(kMaxDims)) {
    std::string s = "(";
    for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    throw nb::value_error((std::string(arg) + ": attn tensors have at most 4 dimensions, got " +
                           std::to_string(a.ndim()) + " with shape " + s + ")").c_str());
  }
  Shape shape;
  for (size_t i = 0; i < a.ndim(); ++i) shape.push_back(static_cast<int64_t>(a.shape(i)));
  return shape;
}

// Calls f(flat_index, element_pointer) for every element in row-major order, following the
// array's strides (in elements of `item` bytes).
template <typename F>
void for_each_element(const nb::ndarray<nb::ro>& a, size_t item, F&& f) {
  const int nd = static_cast<int>(a.ndim());
  const auto* base = static_cast<const uint8_t*>(a.data());
  int64_t n = 1;
  for (int d = 0; d < nd; ++d) n *= static_cast<int64_t>(a.shape(static_cast<size_t>(d)));
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * a.stride(static_cast<size_t>(d));
    f(flat, base + off * static_cast<int64_t>(item));
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < static_cast<int64_t>(a.shape(static_cast<size_t>(d)))) break;
      idx[d] = 0;
    }
  }
}

bool is(const nb::dlpack::dtype& dt, dtype_code code, int bits) {
  return dt.code == static_cast<uint8_t>(code) && dt.bits == bits && dt.lanes == 1;
}

// An array's data for a view: an empty one's may be null (torch's storage-less empty tensors
// through DLPack), which would read as an undefined tensor ("query is undefined") where NumPy's
// empty arrays, whose pointer is not null, get the library's own message ("query is empty
// (shape [2, 0, 8])"). No element is ever read through it.
void* view_data(const nb::ndarray<nb::ro>& a) {
  alignas(64) static uint8_t no_elements[64] = {};
  return a.data() != nullptr || a.size() != 0 ? const_cast<void*>(a.data()) : no_elements;
}

}  // namespace

std::string dtype_name(const nb::dlpack::dtype& dt) {
  std::string base;
  switch (static_cast<dtype_code>(dt.code)) {
    case dtype_code::Int: base = "int"; break;
    case dtype_code::UInt: base = "uint"; break;
    case dtype_code::Float: base = "float"; break;
    case dtype_code::Bfloat: base = "bfloat"; break;
    case dtype_code::Complex: base = "complex"; break;
    case dtype_code::Bool: return "bool";
    default: base = "dtype" + std::to_string(dt.code) + "_"; break;
  }
  return base + std::to_string(dt.bits);
}

Input float_input(nb::handle obj, const char* arg) {
  Input in;
  in.array = read_array(obj, arg);
  const nb::ndarray<nb::ro>& a = in.array;
  const Shape shape = shape_of(a, arg);
  const nb::dlpack::dtype dt = a.dtype();
  bool positive_strides = true;
  for (size_t i = 0; i < a.ndim(); ++i) positive_strides = positive_strides && a.stride(i) >= 0;

  if (is(dt, dtype_code::Float, 32)) {
    in.kind = Kind::kFloat32;
    if (positive_strides) {
      Shape strides;
      for (size_t i = 0; i < a.ndim(); ++i) strides.push_back(a.stride(i));
      // The kernels never write through input views, so dropping const is safe.
      in.view = TensorView(static_cast<float*>(view_data(a)), shape, strides);
      return in;
    }
    in.copy = Tensor::empty(shape);
    float* out = in.copy.data();
    for_each_element(a, 4, [&](int64_t i, const uint8_t* p) { std::memcpy(out + i, p, 4); });
  } else if (is(dt, dtype_code::Float, 64)) {
    in.kind = Kind::kFloat64;
    in.copy = Tensor::empty(shape);
    float* out = in.copy.data();
    for_each_element(a, 8, [&](int64_t i, const uint8_t* p) {
      double d;
      std::memcpy(&d, p, 8);
      out[i] = static_cast<float>(d);
    });
  } else if (is(dt, dtype_code::Bool, 8)) {
    in.kind = Kind::kBool;
    in.copy = Tensor::empty(shape);
    float* out = in.copy.data();
    for_each_element(a, 1, [&](int64_t i, const uint8_t* p) { out[i] = *p ? 1.0f : 0.0f; });
  } else {
    throw nb::type_error((std::string(arg) + ": expected a float32 or float64 array, got " +
                          dtype_name(dt) + " (convert it explicitly, e.g. x.astype(numpy.float32))").c_str());
  }
  in.view = in.copy;
  return in;
}

Input sdpa_input(nb::handle obj, const char* arg, bool bf16_bits) {
  Input in;
  in.array = read_array(obj, arg);
  const nb::ndarray<nb::ro>& a = in.array;
  const Shape shape = shape_of(a, arg);
  const nb::dlpack::dtype dt = a.dtype();
  DType dtype;
  if (bf16_bits) {
    if (!is(dt, dtype_code::UInt, 16)) {
      throw nb::type_error((std::string(arg) + ": bfloat16 bits must be a uint16 array, got " +
                            dtype_name(dt)).c_str());
    }
    in.kind = Kind::kBFloat16;
    dtype = DType::kBFloat16;
  } else if (is(dt, dtype_code::Float, 32)) {
    in.kind = Kind::kFloat32;
    dtype = DType::kFloat32;
  } else if (is(dt, dtype_code::Float, 64)) {
    in.kind = Kind::kFloat64;
    dtype = DType::kFloat64;
  } else if (is(dt, dtype_code::Float, 16)) {
    in.kind = Kind::kFloat16;
    dtype = DType::kFloat16;
  } else if (is(dt, dtype_code::Bfloat, 16)) {
    in.kind = Kind::kBFloat16;
    dtype = DType::kBFloat16;
  } else if (is(dt, dtype_code::Bool, 8)) {
    in.kind = Kind::kBool;  // one byte, 0 or 1: an int8 boolean mask
    dtype = DType::kInt8;
  } else {
    throw nb::type_error((std::string(arg) + ": expected a float32, float64, float16 or bfloat16 "
                          "array, got " + dtype_name(dt) +
                          " (convert it explicitly, e.g. x.astype(numpy.float32))").c_str());
  }
  bool positive_strides = true;
  for (size_t i = 0; i < a.ndim(); ++i) positive_strides = positive_strides && a.stride(i) >= 0;
  if (positive_strides) {
    Shape strides;
    for (size_t i = 0; i < a.ndim(); ++i) strides.push_back(a.stride(i));
    // The kernels never write through input views, so dropping const is safe.
    in.view = TensorView(view_data(a), dtype, shape, strides);
    return in;
  }
  in.copy = Tensor::empty(shape, dtype);
  auto* out = static_cast<uint8_t*>(in.copy.raw_data());
  const size_t item = static_cast<size_t>(dtype_size(dtype));
  for_each_element(a, item, [&](int64_t i, const uint8_t* p) {
    std::memcpy(out + static_cast<size_t>(i) * item, p, item);
  });
  in.view = in.copy;
  return in;
}

std::vector<int64_t> int_input(nb::handle obj, const char* arg, Shape& shape, const char* what) {
  const nb::ndarray<nb::ro> a = read_array(obj, arg);
  shape = shape_of(a, arg);
  const nb::dlpack::dtype dt = a.dtype();
  const auto code = static_cast<dtype_code>(dt.code);
  if ((code != dtype_code::Int && code != dtype_code::UInt) || dt.lanes != 1 ||
      (dt.bits != 8 && dt.bits != 16 && dt.bits != 32 && dt.bits != 64)) {
    throw nb::type_error((std::string(arg) + ": expected an integer array of " + what + ", got " +
                          dtype_name(dt)).c_str());
  }
  std::vector<int64_t> ids(static_cast<size_t>(shape.numel()));
  const size_t item = dt.bits / 8;
  const bool is_signed = code == dtype_code::Int;
  for_each_element(a, item, [&](int64_t i, const uint8_t* p) {
    int64_t v = 0;
    switch (item) {
      case 1: v = is_signed ? *reinterpret_cast<const int8_t*>(p) : *p; break;
      case 2: { int16_t s; uint16_t u; std::memcpy(&s, p, 2); std::memcpy(&u, p, 2); v = is_signed ? s : u; break; }
      case 4: { int32_t s; uint32_t u; std::memcpy(&s, p, 4); std::memcpy(&u, p, 4); v = is_signed ? s : u; break; }
      default: {
        uint64_t u;
        std::memcpy(&u, p, 8);
        // uint64 ids beyond int64 are out of any vocabulary: keep them invalid (negative -> IndexError).
        v = static_cast<int64_t>(u);
      }
    }
    ids[static_cast<size_t>(i)] = v;
  });
  return ids;
}

namespace {

// A heap Tensor owned by a capsule (freed when the array that holds the capsule dies), its
// shape, and its DLPack dtype: bfloat16 as DLPack's Bfloat (torch) or as uint16 bits (NumPy,
// which has no bfloat16).
struct Owned {
  Tensor* tensor;
  nb::capsule owner;
  size_t shape[kMaxDims];
  nb::dlpack::dtype dtype;
  void* data;
};
Owned own(Tensor&& t, bool native_bfloat16) {
  Owned o{new Tensor(std::move(t)), {}, {}, {}, nullptr};
  o.owner = nb::capsule(o.tensor, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  for (int i = 0; i < o.tensor->dim(); ++i) o.shape[i] = static_cast<size_t>(o.tensor->size(i));
  o.dtype.lanes = 1;
  o.dtype.bits = static_cast<uint8_t>(8 * o.tensor->element_size());
  switch (o.tensor->dtype()) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16: o.dtype.code = static_cast<uint8_t>(dtype_code::Float); break;
    case DType::kBFloat16:
      o.dtype.code = static_cast<uint8_t>(native_bfloat16 ? dtype_code::Bfloat : dtype_code::UInt);
      break;
    case DType::kInt8:
    case DType::kInt32: o.dtype.code = static_cast<uint8_t>(dtype_code::Int); break;
  }
  // An empty tensor may have no storage; NumPy and DLPack still want a non-null pointer.
  alignas(8) static uint8_t dummy[8] = {};
  o.data = o.tensor->raw_data() ? o.tensor->raw_data() : dummy;
  return o;
}

}  // namespace

nb::object to_numpy(Tensor&& t) {
  const Owned o = own(std::move(t), false);
  return nb::cast(nb::ndarray<nb::numpy>(o.data, static_cast<size_t>(o.tensor->dim()), o.shape,
                                         o.owner, nullptr, o.dtype));
}

nb::object to_numpy(std::vector<double>&& values, const Shape& shape) {
  auto* owned = new std::vector<double>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  size_t dims[kMaxDims];
  for (int i = 0; i < shape.ndim(); ++i) dims[i] = static_cast<size_t>(shape[i]);
  static double dummy = 0.0;
  double* data = owned->empty() ? &dummy : owned->data();
  return nb::cast(nb::ndarray<nb::numpy, double>(data, static_cast<size_t>(shape.ndim()), dims, owner));
}

nb::object to_torch(Tensor&& t) {
  const Owned o = own(std::move(t), true);
  return nb::cast(nb::ndarray<nb::pytorch>(o.data, static_cast<size_t>(o.tensor->dim()), o.shape,
                                           o.owner, nullptr, o.dtype));
}

// cu_seq_q / cu_seq_k: any integer array, as the int32 tensor varlen_attn reads (ValueError for a
// value outside int32; floats raise TypeError).
Tensor cu_seq_input(nb::handle obj, const char* arg) {
  Shape shape;
  const std::vector<int64_t> v = int_input(obj, arg, shape, "cumulative sequence lengths");
  Tensor t = Tensor::empty(shape, DType::kInt32);
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < INT32_MIN || v[i] > INT32_MAX) {
      throw nb::value_error((std::string(arg) + ": cumulative sequence lengths must fit in int32, got " +
                             std::to_string(v[i])).c_str());
    }
    t.data_as<int32_t>()[i] = static_cast<int32_t>(v[i]);
  }
  return t;
}

// alibi_slopes / sinks: float32 arrays (float64 ones are rounded to float32, the dtype the
// library takes them in); bool and other dtypes raise TypeError naming the argument.
std::optional<Input> head_param_arg(nb::handle obj, const char* arg) {
  if (obj.is_none()) return std::nullopt;
  Input in = float_input(obj, arg);
  if (in.kind == Kind::kBool) {
    throw nb::type_error((std::string(arg) + ": expected a float32 or float64 array, got bool").c_str());
  }
  return in;
}

}  // namespace attn::py

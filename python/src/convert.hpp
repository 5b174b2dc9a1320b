// Arrays in and out of the bindings.
//
// In: anything nanobind can read as an ndarray (NumPy arrays through the buffer protocol, PyTorch
// and other DLPack tensors), Python sequences through numpy.asarray. float32 arrays whose strides
// are non-negative are used in place (a TensorView over the caller's memory, no copy); every other
// accepted case is copied explicitly into an owning Tensor. What cannot be read raises TypeError
// or ValueError naming the argument, never crashes.
// Out: owning NumPy arrays that take over the Tensor's storage (no copy).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::py {

namespace nb = nanobind;

enum class Kind { kFloat32, kFloat64, kBool, kInt };

// A float32 view of a Python array argument. Holds whatever keeps the memory alive: the
// caller's array (zero-copy) or its own converted copy.
struct Input {
  nb::ndarray<nb::ro> array;  // keeps the caller's buffer alive
  Tensor copy;                // set when the data had to be converted or re-laid-out
  TensorView view;            // what the kernels read
  Kind kind = Kind::kFloat32;  // the caller's element type
};

// Reads `obj` (argument `arg`) as a float32 view. Accepts float32 (zero-copy when the strides are
// non-negative), float64 and bool (converted: bool to 0/1). Integers and other types raise
// TypeError, more than 4 dimensions ValueError, non-CPU tensors TypeError.
Input float_input(nb::handle obj, const char* arg);

// Reads `obj` as int64 ids (any integer dtype), with its shape; floats raise TypeError.
std::vector<int64_t> int_input(nb::handle obj, const char* arg, Shape& shape);

// The Python type name of an array's element type, as NumPy spells it ("float32", "int64", ...).
std::string dtype_name(const nb::dlpack::dtype& dt);

// An owning NumPy float32 array taking over `t`'s storage.
nb::object to_numpy(Tensor&& t);
// An owning NumPy float64 array over `values` with `shape`.
nb::object to_numpy(std::vector<double>&& values, const Shape& shape);

}  // namespace attn::py

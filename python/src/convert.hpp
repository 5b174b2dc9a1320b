// Arrays in and out of the bindings.
//
// In: anything nanobind can read as an ndarray (NumPy arrays through the buffer protocol, PyTorch
// and other DLPack tensors), Python sequences through numpy.asarray. Arrays of a dtype the callee
// takes whose strides are non-negative are used in place (a TensorView over the caller's memory,
// no copy); every other accepted case is copied explicitly into an owning Tensor. What cannot be
// read raises TypeError or ValueError naming the argument, never crashes.
// Out: owning NumPy arrays that take over the Tensor's storage (no copy), in the Tensor's dtype
// (bfloat16 as its uint16 bits: NumPy has no bfloat16; attn/__init__.py views them as
// ml_dtypes.bfloat16).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::py {

namespace nb = nanobind;

enum class Kind { kFloat32, kFloat64, kFloat16, kBFloat16, kBool, kInt };

// A view of a Python array argument (float32 for float_input, the caller's dtype for
// sdpa_input). Holds whatever keeps the memory alive: the
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

// Reads `obj` (argument `arg`) in its own dtype, for scaled_dot_product_attention's query, key,
// value and attn_mask: float32, float64, float16 and bfloat16 (DLPack's Bfloat 16, e.g. a
// torch.bfloat16 tensor) are used in place when the strides are non-negative, else copied in
// their dtype; bool is read in place as int8 0/1 (kind kBool). `bf16_bits`: the array holds
// bfloat16 bit patterns as uint16 (an ml_dtypes.bfloat16 array viewed by attn/__init__.py).
// Other dtypes raise TypeError, more than 4 dimensions ValueError, non-CPU tensors TypeError.
Input sdpa_input(nb::handle obj, const char* arg, bool bf16_bits);

// Reads `obj` as int64 ids (any integer dtype), with its shape; floats raise TypeError saying
// an integer array of `what` was expected.
std::vector<int64_t> int_input(nb::handle obj, const char* arg, Shape& shape,
                               const char* what = "token ids");

// alibi_slopes / sinks: a float32 view (float64 rounded to float32), or nullopt for None;
// bool and other dtypes raise TypeError naming `arg`.
std::optional<Input> head_param_arg(nb::handle obj, const char* arg);

// cu_seq_q / cu_seq_k of varlen attention: any integer array, as the int32 tensor the library
// reads (ValueError for a value outside int32; floats raise TypeError).
Tensor cu_seq_input(nb::handle obj, const char* arg);

// The Python type name of an array's element type, as NumPy spells it ("float32", "int64", ...).
std::string dtype_name(const nb::dlpack::dtype& dt);

// An owning NumPy array taking over `t`'s storage, in `t`'s dtype (bfloat16 as uint16 bits).
nb::object to_numpy(Tensor&& t);
// An owning torch.Tensor taking over `t`'s storage through DLPack (no copy), in `t`'s dtype
// (bfloat16 as torch.bfloat16). Imports torch: only attn.torch's bindings call it.
nb::object to_torch(Tensor&& t);
// An owning NumPy float64 array over `values` with `shape`.
nb::object to_numpy(std::vector<double>&& values, const Shape& shape);

}  // namespace attn::py

// Exception hierarchy. Every public entry point validates its arguments and throws one of
// these with a message that names the argument, the expected and the actual value, so an
// embedding application can catch attn::Error and report it instead of crashing.
#pragma once

#include <stdexcept>
#include <string>

namespace attn {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A tensor has the wrong rank or size, or shapes do not broadcast.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An argument has an invalid value (probability outside [0, 1], non-positive size, ...).
class ValueError : public Error {
 public:
  using Error::Error;
};

// An index is outside the valid range (token id >= vocabulary size, dim out of range, ...).
class IndexError : public Error {
 public:
  using Error::Error;
};

// A tensor's dtype is not one the operation takes (an integer query, mixed q/k/v dtypes, a
// bfloat16 tensor handed to a float32-only op). Python raises TypeError for it.
class DTypeError : public Error {
 public:
  using Error::Error;
};

// A file or serialized blob is malformed.
class FormatError : public Error {
 public:
  using Error::Error;
};

}  // namespace attn

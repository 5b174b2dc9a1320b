// Reading and writing safetensors files, the format PyTorch models are exchanged in, and moving a
// module's weights through them under PyTorch's state_dict names.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "value"}}, then the raw little-endian data; offsets are relative to
// the end of the header, and the tensors tile the data exactly (no gaps, no overlap).
//
// Tensors keep their dtype both ways: F32, BF16, F16, F64, I8 and I32 are read into tensors of
// that dtype (DType::kFloat32, kBFloat16, ...) and written with it. Other dtypes, more than 4
// dimensions, and any malformed header or data throw FormatError "<file>: <problem>" (the parser
// accepts arbitrary bytes without crashing: tests/fuzz/fuzz_safetensors.cpp). Loading into a
// module converts to the module's float32, as load_state_dict's copy_ does.
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attn/error.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace nn {
class Module;
}

// A file could not be opened, read, written or renamed (the OS's reason is in the message).
class IoError : public Error {
 public:
  using Error::Error;
};

// The contents of a safetensors file, tensors in the order of their data in the file.
struct Safetensors {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"

  // The tensor called `name`, or nullptr.
  const Tensor* find(std::string_view name) const;
};

// Parses a whole file held in memory; `source` names it in error messages.
Safetensors parse_safetensors(std::string_view bytes, const std::string& source = "<memory>");
// Reads `path`: IoError if it cannot be read, FormatError if it is malformed.
Safetensors load_safetensors(const std::string& path);

using NamedViews = std::vector<std::pair<std::string, TensorView>>;

// The bytes of a safetensors file holding `tensors` (each in its dtype, in the given order; names must be
// unique and not "__metadata__", else ValueError). Views of any strides are written row-major.
std::string serialize_safetensors(const NamedViews& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
// Writes atomically: into "<path>.tmp-<pid>" in the same directory, flushed, then renamed over
// `path`, so a reader never sees a half-written file and a failed write leaves `path` as it was.
void save_safetensors(const std::string& path, const NamedViews& tensors,
                      const std::map<std::string, std::string>& metadata = {});

namespace nn {

// Copies `tensors` into the module's state_dict() entries (parameters and buffers, PyTorch's
// names), like module.load_state_dict(sd, strict). Every source must have the destination's shape
// (ShapeError naming the entry otherwise). strict: a missing or an unexpected name is a
// ValueError listing them all; not strict: they are ignored. Nothing is modified when it throws.
void load_state_dict(Module& module, const std::vector<std::pair<std::string, Tensor>>& tensors,
                     bool strict = true);

// module.state_dict() to a safetensors file (torch: safetensors.torch.save_file(m.state_dict())).
void save_safetensors(Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});
// load_state_dict(module, load_safetensors(path).tensors, strict).
void load_safetensors(Module& module, const std::string& path, bool strict = true);

}  // namespace nn

}  // namespace attn

// Tensor printing in PyTorch's format, so a learner sees the same text `print(t)` shows.
//
// Reproduces torch/_tensor_str.py: fixed, integer ("2.") or scientific mode chosen from the
// non-zero finite values, common width, 80-column wrapping, summarisation past `threshold`
// elements with `edgeitems` at each end, and the "tensor(" prefix indent. Values are formatted
// as the float64 of each element, as Python does.
#pragma once

#include <optional>
#include <string>

#include "attn/tensor.hpp"

namespace attn {

// torch.set_printoptions. The defaults are PyTorch's.
struct PrintOptions {
  int precision = 4;
  int64_t threshold = 1000;
  int edgeitems = 3;
  int linewidth = 80;
  std::optional<bool> sci_mode;  // nullopt: chosen automatically
};

// What print(t) shows, e.g. "tensor([0.9544, 1.4950])", or "tensor([0.1001, 2.0000],
// dtype=torch.bfloat16)" for a dtype other than float32. `suffix`, when not
// empty, is appended like PyTorch's keyword suffixes (e.g. "grad_fn=<MmBackward0>").
std::string format_tensor(const TensorView& t, const PrintOptions& options = {},
                          const std::string& suffix = "");

// torch.Size's text: "torch.Size([2, 6, 3])".
std::string format_size(const Shape& shape);

}  // namespace attn

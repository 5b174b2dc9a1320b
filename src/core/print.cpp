// Tensor printing, a line-by-line port of torch/_tensor_str.py (torch 1.13) for dense tensors.
//
// Design: one pass gathers the values that will be shown (all of them, or only the `edgeitems`
// rows/columns at each end when the tensor has more than `threshold` elements) and builds a
// Formatter from them, exactly as PyTorch builds `_Formatter` from `get_summarized_data`. A
// second, recursive pass walks the view with select() (so strided views need no copy) and lays
// out rows the way `_tensor_str_with_formatter` / `_vector_str` do. Finally `_add_suffixes`
// appends ", size=(...)" for empty tensors and the caller's suffix, then ")".
//
// Numbers are formatted from the float64 value of each element (exact for every dtype), as
// Python's float.__format__ sees them; fmt's "{:.Nf}" / "{:.Ne}" round correctly like Python's,
// so the digits agree. Integer dtypes print as integers; every dtype but float32 (the default
// dtype) gets PyTorch's "dtype=torch.<name>" suffix.
#include "attn/print.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <vector>

#include "core/convert.hpp"

namespace attn {

namespace {

// Python's format(v, ".{p}f") / ".{p}e". Python never prints a sign on NaN; fmt does ("-nan").
std::string py_format(double v, int precision, bool sci) {
  if (std::isnan(v)) return "nan";
  return sci ? fmt::format("{:.{}e}", v, precision) : fmt::format("{:.{}f}", v, precision);
}

// torch._tensor_str._Formatter.
class Formatter {
 public:
  Formatter(const std::vector<double>& values, const PrintOptions& opts, bool floating)
      : precision_(opts.precision), floating_(floating) {
    if (!floating) {  // integers: the width of the longest str(value)
      for (double v : values) {
        max_width_ = std::max(max_width_, fmt::format("{}", static_cast<int64_t>(v)).size());
      }
      return;
    }
    std::vector<double> finite;  // the non-zero finite values decide the mode and width
    for (double v : values) {
      if (std::isfinite(v) && v != 0.0) finite.push_back(v);
    }
    // PyTorch returns early here, so a forced sci_mode is ignored for all-zero/non-finite data.
    if (finite.empty()) return;
    double lo = INFINITY, hi = 0.0;
    for (double v : finite) {
      lo = std::min(lo, std::fabs(v));
      hi = std::max(hi, std::fabs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    // Integers never need sci for being small, only for range or magnitude.
    sci_mode_ = hi / lo > 1000.0 || hi > 1.0e8 || (!int_mode_ && lo < 1.0e-4);
    for (double v : finite) {
      size_t len;
      if (sci_mode_) {
        len = py_format(v, precision_, true).size();
      } else if (int_mode_) {
        len = py_format(v, 0, false).size() + 1;  // the trailing "." of "2."
      } else {
        len = py_format(v, precision_, false).size();
      }
      max_width_ = std::max(max_width_, len);
    }
    // A forced mode changes how values print but not the width measured above (as in PyTorch).
    if (opts.sci_mode) sci_mode_ = *opts.sci_mode;
  }

  size_t width() const { return max_width_; }

  // Right-aligned to the common width; longer strings (e.g. "-0.") are never cut.
  std::string format(double v) const {
    std::string s;
    if (!floating_) {
      s = fmt::format("{}", static_cast<int64_t>(v));
    } else if (sci_mode_) {
      s = py_format(v, precision_, true);
    } else if (int_mode_) {
      s = py_format(v, 0, false);
      if (std::isfinite(v)) s += '.';  // marks the tensor as floating point: "2."
    } else {
      s = py_format(v, precision_, false);
    }
    if (s.size() < max_width_) s.insert(0, max_width_ - s.size(), ' ');
    return s;
  }

 private:
  int precision_;
  bool floating_;
  bool int_mode_ = true;
  bool sci_mode_ = false;
  size_t max_width_ = 1;
};

class Printer {
 public:
  Printer(const TensorView& t, const PrintOptions& opts)
      : opts_(opts), summarize_(t.numel() > opts.threshold) {}

  static double value(const TensorView& t, int64_t offset) {
    return detail::element_as_double(t.raw_data(), t.dtype(), offset);
  }

  // Indices of dim 0 to show; -1 stands for the "..." entry.
  std::vector<int64_t> shown(int64_t n, bool vector) const {
    std::vector<int64_t> idx;
    const int64_t edge = opts_.edgeitems;
    if (!summarize_ || n <= 2 * edge) {
      for (int64_t i = 0; i < n; ++i) idx.push_back(i);
      return idx;
    }
    for (int64_t i = 0; i < edge; ++i) idx.push_back(i);
    idx.push_back(-1);
    // Python's t[-0:] is the whole vector, so edgeitems=0 shows all of a 1-D row after "...".
    const int64_t tail = (vector && edge == 0) ? n : edge;
    for (int64_t i = n - tail; i < n; ++i) idx.push_back(i);
    return idx;
  }

  // get_summarized_data: the values the formatter is built from.
  void collect(const TensorView& t, std::vector<double>& out) const {
    if (t.dim() == 0) {
      out.push_back(value(t, 0));
      return;
    }
    for (int64_t i : shown(t.size(0), t.dim() == 1)) {
      if (i < 0) continue;
      if (t.dim() == 1) {
        out.push_back(value(t, i * t.stride(0)));
      } else {
        collect(t.select(0, i), out);
      }
    }
  }

  // _tensor_str_with_formatter. `indent` is the column of the opening "[".
  std::string str(const TensorView& t, int indent, const Formatter& f) const {
    if (t.dim() == 0) return f.format(value(t, 0));
    if (t.dim() == 1) return vector_str(t, indent, f);
    std::string sep = "," + std::string(t.dim() - 1, '\n') + std::string(indent + 1, ' ');
    std::string out = "[";
    bool first = true;
    for (int64_t i : shown(t.size(0), false)) {
      if (!first) out += sep;
      first = false;
      out += i < 0 ? "..." : str(t.select(0, i), indent + 1, f);
    }
    return out + "]";
  }

  // _vector_str: as many elements per line as fit in linewidth (each costs width + ", ").
  std::string vector_str(const TensorView& t, int indent, const Formatter& f) const {
    const int64_t element_length = static_cast<int64_t>(f.width()) + 2;
    // floor(true division), as Python computes it; never fewer than one element per line.
    const double fit = std::floor(double(opts_.linewidth - indent) / double(element_length));
    const int64_t per_line = std::max<int64_t>(1, static_cast<int64_t>(fit));
    std::vector<std::string> data;
    for (int64_t i : shown(t.size(0), true)) {
      data.push_back(i < 0 ? " ..." : f.format(value(t, i * t.stride(0))));
    }
    const std::string line_sep = ",\n" + std::string(indent + 1, ' ');
    std::string out = "[";
    for (size_t i = 0; i < data.size(); ++i) {
      if (i > 0) out += (i % per_line == 0) ? line_sep : ", ";
      out += data[i];
    }
    return out + "]";
  }

 private:
  const PrintOptions& opts_;
  bool summarize_;
};

// Python's str(tuple(shape)): "(2, 0)", "(0,)".
std::string shape_tuple(const Shape& s) {
  if (s.ndim() == 1) return fmt::format("({},)", s[0]);
  std::string out = "(";
  for (int i = 0; i < s.ndim(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

}  // namespace

std::string format_tensor(const TensorView& t, const PrintOptions& options,
                          const std::string& suffix) {
  const std::string prefix = "tensor(";
  const int indent = static_cast<int>(prefix.size());
  std::vector<std::string> suffixes;
  std::string body;
  const std::string dtype_suffix = fmt::format("dtype=torch.{}", dtype_name(t.dtype()));
  if (t.numel() == 0) {
    body = "[]";
    // Like NumPy, only the plain (0,) shape goes without saying.
    if (t.dim() != 1) suffixes.push_back("size=" + shape_tuple(t.shape()));
    if (t.dtype() != DType::kFloat32) suffixes.push_back(dtype_suffix);
  } else {
    Printer printer(t, options);
    std::vector<double> values;
    printer.collect(t, values);
    body = printer.str(t, indent, Formatter(values, options, is_floating(t.dtype())));
    if (t.dtype() != DType::kFloat32) suffixes.push_back(dtype_suffix);
  }
  if (!suffix.empty()) suffixes.push_back(suffix);

  // _add_suffixes. Its last_line_len is len - rfind("\n") + 1, i.e. len + 2 on a single line
  // (rfind gives -1); kept as is so suffixes wrap at exactly the same length as in PyTorch.
  std::string out = prefix + body;
  const size_t nl = out.rfind('\n');
  int64_t last_line_len = static_cast<int64_t>(out.size()) -
                          (nl == std::string::npos ? -1 : static_cast<int64_t>(nl)) + 1;
  for (const std::string& s : suffixes) {
    const auto len = static_cast<int64_t>(s.size());
    if (last_line_len + len + 2 > options.linewidth) {
      out += ",\n" + std::string(indent, ' ') + s;
      last_line_len = indent + len;
    } else {
      out += ", " + s;
      last_line_len += len + 2;
    }
  }
  return out + ")";
}

std::string format_size(const Shape& shape) { return "torch.Size(" + shape.str() + ")"; }

}  // namespace attn

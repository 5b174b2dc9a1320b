// Fuzz target: byte-driven sequences of TensorView operations on a small tensor.
//
// Starting from a tensor of rank 0-4 (extents 0-4) holding 0, 1, 2, ... in memory order, the
// bytes choose up to 24 operations (view with -1, transpose, t, select, slice, unsqueeze,
// squeeze, expand, contiguous, at, item) with arguments that are often out of range. A model
// kept beside the view (its shape and its elements in logical order, with PyTorch's rules for
// each operation; `view` needs is_contiguous(), as documented, and a shape whose element count
// and row-major strides fit in int64) says whether each call is valid. Properties:
//   - a call throws an attn::Error subclass exactly when the model says it is invalid, and
//     never any other exception;
//   - after every successful call: shape() equals the model's, to_vector(), at() at every
//     index and contiguous() all equal the model's elements, and a view that claims
//     is_contiguous() has element k at data() + k.
// ASan checks every element read stays inside the tensors' storage.
#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <vector>

#include "attn/tensor.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace attn;
using attn::fuzz::ByteReader;

constexpr int64_t kMaxElems = 4096;  // larger models are not materialised

struct Model {
  std::vector<int64_t> shape;
  std::vector<float> vals;  // logical row-major order
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * shape[i + 1];
  return s;
}

// Calls f(flat, index) for every index of `shape` in row-major order.
template <typename F>
void for_each_index(const std::vector<int64_t>& shape, F&& f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t flat = 0; flat < n; ++flat) {
    f(flat, idx);
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

float at_index(const TensorView& v, const std::vector<int64_t>& idx, float** addr = nullptr) {
  float* p = nullptr;
  switch (idx.size()) {
    case 0: p = &v.at({}); break;
    case 1: p = &v.at({idx[0]}); break;
    case 2: p = &v.at({idx[0], idx[1]}); break;
    case 3: p = &v.at({idx[0], idx[1], idx[2]}); break;
    default: p = &v.at({idx[0], idx[1], idx[2], idx[3]}); break;
  }
  if (addr != nullptr) *addr = p;
  return *p;
}

// The product of the extents, left to right as Shape::numel; false if it overflows int64.
bool product_fits(const std::vector<int64_t>& ext, int64_t& product) {
  product = 1;
  for (int64_t e : ext) {
    if (__builtin_mul_overflow(product, e, &product)) return false;
  }
  return true;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// wrap_dim as PyTorch: valid dims of an n-D tensor are [-n, n-1]; a 0-D tensor takes -1 and 0.
bool wrap(int dim, int n, int& out) {
  const int lo = n == 0 ? -1 : -n, hi = n == 0 ? 0 : n - 1;
  if (dim < lo || dim > hi) return false;
  out = dim < 0 ? dim + std::max(n, 1) : dim;
  return true;
}

// Elements of the model picked by a function from the result index to the source index.
template <typename F>
Model remap(const Model& m, std::vector<int64_t> shape, F&& src_index) {
  Model out;
  out.shape = std::move(shape);
  const std::vector<int64_t> st = strides_of(m.shape);
  out.vals.reserve(static_cast<size_t>(out.numel()));
  for_each_index(out.shape, [&](int64_t, const std::vector<int64_t>& idx) {
    const std::vector<int64_t> s = src_index(idx);
    int64_t off = 0;
    for (size_t d = 0; d < s.size(); ++d) off += s[d] * st[d];
    out.vals.push_back(m.vals[static_cast<size_t>(off)]);
  });
  return out;
}

void verify(const TensorView& v, const Model& m, const char* after) {
  ATTN_FUZZ_CHECKF(v.dim() == static_cast<int>(m.shape.size()), "after %s: rank %d, model %zu", after,
                   v.dim(), m.shape.size());
  for (int d = 0; d < v.dim(); ++d) {
    ATTN_FUZZ_CHECKF(v.shape()[d] == m.shape[d], "after %s: extent %d is %lld, model %lld", after, d,
                     static_cast<long long>(v.shape()[d]), static_cast<long long>(m.shape[d]));
  }
  ATTN_FUZZ_CHECK(v.numel() == m.numel());
  const std::vector<float> lin = v.to_vector();
  ATTN_FUZZ_CHECK(lin.size() == m.vals.size());
  for (size_t i = 0; i < lin.size(); ++i) {
    ATTN_FUZZ_CHECKF(same_bits(lin[i], m.vals[i]), "after %s: to_vector()[%zu] = %g, model %g", after, i,
                     lin[i], m.vals[i]);
  }
  const bool contiguous = v.is_contiguous();
  for_each_index(m.shape, [&](int64_t flat, const std::vector<int64_t>& idx) {
    float* addr = nullptr;
    const float x = at_index(v, idx, &addr);
    ATTN_FUZZ_CHECKF(same_bits(x, m.vals[static_cast<size_t>(flat)]), "after %s: at() of element %lld = %g, model %g",
                     after, static_cast<long long>(flat), x, m.vals[static_cast<size_t>(flat)]);
    if (contiguous) {
      ATTN_FUZZ_CHECKF(addr == v.data() + flat, "after %s: is_contiguous() but element %lld is not at data() + %lld",
                       after, static_cast<long long>(flat), static_cast<long long>(flat));
    }
  });
  const Tensor c = v.contiguous();
  ATTN_FUZZ_CHECK(c.shape() == v.shape());
  ATTN_FUZZ_CHECK(c.is_contiguous());
  ATTN_FUZZ_CHECK(c.strides() == contiguous_strides(c.shape()));
  for (int64_t i = 0; i < c.numel(); ++i) ATTN_FUZZ_CHECK(same_bits(c.data()[i], m.vals[static_cast<size_t>(i)]));
}

// Dims and indices the bytes choose: mostly small, sometimes far out of range.
int pick_dim(ByteReader& in) { return static_cast<int>(static_cast<int8_t>(in.u8())) % 7; }  // [-6, 6]
int64_t pick_index(ByteReader& in) {
  static const int64_t kFar[] = {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                                 std::numeric_limits<int64_t>::min() + 1, int64_t{1} << 40, -(int64_t{1} << 40),
                                 int64_t{1} << 62, 1000, -1000};
  const uint8_t b = in.u8();
  if (b >= 240) return kFar[b % 8];
  return static_cast<int64_t>(static_cast<int8_t>(b)) % 8;  // [-7, 7]
}
int64_t pick_extent(ByteReader& in, bool allow_far) {
  static const int64_t kFar[] = {int64_t{1} << 40, std::numeric_limits<int64_t>::max(), int64_t{1} << 31, -5,
                                 std::numeric_limits<int64_t>::min(), int64_t{3} << 61, -2, 1 << 20};
  const uint8_t b = in.u8();
  if (allow_far && b >= 248) return kFar[b % 8];
  return static_cast<int64_t>(b % 9) - 1;  // [-1, 7]
}

struct Step {
  TensorView view;
  Model model;
};

void run(ByteReader& in) {
  // The starting tensor: rank 0-4, extents 0-4, elements 0, 1, 2, ... in memory order.
  const int rank = in.pick(5);
  Shape shape;
  std::vector<int64_t> mshape;
  for (int d = 0; d < rank; ++d) {
    const int64_t e = in.pick(5);
    shape.push_back(e);
    mshape.push_back(e);
  }
  std::deque<Tensor> owned;  // every tensor a live view may alias
  owned.emplace_back(shape);
  for (int64_t i = 0; i < owned.back().numel(); ++i) owned.back().data()[i] = static_cast<float>(i);
  Model model{mshape, owned.back().to_vector()};
  TensorView view = owned.back();
  verify(view, model, "start");

  for (int step = 0; step < 24 && in.remaining() > 0; ++step) {
    const int n = view.dim();
    const int op = in.pick(11);
    TensorView next;
    Model next_model;
    bool valid = false;     // what the model says
    bool materialise = true;  // the model can follow the result
    const char* name = "?";
    bool threw = false;
    switch (op) {
      case 0: {  // view(shape), one extent may be -1
        name = "view";
        const int r = in.pick(5);
        std::vector<int64_t> ext;
        for (int d = 0; d < r; ++d) ext.push_back(pick_extent(in, true));
        // attn's rules: contiguous input; at most one -1, other extents >= 0; the product of
        // the given extents (left to right) fits in int64; the inferred extent divides evenly;
        // the element count is unchanged.
        int infer = -1, ninfer = 0;
        bool ok = true;
        std::vector<int64_t> known_ext;
        for (int d = 0; d < r; ++d) {
          if (ext[d] == -1) {
            ++ninfer;
            infer = d;
          } else if (ext[d] < 0) {
            ok = false;
          } else {
            known_ext.push_back(ext[d]);
          }
        }
        int64_t known = 0;
        ok = ok && ninfer <= 1 && product_fits(known_ext, known);
        const int64_t total = model.numel();
        std::vector<int64_t> out = ext;
        if (ok && ninfer == 1) {
          ok = known != 0 && total % known == 0;
          if (ok) out[infer] = total / known;
        }
        int64_t out_total = 0;
        ok = ok && product_fits(out, out_total) && out_total == total;
        // Row-major strides count zero extents as 1; they must fit in int64 too.
        std::vector<int64_t> stride_ext;
        for (int64_t e : out) stride_ext.push_back(std::max<int64_t>(e, 1));
        int64_t span = 0;
        ok = ok && product_fits(stride_ext, span);
        valid = ok && view.is_contiguous();
        if (valid) next_model = Model{out, model.vals};
        threw = attn::fuzz::throws_attn_error("view", [&] { next = view.view(Shape(std::span<const int64_t>(ext))); });
        break;
      }
      case 1: {  // transpose(d0, d1)
        name = "transpose";
        const int d0 = pick_dim(in), d1 = pick_dim(in);
        int a = 0, b = 0;
        valid = wrap(d0, n, a) && wrap(d1, n, b);
        if (valid) {
          std::vector<int64_t> s = model.shape;
          if (n > 0) std::swap(s[a], s[b]);
          next_model = remap(model, s, [&](std::vector<int64_t> idx) {
            if (n > 0) std::swap(idx[a], idx[b]);
            return idx;
          });
        }
        threw = attn::fuzz::throws_attn_error("transpose", [&] { next = view.transpose(d0, d1); });
        break;
      }
      case 2: {  // t()
        name = "t";
        valid = n <= 2;
        if (valid) {
          std::vector<int64_t> s = model.shape;
          std::reverse(s.begin(), s.end());
          next_model = remap(model, s, [&](std::vector<int64_t> idx) {
            std::reverse(idx.begin(), idx.end());
            return idx;
          });
        }
        threw = attn::fuzz::throws_attn_error("t", [&] { next = view.t(); });
        break;
      }
      case 3: {  // select(dim, index)
        name = "select";
        const int d = pick_dim(in);
        const int64_t index = pick_index(in);
        int w = 0;
        valid = n > 0 && wrap(d, n, w) && index >= -model.shape[w] && index < model.shape[w];
        if (valid) {
          const int64_t i = index < 0 ? index + model.shape[w] : index;
          std::vector<int64_t> s = model.shape;
          s.erase(s.begin() + w);
          next_model = remap(model, s, [&](std::vector<int64_t> idx) {
            idx.insert(idx.begin() + w, i);
            return idx;
          });
        }
        threw = attn::fuzz::throws_attn_error("select", [&] { next = view.select(d, index); });
        break;
      }
      case 4: {  // slice(dim, start, end), Python's clamping
        name = "slice";
        const int d = pick_dim(in);
        const int64_t start = pick_index(in), end = pick_index(in);
        int w = 0;
        valid = n > 0 && wrap(d, n, w);  // PyTorch: slice() cannot be applied to a 0-dim tensor
        if (valid) {
          const int64_t len = model.shape[w];
          int64_t s0 = start < 0 ? start + len : start, e0 = end < 0 ? end + len : end;
          s0 = std::clamp<int64_t>(s0, 0, len);
          e0 = std::clamp<int64_t>(e0, s0, len);
          std::vector<int64_t> s = model.shape;
          s[w] = e0 - s0;
          next_model = remap(model, s, [&](std::vector<int64_t> idx) {
            idx[w] += s0;
            return idx;
          });
        }
        threw = attn::fuzz::throws_attn_error("slice", [&] { next = view.slice(d, start, end); });
        break;
      }
      case 5: {  // unsqueeze(dim)
        name = "unsqueeze";
        const int d = pick_dim(in);
        int w = 0;
        valid = wrap(d, n + 1, w) && n < kMaxDims;
        if (valid) {
          std::vector<int64_t> s = model.shape;
          s.insert(s.begin() + w, 1);
          next_model = Model{s, model.vals};
        }
        threw = attn::fuzz::throws_attn_error("unsqueeze", [&] { next = view.unsqueeze(d); });
        break;
      }
      case 6: {  // squeeze(dim): drops the dim only if its extent is 1
        name = "squeeze";
        const int d = pick_dim(in);
        int w = 0;
        valid = wrap(d, n, w);
        if (valid) {
          std::vector<int64_t> s = model.shape;
          if (n > 0 && s[w] == 1) s.erase(s.begin() + w);
          next_model = Model{s, model.vals};
        }
        threw = attn::fuzz::throws_attn_error("squeeze", [&] { next = view.squeeze(d); });
        break;
      }
      case 7: {  // expand(shape): PyTorch's rules (-1 keeps an existing extent)
        name = "expand";
        const int r = in.pick(5);
        std::vector<int64_t> ext;
        for (int d = 0; d < r; ++d) ext.push_back(in.u8() >= 250 ? pick_extent(in, true) : pick_extent(in, false) % 6);
        const int lead = r - n;
        bool ok = lead >= 0;
        std::vector<int64_t> out = ext;
        for (int d = 0; ok && d < r; ++d) {
          if (d < lead) {
            ok = ext[d] >= 0;  // new leading dims need an explicit, non-negative extent
          } else {
            const int64_t have = model.shape[d - lead];
            if (ext[d] == -1) out[d] = have;
            ok = out[d] == have || (have == 1 && out[d] >= 0);
          }
        }
        valid = ok;
        int64_t total = 0, span = 0;
        std::vector<int64_t> stride_ext;
        for (int64_t e : out) stride_ext.push_back(std::max<int64_t>(e, 1));
        if (valid && (!product_fits(out, total) || total > kMaxElems)) materialise = false;
        const bool unstridable = valid && !product_fits(stride_ext, span);
        if (unstridable) materialise = false;
        if (valid && materialise) {
          next_model = remap(model, out, [&](const std::vector<int64_t>& idx) {
            std::vector<int64_t> src(idx.begin() + lead, idx.end());
            for (size_t d = 0; d < src.size(); ++d) {
              if (model.shape[d] == 1) src[d] = 0;
            }
            return src;
          });
        }
        threw = attn::fuzz::throws_attn_error("expand", [&] { next = view.expand(Shape(std::span<const int64_t>(ext))); });
        if (unstridable && !threw) {
          // An empty view whose row-major strides would overflow (e.g. [2^62, 0, 4]): contiguous()
          // cannot lay it out and must say so with an attn::Error; the sequence ends here.
          ATTN_FUZZ_CHECK(attn::fuzz::throws_attn_error("contiguous", [&] { (void)next.contiguous(); }));
        }
        break;
      }
      case 8: {  // contiguous(): an owning copy
        name = "contiguous";
        valid = true;
        next_model = model;
        threw = attn::fuzz::throws_attn_error("contiguous", [&] {
          owned.push_back(view.contiguous());
          next = owned.back();
        });
        break;
      }
      case 9: {  // at(index), possibly out of range or of the wrong rank
        name = "at";
        const int r = in.u8() < 230 ? n : in.pick(5);
        std::vector<int64_t> idx;
        for (int d = 0; d < r; ++d) idx.push_back(pick_index(in));
        valid = r == n;
        for (int d = 0; valid && d < r; ++d) valid = idx[d] >= 0 && idx[d] < model.shape[d];
        float got = 0;
        threw = attn::fuzz::throws_attn_error("at", [&] { got = at_index(view, idx); });
        if (!threw && valid) {
          int64_t flat = 0;
          const std::vector<int64_t> st = strides_of(model.shape);
          for (int d = 0; d < r; ++d) flat += idx[d] * st[d];
          ATTN_FUZZ_CHECK(same_bits(got, model.vals[static_cast<size_t>(flat)]));
        }
        materialise = false;
        next = view;
        next_model = model;
        break;
      }
      default: {  // item()
        name = "item";
        valid = model.numel() == 1;
        float got = 0;
        threw = attn::fuzz::throws_attn_error("item", [&] { got = view.item(); });
        if (!threw && valid) ATTN_FUZZ_CHECK(same_bits(got, model.vals[0]));
        materialise = false;
        next = view;
        next_model = model;
        break;
      }
    }
    ATTN_FUZZ_CHECKF(threw != valid, "%s on shape %s (strides %s): the model says %s, attn %s", name,
                     view.shape().str().c_str(), view.strides().str().c_str(), valid ? "valid" : "invalid",
                     threw ? "threw" : "returned a view");
    if (!valid) continue;
    if (!materialise) {
      if (op >= 9) continue;  // at/item: the view is unchanged
      // A valid result too large to check element by element: end the sequence here.
      return;
    }
    view = next;
    model = std::move(next_model);
    verify(view, model, name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  run(in);
  return 0;
}

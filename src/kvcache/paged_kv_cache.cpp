// PagedKvCache (attn/kv_cache.hpp): one layer's pool of key/value pages, the free list and the
// block tables. Every public call checks all of its arguments (and, for an append, converts or
// quantises the new tokens into temporaries) before the first byte of the pool or of a block
// table changes, so a rejected call leaves the cache exactly as it was.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "attn/error.hpp"
#include "attn/kv_cache.hpp"
#include "core/convert.hpp"

namespace attn {

namespace {

void require_positive(int64_t v, const char* field) {
  if (v <= 0) {
    throw ValueError(fmt::format("PagedKvCache: options.{} must be positive, got {}", field, v));
  }
}

bool is_cache_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16 || d == DType::kInt8;
}

std::string shape_or_undefined(const TensorView& t) {
  return t.defined() ? t.shape().str() : "undefined";
}

// `t` must be (T, heads, dim) with T = `tokens` (or any T when tokens < 0).
void check_tokens_shape(const TensorView& t, int64_t tokens, int64_t heads, int64_t dim,
                        const char* who, const char* arg, const char* dim_name) {
  const bool ok = t.defined() && t.dim() == 3 && t.size(1) == heads && t.size(2) == dim &&
                  (tokens < 0 || t.size(0) == tokens);
  if (!ok) {
    const std::string T = tokens < 0 ? std::string("T") : std::to_string(tokens);
    throw ShapeError(fmt::format("{}: {} must have shape (T, heads_kv, {}) = ({}, {}, {}), got {}", who,
                                 arg, dim_name, T, heads, dim, shape_or_undefined(t)));
  }
}

// `t` must be the (T, heads) float32 scales of a quantised append: finite and >= 0.
void check_scales(const TensorView& t, int64_t tokens, int64_t heads, const char* who, const char* arg) {
  if (!t.defined() || t.dim() != 2 || t.size(0) != tokens || t.size(1) != heads) {
    throw ShapeError(fmt::format("{}: {} must have shape (T, heads_kv) = ({}, {}), got {}", who, arg,
                                 tokens, heads, shape_or_undefined(t)));
  }
  if (t.dtype() != DType::kFloat32) {
    throw DTypeError(fmt::format("{}: {} must be float32, got {}", who, arg, dtype_name(t.dtype())));
  }
  const float* p = t.data();
  bool bad = false;
  float first_bad = 0.0f;
  for_each_offset(t, [&](int64_t off) {
    if (!bad && !(std::isfinite(p[off]) && p[off] >= 0.0f)) bad = true, first_bad = p[off];
  });
  if (bad) {
    throw ValueError(fmt::format("{}: {} must hold finite scales >= 0 (0 for an all-zero row), got {}",
                                 who, arg, first_bad));
  }
}

// Per (token, head) symmetric int8 of x (T, H, D) float32 contiguous: scale = max|x| / 127,
// q = x / scale rounded to nearest even. ValueError naming `arg` for a NaN or an infinity.
void quantize_rows(const Tensor& x, Tensor& q, Tensor& scales, const char* who, const char* arg) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  q = Tensor::empty({T, H, D}, DType::kInt8);
  scales = Tensor::empty({T, H});
  const float* src = x.data();
  int8_t* dst = q.data_as<int8_t>();
  float* s = scales.data();
  for (int64_t r = 0; r < T * H; ++r) {
    const float* row = src + r * D;
    float amax = 0.0f;
    for (int64_t e = 0; e < D; ++e) {
      if (!std::isfinite(row[e])) {
        throw ValueError(fmt::format("{}: {} holds {} at token {}, head {}, element {}: an int8 cache "
                                     "cannot store it", who, arg, row[e], r / H, r % H, e));
      }
      amax = std::max(amax, std::fabs(row[e]));
    }
    const float scale = amax / 127.0f;
    s[r] = scale;
    for (int64_t e = 0; e < D; ++e) {
      // A subnormal max can round its scale to 0: those rows store 0 (an error below 1e-38).
      const float v = scale > 0.0f ? std::nearbyint(row[e] / scale) : 0.0f;
      dst[r * D + e] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

}  // namespace

PagedKvCache::PagedKvCache(const PagedKvCacheOptions& options) : options_(options) {
  require_positive(options_.num_pages, "num_pages");
  require_positive(options_.page_size, "page_size");
  require_positive(options_.heads_kv, "heads_kv");
  require_positive(options_.head_dim, "head_dim");
  if (options_.head_dim_v < 0) {
    throw ValueError(fmt::format("PagedKvCache: options.head_dim_v must be positive (or 0 for head_dim), "
                                 "got {}", options_.head_dim_v));
  }
  if (options_.head_dim_v == 0) options_.head_dim_v = options_.head_dim;
  if (!is_cache_dtype(options_.dtype)) {
    throw ValueError(fmt::format("PagedKvCache: options.dtype must be float32, bfloat16, float16 or int8, "
                                 "got {}", dtype_name(options_.dtype)));
  }
  const int64_t P = options_.num_pages, H = options_.heads_kv, S = options_.page_size;
  // Zero-filled: rows past a sequence's length are never read, but a pool with defined bytes
  // makes "a rejected call changes nothing" checkable byte for byte.
  keys_ = Tensor::zeros({P, H, S, options_.head_dim}, options_.dtype);
  values_ = Tensor::zeros({P, H, S, options_.head_dim_v}, options_.dtype);
  if (options_.dtype == DType::kInt8) {
    key_scales_ = Tensor::zeros({P, H, S});
    value_scales_ = Tensor::zeros({P, H, S});
  }
  // Taken from the back: a fresh pool hands out pages 0, 1, 2, ...
  free_list_.reserve(static_cast<size_t>(P));
  for (int64_t p = P - 1; p >= 0; --p) free_list_.push_back(p);
}

const PagedKvCache::Sequence& PagedKvCache::live_sequence(int64_t seq, const char* who) const {
  if (!contains(seq)) {
    const bool freed = seq >= 0 && seq < static_cast<int64_t>(seqs_.size());
    throw IndexError(fmt::format("{}: seq {} is {} ({} live sequences)", who, seq,
                                 freed ? "freed" : "not a sequence of this cache",
                                 sequences().size()));
  }
  return seqs_[static_cast<size_t>(seq)];
}

int64_t PagedKvCache::add_sequence() {
  auto it = std::find_if(seqs_.begin(), seqs_.end(), [](const Sequence& s) { return !s.live; });
  if (it == seqs_.end()) it = seqs_.insert(seqs_.end(), Sequence{});
  it->live = true;
  it->length = 0;
  it->pages.clear();
  return it - seqs_.begin();
}

int64_t PagedKvCache::pages_needed(const Sequence& s, int64_t tokens, const char* who) const {
  const int64_t P = options_.page_size;
  const int64_t needed = (s.length + tokens + P - 1) / P - static_cast<int64_t>(s.pages.size());
  if (needed > free_pages()) {
    throw ValueError(fmt::format("{}: {} more tokens at length {} needs {} more pages, {} free of {} "
                                 "(page_size {}; the pool does not grow)",
                                 who, tokens, s.length, needed, free_pages(), options_.num_pages, P));
  }
  return std::max<int64_t>(needed, 0);
}

void PagedKvCache::append(int64_t seq, const TensorView& key, const TensorView& value) {
  const char* who = "PagedKvCache.append";
  const Sequence& s = live_sequence(seq, who);
  check_tokens_shape(key, -1, options_.heads_kv, options_.head_dim, who, "key", "head_dim");
  check_tokens_shape(value, key.size(0), options_.heads_kv, options_.head_dim_v, who, "value",
                     "head_dim_v");
  for (const auto& [arg, t] : {std::pair{"key", &key}, std::pair{"value", &value}}) {
    if (!is_floating(t->dtype())) {
      throw DTypeError(fmt::format("{}: {} must be a floating dtype (float32, bfloat16, float16, "
                                   "float64), got {}", who, arg, dtype_name(t->dtype())));
    }
  }
  const int64_t T = key.size(0);
  const int64_t new_pages = pages_needed(s, T, who);
  if (options_.dtype != DType::kInt8) {
    // Tensor::to rounds to nearest even (and reads any strides).
    write_tokens(seq, new_pages, key.to(options_.dtype), value.to(options_.dtype), nullptr, nullptr);
    return;
  }
  Tensor kq, ks, vq, vs;
  quantize_rows(key.to(DType::kFloat32), kq, ks, who, "key");
  quantize_rows(value.to(DType::kFloat32), vq, vs, who, "value");
  write_tokens(seq, new_pages, kq, vq, &ks, &vs);
}

void PagedKvCache::append_quantized(int64_t seq, const TensorView& key, const TensorView& key_scale,
                                    const TensorView& value, const TensorView& value_scale) {
  const char* who = "PagedKvCache.append_quantized";
  const Sequence& s = live_sequence(seq, who);
  if (options_.dtype != DType::kInt8) {
    throw DTypeError(fmt::format("{}: the cache holds {}, not int8; use append", who,
                                 dtype_name(options_.dtype)));
  }
  check_tokens_shape(key, -1, options_.heads_kv, options_.head_dim, who, "key", "head_dim");
  const int64_t T = key.size(0);
  check_tokens_shape(value, T, options_.heads_kv, options_.head_dim_v, who, "value", "head_dim_v");
  for (const auto& [arg, t] : {std::pair{"key", &key}, std::pair{"value", &value}}) {
    if (t->dtype() != DType::kInt8) {
      throw DTypeError(fmt::format("{}: {} must be int8, got {}", who, arg, dtype_name(t->dtype())));
    }
  }
  check_scales(key_scale, T, options_.heads_kv, who, "key_scale");
  check_scales(value_scale, T, options_.heads_kv, who, "value_scale");
  const int64_t new_pages = pages_needed(s, T, who);
  const Tensor ks = key_scale.contiguous(), vs = value_scale.contiguous();
  write_tokens(seq, new_pages, key.contiguous(), value.contiguous(), &ks, &vs);
}

void PagedKvCache::write_tokens(int64_t seq, int64_t new_pages, const Tensor& key, const Tensor& value,
                                const Tensor* key_scale, const Tensor* value_scale) {
  // Nothing below can fail but the block table's growth: reserve it first.
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  s.pages.reserve(s.pages.size() + static_cast<size_t>(new_pages));
  for (int64_t i = 0; i < new_pages; ++i) {
    s.pages.push_back(free_list_.back());
    free_list_.pop_back();
  }
  const int64_t T = key.size(0), H = options_.heads_kv, P = options_.page_size;
  const int64_t kbytes = options_.head_dim * keys_.element_size();
  const int64_t vbytes = options_.head_dim_v * values_.element_size();
  auto* kdst = static_cast<uint8_t*>(keys_.raw_data());
  auto* vdst = static_cast<uint8_t*>(values_.raw_data());
  const auto* ksrc = static_cast<const uint8_t*>(key.raw_data());
  const auto* vsrc = static_cast<const uint8_t*>(value.raw_data());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = s.length + t;
    const int64_t page = s.pages[static_cast<size_t>(pos / P)], row = pos % P;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t slot = (page * H + h) * P + row;  // (page, head, row) in the pool
      std::memcpy(kdst + slot * kbytes, ksrc + (t * H + h) * kbytes, static_cast<size_t>(kbytes));
      std::memcpy(vdst + slot * vbytes, vsrc + (t * H + h) * vbytes, static_cast<size_t>(vbytes));
      if (key_scale != nullptr) {
        key_scales_.data()[slot] = key_scale->data()[t * H + h];
        value_scales_.data()[slot] = value_scale->data()[t * H + h];
      }
    }
  }
  s.length += T;
}

void PagedKvCache::free_sequence(int64_t seq) {
  live_sequence(seq, "PagedKvCache.free_sequence");
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  // Back in reverse, so that the next sequence takes them in this one's order.
  free_list_.insert(free_list_.end(), s.pages.rbegin(), s.pages.rend());
  s = Sequence{};
}

int64_t PagedKvCache::length(int64_t seq) const {
  return live_sequence(seq, "PagedKvCache.length").length;
}

std::span<const int64_t> PagedKvCache::block_table(int64_t seq) const {
  return live_sequence(seq, "PagedKvCache.block_table").pages;
}

std::vector<int64_t> PagedKvCache::sequences() const {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < seqs_.size(); ++i) {
    if (seqs_[i].live) ids.push_back(static_cast<int64_t>(i));
  }
  return ids;
}

bool PagedKvCache::contains(int64_t seq) const {
  return seq >= 0 && seq < static_cast<int64_t>(seqs_.size()) && seqs_[static_cast<size_t>(seq)].live;
}

int64_t PagedKvCache::free_pages() const { return static_cast<int64_t>(free_list_.size()); }

Tensor PagedKvCache::gather(int64_t seq, bool values, const char* who) const {
  const Sequence& s = live_sequence(seq, who);
  const Tensor& pool = values ? values_ : keys_;
  const Tensor& scales = values ? value_scales_ : key_scales_;
  const int64_t H = options_.heads_kv, P = options_.page_size, D = pool.size(3);
  Tensor out({H, s.length, D});
  const auto* src = static_cast<const uint8_t*>(pool.raw_data());
  const int64_t row_bytes = D * pool.element_size();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < s.length; ++t) {
      const int64_t slot = (s.pages[static_cast<size_t>(t / P)] * H + h) * P + t % P;
      float* dst = out.data() + (h * s.length + t) * D;
      if (options_.dtype == DType::kInt8) {
        const auto* q = reinterpret_cast<const int8_t*>(src + slot * row_bytes);
        const float scale = scales.data()[slot];
        for (int64_t e = 0; e < D; ++e) dst[e] = scale * static_cast<float>(q[e]);
      } else {
        detail::convert_elements(src + slot * row_bytes, options_.dtype, dst, DType::kFloat32, D);
      }
    }
  }
  return out;
}

Tensor PagedKvCache::gather_keys(int64_t seq) const { return gather(seq, false, "PagedKvCache.gather_keys"); }
Tensor PagedKvCache::gather_values(int64_t seq) const {
  return gather(seq, true, "PagedKvCache.gather_values");
}

}  // namespace attn

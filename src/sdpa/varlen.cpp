// attn::varlen_attn and its backward (attn/varlen.hpp): packed variable-length sequences.
//
// Every sequence n is its own scaled_dot_product_attention problem over views into the
// token-major tensors, (1, H, L_n, E) with strides (-, E, H * E, 1) for a contiguous query: no
// copy of the inputs and no padding. The whole call is planned first (the cumulative lengths
// read, every sequence's problem validated by check_sdpa and its kernel chosen by the registry,
// as scaled_dot_product_attention would for that sequence alone), so a rejected call computes
// nothing. Then the sequences run one after another, each kernel on all threads, and their
// outputs are copied into the token-major result. SdpaProblem::bh_base = n * H gives sequence n
// the Philox counters of batch element n of the padded (N, H, max_q, max_k) call.
#include "attn/varlen.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <fmt/format.h>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <omp.h>

#include "attn/error.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/registry.hpp"

namespace attn {

namespace {

constexpr const char* kForward = "varlen_attn";
constexpr const char* kBackward = "varlen_attn_backward";

// An error of check_sdpa or the registry, reworded for a varlen caller: its own prefix
// ("scaled_dot_product_attention: ", "varlen_attn: ") replaced by `who` and the sequence it came
// from, the type kept.
std::string reword(std::string_view message, std::string_view who, const std::string& where) {
  for (std::string_view prefix : {std::string_view("scaled_dot_product_attention_backward: "),
                                  std::string_view("scaled_dot_product_attention: ")}) {
    if (message.starts_with(prefix)) {
      message.remove_prefix(prefix.size());
      break;
    }
  }
  if (message.starts_with(who) && message.substr(who.size()).starts_with(": ")) {
    message.remove_prefix(who.size() + 2);
  }
  return where.empty() ? fmt::format("{}: {}", who, message)
                       : fmt::format("{}: {}: {}", who, where, message);
}

// Called from a catch block: rethrows the current attn::Error, reworded, with its type.
[[noreturn]] void rethrow_reworded(std::string_view who, const std::string& where) {
  try {
    throw;
  } catch (const ShapeError& e) {
    throw ShapeError(reword(e.what(), who, where));
  } catch (const DTypeError& e) {
    throw DTypeError(reword(e.what(), who, where));
  } catch (const IndexError& e) {
    throw IndexError(reword(e.what(), who, where));
  } catch (const ValueError& e) {
    throw ValueError(reword(e.what(), who, where));
  }
}

// One packed sequence: its query rows [q0, q0 + L) and key rows [k0, k0 + S).
struct Sequence {
  int64_t q0, L, k0, S;
};

// A validated varlen call: shapes, sequences, and for every sequence with queries and keys its
// problem and kernel (kernel == nullptr: nothing to compute).
struct VarlenPlan {
  int64_t N = 0, H = 0, H_kv = 0, E = 0, Ev = 0, total_q = 0, total_k = 0;
  std::vector<Sequence> seqs;
  std::vector<detail::SdpaProblem> problems;
  std::vector<const detail::SdpaKernel*> kernels;
};

// The cumulative lengths `t` (named `name`) as int64, checked: int32, 1-D, at least one entry,
// starting at 0, non-decreasing, ending at `total` (the size of `of`'s dim 0).
std::vector<int64_t> read_cu_seq(const TensorView& t, const char* name, const char* of,
                                 int64_t total, const char* who) {
  if (!t.defined()) throw ValueError(fmt::format("{}: {} is undefined", who, name));
  if (t.dtype() != DType::kInt32) {
    throw DTypeError(fmt::format("{}: {} must be int32 (cumulative sequence lengths), got {}", who,
                                 name, dtype_name(t.dtype())));
  }
  if (t.dim() != 1 || t.size(0) < 1) {
    throw ShapeError(fmt::format("{}: {} must be 1-D with N + 1 >= 1 cumulative lengths, got shape {}",
                                 who, name, t.shape().str()));
  }
  const int32_t* d = t.data_as<int32_t>();
  std::vector<int64_t> cu(static_cast<size_t>(t.size(0)));
  for (int64_t i = 0; i < t.size(0); ++i) cu[static_cast<size_t>(i)] = d[i * t.stride(0)];
  if (cu[0] != 0) throw ValueError(fmt::format("{}: {}[0] must be 0, got {}", who, name, cu[0]));
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      throw ValueError(fmt::format("{}: {} must be non-decreasing, got {}[{}] = {} < {}[{}] = {}", who,
                                   name, name, i, cu[i], name, i - 1, cu[i - 1]));
    }
  }
  if (cu.back() != total) {
    throw ValueError(fmt::format("{}: {}[N] must equal {}.size(0) = {} (the total token count), got "
                                 "{}[{}] = {}", who, name, of, total, name, cu.size() - 1, cu.back()));
  }
  return cu;
}

// The (1, H, rows, X) view of rows [row0, row0 + rows) of a token-major (total, H, X) tensor.
TensorView sequence_view(const TensorView& t, int64_t row0, int64_t rows) {
  return t.slice(0, row0, row0 + rows).transpose(0, 1).unsqueeze(0);
}

VarlenPlan make_plan(const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& cu_seq_q, const TensorView& cu_seq_k, int64_t max_q,
                     int64_t max_k, const SdpaOptions& o, const char* who) {
  if (o.query_pos_offset != 0 || o.key_pos_offset != 0) {
    throw ValueError(fmt::format("{}: query_pos_offset and key_pos_offset must be 0 (each sequence "
                                 "starts at position 0), got {} and {}", who, o.query_pos_offset,
                                 o.key_pos_offset));
  }
  const char* names[3] = {"query", "key", "value"};
  const char* layouts[3] = {"(total_q, H, E)", "(total_k, H_kv, E)", "(total_k, H_kv, Ev)"};
  const TensorView* ts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (!ts[i]->defined()) throw ValueError(fmt::format("{}: {} is undefined", who, names[i]));
    if (ts[i]->dim() != 3) {
      throw ShapeError(fmt::format("{}: {} must have 3 dims {} (tokens packed along dim 0), got shape {}",
                                   who, names[i], layouts[i], ts[i]->shape().str()));
    }
    if (ts[i]->size(1) == 0 || ts[i]->size(2) == 0) {
      throw ShapeError(fmt::format("{}: {} must have at least one head and a nonzero embed dim, got "
                                   "shape {}", who, names[i], ts[i]->shape().str()));
    }
  }
  VarlenPlan plan;
  plan.total_q = q.size(0), plan.H = q.size(1), plan.E = q.size(2);
  plan.total_k = k.size(0), plan.H_kv = k.size(1), plan.Ev = v.size(2);
  if (v.size(0) != plan.total_k || v.size(1) != plan.H_kv) {
    throw ShapeError(fmt::format("{}: key and value must have the same tokens and heads (dims 0, 1), "
                                 "got key {}, value {}", who, k.shape().str(), v.shape().str()));
  }
  if (k.size(2) != plan.E) {
    throw ShapeError(fmt::format("{}: key's embed dim must equal query's ({}), got key {} (query {})",
                                 who, plan.E, k.shape().str(), q.shape().str()));
  }
  if (!o.enable_gqa && plan.H_kv != plan.H) {
    throw ShapeError(fmt::format("{}: key and value must have query's {} heads (dim 1) without "
                                 "enable_gqa, got query {}, key {}", who, plan.H, q.shape().str(),
                                 k.shape().str()));
  }
  if (o.enable_gqa && plan.H % plan.H_kv != 0) {
    throw ShapeError(fmt::format("{}: with enable_gqa, query's number of heads ({}) must be a "
                                 "multiple of key/value's ({}); got query {}, key {}", who, plan.H,
                                 plan.H_kv, q.shape().str(), k.shape().str()));
  }
  if (o.attn_mask) {
    throw ValueError(fmt::format("{}: attn_mask is not supported (each sequence attends within "
                                 "itself; use is_causal or window_size)", who));
  }
  if (o.need_weights) {
    throw ValueError(fmt::format("{}: need_weights is not supported (the weights of packed "
                                 "sequences are ragged); run scaled_dot_product_attention per "
                                 "sequence for them", who));
  }
  if (o.dropout_p > 0.0f && o.dropout_rng == DropoutRng::kTorch) {
    throw ValueError(fmt::format("{}: dropout needs dropout_rng = DropoutRng::kPhilox (the mask of "
                                 "sequence n is that of batch element n of the padded call), got "
                                 "DropoutRng::kTorch with dropout_p = {}", who, o.dropout_p));
  }
  if (o.alibi_slopes && o.alibi_slopes->defined() && !(o.alibi_slopes->shape() == Shape{plan.H})) {
    throw ShapeError(fmt::format("{}: alibi_slopes must have shape {} (one slope per query head), got {}",
                                 who, Shape{plan.H}.str(), o.alibi_slopes->shape().str()));
  }
  const std::vector<int64_t> cq = read_cu_seq(cu_seq_q, "cu_seq_q", "query", plan.total_q, who);
  const std::vector<int64_t> ck = read_cu_seq(cu_seq_k, "cu_seq_k", "key", plan.total_k, who);
  if (cq.size() != ck.size()) {
    throw ShapeError(fmt::format("{}: cu_seq_q and cu_seq_k must both hold N + 1 entries, got "
                                 "cu_seq_q {}, cu_seq_k {}", who, cu_seq_q.shape().str(),
                                 cu_seq_k.shape().str()));
  }
  plan.N = static_cast<int64_t>(cq.size()) - 1;
  for (int64_t n = 0; n < plan.N; ++n) {
    const size_t i = static_cast<size_t>(n);
    plan.seqs.push_back({cq[i], cq[i + 1] - cq[i], ck[i], ck[i + 1] - ck[i]});
  }
  const char* max_names[2] = {"max_q", "max_k"};
  const int64_t maxes[2] = {max_q, max_k};
  for (int m = 0; m < 2; ++m) {
    if (maxes[m] < 0) throw ValueError(fmt::format("{}: {} must be >= 0, got {}", who, max_names[m], maxes[m]));
    for (int64_t n = 0; n < plan.N; ++n) {
      const Sequence& s = plan.seqs[static_cast<size_t>(n)];
      const int64_t len = m == 0 ? s.L : s.S;
      if (len > maxes[m]) {
        throw ValueError(fmt::format("{}: {} = {} is smaller than sequence {}'s {} length {} ({}[{}] - {}[{}])",
                                     who, max_names[m], maxes[m], n, m == 0 ? "query" : "key", len,
                                     m == 0 ? "cu_seq_q" : "cu_seq_k", n + 1,
                                     m == 0 ? "cu_seq_q" : "cu_seq_k", n));
      }
    }
  }

  // The options and dtypes, once, on a one-token probe: a batch whose sequences are all empty
  // is checked like any other.
  try {
    const Tensor pq = Tensor::zeros({1, plan.H, 1, plan.E}, q.dtype());
    const Tensor pk = Tensor::zeros({1, plan.H_kv, 1, plan.E}, k.dtype());
    const Tensor pv = Tensor::zeros({1, plan.H_kv, 1, plan.Ev}, v.dtype());
    (void)detail::select_sdpa_kernel(detail::check_sdpa(pq, pk, pv, o), o, who);
  } catch (const Error&) {
    rethrow_reworded(who, "");
  }
  plan.problems.resize(static_cast<size_t>(plan.N));
  plan.kernels.assign(static_cast<size_t>(plan.N), nullptr);
  for (int64_t n = 0; n < plan.N; ++n) {
    const size_t i = static_cast<size_t>(n);
    const Sequence& s = plan.seqs[i];
    if (s.L == 0 || s.S == 0) continue;
    try {
      detail::SdpaProblem p = detail::check_sdpa(sequence_view(q, s.q0, s.L), sequence_view(k, s.k0, s.S),
                                                 sequence_view(v, s.k0, s.S), o);
      p.bh_base = n * plan.H;
      plan.kernels[i] = &detail::select_sdpa_kernel(p, o, who);
      plan.problems[i] = std::move(p);
    } catch (const Error&) {
      rethrow_reworded(who, fmt::format("sequence {} (L = {}, S = {})", n, s.L, s.S));
    }
  }
  return plan;
}

// `t` contiguous in `dtype`: itself, or a converted copy kept in `owned`.
TensorView contiguous_as(const Tensor& t, DType dtype, Tensor& owned) {
  if (t.dtype() != dtype) return owned = t.to(dtype);
  if (!t.is_contiguous()) return owned = t.contiguous();
  return t;
}

// Copies a (1, H, rows, X) block into rows [row0, row0 + rows) of the contiguous token-major
// (total, H, X) tensor `dst`.
// Rows on `threads` threads: a serial copy of every sequence's output was ~4 % of a causal call.
void scatter_rows(const Tensor& block, Tensor& dst, int64_t row0, int threads) {
  Tensor owned;
  const TensorView src = contiguous_as(block, dst.dtype(), owned);
  const int64_t H = src.size(1), rows = src.size(2), X = src.size(3), es = src.element_size();
  const auto* from = static_cast<const std::byte*>(src.raw_data());
  auto* to = static_cast<std::byte*>(dst.raw_data());
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (H * rows * X > 65536)
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(to + ((row0 + r) * H + h) * X * es, from + (h * rows + r) * X * es,
                  static_cast<size_t>(X * es));
    }
  }
}

// Zeroes rows [row0, row0 + rows) of a contiguous token-major tensor.
void zero_rows(Tensor& t, int64_t row0, int64_t rows) {
  const int64_t row_bytes = t.numel() / std::max<int64_t>(1, t.size(0)) * t.element_size();
  std::memset(static_cast<std::byte*>(t.raw_data()) + row0 * row_bytes, 0, static_cast<size_t>(rows * row_bytes));
}

// Copies a (1, H, rows) LSE block into columns [col0, col0 + rows) of the (H, total_q) `lse`.
void scatter_lse(const Tensor& block, Tensor& lse, int64_t col0) {
  Tensor owned;
  const TensorView src = contiguous_as(block, lse.dtype(), owned);
  const int64_t H = src.size(1), rows = src.size(2), total = lse.size(1), es = lse.element_size();
  for (int64_t h = 0; h < H; ++h) {
    std::memcpy(static_cast<std::byte*>(lse.raw_data()) + (h * total + col0) * es,
                static_cast<const std::byte*>(src.raw_data()) + h * rows * es,
                static_cast<size_t>(rows * es));
  }
}

// The LSE of a row that sees no key: -inf, or the head's sink logit.
template <typename T>
void fill_lse(Tensor& lse, const SdpaOptions& o) {
  T* d = lse.data_as<T>();
  const int64_t H = lse.size(0), total = lse.size(1);
  for (int64_t h = 0; h < H; ++h) {
    const T value = o.sinks ? static_cast<T>(o.sinks->data()[h * o.sinks->stride(0)])
                            : -std::numeric_limits<T>::infinity();
    for (int64_t t = 0; t < total; ++t) d[h * total + t] = value;
  }
}

DType lse_dtype(DType input) { return input == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

// The backward's extra arguments against the plan: grad_output and forward.output of shape
// (total_q, H, Ev) in query's dtype, forward.lse of shape (H, total_q).
void check_backward(const TensorView& grad_output, const SdpaSaved& forward, const TensorView& q,
                    const VarlenPlan& plan) {
  const Shape out{plan.total_q, plan.H, plan.Ev}, lse{plan.H, plan.total_q};
  struct Arg {
    const TensorView* t;
    const char* name;
    const Shape* shape;
    DType dtype;
    const char* hint;
  };
  const Arg args[3] = {
      {&grad_output, "grad_output", &out, q.dtype(), ""},
      {&forward.output, "forward.output", &out, q.dtype(), " (pass the forward's SdpaResult)"},
      {&forward.lse, "forward.lse", &lse, lse_dtype(q.dtype()), " (run the forward with need_lse = true)"},
  };
  for (const Arg& a : args) {
    if (!a.t->defined()) throw ValueError(fmt::format("{}: {} is undefined{}", kBackward, a.name, a.hint));
    if (!(a.t->shape() == *a.shape)) {
      throw ShapeError(fmt::format("{}: {} must have shape {} (the forward's), got {}", kBackward,
                                   a.name, a.shape->str(), a.t->shape().str()));
    }
    if (a.t->dtype() != a.dtype) {
      throw DTypeError(fmt::format("{}: {} must be {} (the forward's), got {}", kBackward, a.name,
                                   dtype_name(a.dtype), dtype_name(a.t->dtype())));
    }
  }
  const TensorView& res = forward.output_residual;
  if (!res.defined()) return;
  if (!is_sixteen_bit_float(q.dtype())) {
    throw ValueError(fmt::format("{}: forward.output_residual is for bfloat16 and float16 calls, got "
                                 "one for a {} call: leave it undefined", kBackward, dtype_name(q.dtype())));
  }
  if (!(res.shape() == out)) {
    throw ShapeError(fmt::format("{}: forward.output_residual must have shape {} (the forward's), got {}",
                                 kBackward, out.str(), res.shape().str()));
  }
  if (res.dtype() != q.dtype()) {
    throw DTypeError(fmt::format("{}: forward.output_residual must be {} (the output's), got {}", kBackward,
                                 dtype_name(q.dtype()), dtype_name(res.dtype())));
  }
}

}  // namespace

SdpaResult varlen_attn(const TensorView& query, const TensorView& key, const TensorView& value,
                       const TensorView& cu_seq_q, const TensorView& cu_seq_k, int64_t max_q,
                       int64_t max_k, const SdpaOptions& options) {
  const VarlenPlan plan = make_plan(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, options, kForward);
  SdpaResult result;
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  result.output = Tensor::empty({plan.total_q, plan.H, plan.Ev}, query.dtype());
  const bool residual = options.need_output_residual && is_sixteen_bit_float(query.dtype());
  if (residual) result.output_residual = Tensor::empty(result.output.shape(), query.dtype());
  for (size_t i = 0; i < plan.seqs.size(); ++i) {  // rows no kernel writes: sequences without keys
    if (plan.kernels[i] != nullptr) continue;
    zero_rows(result.output, plan.seqs[i].q0, plan.seqs[i].L);
    if (residual) zero_rows(result.output_residual, plan.seqs[i].q0, plan.seqs[i].L);
  }
  if (options.need_lse) {
    result.lse = Tensor::empty({plan.H, plan.total_q}, lse_dtype(query.dtype()));
    if (result.lse.dtype() == DType::kFloat64) {
      fill_lse<double>(result.lse, options);
    } else {
      fill_lse<float>(result.lse, options);
    }
  }
  for (int64_t n = 0; n < plan.N; ++n) {
    const size_t i = static_cast<size_t>(n);
    if (plan.kernels[i] == nullptr) continue;
    const Sequence& s = plan.seqs[i];
    const SdpaResult r = plan.kernels[i]->forward(sequence_view(query, s.q0, s.L), sequence_view(key, s.k0, s.S),
                                                  sequence_view(value, s.k0, s.S), options, plan.problems[i]);
    scatter_rows(r.output, result.output, s.q0, threads);
    if (residual) scatter_rows(r.output_residual, result.output_residual, s.q0, threads);
    if (options.need_lse) scatter_lse(r.lse, result.lse, s.q0);
  }
  return result;
}

SdpaGrads varlen_attn_backward(const TensorView& grad_output, const TensorView& query,
                               const TensorView& key, const TensorView& value,
                               const TensorView& cu_seq_q, const TensorView& cu_seq_k,
                               int64_t max_q, int64_t max_k, const SdpaSaved& forward,
                               const SdpaOptions& options) {
  const VarlenPlan plan = make_plan(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, options, kBackward);
  check_backward(grad_output, forward, query, plan);
  SdpaGrads g;
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  // Every row is written once: by its sequence's scatter, or zeroed below when the sequence has no
  // queries or no keys. A whole-tensor memset first cost a serial pass over fresh pages.
  g.grad_query = Tensor::empty(query.shape(), query.dtype());
  g.grad_key = Tensor::empty(key.shape(), key.dtype());
  g.grad_value = Tensor::empty(value.shape(), value.dtype());
  for (int64_t n = 0; n < plan.N; ++n) {
    const size_t i = static_cast<size_t>(n);
    if (plan.kernels[i] != nullptr) continue;
    const Sequence& s = plan.seqs[i];
    zero_rows(g.grad_query, s.q0, s.L);
    zero_rows(g.grad_key, s.k0, s.S);
    zero_rows(g.grad_value, s.k0, s.S);
  }
  std::vector<double> dsinks(options.sinks ? static_cast<size_t>(plan.H) : 0, 0.0);
  for (int64_t n = 0; n < plan.N; ++n) {
    const size_t i = static_cast<size_t>(n);
    if (plan.kernels[i] == nullptr) continue;
    const Sequence& s = plan.seqs[i];
    // The saved output is read in place (the kernels take any row stride); the LSE, a few KiB,
    // is gathered.
    SdpaSaved fwd;
    fwd.output = sequence_view(forward.output, s.q0, s.L);
    if (forward.output_residual.defined()) fwd.output_residual = sequence_view(forward.output_residual, s.q0, s.L);
    Tensor lse = forward.lse.slice(1, s.q0, s.q0 + s.L).unsqueeze(0).contiguous();
    fwd.lse = lse;
    const SdpaGrads sg = plan.kernels[i]->backward(
        sequence_view(grad_output, s.q0, s.L), sequence_view(query, s.q0, s.L),
        sequence_view(key, s.k0, s.S), sequence_view(value, s.k0, s.S), fwd, options, plan.problems[i]);
    scatter_rows(sg.grad_query, g.grad_query, s.q0, threads);
    scatter_rows(sg.grad_key, g.grad_key, s.k0, threads);
    scatter_rows(sg.grad_value, g.grad_value, s.k0, threads);
    if (!dsinks.empty()) {
      const std::vector<double> d = sg.grad_sinks.to_double_vector();
      for (size_t h = 0; h < dsinks.size(); ++h) dsinks[h] += d[h];
    }
  }
  if (!dsinks.empty()) {
    const DType dt = lse_dtype(query.dtype());
    g.grad_sinks = Tensor::empty({plan.H}, dt);
    for (int64_t h = 0; h < plan.H; ++h) {
      if (dt == DType::kFloat64) {
        g.grad_sinks.data_as<double>()[h] = dsinks[static_cast<size_t>(h)];
      } else {
        g.grad_sinks.data()[h] = static_cast<float>(dsinks[static_cast<size_t>(h)]);
      }
    }
  }
  return g;
}

}  // namespace attn

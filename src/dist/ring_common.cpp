#include "dist/ring_common.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <fmt/format.h>

#include "sdpa/problem.hpp"

namespace attn::dist::detail {

std::vector<Piece> pieces(int64_t length, int world, int rank, Layout layout) {
  std::vector<Piece> out;
  int64_t row = 0;
  for (const auto& [b, e] : shard_ranges(length, world, rank, layout)) {
    out.push_back({b, e, row});
    row += e - b;
  }
  return out;
}

int64_t rows_of(int64_t length, int world, int rank, Layout layout) {
  int64_t n = 0;
  for (const auto& [b, e] : shard_ranges(length, world, rank, layout)) n += e - b;
  return n;
}

bool band_visible(const Piece& q, const Piece& k, const SdpaOptions& o, int64_t length) {
  if (q.begin == q.end || k.begin == k.end) return false;
  // Key j is visible from query i iff i - left <= j <= i + right (right clipped at 0 by
  // is_causal); sides beyond the sequence are unbounded, and clamping them avoids overflow.
  int64_t right = o.window_size.right >= 0 ? std::min(o.window_size.right, length) : length;
  if (o.is_causal) right = std::min<int64_t>(right, 0);
  const int64_t left = o.window_size.left >= 0 ? std::min(o.window_size.left, length) : length;
  return k.begin <= (q.end - 1) + right && k.end - 1 >= q.begin - left;
}

SdpaOptions block_options(const SdpaOptions& o, const Piece& q, const Piece& k) {
  SdpaOptions b = o;
  b.sinks.reset();
  b.need_lse = true;
  b.need_weights = false;
  b.need_output_residual = false;
  b.causal_alignment = CausalAlignment::kTopLeft;
  b.query_pos_offset = q.begin;
  b.key_pos_offset = k.begin;
  return b;
}

namespace {
std::string shape_without_rows(const TensorView& t) {
  std::string s = "(";
  for (int d = 0; d < t.dim(); ++d) {
    s += d == t.dim() - 2 ? std::string("L") : std::to_string(t.size(d));
    if (d + 1 < t.dim()) s += ", ";
  }
  return s + ")";
}

// FNV-1a of a float32 head parameter's values: ranks must agree on them, not only their shape.
uint64_t values_hash(const std::optional<TensorView>& t) {
  if (!t) return 0;
  uint64_t h = 1469598103934665603ull;
  const Tensor c = t->contiguous();
  const auto* p = static_cast<const unsigned char*>(c.raw_data());
  for (int64_t i = 0; i < c.numel() * c.element_size(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
}  // namespace

Agreement check_ring_args(const TensorView& q, const TensorView& k, const TensorView& v,
                          const SdpaOptions& o, const RingOptions& ring, const char* who) {
  const TensorView* ts[3] = {&q, &k, &v};
  const char* names[3] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    if (!ts[i]->defined() || ts[i]->dim() < 2) {
      throw ShapeError(fmt::format("{}: {} must be a tensor of at least 2 dims (..., L_r, E), the sequence on dim -2",
                                   who, names[i]));
    }
  }
  if (o.attn_mask) {
    throw ValueError(fmt::format("{}: attn_mask is not supported (its keys are spread over the ranks); use "
                                 "is_causal, window_size or alibi_slopes", who));
  }
  if (o.need_weights) throw ValueError(fmt::format("{}: need_weights is not supported (the L x L weights are what context parallelism avoids)", who));
  if (o.need_output_residual) {
    throw ValueError(fmt::format("{}: need_output_residual is not supported (the merged output's residual is "
                                 "not formed; the backward re-derives D per block)", who));
  }
  if (o.dropout_p > 0.0f && o.dropout_rng != DropoutRng::kPhilox) {
    throw ValueError(fmt::format("{}: dropout needs dropout_rng = DropoutRng::kPhilox (keyed by global position; "
                                 "kTorch's stream depends on the call's layout), got kTorch", who));
  }
  if (o.query_pos_offset != 0 || o.key_pos_offset != 0) {
    throw ValueError(fmt::format("{}: query_pos_offset and key_pos_offset must be 0 (the ring sets each block's), "
                                 "got {} and {}", who, o.query_pos_offset, o.key_pos_offset));
  }
  if (q.dtype() == DType::kFloat64) {
    throw DTypeError(fmt::format("{}: query, key and value must be float32, bfloat16 or float16, got float64", who));
  }
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    // (A single call takes float32 queries with 16-bit keys for decoding; a ring's blocks are not
    // all decode-sized, so their kernels would refuse some of them midway.)
    throw DTypeError(fmt::format("{}: query, key and value must share one dtype, got {}, {} and {}", who,
                                 dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype())));
  }
  if (ring.progress_rows < 1) throw ValueError(fmt::format("{}: progress_rows must be >= 1, got {}", who, ring.progress_rows));
  // Everything else as scaled_dot_product_attention checks it, on this rank's rows (a rank with
  // no rows, when L < 2P, has nothing to check: the signature still compares its other dims).
  if (q.size(-2) > 0) (void)::attn::detail::check_sdpa(q, k, v, o);
  // A named kernel must take the blocks too (a decode kernel refuses pieces of more than 16
  // rows): asked here, so that a refusal is every rank's error and not one rank's, midway.
  if (q.size(-2) > 0 && k.size(-2) > 0 && !o.kernel.empty()) {
    Piece first{0, std::min(ring.progress_rows, q.size(-2)), 0}, keys{0, k.size(-2), 0};
    (void)sdpa_kernel_name(q.slice(-2, 0, first.end), k, v, block_options(o, first, keys));
  }
  Agreement a;
  a.len_q = q.size(-2);
  a.len_k = k.size(-2);
  a.signature = fmt::format(
      "query {} {}, key {} {}, value {} {}, is_causal {}, alignment {}, scale {}, enable_gqa {}, dropout_p {} "
      "seed {} offset {}, window ({}, {}), softcap {}, alibi_slopes {:x}, sinks {:x}, need_lse {}, kernel '{}', "
      "backend {}, layout {}",
      shape_without_rows(q), dtype_name(q.dtype()), shape_without_rows(k), dtype_name(k.dtype()),
      shape_without_rows(v), dtype_name(v.dtype()), o.is_causal, static_cast<int>(o.causal_alignment),
      o.scale ? fmt::format("{}", *o.scale) : "default", o.enable_gqa, o.dropout_p, o.dropout_seed,
      o.dropout_offset, o.window_size.left, o.window_size.right, o.softcap ? *o.softcap : 0.0,
      values_hash(o.alibi_slopes), values_hash(o.sinks), o.need_lse, o.kernel, static_cast<int>(o.backend),
      ring.layout == Layout::kZigzag ? "zigzag" : "contiguous");
  return a;
}

std::string check_ring_backward_args(const TensorView& dout, const SdpaSaved& fwd, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const SdpaOptions& o, const char* who) {
  const std::pair<const TensorView*, const char*> ts[] = {{&dout, "grad_output"}, {&fwd.output, "forward.output"},
                                                          {&fwd.lse, "forward.lse"}};
  for (const auto& [t, name] : ts) {
    if (!t->defined() || t->dim() < (t == &fwd.lse ? 1 : 2)) {
      throw ShapeError(fmt::format("{}: {} must be this rank's rows of the forward's (run the forward with need_lse)", who, name));
    }
  }
  if (q.size(-2) > 0) {
    const ::attn::detail::SdpaProblem p = ::attn::detail::check_sdpa(q, k, v, o);
    ::attn::detail::check_sdpa_backward(dout, fwd, o, p);
  }
  // What a rank without rows cannot check itself: the others compare it.
  return fmt::format(", grad_output {} {}, forward.output {} {}, forward.lse {} dims {}", shape_without_rows(dout),
                     dtype_name(dout.dtype()), shape_without_rows(fwd.output), dtype_name(fwd.output.dtype()),
                     fwd.lse.dim(), dtype_name(fwd.lse.dtype()));
}

Tensor sinks_grad(const Comm& comm, const TensorView& dout, const SdpaSaved& fwd, const TensorView& sinks) {
  const int64_t H = sinks.size(0), N = dout.size(-2), X = dout.size(-1);
  const Tensor d = dout.to(DType::kFloat32), o = fwd.output.to(DType::kFloat32), lse = fwd.lse.contiguous();
  std::vector<double> g(static_cast<size_t>(H), 0.0);
  const int64_t lead = N == 0 ? 0 : lse.numel() / N;
  for (int64_t b = 0; b < lead; ++b) {
    const double s = sinks.data()[(b % H) * sinks.stride(0)];
    for (int64_t i = 0; i < N; ++i) {
      double delta = 0;
      for (int64_t x = 0; x < X; ++x) delta += static_cast<double>(d.data()[(b * N + i) * X + x]) * o.data()[(b * N + i) * X + x];
      g[static_cast<size_t>(b % H)] -= std::exp(s - lse.data()[b * N + i]) * delta;
    }
  }
  std::vector<double> sum(g.size());
  std::vector<MPI_Request> reqs(1);
  check_mpi(MPI_Iallreduce(g.data(), sum.data(), static_cast<int>(H), MPI_DOUBLE, MPI_SUM, comm.get(), &reqs[0]),
            comm.who(), "MPI_Iallreduce");
  comm.wait(reqs, "every rank's d(sinks)");
  Tensor out = Tensor::empty({H});
  for (int64_t h = 0; h < H; ++h) out.data()[h] = static_cast<float>(sum[static_cast<size_t>(h)]);
  return out;
}

}  // namespace attn::dist::detail

// Ulysses attention (DeepSpeed-Ulysses head parallelism) over MPI, forward and backward.
//
// Shapes per rank r of P: q (..., H, L_r, E), k and v (..., H_kv, L_r, E / Ev), the rows of
// shard_ranges(L, P, r, layout). One all-to-all per tensor turns them into (..., H/P, L, E):
// rank p receives every rank's rows of heads [p H/P, (p+1) H/P) (and H_kv/P key/value heads:
// query head h reads key head h / (H / H_kv), which stays on the same rank) and lays them out in
// global token order. One local SDPA over the whole sequence, then one all-to-all returns the
// output (and LSE) rows to their owners. The backward sends dO, q, k, v, O and the LSE to heads
// and dQ, dK, dV back.
//
// Traffic per rank: each all-to-all moves (P-1)/P of the rank's tensor, once: forward
// (q + k + v + o), where the ring moves K/V (P-1) times but behind the compute. Nothing here
// overlaps the compute. Needs H and H_kv divisible by P. Dropout is refused: its Philox mask is
// keyed by the flat batch*head index, which head sharding changes.
#include <algorithm>
#include <cstring>
#include <vector>
#include <fmt/format.h>

#include "attn/dist.hpp"
#include "dist/comm.hpp"
#include "dist/ring_common.hpp"
#include "dist/rows.hpp"

namespace attn::dist {

using detail::Comm;

namespace {

constexpr const char* kFwd = "ulysses_attention";
constexpr const char* kBwd = "ulysses_attention_backward";

Shape with(Shape s, int dim, int64_t n) {
  s[dim < 0 ? s.ndim() + dim : dim] = n;
  return s;
}

int64_t bytes_of(const Shape& s, DType dt) { return s.numel() * dtype_size(dt); }

// (..., H, L_r, X) sequence-sharded -> (..., H/P, L, X) head-sharded, global token order.
Tensor seq_to_heads(const Comm& comm, const TensorView& t, int64_t L, Layout layout, const char* what, RingStats& st) {
  const int P = comm.size(), r = comm.rank();
  const int64_t hp = t.size(-3) / P;
  std::vector<Tensor> send(static_cast<size_t>(P)), recv(static_cast<size_t>(P));
  std::vector<MPI_Request> reqs;
  for (int p = 0; p < P; ++p) {
    recv[static_cast<size_t>(p)] = Tensor::empty(with(with(t.shape(), -3, hp), -2, detail::rows_of(L, P, p, layout)), t.dtype());
    comm.irecv(recv[static_cast<size_t>(p)].raw_data(), bytes_of(recv[static_cast<size_t>(p)].shape(), t.dtype()), p, 11, reqs);
  }
  for (int p = 0; p < P; ++p) {
    send[static_cast<size_t>(p)] = t.slice(-3, p * hp, (p + 1) * hp).contiguous();
    comm.isend(send[static_cast<size_t>(p)].raw_data(), bytes_of(send[static_cast<size_t>(p)].shape(), t.dtype()), p, 11, reqs);
    if (p != r) st.bytes_sent += bytes_of(send[static_cast<size_t>(p)].shape(), t.dtype());
  }
  const double w0 = detail::now_seconds();
  comm.wait(reqs, fmt::format("every rank's rows of {} (all-to-all)", what));
  st.wait += detail::now_seconds() - w0;
  Tensor out = Tensor::empty(with(with(t.shape(), -3, hp), -2, L), t.dtype());
  for (int p = 0; p < P; ++p) {
    for (const detail::Piece& pc : detail::pieces(L, P, p, layout)) {
      const int64_t n = pc.end - pc.begin;
      detail::copy_rows(recv[static_cast<size_t>(p)].slice(-2, pc.row, pc.row + n), out.slice(-2, pc.begin, pc.begin + n));
    }
  }
  return out;
}

// (..., H/P, L, X) head-sharded -> (..., H, L_r, X): this rank's rows of every head.
Tensor heads_to_seq(const Comm& comm, const TensorView& u, int64_t L, Layout layout, const char* what, RingStats& st) {
  const int P = comm.size(), r = comm.rank();
  const int64_t hp = u.size(-3), mine = detail::rows_of(L, P, r, layout);
  std::vector<Tensor> send(static_cast<size_t>(P)), recv(static_cast<size_t>(P));
  std::vector<MPI_Request> reqs;
  for (int p = 0; p < P; ++p) {
    recv[static_cast<size_t>(p)] = Tensor::empty(with(u.shape(), -2, mine), u.dtype());
    comm.irecv(recv[static_cast<size_t>(p)].raw_data(), bytes_of(recv[static_cast<size_t>(p)].shape(), u.dtype()), p, 12, reqs);
  }
  for (int p = 0; p < P; ++p) {
    Tensor& s = send[static_cast<size_t>(p)];
    s = Tensor::empty(with(u.shape(), -2, detail::rows_of(L, P, p, layout)), u.dtype());
    for (const detail::Piece& pc : detail::pieces(L, P, p, layout)) {
      const int64_t n = pc.end - pc.begin;
      detail::copy_rows(u.slice(-2, pc.begin, pc.begin + n), s.slice(-2, pc.row, pc.row + n));
    }
    comm.isend(s.raw_data(), bytes_of(s.shape(), u.dtype()), p, 12, reqs);
    if (p != r) st.bytes_sent += bytes_of(s.shape(), u.dtype());
  }
  const double w0 = detail::now_seconds();
  comm.wait(reqs, fmt::format("every rank's heads of {} (all-to-all)", what));
  st.wait += detail::now_seconds() - w0;
  Tensor out = Tensor::empty(with(with(u.shape(), -3, hp * P), -2, mine), u.dtype());
  for (int p = 0; p < P; ++p) detail::copy_rows(recv[static_cast<size_t>(p)], out.slice(-3, p * hp, (p + 1) * hp));
  return out;
}

// The LSE (..., H, L) travels as (..., H, L, 1).
Tensor lse_rows(const Tensor& t) { return t.unsqueeze(-1).contiguous(); }
Tensor lse_back(const Tensor& t) { return t.squeeze(-1).contiguous(); }

// This rank's heads of the per-head parameters.
SdpaOptions head_options(const SdpaOptions& o, int64_t h0, int64_t h1) {
  SdpaOptions u = o;
  if (o.alibi_slopes) u.alibi_slopes = o.alibi_slopes->slice(-1, h0, h1);
  if (o.sinks) u.sinks = o.sinks->slice(0, h0, h1);
  return u;
}

detail::Agreement check_args(const Comm& comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const SdpaOptions& o, const RingOptions& ring, const char* who) {
  detail::Agreement a = detail::check_ring_args(q, k, v, o, ring, who);
  if (o.dropout_p > 0.0f) {
    throw ValueError(fmt::format("{}: dropout is not supported (its Philox mask is keyed by the flat batch*head "
                                 "index, which head sharding changes); use ring_attention", who));
  }
  if (q.dim() < 3) throw ShapeError(fmt::format("{}: query must have a head dim (..., H, L_r, E), got {} dims", who, q.dim()));
  const int P = comm.size();
  if (q.size(-3) % P != 0 || k.size(-3) % P != 0) {
    throw ValueError(fmt::format("{}: H ({}) and H_kv ({}) must be divisible by the {} ranks (each rank takes H/P "
                                 "heads); use ring_attention, which has no such constraint",
                                 who, q.size(-3), k.size(-3), P));
  }
  return a;
}

}  // namespace

SdpaResult ulysses_attention(const TensorView& q, const TensorView& k, const TensorView& v, MPI_Comm comm_in,
                             const SdpaOptions& options, const RingOptions& ring) {
  const double t0 = detail::now_seconds();
  Comm comm(comm_in, ring.timeout_seconds, kFwd);
  const detail::Agreement mine =
      detail::local_check([&](detail::Agreement& a) { a = check_args(comm, q, k, v, options, ring, kFwd); });
  const int64_t L = detail::agree(comm, mine, ring.layout);
  const int P = comm.size(), r = comm.rank();
  RingStats st;
  st.steps = 1;
  st.setup = detail::now_seconds() - t0;
  const Tensor qh = seq_to_heads(comm, q, L, ring.layout, "query", st);
  const Tensor kh = seq_to_heads(comm, k, L, ring.layout, "key", st);
  const Tensor vh = seq_to_heads(comm, v, L, ring.layout, "value", st);
  const int64_t hp = q.size(-3) / P;
  const double c0 = detail::cpu_seconds();
  const SdpaResult part = scaled_dot_product_attention(qh, kh, vh, head_options(options, r * hp, (r + 1) * hp));
  st.compute_cpu = detail::cpu_seconds() - c0;
  SdpaResult res;
  res.output = heads_to_seq(comm, part.output, L, ring.layout, "the output", st);
  if (options.need_lse) res.lse = lse_back(heads_to_seq(comm, lse_rows(part.lse), L, ring.layout, "the LSE", st));
  st.wall = detail::now_seconds() - t0;
  st.compute = st.wall - st.setup - st.wait;
  if (ring.stats != nullptr) *ring.stats = st;
  return res;
}

SdpaGrads ulysses_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const SdpaSaved& fwd, MPI_Comm comm_in,
                                     const SdpaOptions& options, const RingOptions& ring) {
  const double t0 = detail::now_seconds();
  Comm comm(comm_in, ring.timeout_seconds, kBwd);
  const detail::Agreement mine = detail::local_check([&](detail::Agreement& a) {
    a = check_args(comm, q, k, v, options, ring, kBwd);
    a.signature += detail::check_ring_backward_args(dout, fwd, q, k, v, options, kBwd);
  });
  const int64_t L = detail::agree(comm, mine, ring.layout);
  const int P = comm.size(), r = comm.rank();
  RingStats st;
  st.steps = 1;
  st.setup = detail::now_seconds() - t0;
  const Tensor dh = seq_to_heads(comm, dout, L, ring.layout, "grad_output", st);
  const Tensor qh = seq_to_heads(comm, q, L, ring.layout, "query", st);
  const Tensor kh = seq_to_heads(comm, k, L, ring.layout, "key", st);
  const Tensor vh = seq_to_heads(comm, v, L, ring.layout, "value", st);
  const Tensor oh = seq_to_heads(comm, fwd.output, L, ring.layout, "the output", st);
  const Tensor lh = lse_back(seq_to_heads(comm, lse_rows(fwd.lse.contiguous()), L, ring.layout, "the LSE", st));
  const int64_t hp = q.size(-3) / P;
  const double c0 = detail::cpu_seconds();
  const SdpaGrads g = scaled_dot_product_attention_backward(dh, qh, kh, vh, SdpaSaved(oh, lh),
                                                            head_options(options, r * hp, (r + 1) * hp));
  st.compute_cpu = detail::cpu_seconds() - c0;
  SdpaGrads out;
  out.grad_query = heads_to_seq(comm, g.grad_query, L, ring.layout, "grad_query", st);
  out.grad_key = heads_to_seq(comm, g.grad_key, L, ring.layout, "grad_key", st);
  out.grad_value = heads_to_seq(comm, g.grad_value, L, ring.layout, "grad_value", st);
  if (options.sinks) {
    // Each rank has d(sinks) of its heads; every rank gets all of them.
    out.grad_sinks = Tensor::empty({hp * P});
    std::vector<MPI_Request> reqs(1);
    detail::check_mpi(MPI_Iallgather(g.grad_sinks.data(), static_cast<int>(hp), MPI_FLOAT, out.grad_sinks.data(),
                                     static_cast<int>(hp), MPI_FLOAT, comm.get(), &reqs[0]),
                      kBwd, "MPI_Iallgather");
    comm.wait(reqs, "every rank's d(sinks)");
  }
  st.wall = detail::now_seconds() - t0;
  st.compute = st.wall - st.setup - st.wait;
  if (ring.stats != nullptr) *ring.stats = st;
  return out;
}

}  // namespace attn::dist

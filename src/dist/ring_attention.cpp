// Ring attention (context parallelism) over MPI, forward and backward.
//
// Shapes per rank r of P: q (..., L_r, E), k (..., L_r, E) (H_kv heads with GQA), v (..., L_r, Ev),
// holding the global tokens shard_ranges(L, P, r, layout) (1 piece, or 2 with zigzag).
//
// Forward, step s = 0 .. P-1: the K/V block of rank src = r - s (mod P) is in hand. Post Irecv of
// the next block from r-1 and Isend of this one to r+1, then run the fused kernel on every
// (query piece, key piece) pair whose band is not empty, with query_pos_offset / key_pos_offset
// set to the pieces' global starts, and merge each partial (o_b, lse_b) into the float32
// accumulator:  lse = logaddexp(lse, lse_b);  o = o * exp(lse_old - lse) + o_b * exp(lse_b - lse).
// Sinks are left out of the blocks and folded in once at the end (a block's own sink would count
// P times). MPI only moves a large message when called, so the compute is cut into pieces of
// RingOptions::progress_rows query rows with MPI_Testall between them.
//
// Backward, the same ring with the forward's output and (global) LSE: each pair's fused backward
// gives dQ rows (accumulated here) and dK/dV contributions of the block in hand. Those travel with
// the block: after step s the partial dK/dV of block src (received from r-1 during the step, plus
// this rank's contributions) goes to r+1; after P steps each block's sum arrives at its owner.
//
// Traffic per rank and step: one K/V block, L_r * H_kv * (E + Ev) elements (the backward adds
// its float32 dK/dV). Memory: two K/V buffers, float32 output/LSE (or dQ and two dK/dV) buffers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <vector>
#include <fmt/format.h>

#include "attn/dist.hpp"
#include "dist/comm.hpp"
#include "dist/ring_common.hpp"
#include "dist/rows.hpp"

namespace attn::dist {

using detail::Comm;
using detail::Piece;

namespace {

constexpr const char* kFwd = "ring_attention";
constexpr const char* kBwd = "ring_attention_backward";

// The K/V block of one rank, packed: k (lead_kv..., n, E) then v (lead_kv..., n, Ev).
struct KvFormat {
  Shape k_shape, v_shape;  // with dim -2 = 0
  DType dtype;
  int64_t k_row_bytes, v_row_bytes;  // bytes per token (all heads)
  int64_t bytes(int64_t n) const { return n * (k_row_bytes + v_row_bytes); }
  TensorView k(void* buf, int64_t n) const {
    Shape s = k_shape;
    s[s.ndim() - 2] = n;
    return TensorView(buf, dtype, s);
  }
  TensorView v(void* buf, int64_t n) const {
    Shape s = v_shape;
    s[s.ndim() - 2] = n;
    return TensorView(static_cast<char*>(buf) + n * k_row_bytes, dtype, s);
  }
};

KvFormat kv_format(const TensorView& k, const TensorView& v) {
  KvFormat f{k.shape(), v.shape(), k.dtype(), 0, 0};
  f.k_shape[f.k_shape.ndim() - 2] = 0;
  f.v_shape[f.v_shape.ndim() - 2] = 0;
  f.k_row_bytes = k.size(-2) == 0 ? 0 : k.numel() / k.size(-2) * k.element_size();
  f.v_row_bytes = v.size(-2) == 0 ? 0 : v.numel() / v.size(-2) * v.element_size();
  if (k.size(-2) == 0) {  // an empty shard still knows its row size from the other dims
    int64_t n = k.element_size(), m = v.element_size();
    for (int d = 0; d < k.dim(); ++d) n *= d == k.dim() - 2 ? 1 : k.size(d);
    for (int d = 0; d < v.dim(); ++d) m *= d == v.dim() - 2 ? 1 : v.size(d);
    f.k_row_bytes = n, f.v_row_bytes = m;
  }
  return f;
}

void pack_kv(const KvFormat& f, const TensorView& k, const TensorView& v, void* buf) {
  const int64_t n = k.size(-2);
  detail::copy_rows(k, f.k(buf, n));
  detail::copy_rows(v, f.v(buf, n));
}

// Merges one partial (out_b (lead..., n, Ev), lse_b (lead..., n)) into rows [row0, row0 + n).
void merge(Tensor& acc, Tensor& acc_lse, int64_t row0, const Tensor& out_b, const Tensor& lse_b) {
  const Tensor o32 = out_b.dtype() == DType::kFloat32 ? out_b : out_b.to(DType::kFloat32);
  const int64_t N = acc.size(-2), X = acc.size(-1), n = out_b.size(-2);
  const int64_t lead = N == 0 ? 0 : acc_lse.numel() / N;
  for (int64_t b = 0; b < lead; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      const float l = lse_b.data()[b * n + i];
      if (l == -std::numeric_limits<float>::infinity()) continue;  // no visible key in this block
      float& m = acc_lse.data()[b * N + row0 + i];
      float* a = acc.data() + (b * N + row0 + i) * X;
      const float* o = o32.data() + (b * n + i) * X;
      if (m == -std::numeric_limits<float>::infinity()) {
        std::memcpy(a, o, static_cast<size_t>(X) * sizeof(float));
        m = l;
        continue;
      }
      const float hi = std::max(m, l), merged = hi + std::log1p(std::exp(-std::fabs(m - l)));
      const float wa = std::exp(m - merged), wb = std::exp(l - merged);
      for (int64_t x = 0; x < X; ++x) a[x] = a[x] * wa + o[x] * wb;
      m = merged;
    }
  }
}

// Folds the sinks in once: lse' = logaddexp(lse, s_h), o *= exp(lse - lse').
void apply_sinks(Tensor& acc, Tensor& acc_lse, const TensorView& sinks, int64_t heads) {
  const int64_t N = acc.size(-2), X = acc.size(-1);
  const int64_t lead = N == 0 ? 0 : acc_lse.numel() / N;
  for (int64_t b = 0; b < lead; ++b) {
    const float s = sinks.data()[(b % heads) * sinks.stride(0)];
    for (int64_t i = 0; i < N; ++i) {
      float& m = acc_lse.data()[b * N + i];
      const float merged = m == -std::numeric_limits<float>::infinity()
                               ? s
                               : std::max(m, s) + std::log1p(std::exp(-std::fabs(m - s)));
      const float w = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - merged);
      float* a = acc.data() + (b * N + i) * X;
      for (int64_t x = 0; x < X; ++x) a[x] *= w;
      m = merged;
    }
  }
}

// The key rows of the last backward step, cut into up to 4 chunks whose dK/dV leave as soon as
// they are final, so that only the last chunk's transfer is exposed (sender and owner cut the
// owner's rows alike).
std::vector<std::pair<int64_t, int64_t>> final_chunks(int64_t n) {
  const int64_t c = std::min<int64_t>(4, n);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < c; ++i) out.emplace_back(n * i / c, n * (i + 1) / c);
  return out;
}

// Step s of the ring: the block in hand (rank src's) goes to r + 1 while the next one (rank
// src - 1's) arrives from r - 1 into the other buffer; nothing moves at the last step.
void post_kv(const Comm& comm, const KvFormat& f, int64_t L, Layout layout, int s, const char* in_hand,
             char* next_block, std::vector<MPI_Request>& reqs, RingStats& st) {
  const int P = comm.size(), r = comm.rank();
  if (s == P - 1) return;
  const int src = (r - s + P) % P, nsrc = (r - s - 1 + 2 * P) % P;
  comm.irecv(next_block, f.bytes(detail::rows_of(L, P, nsrc, layout)), (r + P - 1) % P, 2 * s, reqs);
  comm.isend(in_hand, f.bytes(detail::rows_of(L, P, src, layout)), (r + 1) % P, 2 * s, reqs);
  st.bytes_sent += f.bytes(detail::rows_of(L, P, src, layout));
}

// Calls f(sub, kp) for every (query piece of at most progress_rows rows, key piece of rank src)
// whose band is not empty, polling `reqs` after each so that the transfers progress.
// Only the key rows [k0, k1) of the block (local rows) when given.
template <typename F>
void for_each_block(const Comm& comm, const std::vector<Piece>& mine, int64_t L, int src, const SdpaOptions& o,
                    const RingOptions& ring, std::vector<std::vector<MPI_Request>*> reqs, F&& f,
                    int64_t k0 = 0, int64_t k1 = std::numeric_limits<int64_t>::max()) {
  for (const Piece& qp : mine) {
    for (const Piece& whole : detail::pieces(L, comm.size(), src, ring.layout)) {
      const int64_t a = std::max(whole.row, k0), b = std::min(whole.row + whole.end - whole.begin, k1);
      if (a >= b) continue;
      const Piece kp{whole.begin + a - whole.row, whole.begin + b - whole.row, a};
      for (int64_t c = 0; c < qp.end - qp.begin; c += ring.progress_rows) {
        const int64_t n = std::min(ring.progress_rows, qp.end - qp.begin - c);
        const Piece sub{qp.begin + c, qp.begin + c + n, qp.row + c};
        if (!detail::band_visible(sub, kp, o, L)) continue;
        f(sub, kp);
        for (std::vector<MPI_Request>* r : reqs) (void)comm.test(*r);
      }
    }
  }
}

// What MPI reads and writes during the ring: the K/V block in hand and the next, and the
// backward's travelling dK/dV (received, sent).
struct Buffers {
  std::vector<char> kv[2];
  std::vector<float> g_in, g_out;
  std::vector<std::vector<float>> fin_in, fin_out;  // the last step's dK/dV chunks
  Buffers(int64_t kv_bytes, int64_t g_floats)
      : kv{std::vector<char>(static_cast<size_t>(kv_bytes)), std::vector<char>(static_cast<size_t>(kv_bytes))},
        g_in(static_cast<size_t>(g_floats)), g_out(static_cast<size_t>(g_floats)) {}
};

// When the ring throws midway (a kernel error, a timeout), transfers may still be posted and a
// late peer's data may still arrive: the buffers are leaked rather than freed under MPI.
class LeakOnThrow {
 public:
  explicit LeakOnThrow(std::unique_ptr<Buffers>& b) : b_(b), n_(std::uncaught_exceptions()) {}
  ~LeakOnThrow() {
    if (std::uncaught_exceptions() > n_) (void)b_.release();
  }
  LeakOnThrow(const LeakOnThrow&) = delete;
  LeakOnThrow& operator=(const LeakOnThrow&) = delete;

 private:
  std::unique_ptr<Buffers>& b_;
  int n_;
};

int64_t largest_shard(int64_t L, int P, Layout layout) {
  int64_t most = 0;
  for (int s = 0; s < P; ++s) most = std::max(most, detail::rows_of(L, P, s, layout));
  return most;
}

Shape with_rows(Shape s, int64_t n) {
  s[s.ndim() - 2] = n;
  return s;
}

}  // namespace

SdpaResult ring_attention(const TensorView& q, const TensorView& k, const TensorView& v, MPI_Comm comm_in,
                          const SdpaOptions& options, const RingOptions& ring) {
  const double t0 = detail::now_seconds();
  Comm comm(comm_in, ring.timeout_seconds, kFwd);
  const detail::Agreement mine =
      detail::local_check([&](detail::Agreement& a) { a = detail::check_ring_args(q, k, v, options, ring, kFwd); });
  const int64_t L = detail::agree(comm, mine, ring.layout);
  const int P = comm.size(), r = comm.rank();
  const KvFormat fmt_kv = kv_format(k, v);
  const std::vector<Piece> my = detail::pieces(L, P, r, ring.layout);
  const int64_t Ev = v.size(-1);
  const int64_t heads = q.dim() >= 3 ? q.size(-3) : 1;

  Shape out_shape = q.shape(), lse_shape;
  out_shape[out_shape.ndim() - 1] = Ev;
  for (int d = 0; d < q.dim() - 1; ++d) lse_shape.push_back(q.size(d));
  Tensor acc = Tensor::zeros(out_shape);
  Tensor acc_lse = Tensor::full(lse_shape, -std::numeric_limits<float>::infinity());

  const int64_t max_rows = largest_shard(L, P, ring.layout);
  auto mem = std::make_unique<Buffers>(fmt_kv.bytes(max_rows), 0);
  const LeakOnThrow keep(mem);
  std::vector<char>* buf = mem->kv;
  pack_kv(fmt_kv, k, v, buf[0].data());

  RingStats st;
  st.steps = P;
  st.setup = detail::now_seconds() - t0;
  int cur = 0;
  for (int s = 0; s < P; ++s) {
    const int src = (r - s + P) % P;
    const int64_t n_src = detail::rows_of(L, P, src, ring.layout);
    std::vector<MPI_Request> reqs;
    post_kv(comm, fmt_kv, L, ring.layout, s, buf[cur].data(), buf[1 - cur].data(), reqs, st);
    const double c0 = detail::cpu_seconds();
    const TensorView kb = fmt_kv.k(buf[cur].data(), n_src), vb = fmt_kv.v(buf[cur].data(), n_src);
    for_each_block(comm, my, L, src, options, ring, {&reqs}, [&](const Piece& sub, const Piece& kp) {
      const int64_t n = sub.end - sub.begin, kn = kp.end - kp.begin;
      const SdpaResult part = scaled_dot_product_attention(q.slice(-2, sub.row, sub.row + n),
                                                           kb.slice(-2, kp.row, kp.row + kn),
                                                           vb.slice(-2, kp.row, kp.row + kn),
                                                           detail::block_options(options, sub, kp));
      merge(acc, acc_lse, sub.row, part.output, part.lse);
    });
    if (s == P - 1 && options.sinks) apply_sinks(acc, acc_lse, *options.sinks, heads);
    const double w1 = detail::now_seconds();
    st.compute_cpu += detail::cpu_seconds() - c0;
    comm.wait(reqs, fmt::format("the K/V block of rank {} (ring step {} of {})", (src - 1 + P) % P, s + 1, P));
    st.wait += detail::now_seconds() - w1;
    cur = 1 - cur;
  }
  SdpaResult res;
  res.output = q.dtype() == DType::kFloat32 ? acc : acc.to(q.dtype());
  if (options.need_lse) res.lse = acc_lse;
  st.wall = detail::now_seconds() - t0;
  st.compute = st.wall - st.setup - st.wait;  // the local work, bookkeeping and final casts included
  if (ring.stats != nullptr) *ring.stats = st;
  return res;
}

namespace {
// 16-bit inputs (see dist.hpp): the output recomputed in float32 by a forward ring, then the
// float32 backward ring on the widened inputs; the gradients rounded to the inputs' dtype once.
SdpaGrads widened_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                           MPI_Comm comm, const SdpaOptions& options, const RingOptions& ring, double t0) {
  const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
  const Tensor d32 = dout.to(DType::kFloat32);
  RingStats fs, bs;
  RingOptions inner = ring;
  inner.stats = &fs;
  SdpaOptions o32 = options;
  // A kernel named for the 16-bit dtype cannot take the float32 rings: they choose their own.
  for (const SdpaKernelInfo& info : sdpa_kernels()) {
    if (info.name == options.kernel && std::find(info.dtypes.begin(), info.dtypes.end(), DType::kFloat32) == info.dtypes.end()) {
      o32.kernel = SdpaOptions{}.kernel;
    }
  }
  SdpaOptions fo = o32;
  fo.need_lse = true;
  const SdpaResult f = ring_attention(q32, k32, v32, comm, fo, inner);
  inner.stats = &bs;
  SdpaGrads g = ring_attention_backward(d32, q32, k32, v32, f, comm, o32, inner);
  g.grad_query = g.grad_query.to(q.dtype());
  g.grad_key = g.grad_key.to(k.dtype());
  g.grad_value = g.grad_value.to(v.dtype());
  if (ring.stats != nullptr) {
    RingStats& st = *ring.stats;
    st.wall = detail::now_seconds() - t0;
    st.compute_cpu = fs.compute_cpu + bs.compute_cpu;
    st.wait = fs.wait + bs.wait;
    st.setup = fs.setup + bs.setup;
    st.compute = st.wall - st.setup - st.wait;  // the widening is local work too
    st.bytes_sent = fs.bytes_sent + bs.bytes_sent;
    st.steps = fs.steps + bs.steps;
  }
  return g;
}
}  // namespace

SdpaGrads ring_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const SdpaSaved& fwd, MPI_Comm comm_in,
                                  const SdpaOptions& options, const RingOptions& ring) {
  const double t0 = detail::now_seconds();
  Comm comm(comm_in, ring.timeout_seconds, kBwd);
  const detail::Agreement mine = detail::local_check([&](detail::Agreement& a) {
    a = detail::check_ring_args(q, k, v, options, ring, kBwd);
    a.signature += detail::check_ring_backward_args(dout, fwd, q, k, v, options, kBwd);
  });
  const int64_t L = detail::agree(comm, mine, ring.layout);
  if (q.dtype() != DType::kFloat32) return widened_backward(dout, q, k, v, comm_in, options, ring, t0);
  const int P = comm.size(), r = comm.rank();
  const KvFormat fmt_kv = kv_format(k, v);
  // The travelling dK/dV are float32 whatever the input dtype: they sum P contributions.
  const KvFormat fmt_g{fmt_kv.k_shape, fmt_kv.v_shape, DType::kFloat32,
                       fmt_kv.k_row_bytes / k.element_size() * 4, fmt_kv.v_row_bytes / v.element_size() * 4};
  const std::vector<Piece> my = detail::pieces(L, P, r, ring.layout);

  Tensor dq = Tensor::zeros(q.shape());
  const int64_t max_rows = largest_shard(L, P, ring.layout);
  auto mem = std::make_unique<Buffers>(fmt_kv.bytes(max_rows), fmt_g.bytes(max_rows) / 4);
  const LeakOnThrow keep(mem);
  std::vector<char>* buf = mem->kv;
  std::vector<float>&g_in = mem->g_in, &g_out = mem->g_out;
  pack_kv(fmt_kv, k, v, buf[0].data());

  RingStats st;
  st.steps = P;
  st.setup = detail::now_seconds() - t0;
  int cur = 0;
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  std::vector<MPI_Request> g_recv, g_send;
  // This rank's own dK/dV come back, in chunks, after the last step: receives posted now.
  const int64_t Lr = k.size(-2);
  const std::vector<std::pair<int64_t, int64_t>> own_chunks = final_chunks(Lr);
  mem->fin_in.reserve(own_chunks.size());
  mem->fin_out.reserve(4);
  std::vector<MPI_Request> fin_recv, fin_send;
  for (size_t c = 0; c < own_chunks.size(); ++c) {
    const int64_t m = own_chunks[c].second - own_chunks[c].first;
    mem->fin_in.emplace_back(static_cast<size_t>(fmt_g.bytes(m) / 4));
    comm.irecv(mem->fin_in.back().data(), fmt_g.bytes(m), prev, 2 * P + static_cast<int>(c), fin_recv);
  }
  for (int s = 0; s < P; ++s) {
    const int src = (r - s + P) % P;
    const int64_t n_src = detail::rows_of(L, P, src, ring.layout);
    const bool last = s == P - 1;
    std::vector<MPI_Request> reqs;
    post_kv(comm, fmt_kv, L, ring.layout, s, buf[cur].data(), buf[1 - cur].data(), reqs, st);
    const double c0 = detail::cpu_seconds();
    const TensorView kb = fmt_kv.k(buf[cur].data(), n_src), vb = fmt_kv.v(buf[cur].data(), n_src);
    // The partial dK/dV that came with the block (from the previous ranks' steps).
    const TensorView gk_in = fmt_g.k(g_in.data(), n_src), gv_in = fmt_g.v(g_in.data(), n_src);
    Tensor dk_view(with_rows(fmt_g.k_shape, n_src)), dv_view(with_rows(fmt_g.v_shape, n_src));
    const auto chunks = last ? final_chunks(n_src) : std::vector<std::pair<int64_t, int64_t>>{{0, n_src}};
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto [k0, k1] = chunks[c];
      for_each_block(comm, my, L, src, options, ring, {&reqs, &g_recv, &g_send, &fin_recv, &fin_send},
                     [&](const Piece& sub, const Piece& kp) {
        const int64_t n = sub.end - sub.begin, kn = kp.end - kp.begin;
        const SdpaSaved saved(fwd.output.slice(-2, sub.row, sub.row + n), fwd.lse.slice(-1, sub.row, sub.row + n));
        const SdpaGrads g = scaled_dot_product_attention_backward(
            dout.slice(-2, sub.row, sub.row + n), q.slice(-2, sub.row, sub.row + n), kb.slice(-2, kp.row, kp.row + kn),
            vb.slice(-2, kp.row, kp.row + kn), saved, detail::block_options(options, sub, kp));
        detail::add_rows(dq, sub.row, g.grad_query);
        detail::add_rows(dk_view, kp.row, g.grad_key);
        detail::add_rows(dv_view, kp.row, g.grad_value);
      }, k0, k1);
      if (!last) continue;
      // Rows [k0, k1) of the block are final: to their owner, rank r + 1.
      const double w = detail::now_seconds();
      comm.wait(g_recv, fmt::format("the dK/dV partial of rank {} (last ring step)", prev));
      st.wait += detail::now_seconds() - w;
      const int64_t m = k1 - k0;
      mem->fin_out.emplace_back(static_cast<size_t>(fmt_g.bytes(m) / 4));
      void* chunk = mem->fin_out.back().data();
      Tensor ck = dk_view.slice(-2, k0, k1).contiguous(), cv = dv_view.slice(-2, k0, k1).contiguous();
      if (s > 0) {
        detail::add_rows(ck, 0, gk_in.slice(-2, k0, k1).contiguous());
        detail::add_rows(cv, 0, gv_in.slice(-2, k0, k1).contiguous());
      }
      detail::copy_rows(ck, fmt_g.k(chunk, m));
      detail::copy_rows(cv, fmt_g.v(chunk, m));
      comm.isend(chunk, fmt_g.bytes(m), next, 2 * P + static_cast<int>(c), fin_send);
      st.bytes_sent += fmt_g.bytes(m);
    }
    const double w1 = detail::now_seconds();
    st.compute_cpu += detail::cpu_seconds() - c0;
    const std::string what = fmt::format("the K/V block and dK/dV of rank {} (ring step {} of {})", prev, s + 1, P);
    comm.wait(reqs, what);
    comm.wait(g_recv, what);
    comm.wait(g_send, what);
    st.wait += detail::now_seconds() - w1;
    if (last) break;
    // g_out = this step's contributions + the partial that came with the block, to rank r + 1;
    // the next block's partial comes from rank r - 1.
    const int64_t nk = dk_view.numel(), nv = dv_view.numel();
    for (int64_t i = 0; i < nk; ++i) g_out[static_cast<size_t>(i)] = dk_view.data()[i] + (s > 0 ? g_in[static_cast<size_t>(i)] : 0.0f);
    for (int64_t i = 0; i < nv; ++i) g_out[static_cast<size_t>(nk + i)] = dv_view.data()[i] + (s > 0 ? g_in[static_cast<size_t>(nk + i)] : 0.0f);
    comm.isend(g_out.data(), (nk + nv) * 4, next, 2 * s + 1, g_send);
    st.bytes_sent += (nk + nv) * 4;
    const int nsrc = (r - s - 1 + 2 * P) % P;
    comm.irecv(g_in.data(), fmt_g.bytes(detail::rows_of(L, P, nsrc, ring.layout)), prev, 2 * s + 1, g_recv);
    cur = 1 - cur;
  }
  const double w2 = detail::now_seconds();
  comm.wait(fin_recv, "this rank's dK/dV at the end of the ring");
  comm.wait(fin_send, "the last dK/dV sends");
  st.wait += detail::now_seconds() - w2;

  SdpaGrads out;
  Tensor dk(with_rows(fmt_g.k_shape, Lr)), dv(with_rows(fmt_g.v_shape, Lr));
  for (size_t c = 0; c < own_chunks.size(); ++c) {
    const auto [a, b] = own_chunks[c];
    detail::copy_rows(fmt_g.k(mem->fin_in[c].data(), b - a), dk.slice(-2, a, b));
    detail::copy_rows(fmt_g.v(mem->fin_in[c].data(), b - a), dv.slice(-2, a, b));
  }
  out.grad_query = q.dtype() == DType::kFloat32 ? dq : dq.to(q.dtype());
  out.grad_key = k.dtype() == DType::kFloat32 ? dk : dk.to(k.dtype());
  out.grad_value = v.dtype() == DType::kFloat32 ? dv : dv.to(v.dtype());
  if (options.sinks) out.grad_sinks = detail::sinks_grad(comm, dout, fwd, *options.sinks);
  st.wall = detail::now_seconds() - t0;
  st.compute = st.wall - st.setup - st.wait;  // the local work, bookkeeping and final casts included
  if (ring.stats != nullptr) *ring.stats = st;
  return out;
}

}  // namespace attn::dist

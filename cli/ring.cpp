// `attn ring`: ring attention (attn::dist) timed under `mpirun -np P attn ring ...`
// (--strategy ulysses: DeepSpeed-Ulysses all-to-all head parallelism, for comparison).
//
// Every rank makes the same global q, k, v, dO (B, H, L, E) from --seed and keeps its shard. The
// forward and backward run --repeats times after a warm-up; per rank it reports the median wall,
// compute (wall and CPU) and wait times, and the bytes sent. Then:
//   comm alone    the same transfers (same peers, sizes and order) timed with no compute;
//   hidden        1 - (wall - setup - compute) / comm alone = 1 - wait / comm alone: the share
//                 of communication behind the ring steps' local work (compute: kernels, merging,
//                 casts; setup, the communicator's duplicate and the collective argument check,
//                 is shown apart);
//   efficiency    T1 / (P * T_P), T1 the fused kernel on the whole sequence in one process with
//                 the same threads (rank 0, the others idle); with more ranks than cores it is
//                 bounded by cores / P, so the CPU-time efficiency T1_cpu / sum CPU_r is shown too;
//   balance       max / min over ranks of the compute CPU time.
// --check gathers the ring's output and gradients on every rank and compares them with the
// fused kernel on the gathered inputs (and both with float64 maths when the problem is small).
#include "ring.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <fmt/format.h>

#include "attn/attn.hpp"
#include "attn/dist.hpp"
#include "gpt_commands.hpp"

namespace attn::cli {
namespace {

struct RingArgs {
  int64_t batch = 1, heads = 8, kv_heads = 0, seq = 4096, dim = 64;
  std::string dtype = "f32", layout = "auto", strategy = "ring";
  bool causal = false, check = false;
  int repeats = 5, threads = 1;
  int64_t progress_rows = 256;
  uint64_t seed = 0;
  double timeout = 300;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Idles until every rank arrives without spinning a core (MPI_Barrier busy-polls, which would
// steal the core of a rank still computing when ranks outnumber cores).
void quiet_barrier() {
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  int done = 0;
  while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// The ring's transfers alone: P-1 steps of K/V blocks (plus, for the backward, P steps of the
// float32 dK/dV that travel with them), each step's sends and receives awaited before the next.
double comm_alone(int64_t L, int P, int r, dist::Layout layout, int64_t kv_row_bytes, int64_t grad_row_bytes) {
  const auto rows = [&](int rank) {
    int64_t n = 0;
    for (const auto& [b, e] : dist::shard_ranges(L, P, rank, layout)) n += e - b;
    return n;
  };
  int64_t most = 0;
  for (int s = 0; s < P; ++s) most = std::max(most, rows(s));
  const int64_t row_bytes = std::max(kv_row_bytes, grad_row_bytes);
  std::vector<char> a(static_cast<size_t>(most * row_bytes)), b(a.size());
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  quiet_barrier();
  const double t0 = seconds();
  for (int s = 0; s < P; ++s) {
    std::vector<MPI_Request> reqs;
    const int src = (r - s + P) % P, nsrc = (r - s - 1 + 2 * P) % P;
    const auto post = [&](int64_t per_row, int tag) {
      if (per_row == 0) return;
      reqs.emplace_back();
      MPI_Irecv(b.data(), static_cast<int>(rows(nsrc) * per_row), MPI_BYTE, prev, tag, MPI_COMM_WORLD, &reqs.back());
      reqs.emplace_back();
      MPI_Isend(a.data(), static_cast<int>(rows(src) * per_row), MPI_BYTE, next, tag, MPI_COMM_WORLD, &reqs.back());
    };
    if (s < P - 1) post(kv_row_bytes, 2 * s);
    post(grad_row_bytes, 2 * s + 1);
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  }
  return seconds() - t0;
}

// Ulysses' all-to-alls alone: one per tensor, each rank sending 1/P of `bytes` to every rank.
double alltoall_alone(const std::vector<int64_t>& bytes, int P) {
  int64_t most = 0;
  for (int64_t b : bytes) most = std::max(most, b);
  std::vector<char> a(static_cast<size_t>(most)), b(a.size());
  quiet_barrier();
  const double t0 = seconds();
  for (int64_t n : bytes) {
    MPI_Alltoall(a.data(), static_cast<int>(n / P), MPI_BYTE, b.data(), static_cast<int>(n / P), MPI_BYTE, MPI_COMM_WORLD);
  }
  return seconds() - t0;
}

double max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to(DType::kFloat32).to_vector(), y = b.to(DType::kFloat32).to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(x[i]) - y[i]));
  return m;
}
double max_diff(const Tensor& a, const std::vector<double>& want) {
  const std::vector<float> x = a.to(DType::kFloat32).to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(x[i]) - want[i]));
  return m;
}

struct Timing {
  std::vector<double> wall, setup, compute, cpu, wait;
  int64_t bytes = 0;
  void add(const dist::RingStats& s) {
    wall.push_back(s.wall), setup.push_back(s.setup), compute.push_back(s.compute), cpu.push_back(s.compute_cpu);
    wait.push_back(s.wait);
    bytes = s.bytes_sent;
  }
  std::vector<double> medians() const { return {median(wall), median(setup), median(compute), median(cpu), median(wait)}; }
};

// Every rank's medians on rank 0 (wall, setup, compute, cpu, wait, comm alone, bytes).
std::vector<double> gather_row(const Timing& t, double comm, int P) {
  std::vector<double> mine = t.medians();
  mine.push_back(comm);
  mine.push_back(static_cast<double>(t.bytes));
  std::vector<double> all(mine.size() * static_cast<size_t>(P));
  MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(), static_cast<int>(mine.size()),
             MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return all;
}

void report(const char* pass, const std::vector<double>& all, int P, double t1, double t1_cpu, int threads, bool overlapped) {
  constexpr size_t kCols = 7;
  fmt::print("{}:\n  rank  wall ms  setup ms  compute ms  compute CPU ms  wait ms  comm alone ms  hidden  sent MB\n", pass);
  double wall = 0, cpu_sum = 0, cpu_max = 0, cpu_min = 1e300, hidden_min = 1;
  for (int r = 0; r < P; ++r) {
    const double* x = all.data() + static_cast<size_t>(r) * kCols;
    const double hidden = x[5] > 0 ? 1.0 - (x[0] - x[1] - x[2]) / x[5] : 1.0;
    fmt::print("  {:>4} {:>8.2f} {:>9.2f} {:>11.2f} {:>15.2f} {:>8.2f} {:>14.2f} {:>6.1f}% {:>8.2f}\n", r, 1e3 * x[0],
               1e3 * x[1], 1e3 * x[2], 1e3 * x[3], 1e3 * x[4], 1e3 * x[5], 100 * hidden, x[6] / 1e6);
    wall = std::max(wall, x[0]);
    cpu_sum += x[3], cpu_max = std::max(cpu_max, x[3]), cpu_min = std::min(cpu_min, x[3]);
    if (P > 1) hidden_min = std::min(hidden_min, hidden);
  }
  fmt::print("  one process ({} thread{}): {:.2f} ms; efficiency T1/(P*T_P) {:.2f}, CPU-time efficiency {:.2f}, "
             "compute CPU balance max/min {:.3f}, hidden (worst rank) {}\n",
             threads, threads == 1 ? "" : "s", 1e3 * t1, t1 / (P * wall), t1_cpu / cpu_sum,
             cpu_min > 0 ? cpu_max / cpu_min : 0.0,
             overlapped ? fmt::format("{:.1f}%", 100 * hidden_min) : std::string("n/a (all-to-alls, not overlapped)"));
}

int run_ring(const RingArgs& a) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  // MPI_Finalize on every way out, errors included (an exception on one rank must not leave
  // mpirun waiting on the others).
  const std::unique_ptr<void, void (*)(void*)> finalize(reinterpret_cast<void*>(1), [](void*) { MPI_Finalize(); });
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  set_threads(a.threads);
  const DType dt = a.dtype == "bf16" ? DType::kBFloat16 : a.dtype == "f16" ? DType::kFloat16 : DType::kFloat32;
  if (a.dtype != "f32" && a.dtype != "bf16" && a.dtype != "f16") {
    throw ValueError(fmt::format("attn ring: --dtype must be f32, bf16 or f16, got '{}'", a.dtype));
  }
  const dist::Layout layout = a.layout == "zigzag" || (a.layout == "auto" && a.causal) ? dist::Layout::kZigzag
                                                                                         : dist::Layout::kContiguous;
  if (a.layout != "auto" && a.layout != "zigzag" && a.layout != "contiguous") {
    throw ValueError(fmt::format("attn ring: --layout must be auto, zigzag or contiguous, got '{}'", a.layout));
  }
  const int64_t hkv = a.kv_heads > 0 ? a.kv_heads : a.heads;
  if (a.strategy != "ring" && a.strategy != "ulysses") {
    throw ValueError(fmt::format("attn ring: --strategy must be ring or ulysses, got '{}'", a.strategy));
  }
  const bool ulysses = a.strategy == "ulysses";
  manual_seed(a.seed);
  const Tensor q = randn({a.batch, a.heads, a.seq, a.dim}).to(dt), k = randn({a.batch, hkv, a.seq, a.dim}).to(dt);
  const Tensor v = randn({a.batch, hkv, a.seq, a.dim}).to(dt), dout = randn({a.batch, a.heads, a.seq, a.dim}).to(dt);
  const Tensor ql = dist::shard(q, P, r, layout), kl = dist::shard(k, P, r, layout), vl = dist::shard(v, P, r, layout);
  const Tensor dl = dist::shard(dout, P, r, layout);
  SdpaOptions o;
  o.is_causal = a.causal;
  o.enable_gqa = hkv != a.heads;
  o.need_lse = true;
  o.num_threads = a.threads;
  dist::RingOptions ro;
  ro.layout = layout;
  ro.timeout_seconds = a.timeout;
  ro.progress_rows = a.progress_rows;
  dist::RingStats st;
  ro.stats = &st;

  if (r == 0) {
    fmt::print("attn ring: {} ({}), {} ranks, B={} H={} H_kv={} L={} E={} {} {}, {} layout, {} thread{} per rank, "
               "progress every {} rows, median of {}\n",
               ulysses ? "ulysses_attention" : "ring_attention", ulysses ? "all-to-all, not overlapped" : "overlapped", P, a.batch, a.heads, hkv, a.seq, a.dim, dtype_name(dt), a.causal ? "causal" : "non-causal",
               layout == dist::Layout::kZigzag ? "zigzag" : "contiguous", a.threads, a.threads == 1 ? "" : "s",
               a.progress_rows, a.repeats);
  }
  Timing fwd, bwd;
  SdpaResult res;
  SdpaGrads g;
  for (int i = 0; i <= a.repeats; ++i) {
    quiet_barrier();
    res = (ulysses ? dist::ulysses_attention : dist::ring_attention)(ql, kl, vl, MPI_COMM_WORLD, o, ro);
    if (i > 0) fwd.add(st);
    quiet_barrier();
    g = (ulysses ? dist::ulysses_attention_backward : dist::ring_attention_backward)(dl, ql, kl, vl, res, MPI_COMM_WORLD, o, ro);
    if (i > 0) bwd.add(st);
  }
  const int64_t kv_row = hkv * a.batch * 2 * a.dim * dtype_size(dt), grad_row = hkv * a.batch * 2 * a.dim * 4;
  std::vector<double> c_fwd, c_bwd;
  // Ulysses: q, k, v there and o, lse back; the backward dO, q, k, v, o, lse there, dQ, dK, dV back.
  // (sizes from the largest shard, the same on every rank as MPI_Alltoall needs)
  const int64_t lr = (a.seq + P - 1) / P, qb = a.batch * a.heads * lr * a.dim * dtype_size(dt);
  const int64_t kb = a.batch * hkv * lr * a.dim * dtype_size(dt), lb = a.batch * a.heads * lr * 4;
  for (int i = 0; ulysses && i < std::max(1, a.repeats); ++i) {
    c_fwd.push_back(alltoall_alone({qb, kb, kb, qb, lb}, P));
    c_bwd.push_back(alltoall_alone({qb, qb, kb, kb, qb, lb, qb, kb, kb}, P));
  }
  for (int i = 0; !ulysses && i < std::max(1, a.repeats); ++i) {
    c_fwd.push_back(comm_alone(a.seq, P, r, layout, kv_row, 0));
    // A 16-bit backward runs a float32 forward ring, then the float32 backward ring.
    c_bwd.push_back(dt == DType::kFloat32 ? comm_alone(a.seq, P, r, layout, kv_row, grad_row)
                                          : comm_alone(a.seq, P, r, layout, grad_row, 0) +
                                                comm_alone(a.seq, P, r, layout, grad_row, grad_row));
  }
  // One process on the whole sequence, the others idle.
  double t1 = 0, t1b = 0, t1_cpu = 0, t1b_cpu = 0;
  quiet_barrier();
  if (r == 0) {
    std::vector<double> w, wb, c, cb;
    for (int i = 0; i <= a.repeats; ++i) {
      const double w0 = seconds(), c0 = static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
      const SdpaResult one = scaled_dot_product_attention(q, k, v, o);
      const double w1 = seconds(), c1 = static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
      (void)scaled_dot_product_attention_backward(dout, q, k, v, one, o);
      if (i == 0) continue;
      w.push_back(w1 - w0), c.push_back(c1 - c0);
      wb.push_back(seconds() - w1), cb.push_back(static_cast<double>(std::clock()) / CLOCKS_PER_SEC - c1);
    }
    t1 = median(w), t1b = median(wb), t1_cpu = median(c), t1b_cpu = median(cb);
  }
  quiet_barrier();
  const std::vector<double> rows_f = gather_row(fwd, median(c_fwd), P), rows_b = gather_row(bwd, median(c_bwd), P);
  if (r == 0) {
    report("forward", rows_f, P, t1, t1_cpu, a.threads, !ulysses);
    report("backward", rows_b, P, t1b, t1b_cpu, a.threads, !ulysses);
  }
  if (!a.check) return 0;

  // Gathered inputs, the fused kernel on one process, the ring's gathered results.
  const Tensor qa = dist::gather(ql, MPI_COMM_WORLD, layout), ka = dist::gather(kl, MPI_COMM_WORLD, layout);
  const Tensor va = dist::gather(vl, MPI_COMM_WORLD, layout), da = dist::gather(dl, MPI_COMM_WORLD, layout);
  const Tensor out = dist::gather(res.output, MPI_COMM_WORLD, layout);
  const Tensor dq = dist::gather(g.grad_query, MPI_COMM_WORLD, layout);
  const Tensor dk = dist::gather(g.grad_key, MPI_COMM_WORLD, layout), dv = dist::gather(g.grad_value, MPI_COMM_WORLD, layout);
  int bad = 0;
  if (r == 0) {
    const SdpaResult one = scaled_dot_product_attention(qa, ka, va, o);
    const SdpaGrads og = scaled_dot_product_attention_backward(da, qa, ka, va, one, o);
    const bool small = a.batch * a.heads * a.seq * a.seq <= (int64_t{1} << 26);
    reference::SdpaResultF64 w64;
    reference::SdpaGradsF64 g64;
    if (small) w64 = reference::scaled_dot_product_attention_f64(qa, ka, va, o), g64 = reference::scaled_dot_product_attention_backward_f64(da, qa, ka, va, o);
    const double rel = dt == DType::kFloat32 ? 1e-4 : 2e-2;
    fmt::print("check against the fused kernel on one process{}:\n", small ? " (and float64 maths)" : "");
    const auto one_check = [&](const char* name, const Tensor& ring, const Tensor& single, const std::vector<double>* truth) {
      const double d = max_diff(ring, single);
      bool ok;
      if (truth != nullptr) {
        const double er = max_diff(ring, *truth), es = max_diff(single, *truth);
        ok = er <= 2 * es + (dt == DType::kFloat32 ? 2e-6 : 8e-3);
        fmt::print("  {:<11} max |ring - one| {:.3g}; vs float64: ring {:.3g}, one process {:.3g}  {}\n", name, d, er, es,
                   ok ? "ok" : "FAIL (ring error above 2x the one-process error)");
      } else {
        const double scale = std::max(1.0, max_diff(single, Tensor::zeros(single.shape())));
        ok = d <= rel * scale;
        fmt::print("  {:<11} max |ring - one| {:.3g} (bound {:.3g})  {}\n", name, d, rel * scale, ok ? "ok" : "FAIL");
      }
      bad += ok ? 0 : 1;
    };
    one_check("output", out, one.output, small ? &w64.output : nullptr);
    one_check("grad_query", dq, og.grad_query, small ? &g64.grad_query : nullptr);
    one_check("grad_key", dk, og.grad_key, small ? &g64.grad_key : nullptr);
    one_check("grad_value", dv, og.grad_value, small ? &g64.grad_value : nullptr);
  }
  MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return bad == 0 ? 0 : 1;
}

}  // namespace

std::function<int()> add_ring_command(CLI::App& app) {
  auto a = std::make_shared<RingArgs>();
  CLI::App* c = app.add_subcommand(
      "ring", "Ring attention over MPI (run under `mpirun -np P`): per-rank compute and communication "
              "times, the share of communication hidden, efficiency vs one process; --check compares "
              "with the single-process fused kernel");
  c->add_option("--batch", a->batch, "Batch size")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--heads", a->heads, "Query heads")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--kv-heads", a->kv_heads, "Key/value heads (GQA); 0: --heads")->capture_default_str()->check(CLI::NonNegativeNumber);
  c->add_option("--seq", a->seq, "Global sequence length L (split over the ranks)")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--dim", a->dim, "Head dimension E")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--dtype", a->dtype, "f32, bf16 or f16")->capture_default_str();
  c->add_option("--layout", a->layout, "auto (zigzag when causal), zigzag or contiguous")->capture_default_str();
  c->add_option("--strategy", a->strategy, "ring (ring_attention) or ulysses (ulysses_attention: all-to-all head parallelism)")
      ->capture_default_str();
  c->add_flag("--causal", a->causal, "Causal attention");
  c->add_option("--repeats", a->repeats, "Timed runs after one warm-up (medians reported)")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--threads", a->threads, "Threads per rank")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--progress-rows", a->progress_rows, "Query rows computed between MPI polls")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--timeout", a->timeout, "Seconds without progress before a rank gives up")->capture_default_str();
  c->add_option("--seed", a->seed, "Seed of the random q, k, v, dO")->capture_default_str();
  c->add_flag("--check", a->check, "Compare output and gradients with the single-process fused kernel");
  return [a] { return run_ring(*a); };
}

}  // namespace attn::cli

// The fused CPU backward of scaled_dot_product_attention: (key/value head, key range) work
// items on OpenMP threads, each running flash_bwd_kernel.hpp over the query heads that read the
// head, then a fixed-order sum of the ranges' partial dQ.
//
// Shapes: B*H_kv key/value heads of S keys, each read by `group` query heads of L queries.
// flash_bwd_split.hpp cuts S into `ranges` key ranges (whole 256-key groups, >= 256 keys each)
// so that B*H_kv*ranges items keep threads busy when key/value heads are few (GQA, MQA, one long
// sequence), and leaves one range per head otherwise. An item owns dK, dV rows [j_begin, j_end)
// of its head outright (disjoint across items: written without atomics, the group's query heads
// summed in order), and writes a partial dQ, (L, E) per query head, over its keys only.
//
// Memory traffic: range 0 writes its partial straight into grad_query; ranges 1.. write
// (ranges - 1) * B*H_q*L*E floats of scratch, which the reduction reads once and adds into
// grad_query in range order 1, 2, ... (rows a causal range cannot reach are left out: exact
// zeros). With one range there is no scratch and no reduction: the bits are those of an unsplit
// head.
//
// Determinism: the split depends on S, H_kv and the key group only, each item runs in a fixed
// order on one thread, and each dQ element is summed over ranges in a fixed order, so gradients
// are bit-identical for any thread count and run to run.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <optional>
#include <vector>

#include <omp.h>

#include "sdpa/mask_grad.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_bwd_split.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/flush_denormals.hpp"

namespace attn::cpu {

// d(sinks)_h = -sum over the rows of head h of p_sink * D, with p_sink = exp(s_h - lse) and
// D = rowsum(dO * O) (the kernel's own D: the sink has no value, so D is its whole dP term).
// Summed in float64 in row order: deterministic for any thread count.
static Tensor sinks_grad(const detail::SdpaProblem& p, const TensorView& dout, const TensorView& out,
                  const TensorView& lse) {
  std::vector<double> acc(static_cast<size_t>(p.heads_q), 0.0);
  for (int64_t b = 0; b < p.batch; ++b) {
    const float* o = out.data() + detail::lead_offset(out, p.lead, b);
    const float* d = dout.data() + detail::lead_offset(dout, p.lead, b);
    const float* l = lse.data() + detail::lead_offset(lse, p.lead, b);
    const double sink = p.sink(b);
    double sum = 0.0;
    for (int64_t i = 0; i < p.L; ++i) {
      double dd = 0.0;
      for (int64_t e = 0; e < p.Ev; ++e) dd += static_cast<double>(d[i * dout.stride(-2) + e]) * o[i * out.stride(-2) + e];
      sum += std::exp(sink - static_cast<double>(l[i * lse.stride(-1)])) * dd;
    }
    acc[static_cast<size_t>(b % p.heads_q)] -= sum;
  }
  Tensor g = Tensor::empty({p.heads_q});
  for (int64_t h = 0; h < p.heads_q; ++h) g.data()[h] = static_cast<float>(acc[static_cast<size_t>(h)]);
  return g;
}

// The inputs as the kernels read them: q, k, v and dO with each head's rows adjacent, the saved
// output's rows contiguous, the LSE contiguous (copies only where the caller's layout differs).
struct BackwardInputs {
  Tensor qs, ks, vs, ds, os, ls;  // storage of the copies
  int cores;
  TensorView q, k, v, dout, out, lse;
  BackwardInputs(const TensorView& dout_in, const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                 const SdpaSaved& forward, const SdpaOptions& options)
      : cores(options.num_threads > 0 ? options.num_threads : omp_get_max_threads()),
        q(rows_adjacent(q_in, qs, cores)),
        k(rows_adjacent(k_in, ks, cores)),
        v(rows_adjacent(v_in, vs, cores)),
        dout(rows_adjacent(dout_in, ds, cores)),
        out(rows_contiguous(forward.output, os)),
        lse(forward.lse.is_contiguous() ? TensorView(forward.lse) : (ls = forward.lse.contiguous())) {}
};

// Runs the (key/value head, key range) items on up to `cores` threads, each calling run(h, ws) for
// the query heads of its group in order with h = fill(b) plus the range and its dQ destination,
// then sums the ranges' partial dQ into dq_all (B*H_q heads of (L, E), contiguous) in order.
template <class Fill, class Run>
void run_backward_items(const detail::SdpaProblem& p, const FlashBwdParams& fp, int cores, int64_t ws_bytes,
                        float* const dq_all, Fill fill, Run run) {
  const int64_t kv_heads = p.batch / p.group;
  const FlashBwdKeySplit split = flash_bwd_key_split(p.S, kv_heads);
  const int64_t ranges = split.ranges, items = kv_heads * ranges;
  const int threads = std::max<int>(1, std::min<int64_t>(cores, items));

  // Partial dQ of ranges 1.., each B*H_q heads of (L, E): every element is written by its item
  // (all L rows), so the buffer needs no zeroing.
  const int64_t head_dq = p.L * p.E;
  std::unique_ptr<float[]> partial;
  if (ranges > 1) partial = std::make_unique_for_overwrite<float[]>(static_cast<size_t>((ranges - 1) * p.batch * head_dq));
  // A causal range starting at key j is seen by queries i >= j - causal_offset only.
  auto first_row = [&](int64_t r) -> int64_t {
    return fp.causal ? std::clamp<int64_t>(split.begin(r, p.S) - fp.causal_offset, 0, p.L) : 0;
  };

#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals ftz;  // flush_denormals.hpp
    std::vector<float> ws(static_cast<size_t>((ws_bytes + 3) / 4));
    // Range-major: under causal masking the first ranges are the longest-running, so they start
    // first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t r = it / kv_heads, kvh = it % kv_heads;
      // Query heads b of this key/value head: batch index kvh / H_kv, heads (kvh % H_kv) * group ...
      const int64_t heads_kv = p.heads_q / p.group;
      const int64_t b_first = (kvh / heads_kv) * p.heads_q + (kvh % heads_kv) * p.group;
      for (int64_t b = b_first; b < b_first + p.group; ++b) {
        FlashBwdHead h = fill(b);
        h.dq = r == 0 ? dq_all + b * head_dq : partial.get() + ((r - 1) * p.batch + b) * head_dq;
        h.j_begin = split.begin(r, p.S);
        h.j_end = split.begin(r + 1, p.S);
        run(h, ws.data());
      }
    }
    if (ranges > 1) {
      // Each dQ element sums its ranges in order 0, 1, 2, ... whichever thread takes the chunk.
      constexpr int64_t kRows = 64;
      const int64_t chunks = (p.L + kRows - 1) / kRows;
#pragma omp for schedule(static)
      for (int64_t c = 0; c < p.batch * chunks; ++c) {
        const int64_t b = c / chunks, i0 = c % chunks * kRows, i1 = std::min(p.L, i0 + kRows);
        float* dst = dq_all + b * head_dq;
        for (int64_t r = 1; r < ranges; ++r) {
          const float* src = partial.get() + ((r - 1) * p.batch + b) * head_dq;
          for (int64_t e = std::max(i0, first_row(r)) * p.E; e < i1 * p.E; ++e) dst[e] += src[e];
        }
      }
    }
  }
}

SdpaGrads flash_backward(const FlashKernel& kernel, const TensorView& dout_in,
                         const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                         const SdpaSaved& forward, const SdpaOptions& options,
                         const detail::SdpaProblem& p) {
  const BackwardInputs in(dout_in, q_in, k_in, v_in, forward, options);
  const int cores = in.cores;
  const TensorView &q = in.q, &k = in.k, &v = in.v, &dout = in.dout, &out = in.out, &lse = in.lse;

  SdpaGrads g{Tensor::empty(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape()), Tensor(), Tensor()};

  FlashBwdParams fp = make_flash_bwd_params(p, options, q, k, v);
  fp.guard_v = !all_finite(q, cores) || !all_finite(k, cores) || !all_finite(v, cores) ||
               !all_finite(dout, cores);
  // dS of every score for the mask's gradient (mask_grad.hpp): keys a row never sees stay 0.
  std::optional<detail::MaskGradRows> dmask;
  if (options.need_attn_mask_grad) dmask.emplace(p, options.attn_mask->values, cores);
  auto fill = [&](int64_t b) {
    FlashBwdHead h{};
    h.q = q.data() + detail::lead_offset(q, p.lead, b);
    h.k = k.data() + detail::kv_lead_offset(k, p, b);
    h.v = v.data() + detail::kv_lead_offset(v, p, b);
    h.o = out.data() + detail::lead_offset(out, p.lead, b);
    h.dout = dout.data() + detail::lead_offset(dout, p.lead, b);
    h.o_row = out.stride(-2);
    h.do_row = dout.stride(-2);
    h.lse = lse.data() + detail::lead_offset(lse, p.lead, b);
    if (p.mask.defined()) h.mask = p.mask.data() + detail::lead_offset(p.mask, p.lead, b);
    h.dk = g.grad_key.data() + detail::kv_lead_offset(g.grad_key, p, b);
    h.dv = g.grad_value.data() + detail::kv_lead_offset(g.grad_value, p, b);
    h.dmask = dmask ? dmask->rows() + b * p.L * p.S : nullptr;
    h.bh = b + p.bh_base;
    h.alibi2 = p.alibi_slope(b) * std::numbers::log2e_v<float>;
    return h;
  };
  run_backward_items(p, fp, cores, 4 * kernel.backward_workspace_floats(p.L, p.E, p.Ev), g.grad_query.data(), fill,
                     [&](const FlashBwdHead& h, float* ws) { kernel.backward(fp, h, ws); });
  if (p.sinks.defined()) g.grad_sinks = sinks_grad(p, dout, out, lse);
  if (dmask) g.grad_attn_mask = dmask->finish(cores);
  return g;
}

// sum_e g[e] * (o[e] + lo[e]) over bf16 rows in float32, in 16 interleaved partial sums (a fixed
// order, so deterministic, and vectorisable where one running sum is a chain of dependent adds).
static float dot_with_residual(const uint16_t* g, const uint16_t* o, const uint16_t* lo, int64_t n) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      part[l] += bf16_to_float({g[e + l]}) * (bf16_to_float({o[e + l]}) + bf16_to_float({lo[e + l]}));
    }
  }
  for (; e < n; ++e) part[e % kLanes] += bf16_to_float({g[e]}) * (bf16_to_float({o[e]}) + bf16_to_float({lo[e]}));
  float s = 0.0f;
  for (float x : part) s += x;
  return s;
}

// The bf16 backward: D of every row first (from the forward's output_residual where saved, else
// row_dots, parallel over query blocks), then the items as above on float32 gradient buffers,
// rounded to bf16 once. A row whose probability mass over
// the call's keys is not 1 (a call on a slice of the keys: context parallelism, whose saved LSE is
// the whole row's) takes D from the saved output instead, as the float32 kernels always do.
SdpaGrads flash_backward_bf16(const Bf16BackwardKernel& kernel, const TensorView& dout_in,
                              const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                              const SdpaSaved& forward, const SdpaOptions& options,
                              const detail::SdpaProblem& p) {
  const BackwardInputs in(dout_in, q_in, k_in, v_in, forward, options);
  const int cores = in.cores;
  const TensorView &q = in.q, &k = in.k, &v = in.v, &dout = in.dout, &out = in.out, &lse = in.lse;
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::zeros(k.shape()), dv = Tensor::zeros(v.shape());
  const FlashBwdParams fp = make_flash_bwd_params(p, options, q, k, v);
  std::optional<detail::MaskGradRows> dmask;  // bf16 rows where the mask is bf16: rounded in the kernel
  if (options.need_attn_mask_grad) dmask.emplace(p, options.attn_mask->values, cores, /*bf16_rows=*/true);
  auto bits = [](const TensorView& t, int64_t off) { return static_cast<const uint16_t*>(t.raw_data()) + off; };
  std::vector<float> dd(static_cast<size_t>(p.batch * p.L));
  auto fill = [&](int64_t b) {
    FlashBwdHead h{};
    h.q = bits(q, detail::lead_offset(q, p.lead, b));
    h.k = bits(k, detail::kv_lead_offset(k, p, b));
    h.v = bits(v, detail::kv_lead_offset(v, p, b));
    h.dout = bits(dout, detail::lead_offset(dout, p.lead, b));
    h.do_row = dout.stride(-2);
    h.lse = lse.data() + detail::lead_offset(lse, p.lead, b);
    h.dd = dd.data() + b * p.L;
    if (p.mask.defined()) h.mask = p.mask.data() + detail::lead_offset(p.mask, p.lead, b);
    h.dk = dk.data() + detail::kv_lead_offset(dk, p, b);
    h.dv = dv.data() + detail::kv_lead_offset(dv, p, b);
    h.dmask = dmask && dmask->rows() != nullptr ? dmask->rows() + b * p.L * p.S : nullptr;
    h.dmask_bf16 = dmask && dmask->rows_bf16() != nullptr ? dmask->rows_bf16() + b * p.L * p.S : nullptr;
    h.bh = b + p.bh_base;
    return h;
  };

  const int64_t bq = kernel.block_q, nqb = (p.L + bq - 1) / bq;
  const int dthreads = std::max<int>(1, std::min<int64_t>(cores, p.batch * nqb));
  if (forward.output_residual.defined()) {
    // D = rowsum(dO * (O + residual)): the forward's float32 output, no pass over the keys.
    Tensor rs;
    const TensorView res = rows_contiguous(forward.output_residual, rs);
#pragma omp parallel for num_threads(dthreads) schedule(static)
    for (int64_t row = 0; row < p.batch * p.L; ++row) {
      const int64_t b = row / p.L, i = row % p.L;
      dd[static_cast<size_t>(row)] = dot_with_residual(
          bits(dout, detail::lead_offset(dout, p.lead, b) + i * dout.stride(-2)),
          bits(out, detail::lead_offset(out, p.lead, b) + i * out.stride(-2)),
          bits(res, detail::lead_offset(res, p.lead, b) + i * res.stride(-2)), p.Ev);
    }
  } else {
#pragma omp parallel num_threads(dthreads)
    {
      const FlushDenormals ftz;
      std::vector<float> ws(static_cast<size_t>((kernel.row_dots_workspace_bytes(p.E, p.Ev) + 3) / 4));
      std::vector<float> mass(static_cast<size_t>(bq));
#pragma omp for schedule(dynamic, 4)
      for (int64_t it = 0; it < p.batch * nqb; ++it) {
        const int64_t b = it / nqb, i0 = it % nqb * bq, nq = std::min(bq, p.L - i0);
        const FlashBwdHead h = fill(b);
        float* d = dd.data() + b * p.L + i0;
        kernel.row_dots(fp, h, i0, nq, d, mass.data(), ws.data());
        for (int64_t r = 0; r < nq; ++r) {
          const float l = h.lse[i0 + r];
          const float tol = 64.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(l));
          const float m = mass[static_cast<size_t>(r)];
          if (std::isinf(l) || std::fabs(m - 1.0f) <= tol) {
            // Normalised by the mass the kernel's own P carries: sum_j dS_ij = 0, and a row of one
            // key gets D = dP (P = 1 - a few ulps otherwise leaves dQ a few ulps off its exact 0).
            if (m > 0.0f) d[r] /= m;
            continue;
          }
          const uint16_t* o = bits(out, detail::lead_offset(out, p.lead, b) + (i0 + r) * out.stride(-2));
          const uint16_t* g = static_cast<const uint16_t*>(h.dout) + (i0 + r) * h.do_row;
          float s = 0.0f;
          for (int64_t e = 0; e < p.Ev; ++e) s += bf16_to_float({g[e]}) * bf16_to_float({o[e]});
          d[r] = s;
        }
      }
    }
  }
  run_backward_items(p, fp, cores, kernel.backward_workspace_bytes(p.L, p.E, p.Ev), dq.data(), fill,
                     [&](const FlashBwdHead& h, float* ws) { kernel.backward(fp, h, ws); });
  return {dq.to(p.dtype), dk.to(p.dtype), dv.to(p.dtype), Tensor(), dmask ? dmask->finish(cores) : Tensor()};
}

}  // namespace attn::cpu

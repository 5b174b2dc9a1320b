// The fused CPU backward of scaled_dot_product_attention: per key/value head work items on
// OpenMP threads, each running flash_bwd_kernel.hpp over the query heads that read it.
//
// A work item is one key/value head: its group's query heads (one without GQA) are visited in
// order by one thread and sum into that head's dK and dV, and each dQ row is produced by one
// thread in a fixed order, so gradients are bit-identical for any thread count and run to run.
// The price: parallelism is the number of key/value heads (B * H_kv); a single long head runs on
// one thread.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include <omp.h>

#include "sdpa/registry.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/cpu/flash_isa.hpp"

namespace attn::cpu {

SdpaGrads flash_backward(const FlashKernel& kernel, const TensorView& dout_in,
                         const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                         const SdpaResult& forward, const SdpaOptions& options,
                         const detail::SdpaProblem& p) {
  Tensor qs, ks, vs, ds, os, ls;
  const TensorView q = rows_contiguous(q_in, qs), k = rows_contiguous(k_in, ks),
                   v = rows_contiguous(v_in, vs), dout = rows_contiguous(dout_in, ds),
                   out = rows_contiguous(forward.output, os);
  const TensorView lse = forward.lse.is_contiguous() ? TensorView(forward.lse) : (ls = forward.lse.contiguous());

  SdpaGrads g{Tensor::empty(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape())};

  FlashBwdParams fp = make_flash_bwd_params(p, options, q, k, v);
  fp.guard_v = !all_finite(q) || !all_finite(k) || !all_finite(v) || !all_finite(dout);

  const int64_t kv_heads = p.batch / p.group;
  const int threads = std::max<int>(1, std::min<int64_t>(
      options.num_threads > 0 ? options.num_threads : omp_get_max_threads(), kv_heads));
  const int64_t ws_floats = kernel.backward_workspace_floats(p.L, p.E, p.Ev);

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> ws(static_cast<size_t>(ws_floats));
#pragma omp for schedule(dynamic, 1)
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      // Query heads b of this key/value head: batch index kvh / H_kv, heads (kvh % H_kv) * group ...
      const int64_t heads_kv = p.heads_q / p.group;
      const int64_t b_first = (kvh / heads_kv) * p.heads_q + (kvh % heads_kv) * p.group;
      for (int64_t b = b_first; b < b_first + p.group; ++b) {
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
        h.dq = g.grad_query.data() + detail::lead_offset(g.grad_query, p.lead, b);
        h.dk = g.grad_key.data() + detail::kv_lead_offset(g.grad_key, p, b);
        h.dv = g.grad_value.data() + detail::kv_lead_offset(g.grad_value, p, b);
        h.bh = b;
        kernel.backward(fp, h, ws.data());
      }
    }
  }
  return g;
}

}  // namespace attn::cpu

// The fused CPU forward of scaled_dot_product_attention: turns a validated problem into
// per-block work items and runs them on OpenMP threads with the kernel build the registry chose
// (src/sdpa/registry.cpp registers one entry per build, all running this driver).
//
// Work items are (batch*head, block of kBQ queries). Every output row is produced by exactly
// one item in a fixed order, so results are bit-identical for any thread count. With is_causal
// the items differ in cost (the last block sees every key, the first almost none), so they are
// handed out longest first with dynamic scheduling.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>
#include <vector>

#include <omp.h>

#include "attn/philox.hpp"
#include "sdpa/registry.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/flush_denormals.hpp"

namespace attn::cpu {

bool dropout_keep(const FlashParams& p, int64_t bh, int64_t i, int64_t j) {
  return philox_dropout_keep(p.dropout_seed, p.dropout_offset, bh, i + p.dropout_i0, j + p.dropout_j0,
                             p.dropout_p);
}

SdpaResult flash_forward(const FlashKernel& kernel, const TensorView& q_in, const TensorView& k_in,
                         const TensorView& v_in, const SdpaOptions& options,
                         const detail::SdpaProblem& p) {
  Tensor qs, ks, vs;
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  const TensorView q = rows_contiguous(q_in, qs), k = rows_adjacent(k_in, ks, threads),
                   v = rows_adjacent(v_in, vs, threads);

  SdpaResult result = make_forward_result(p, DType::kFloat32, options.need_lse);
  std::vector<float> stats(options.need_weights ? static_cast<size_t>(2 * p.batch * p.L) : 0);

  FlashParams fp = make_flash_params(p, options, q, k, v);
  fp.guard_v = !all_finite(v, threads);

  const int64_t nqb = (p.L + kernel.block_q - 1) / kernel.block_q;
  const std::vector<int64_t> items = forward_work_items(p, kernel.block_q);
  const int64_t ws_floats = kernel.workspace_floats(p.E, p.Ev);
  float* const out = result.output.data();
  float* const lse = options.need_lse ? result.lse.data() : nullptr;

  auto block_of = [&](int64_t item) {
    const int64_t b = item / nqb, i0 = (item % nqb) * kernel.block_q;
    FlashBlock blk{};
    blk.i0 = i0;
    blk.nq = std::min<int64_t>(kernel.block_q, p.L - i0);
    blk.bh = b + p.bh_base;  // the Philox counter's batch*head
    blk.alibi2 = p.alibi_slope(b) * std::numbers::log2e_v<float>;
    blk.sink2 = p.sink(b) * std::numbers::log2e_v<float>;  // -inf stays -inf: no sink
    blk.q = q.data() + detail::lead_offset(q, p.lead, b) + i0 * fp.q_row;
    blk.k = k.data() + detail::kv_lead_offset(k, p, b);
    blk.v = v.data() + detail::kv_lead_offset(v, p, b);
    blk.o = out + (b * p.L + i0) * p.Ev;
    blk.lse = lse != nullptr ? lse + b * p.L + i0 : nullptr;
    blk.stats = stats.empty() ? nullptr : stats.data() + 2 * (b * p.L + i0);
    if (p.mask.defined()) blk.mask = p.mask.data() + detail::lead_offset(p.mask, p.lead, b) + i0 * fp.mask_row;
    return blk;
  };

#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals ftz;  // flush_denormals.hpp
    std::vector<float> ws(static_cast<size_t>(ws_floats));
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < items.size(); ++t) kernel.forward(fp, block_of(items[t]), ws.data());
  }

  if (options.need_weights) {
    Shape w_shape = p.lead;
    w_shape.push_back(p.L);
    w_shape.push_back(p.S);
    result.attn_weights = Tensor::empty(w_shape);
    float* const weights = result.attn_weights.data();
#pragma omp parallel num_threads(threads)
    {
      const FlushDenormals ftz;
      std::vector<float> ws(static_cast<size_t>(ws_floats));
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < items.size(); ++t) {
        FlashBlock blk = block_of(items[t]);
        blk.weights = weights + (items[t] / nqb * p.L + blk.i0) * p.S;
        kernel.weights(fp, blk, ws.data());
      }
    }
  }
  // The kernel keeps the LSE in base 2; the API's is natural.
  if (options.need_lse) {
    float* const l = result.lse.data();
    for (int64_t r = 0; r < p.batch * p.L; ++r) l[r] *= std::numbers::ln2_v<float>;
  }
  return result;
}

}  // namespace attn::cpu

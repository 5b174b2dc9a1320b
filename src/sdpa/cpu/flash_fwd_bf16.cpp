// The driver of the low-precision fused forward (kernels: flash_avx512_bf16.cpp,
// flash_amx_bf16.cpp): the float32 driver's work items and thread schedule (flash_fwd.cpp) over
// q, k, v and output in the kernel's input dtype (bf16, fp16, or float32 computed on bf16
// terms), with K and V of every key/value head packed once in the kernel's layout.
// Every output row is produced by one work item in a fixed order: bit-identical results for
// any thread count.
#include <algorithm>
#include <numbers>
#include <numeric>
#include <vector>

#include <omp.h>

#include "attn/error.hpp"
#include "sdpa/cpu/flush_denormals.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/registry.hpp"

namespace attn::cpu {

bool all_finite_16(const TensorView& t, int threads) {
  // All exponent bits set: Inf or NaN.
  return no_inf_or_nan<uint16_t>(t, t.dtype() == DType::kFloat16 ? 0x7c00u : 0x7f80u, threads);
}

SdpaResult flash_forward_bf16(const Bf16ForwardKernel& kern, const TensorView& q_in,
                              const TensorView& k_in, const TensorView& v_in,
                              const SdpaOptions& options, const detail::SdpaProblem& p) {
  Tensor qs, ks, vs;
  const TensorView q = rows_contiguous(q_in, qs), k = rows_contiguous(k_in, ks),
                   v = rows_contiguous(v_in, vs);
  SdpaResult result = make_forward_result(p, p.dtype, options.need_lse);

  const FlashParams fp = make_flash_params(p, options, q, k, v);
  const int64_t bq = kern.block_q;
  const int64_t nqb = (p.L + bq - 1) / bq;
  const std::vector<int64_t> items = forward_work_items(p, bq);
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  const int64_t ws_bytes = kern.workspace_bytes(p.E, p.Ev);
  // Byte pointers: offsets below are in elements of the input dtype, times its size.
  const int64_t es = dtype_size(p.dtype);
  const auto* qd = static_cast<const char*>(q.raw_data());
  const auto* kd = static_cast<const char*>(k.raw_data());
  const auto* vd = static_cast<const char*>(v.raw_data());
  auto* const out = static_cast<char*>(result.output.raw_data());
  float* const lse = options.need_lse ? result.lse.data() : nullptr;
  char* residual = nullptr;
  if (options.need_output_residual && is_sixteen_bit_float(p.dtype)) {
    if (!kern.residual_ok && !options.allow_fp16_bf16_reduction) {
      throw ValueError("flash_forward_bf16: this kernel table cannot form output_residual");
    }
    result.output_residual = Tensor::empty(result.output.shape(), p.dtype);
    residual = static_cast<char*>(result.output_residual.raw_data());
  }

  // K and V of every key/value head in the kernel's layout, once, before any query block reads
  // them.
  const int64_t kv_heads = p.batch / p.group, vwords = kern.packed_v_words(p.S, p.Ev);
  const int64_t kwords = kern.packed_k_words != nullptr ? kern.packed_k_words(p.S, p.E) : 0;
  std::vector<uint32_t> vpacked(static_cast<size_t>(kv_heads * vwords));
  std::vector<uint32_t> kpacked(static_cast<size_t>(kv_heads * kwords));
  auto first_query_head = [&](int64_t kvh) {  // a query (batch, head) reading kv head kvh
    return (kvh / p.heads_kv) * p.heads_q + (kvh % p.heads_kv) * p.group;
  };
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
    const int64_t b = first_query_head(kvh);
    kern.pack_v(vd + detail::kv_lead_offset(v, p, b) * es, fp.v_row, p.S, p.Ev, vpacked.data() + kvh * vwords);
    if (kwords > 0) {
      kern.pack_k(kd + detail::kv_lead_offset(k, p, b) * es, fp.k_row, p.S, p.E, kpacked.data() + kvh * kwords);
    }
  }

#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals ftz;  // flush_denormals.hpp
    std::vector<float> ws(static_cast<size_t>((ws_bytes + 3) / 4));
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < items.size(); ++t) {
      const int64_t b = items[t] / nqb, i0 = (items[t] % nqb) * bq;
      FlashBlock16 blk{};
      blk.i0 = i0;
      blk.nq = std::min<int64_t>(bq, p.L - i0);
      blk.bh = b + p.bh_base;
      blk.q = qd + (detail::lead_offset(q, p.lead, b) + i0 * fp.q_row) * es;
      blk.k = kd + detail::kv_lead_offset(k, p, b) * es;
      const int64_t kvh = (b / p.heads_q) * p.heads_kv + (b % p.heads_q) / p.group;
      blk.vp = vpacked.data() + kvh * vwords;
      blk.kp = kwords > 0 ? kpacked.data() + kvh * kwords : nullptr;
      blk.o = out + (b * p.L + i0) * p.Ev * es;
      blk.o_lo = residual != nullptr ? residual + (b * p.L + i0) * p.Ev * es : nullptr;
      blk.lse = lse != nullptr ? lse + b * p.L + i0 : nullptr;
      if (p.mask.defined()) blk.mask = p.mask.data() + detail::lead_offset(p.mask, p.lead, b) + i0 * fp.mask_row;
      kern.forward_block(fp, blk, ws.data());
    }
  }
  if (lse != nullptr) {  // base 2 in the kernel, natural in the API
    for (int64_t r = 0; r < p.batch * p.L; ++r) lse[r] *= std::numbers::ln2_v<float>;
  }
  return result;
}

}  // namespace attn::cpu

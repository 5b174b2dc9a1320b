// The driver of the bfloat16 fused forward (kernel: flash_avx512_bf16.cpp): the float32
// driver's work items and thread schedule (flash_fwd.cpp) over 16-bit q, k, v and output.
// Every output row is produced by one work item in a fixed order: bit-identical results for
// any thread count.
#include <algorithm>
#include <numbers>
#include <numeric>
#include <vector>

#include <omp.h>

#include "sdpa/cpu/flush_denormals.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/registry.hpp"

namespace attn::cpu {

bool all_finite_bf16(const TensorView& t) {
  const auto* bits = static_cast<const uint16_t*>(t.raw_data());
  bool ok = true;
  for_each_offset(t, [&](int64_t o) { ok = ok && (bits[o] & 0x7f80u) != 0x7f80u; });
  return ok;
}

SdpaResult flash_forward_bf16(const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                              const SdpaOptions& options, const detail::SdpaProblem& p) {
  Tensor qs, ks, vs;
  const TensorView q = rows_contiguous(q_in, qs), k = rows_contiguous(k_in, ks),
                   v = rows_contiguous(v_in, vs);
  SdpaResult result = make_forward_result(p, DType::kBFloat16, options.need_lse);

  const FlashParams fp = make_flash_params(p, options, q, k, v);
  constexpr int64_t bq = avx512_bf16::kBlockQ;
  const int64_t nqb = (p.L + bq - 1) / bq;
  const std::vector<int64_t> items = forward_work_items(p, bq);
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  const int64_t ws_bytes = avx512_bf16::workspace_bytes(p.E, p.Ev);
  const auto* qd = static_cast<const uint16_t*>(q.raw_data());
  const auto* kd = static_cast<const uint16_t*>(k.raw_data());
  const auto* vd = static_cast<const uint16_t*>(v.raw_data());
  auto* const out = static_cast<uint16_t*>(result.output.raw_data());
  float* const lse = options.need_lse ? result.lse.data() : nullptr;

  // V of every key/value head as key pairs, once, before any query block reads it.
  const int64_t kv_heads = p.batch / p.group, vwords = avx512_bf16::packed_v_words(p.S, p.Ev);
  std::vector<uint32_t> vpacked(static_cast<size_t>(kv_heads * vwords));
  auto first_query_head = [&](int64_t kvh) {  // a query (batch, head) reading kv head kvh
    return (kvh / p.heads_kv) * p.heads_q + (kvh % p.heads_kv) * p.group;
  };
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
    avx512_bf16::pack_v_pairs(vd + detail::kv_lead_offset(v, p, first_query_head(kvh)), fp.v_row, p.S,
                              p.Ev, vpacked.data() + kvh * vwords);
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
      blk.q = qd + detail::lead_offset(q, p.lead, b) + i0 * fp.q_row;
      blk.k = kd + detail::kv_lead_offset(k, p, b);
      blk.vp = vpacked.data() + ((b / p.heads_q) * p.heads_kv + (b % p.heads_q) / p.group) * vwords;
      blk.o = out + (b * p.L + i0) * p.Ev;
      blk.lse = lse != nullptr ? lse + b * p.L + i0 : nullptr;
      if (p.mask.defined()) blk.mask = p.mask.data() + detail::lead_offset(p.mask, p.lead, b) + i0 * fp.mask_row;
      avx512_bf16::forward_block(fp, blk, ws.data());
    }
  }
  if (lse != nullptr) {  // base 2 in the kernel, natural in the API
    for (int64_t r = 0; r < p.batch * p.L; ++r) lse[r] *= std::numbers::ln2_v<float>;
  }
  return result;
}

}  // namespace attn::cpu

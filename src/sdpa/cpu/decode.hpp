// The split-KV decode driver (decode.cpp): one description of a decode call that both front
// ends fill, scaled_dot_product_attention for short queries (dense K/V tensors, one page per
// head) and attn::paged_attention (pages of an attn::PagedKvCache, read in place).
#pragma once

#include <cstdint>
#include <vector>

#include "attn/dtype.hpp"
#include "attn/sdpa.hpp"
#include "sdpa/cpu/decode_params.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/problem.hpp"

namespace attn::cpu {

// The most queries per head the decode kernels take: beyond it a query block of the prefill
// kernels (32 rows) is as fast and the R x S work dominates the reads.
constexpr int64_t kDecodeMaxQueries = 16;

// A decode call: N sequences x heads_q query heads x L queries. Element (n, h, i, e) of the
// query is at q + n * q_n + h * q_h + i * q_i + e (in elements of q_dtype; e contiguous), and
// likewise the output (o_dtype), the LSE (natural log, float32; null if not wanted) and the
// float32 mask (element (n, h, i, j) at mask + ... + j * params.mask_col; null for none).
struct DecodeCall {
  int64_t N = 0, heads_q = 0, heads_kv = 0, L = 0;
  DecodeParams params;
  const void* q = nullptr;
  DType q_dtype = DType::kFloat32;
  int64_t q_n = 0, q_h = 0, q_i = 0;
  void* o = nullptr;
  DType o_dtype = DType::kFloat32;
  int64_t o_n = 0, o_h = 0, o_i = 0;
  float* lse = nullptr;
  int64_t lse_n = 0, lse_h = 0, lse_i = 0;
  const float* mask = nullptr;
  int64_t mask_n = 0, mask_h = 0, mask_i = 0;
  // Per query head h of sequence n: the ALiBi slope alibi[n * alibi_n + h * alibi_h] and the sink
  // logit sinks[h * sinks_h] (natural log, added once per row at the merge); null for none.
  const float* alibi = nullptr;
  int64_t alibi_n = 0, alibi_h = 0;
  const float* sinks = nullptr;
  int64_t sinks_h = 0;
  std::vector<DecodeKv> kv;  // N * heads_kv, (n, kv head) row-major
  int threads = 1;
};

void run_decode(const DecodeKernel& kernel, const DecodeCall& call);

KvType kv_type_of(DType dtype);  // float32, bfloat16, float16 or int8
// A call's constants: padded sizes, the element type, the softmax scale in base 2, the band's
// sides (is_causal, window_size: -1 unbounded) and the softcap (0: none).
DecodeParams make_decode_params(int64_t E, int64_t Ev, DType kv_dtype, double scale, bool causal,
                                WindowSize window = {}, double softcap = 0);
// One (sequence, kv head)'s band for queries placed at i' = i + diag_offset (S - L bottom-right,
// 0 top-left): key j is visible iff i' - left <= j <= i' + right and, causal, j <= i'.
void set_decode_band(const DecodeParams& p, int64_t diag_offset, DecodeKv& kv);
// E or Ev rounded up to the padding the kernels use.
inline int64_t decode_padded(int64_t n) { return (n + 15) / 16 * 16; }

// scaled_dot_product_attention through the decode kernel (registered in src/sdpa/registry.cpp).
SdpaResult decode_forward(const DecodeKernel& kernel, const TensorView& q, const TensorView& k,
                          const TensorView& v, const SdpaOptions& options,
                          const detail::SdpaProblem& problem);

}  // namespace attn::cpu

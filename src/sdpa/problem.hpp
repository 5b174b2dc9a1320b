// Argument checking and shape bookkeeping shared by every scaled_dot_product_attention backend,
// so each one rejects the same inputs with the same messages.
#pragma once

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attn/dtype.hpp"
#include "attn/sdpa.hpp"

namespace attn::detail {

// A validated scaled_dot_product_attention call. Every backend loops over `batch` query
// (batch, head) pairs b = 0 .. batch-1, row-major over `lead`, and for each computes an L x S
// attention block:
//   query / output / mask / weights / lse of b: detail::lead_offset(t, p.lead, b)
//   key / value of b:                           detail::kv_lead_offset(t, p, b)
// (with GQA several b share one key/value head; without GQA both offsets coincide).
struct SdpaProblem {
  Shape lead;       // leading (batch, head) dims of query and of the output; may be empty
  int64_t batch;    // product of lead: the number of query (batch, head) pairs
  int64_t L, S, E, Ev;
  double scale;     // the multiplier actually applied to q.k
  bool divide;      // true: scores are divided by sqrt(E) (PyTorch's `scores / d_k**0.5`)
  float divisor;    // sqrt(E) as float32, used when divide
  TensorView mask;  // float32, expanded to lead + (L, S), or undefined
  // A mask given in another dtype (bool-like int8, bfloat16, float64, ...), converted to float32
  // once; `mask` views it. Shared so that copies of the problem stay cheap.
  std::shared_ptr<const Tensor> mask_storage;
  bool mask_is_bool;
  float dropout_p;
  // The element type of q (and of the output); kernels declare the dtypes they take.
  DType dtype = DType::kFloat32;
  // The element type of k and v: dtype, except for float32 queries against bfloat16 or float16
  // keys and values (a decode step reading a low-precision cache), which only kernels with
  // SdpaKernel::mixed_kv take.
  DType kv_dtype = DType::kFloat32;
  // SdpaOptions::float32_matmul_precision with kDefault resolved to the process-wide level: what
  // float32 products may be computed in (kernels that compute in float32 ignore it).
  Float32MatmulPrecision f32_precision = Float32MatmulPrecision::kHighest;

  // Grouped-query attention (SdpaOptions::enable_gqa). The head dim is dim -3 of 3-D and 4-D
  // inputs (the last of `lead`); 2-D inputs have one head. Query head h reads key/value head
  // h / group, as PyTorch's k.repeat_interleave(group, dim=-3). Without enable_gqa,
  // heads_kv == heads_q and group == 1.
  int64_t heads_q = 1;   // query heads (lead's last dim, or 1 for 2-D inputs)
  int64_t heads_kv = 1;  // key/value heads; heads_q % heads_kv == 0
  int64_t group = 1;     // heads_q / heads_kv: query heads sharing one key/value head

  // is_causal, with the alignment resolved: key j is masked for query i when
  // causal && j > i + causal_offset. causal_offset is 0 for CausalAlignment::kTopLeft and S - L
  // for kBottomRight (negative when L > S: the first L - S query rows see no key). It is 0
  // whenever causal is false (the alignment is ignored then).
  bool causal = false;
  int64_t causal_offset = 0;

  // The flat batch*head index of query batch-head b = 0 for Philox dropout is bh_base (dropout
  // keys weight (i, j) of batch-head b by b + bh_base). 0 for scaled_dot_product_attention;
  // varlen_attn (src/sdpa/varlen.cpp) runs sequence n as its own problem with bh_base = n * H,
  // so its mask is that of batch element n of the padded (N, H, max_q, max_k) call.
  int64_t bh_base = 0;
  // SdpaOptions' global positions: Philox dropout indexes weight (i, j) as (q_pos + i, k_pos + j).
  // Their difference is already folded into causal_offset and diag_offset.
  int64_t q_pos = 0, k_pos = 0;

  // The variants (SdpaOptions' last block), validated. diag_offset places query i at
  // i' = i + diag_offset for the window and ALiBi: S - L with kBottomRight (causal or not), else 0.
  int64_t diag_offset = 0;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded on that side
  double softcap = 0;                           // 0: none
  TensorView alibi;  // float32 (H) or (B, H), or undefined
  TensorView sinks;  // float32 (H), or undefined

  // The keys query i sees by position (is_causal and the window; attn_mask aside): j in
  // [key_lo(i), key_hi(i)], which may be empty or reach outside [0, S).
  int64_t key_lo(int64_t i) const {
    return window_left >= 0 ? i + diag_offset - window_left : std::numeric_limits<int64_t>::min() / 2;
  }
  int64_t key_hi(int64_t i) const {
    int64_t hi = std::numeric_limits<int64_t>::max() / 2;
    if (window_right >= 0) hi = i + diag_offset + window_right;
    if (causal && i + causal_offset < hi) hi = i + causal_offset;
    return hi;
  }
  bool banded() const { return causal || window_left >= 0 || window_right >= 0; }
  // ALiBi slope and sink logit of query batch-head b (0 and -inf when unset).
  float alibi_slope(int64_t b) const;
  float sink(int64_t b) const;
  // The variants this call uses, by option name ("window_size, softcap"), or "" for none: what a
  // kernel that lacks them names when it refuses.
  std::string variants_used() const;
};
// The variants' checks, shared with paged_attention: `who` names the function, `name` the
// argument as its caller spells it ("window_size", "options.window_size"). ValueError for a
// side below -1, a softcap outside [FLT_MIN, FLT_MAX / log2(e)] (check_softcap returns 0 when
// unset); for a per-head parameter (ALiBi slopes, sinks) DTypeError unless float32, ShapeError
// unless one of `allowed`, ValueError for a value that is not finite or above FLT_MAX / log2(e)
// in magnitude (the kernels' base-2 range).
void check_window_size(const WindowSize& w, const char* who, const char* name);
double check_softcap(const std::optional<double>& c, const char* who, const char* name);
void check_head_param(const TensorView& t, const char* who, const char* name,
                      const std::vector<Shape>& allowed);

// Validates the arguments and returns the problem description; throws attn::Error subclasses.
SdpaProblem check_sdpa(const TensorView& q, const TensorView& k, const TensorView& v,
                       const SdpaOptions& options);

// Validates the extra arguments of scaled_dot_product_attention_backward against the forward's
// problem `p`: grad_output and forward.output of shape lead + (L, Ev), forward.lse of shape
// lead + (L), and with kTorch dropout forward.attn_weights of shape lead + (L, S).
void check_sdpa_backward(const TensorView& grad_output, const SdpaSaved& forward,
                         const SdpaOptions& options, const SdpaProblem& p);

// ValueError naming `who` when options.need_attn_mask_grad has no additive attn_mask to give a
// gradient to (none, or a boolean one). Part of check_sdpa_backward.
void check_attn_mask_grad(const SdpaOptions& options, const SdpaProblem& p, const char* who);

// Offset of batch element `b` (row-major over `lead`) in a view whose leading dims match `lead`.
int64_t lead_offset(const TensorView& t, const Shape& lead, int64_t b);

// Offset of the key/value (batch, head) that query batch-head `b` (row-major over p.lead) reads,
// in `kv` (the key or the value view): batch index b / heads_q, head (b % heads_q) / group.
int64_t kv_lead_offset(const TensorView& kv, const SdpaProblem& p, int64_t b);

}  // namespace attn::detail

// Parameters of the fused attention kernel, shared by the driver (flash_fwd.cpp, flash_bwd.cpp)
// and the per-ISA kernel builds (flash_kernel.hpp compiled as avx512, avx2 and generic).
// FlashAttention's flash.h layout: one struct for the forward, extended by the backward's.
#pragma once

#include <cstdint>
#include <limits>

namespace attn::cpu {

// One head's problem, FlashAttention-style: raw pointers and row strides (the last dim of q, k,
// v and o is contiguous), sizes, scale, masking and dropout.
struct FlashParams {
  int64_t L = 0, S = 0, E = 0, Ev = 0;
  int64_t q_row = 0, k_row = 0, v_row = 0, o_row = 0;  // element stride between rows

  float scale_log2 = 0;   // softmax scale times log2(e): scores are kept in base 2
  // The band of keys a query sees by position (is_causal and window_size, combined): key j is
  // hidden from query i when j > i + causal_offset (if `causal`: is_causal, or a window's right
  // side) or j < i + lo_offset (if band_lo: a window's left side).
  bool causal = false;
  int64_t causal_offset = 0;
  bool band_lo = false;
  int64_t lo_offset = 0;

  // Variants, in base-2 units like the scores: softcap2 = softcap * log2(e) (0: none), then
  // ALiBi x -= slope2 * |i + diag_offset - j| when alibi (the slope is per head: FlashBlock).
  float softcap2 = 0;
  bool alibi = false;
  int64_t diag_offset = 0;

  const float* mask = nullptr;      // per (b): mask[i * mask_row + j * mask_col], or nullptr
  int64_t mask_row = 0, mask_col = 0;
  bool mask_is_bool = true;

  float dropout_p = 0;              // Philox dropout on the weights when > 0
  uint64_t dropout_seed = 0, dropout_offset = 0;
  int64_t dropout_i0 = 0, dropout_j0 = 0;  // global position of row 0 / key 0 (Philox counters)
  bool guard_v = false;             // v (backward: any input) holds NaN/Inf: never multiply it by a 0
  // SdpaOptions::allow_fp16_bf16_reduction (16-bit kernels only): P enters P.V as one 16-bit term
  // also when output_residual is asked (which then carries that output's float32 rounding), and
  // the backward enters P and dS as one term each, rounded to nearest, not as hi + lo.
  bool reduction = false;
};

// The backward's parameters: the forward's, plus what only the gradients need. Filled by
// make_flash_bwd_params (flash_inputs.hpp) from the same problem as the forward's.
struct FlashBwdParams : FlashParams {
  float scale = 0;  // the softmax scale itself (the dS -> dQ, dK factor)
};

// One work item: a block of up to kBlockQ queries of one (batch, head).
struct FlashBlock {
  const float* q;   // first query row of the block
  const float* k;   // key rows of this head
  const float* v;
  float* o;         // first output row of the block
  float* lse;       // base-2 LSE of the block's rows (max + log2(sum)), or nullptr
  float* weights;   // second pass only: (nq, S) rows of the attention weights, row stride S
  float* stats;     // with weights asked: (nq, 2) base-2 max and 1/sum per row, for their pass
  const float* mask;  // the (i0, 0) element of this head's mask, or nullptr
  int64_t i0, nq;   // first query index and number of queries
  int64_t bh;       // flat batch*head index (dropout counter)
  float alibi2 = 0;  // this head's ALiBi slope times log2(e)
  float sink2 = -std::numeric_limits<float>::infinity();  // its sink logit times log2(e), or none
};

// One query head of the backward pass over one key range (flash_bwd_kernel.hpp): its inputs,
// the forward's output and natural-log LSE, dO, and where its gradients go. dq is written (all L
// rows, row stride E) with the contribution of keys [j_begin, j_end) only: the driver sums the
// ranges' dq in a fixed order. dk and dv belong to the key/value head and are accumulated into
// (+=) on rows [j_begin, j_end), so the query heads of a GQA group, visited in order by the one
// thread that owns the range, sum into them deterministically.
struct FlashBwdHead {
  // Rows in the kernel's input dtype (float32, or bf16 for the AVX512-BF16 backward).
  const void* q;      // (L, E), row stride p.q_row
  const void* k;      // (S, E), row stride p.k_row
  const void* v;      // (S, Ev), row stride p.v_row
  const void* o;      // (L, Ev), row stride o_row: the forward's output (float32 kernels)
  const void* dout;   // (L, Ev), row stride do_row
  int64_t o_row, do_row;
  const float* lse;   // (L): the forward's LSE in natural log
  const float* dd;    // (L): D = rowsum(dO * O), computed beforehand (bf16 kernel), or nullptr
  const float* mask;  // the (0, 0) element of this head's mask, or nullptr
  float* dq;          // (L, E), row stride E, float32
  float* dk;          // (S, E), row stride E, float32
  float* dv;          // (S, Ev), row stride Ev, float32
  // (L, S), row stride S: receives dS of the head's keys in [j_begin, j_end) where P != 0
  // (SdpaOptions::need_attn_mask_grad; the rest must be zero beforehand), or nullptr.
  float* dmask;
  // The same as bf16 bits, rounded as they are written (the bf16 backward only; a bf16 mask with
  // an element per score: the gradient itself), or nullptr. At most one of the two is set.
  uint16_t* dmask_bf16;
  int64_t bh;         // flat batch*head index of the query head (dropout counter)
  float alibi2;       // the query head's ALiBi slope times log2(e) (0: none)
  int64_t j_begin, j_end;  // the key range; j_begin a multiple of the kernel's key group
};

// Philox keep decision for weight (bh, i, j), out of line (flash_fwd.cpp) so that the per-ISA
// kernel builds include no inline code shared with the rest of the library.
bool dropout_keep(const FlashParams& p, int64_t bh, int64_t i, int64_t j);

// Per-thread scratch, sized by flash_workspace_floats().
struct FlashWorkspace {
  float* buf;
};

}  // namespace attn::cpu

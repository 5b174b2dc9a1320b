// The low-precision fused forward kernels: one block of up to 32 queries of one (batch, head)
// with bf16 q, k, v and output (or, for the AMX kernel, fp16, and float32 computed at
// float32_matmul_precision "high" or "medium" on bf16 terms). Same FlashParams as the float32
// kernels (row strides in elements); their own block struct because the element type is the
// kernel's (its table knows which). Each kernel (AVX512-BF16:
// flash_avx512_bf16.cpp; AMX-BF16: flash_amx_bf16.cpp) is a table of functions the one driver
// (flash_fwd_bf16.cpp) runs: it packs K and V of every key/value head once, in the kernel's
// layout, before any query block reads them.
#pragma once

#include <cstdint>

#include "attn/dtype.hpp"
#include "sdpa/cpu/flash_params.hpp"

namespace attn::cpu {

// Whether a bf16 forward rounds P to two bf16 terms (hi + lo, 16 significant bits) before P.V
// instead of one (bf16, as PyTorch and FlashAttention do). Two when the call asks for
// output_residual (the float32 output must be the float32 attention's) and for head dims of
// values under 32: there one term broke the low-precision rule (error vs float64 at most 2x the
// float32 reference's rounded to bf16, plus 1e-4): three audits of small problems (L 1-33, S
// 1-130, GQA, every mask, up to 8 seeds; 1540 bf16 problems; AMD Zen 4) measured the one-term
// output's error at up to 2.5x that bound at Ev 1, 1.3x at 3, 1.9x at 8, 0.97x at 16, 0.88x at
// 32 and 64, 0.70x at 128 (tests/sdpa/test_low_precision.cpp keeps the worst as cases). Few
// output values, each a sum of few weights times values of either sign, leave nothing to
// average the rounding of P over. A second P.V product costs ~30 % of the forward at E = Ev =
// 128; at these head dims the scores dominate. At 32 and 64 one term stays within the bound on
// every problem measured, with 12-30 % to spare.
constexpr int64_t kBf16OneTermMinEv = 32;
inline bool bf16_p_two_terms(int64_t Ev, bool residual) { return residual || Ev < kBf16OneTermMinEv; }

struct FlashBlock16 {
  const void* q;       // first query row of the block, in the kernel's input dtype
  const void* k;       // key rows of this head
  const uint32_t* kp;  // K of this head in the kernel's layout (Bf16ForwardKernel::pack_k)
  const uint32_t* vp;  // V of this head in the kernel's layout (Bf16ForwardKernel::pack_v)
  void* o;             // first output row of the block
  void* o_lo;          // its rows of SdpaResult::output_residual (16-bit outputs), or nullptr
  float* lse;          // base-2 LSE of the block's rows, or nullptr
  const float* mask;   // the (i0, 0) element of this head's mask, or nullptr
  int64_t i0, nq;      // first query index and number of queries
  int64_t bh;          // flat batch*head index (dropout counter)
};

struct Bf16ForwardKernel {
  int64_t block_q;  // queries per block (FlashBlock16::nq <= block_q)
  int64_t (*workspace_bytes)(int64_t E, int64_t Ev);  // per thread
  // K of one head (S rows of E elements, row stride k_row) in 32-bit words; nullptr (with
  // pack_k): the kernel reads FlashBlock16::k directly.
  int64_t (*packed_k_words)(int64_t S, int64_t E);
  void (*pack_k)(const void* k, int64_t k_row, int64_t S, int64_t E, uint32_t* out);
  int64_t (*packed_v_words)(int64_t S, int64_t Ev);
  void (*pack_v)(const void* v, int64_t v_row, int64_t S, int64_t Ev, uint32_t* out);
  void (*forward_block)(const FlashParams& p, const FlashBlock16& b, void* workspace);
  // Whether the float32 output it computes when FlashBlock16::o_lo is set is the float32
  // attention's (P.V with P to 16 or more bits), which SdpaResult::output_residual must carry;
  // the registry sends a call asking for the residual elsewhere when not, unless the call allows
  // fp16/bf16 reduction (the residual then carries the one-term P's float32 output).
  bool residual_ok;
};

// The AVX512-BF16 (vdpbf16ps) kernel: built with -mavx512{f,vl,dq,bw,bf16} -mfma.
const Bf16ForwardKernel& bf16_kernel_avx512();
// The AMX-BF16 (tdpbf16ps) kernel, for bf16 inputs, fp16 ones (each value as two bf16 terms)
// and float32 ones at float32_matmul_precision "high" (three terms) or "medium" (one): built
// with the same flags plus -mamx-tile -mamx-bf16.
const Bf16ForwardKernel& bf16_kernel_amx();
// bf16 with P as two terms (hi + lo), where bf16_p_two_terms says so (output_residual asked, or
// Ev under 32).
const Bf16ForwardKernel& bf16_two_term_kernel_amx();
const Bf16ForwardKernel& fp16_kernel_amx();
const Bf16ForwardKernel& fp32_high_kernel_amx();
const Bf16ForwardKernel& fp32_medium_kernel_amx();

// The low-precision backward (flash_bwd_avx512_bf16.cpp; driver flash_backward_bf16 in
// flash_bwd.cpp): FlashBwdHead's q, k, v, dout in the kernel's dtype, gradients accumulated in
// float32. D = rowsum(dO * O) comes from the forward's output_residual (O + residual) where the
// caller saved it, else from row_dots (sum_j P_ij dP_ij over the keys the call sees), run over
// every query block before any backward item.
struct Bf16BackwardKernel {
  int64_t block_q;  // rows per row_dots call (nq <= block_q)
  int64_t (*row_dots_workspace_bytes)(int64_t E, int64_t Ev);
  // D and the probability mass sum_j P_ij (1 where the call holds the row's every key) of rows
  // [i0, i0 + nq) of the head; h.dd, dq, dk, dv, j_begin, j_end are not read.
  void (*row_dots)(const FlashBwdParams& p, const FlashBwdHead& h, int64_t i0, int64_t nq, float* d,
                   float* mass, void* workspace);
  int64_t (*backward_workspace_bytes)(int64_t L, int64_t E, int64_t Ev);  // per thread
  void (*backward)(const FlashBwdParams& p, const FlashBwdHead& h, void* workspace);
};

// AVX512-BF16 (vdpbf16ps), bf16 only: the flags of bf16_kernel_avx512.
const Bf16BackwardKernel& bf16_backward_avx512();

}  // namespace attn::cpu

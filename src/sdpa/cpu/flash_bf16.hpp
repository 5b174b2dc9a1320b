// The bfloat16 fused forward (flash_avx512_bf16.cpp): one block of up to 32 queries of one
// (batch, head) with bf16 q, k, v and output. Same FlashParams as the float32 kernels (row
// strides in elements), its own block struct because the pointers are 16-bit.
#pragma once

#include <cstdint>

#include "attn/dtype.hpp"
#include "sdpa/cpu/flash_params.hpp"

namespace attn::cpu {

struct FlashBlock16 {
  const uint16_t* q;  // first query row of the block (bf16 bits)
  const uint16_t* k;  // key rows of this head
  const uint32_t* vp;  // V of this head as key pairs (pack_v_pairs)
  uint16_t* o;        // first output row of the block
  float* lse;         // base-2 LSE of the block's rows, or nullptr
  const float* mask;  // the (i0, 0) element of this head's mask, or nullptr
  int64_t i0, nq;     // first query index and number of queries
  int64_t bh;         // flat batch*head index (dropout counter)
};

namespace avx512_bf16 {
constexpr int64_t kBlockQ = 32;
int64_t workspace_bytes(int64_t E, int64_t Ev);
void forward_block(const FlashParams& p, const FlashBlock16& b, void* workspace);
// V of one head (S rows of Ev bf16, row stride v_row) as key pairs for vdpbf16ps:
// out[j2 * Evp + c] = v[2 j2][c] | v[2 j2 + 1][c] << 16, Evp = Ev rounded up to 16, zero padded.
int64_t packed_v_words(int64_t S, int64_t Ev);
void pack_v_pairs(const uint16_t* v, int64_t v_row, int64_t S, int64_t Ev, uint32_t* out);
}  // namespace avx512_bf16

}  // namespace attn::cpu

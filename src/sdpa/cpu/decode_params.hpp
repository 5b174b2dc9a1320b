// Parameters of the split-KV decode kernel (flash-decoding), shared by its driver (decode.cpp)
// and its per-ISA builds (decode_kernel.hpp, compiled inside flash_<isa>.cpp).
//
// Decoding attends a few new queries (L <= 16) to a long KV cache: the work is reading K and V
// once, at the memory bandwidth. A work item is one (sequence, kv head, key range): the R =
// group * L query rows that read this kv head (GQA groups packed, so K/V are read once per kv
// head, not once per query head) against keys [j0, j1). It leaves a partial softmax per row
// (max m, sum l, unnormalised accumulator acc), and the driver merges the ranges through their
// LSEs. Keys and values are addressed through pages (a contiguous cache is one page), so the
// same kernel reads attn::PagedKvCache in place; there one kernel call runs the items of every
// kv head of a sequence over the same key range together, in the pool's memory order.
//
// Variants (SdpaOptions' window_size, softcap, alibi_slopes, sinks): the band (is_causal and the
// window) is two offsets per DecodeKv, since each sequence of a paged call has its own length;
// softcap is call-wide; ALiBi's slope is per row (rows of one item belong to different query
// heads). Sinks never reach the kernel: they are one logit per row with no value, which the
// driver adds once at the merge (a partial of every range would count it once per range).
#pragma once

#include <cstdint>

namespace attn::cpu {

// The element type of the cached keys and values. Its own enum, not attn::DType: the per-ISA
// builds include no header with inline code shared with the rest of the library.
enum class KvType : int { kFloat32, kBFloat16, kFloat16, kInt8 };

// Where one (sequence, kv head)'s keys and values live. Token t is in page
// pages[t / page_size] (page t / page_size itself when pages is null), row t % page_size:
//   key row   k + page * k_page + row * k_row   (elements of the KvType)
//   its scale k_scale[page * scale_page + row]  (kInt8 only: key = k_scale * int8 values)
// and likewise for v. A dense tensor is one page of page_size = S tokens.
struct DecodeKv {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_page = 0, v_page = 0, k_row = 0, v_row = 0;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_page = 0;
  const int64_t* pages = nullptr;
  int64_t page_size = 0;
  int64_t S = 0;  // tokens held
  // The band of query i: key j is visible iff i + lo_offset <= j (with DecodeParams::band_lo)
  // and j <= i + hi_offset (with band_hi); ALiBi's distance is |i + diag_offset - j|.
  int64_t lo_offset = 0, hi_offset = 0, diag_offset = 0;
};

// One call's constants.
struct DecodeParams {
  int64_t E = 0, Ev = 0;
  int64_t Ep = 0, Evp = 0;  // E and Ev rounded up to a multiple of 16 (every ISA's width divides)
  KvType kv = KvType::kFloat32;
  float scale_log2 = 0;     // softmax scale times log2(e): scores are kept in base 2
  // The variants as given (the driver turns them into each DecodeKv's offsets) ...
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded on that side
  // ... and as the kernel reads them: which sides of the band bound the keys, the softcap.
  bool band_lo = false, band_hi = false;
  float softcap2 = 0;       // softcap times log2(e) (0: none): x = c2 tanh(x / c2) in base 2
  int64_t mask_col = 0;     // element stride between keys of a mask row
  bool mask_is_bool = true;
  // The queries are bf16 (and so the output): with a bf16 cache, a build with a bf16 dot unit
  // scores them as bf16 pairs on it; P stays float32 (decode_bf16_dot.hpp). Set by run_decode.
  bool q_bf16 = false;
};

// One work item: R query rows against keys [j0, j1) of one DecodeKv.
struct DecodeItem {
  const float* q;            // (R, Ep) float32, zero-padded past E
  const int64_t* query_pos;  // (R): each row's query index i (its band: DecodeKv's offsets)
  const float* const* mask;  // (R): each row's mask row (key 0), or nullptr for no mask
  const float* alibi2;       // (R): each row's ALiBi slope times log2(e), or nullptr for none
  int64_t R;
  int64_t j0, j1;
  float* m;    // (R) out: base-2 running max of the range's visible scores (-inf if none)
  float* l;    // (R) out: sum of exp2(score - m)
  float* acc;  // (R, Evp) out: sum of exp2(score - m) * v
};

}  // namespace attn::cpu

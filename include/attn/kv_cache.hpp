// A paged KV cache for decoding, and attention over it.
//
// An inference engine keeps each layer's keys and values in fixed-size pages so that sequences
// grow without copies and freed memory is reused at once (vLLM's PagedAttention, llama.cpp's
// KV cells, FlashAttention's block table). PagedKvCache is one layer's pool:
//
//   key pages    (num_pages, heads_kv, page_size, head_dim)     in the cache's dtype
//   value pages  (num_pages, heads_kv, page_size, head_dim_v)
//   int8 only:   key/value scales (num_pages, heads_kv, page_size) float32, one per token and
//                head (symmetric: x ~= scale * q, q in [-127, 127])
//
// A page holds page_size consecutive tokens of one sequence for every head, each head's tokens
// contiguous (so the decode kernel reads a page's heads one after another: one run of memory per
// page, not one short block per head and page). A sequence's block table
// lists its pages in token order: token t lives in page block_table[t / page_size], row
// t % page_size. Pages come from a free list; free_sequence returns them (they are reused by the
// next sequence that needs a page, in any order, so a block table is in general not sorted).
//
// paged_attention reads the pages in place (no gather copy) through the split-KV decode kernel
// (src/sdpa/cpu/decode*.cpp), the one scaled_dot_product_attention uses for short queries.
//
// Errors are typed and leave the cache unchanged: every argument of a call is checked before
// anything is written.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attn/dtype.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn {

struct PagedKvCacheOptions {
  int64_t num_pages = 0;   // the pool's capacity: num_pages * page_size tokens over all sequences
  int64_t page_size = 16;  // tokens per page
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;  // 0: head_dim
  // kFloat32 (default), kBFloat16, kFloat16 (rounded to nearest even on append) or kInt8
  // (quantised on append, per token and head, scale = max|x| / 127; an all-zero row gets
  // scale 0).
  DType dtype = DType::kFloat32;
};

class PagedKvCache {
 public:
  // ValueError naming the field for a non-positive size or an unsupported dtype.
  explicit PagedKvCache(const PagedKvCacheOptions& options);

  // A new empty sequence; returns its id (the smallest id not in use, so ids are reused after
  // free_sequence and several caches driven by the same calls hand out the same ids).
  int64_t add_sequence();

  // Appends T tokens to sequence `seq`: key (T, heads_kv, head_dim) and value
  // (T, heads_kv, head_dim_v), of any floating dtype, converted (or quantised) to the cache's.
  // Errors (the cache unchanged): IndexError for an unknown or freed seq; ShapeError for a
  // wrong shape; DTypeError for a non-floating key or value; ValueError when the pool has too
  // few free pages ("needs N more pages, M free of P": the pool never grows, so that the
  // pointers handed to kernels stay valid) or, for an int8 cache, a NaN or Inf that int8
  // cannot hold.
  void append(int64_t seq, const TensorView& key, const TensorView& value);

  // Appends tokens already quantised (int8 caches only): key (T, heads_kv, head_dim) int8 with
  // key_scale (T, heads_kv) float32, and likewise value. A negative or non-finite scale is a
  // ValueError naming the argument (a zero scale is an all-zero row). DTypeError on a float cache.
  void append_quantized(int64_t seq, const TensorView& key, const TensorView& key_scale,
                        const TensorView& value, const TensorView& value_scale);

  // Returns the sequence's pages to the free list; the id may be handed out again.
  // IndexError for an unknown or already freed seq.
  void free_sequence(int64_t seq);

  int64_t length(int64_t seq) const;                    // tokens held; IndexError if unknown
  std::span<const int64_t> block_table(int64_t seq) const;  // its pages, in token order
  std::vector<int64_t> sequences() const;               // the live ids, ascending
  bool contains(int64_t seq) const;
  int64_t free_pages() const;

  const PagedKvCacheOptions& options() const { return options_; }
  int64_t num_pages() const { return options_.num_pages; }
  int64_t page_size() const { return options_.page_size; }
  int64_t heads_kv() const { return options_.heads_kv; }
  int64_t head_dim() const { return options_.head_dim; }
  int64_t head_dim_v() const { return options_.head_dim_v; }
  DType dtype() const { return options_.dtype; }

  // The pool (layout above); the scales are undefined tensors unless the dtype is kInt8.
  const Tensor& key_pages() const { return keys_; }
  const Tensor& value_pages() const { return values_; }
  const Tensor& key_scales() const { return key_scales_; }
  const Tensor& value_scales() const { return value_scales_; }

  // The sequence's tokens [0, length) as dense tensors (heads_kv, length, head_dim[_v]) in
  // float32 (int8 dequantised): for tests and for checking a kernel against the dense path.
  Tensor gather_keys(int64_t seq) const;
  Tensor gather_values(int64_t seq) const;

 private:
  struct Sequence {
    bool live = false;
    int64_t length = 0;
    std::vector<int64_t> pages;
  };
  const Sequence& live_sequence(int64_t seq, const char* who) const;
  // Pages an append of `tokens` to `s` takes from the free list; ValueError when too few are free.
  int64_t pages_needed(const Sequence& s, int64_t tokens, const char* who) const;
  // Writes checked tokens (T, heads_kv, dim) already in the cache's dtype (and their int8 scales).
  void write_tokens(int64_t seq, int64_t new_pages, const Tensor& key, const Tensor& value,
                    const Tensor* key_scale, const Tensor* value_scale);
  Tensor gather(int64_t seq, bool values, const char* who) const;

  PagedKvCacheOptions options_;
  Tensor keys_, values_, key_scales_, value_scales_;
  std::vector<Sequence> seqs_;        // indexed by id
  std::vector<int64_t> free_list_;    // pages not in use; taken from the back
};

struct PagedAttentionOptions {
  std::optional<double> scale;  // default 1/sqrt(head_dim)
  // Causal among the new tokens, bottom-right aligned (PyTorch's causal_lower_right): query i
  // of a sequence of length S sees keys j <= S - L_q + i. Without it every query sees all S keys.
  bool is_causal = false;
  bool need_lse = false;  // also return the LSE, (N, H_q, L_q) float32 (FlashAttention's layout)
  int num_threads = 0;    // 0: OpenMP's default
  // A decode kernel by name ("cpu.decode.avx512_bf16", "cpu.decode.avx512", "cpu.decode.avx2",
  // "cpu.decode.generic"), or "" for the best this CPU runs; ValueError for another name or one
  // this CPU cannot run.
  std::string kernel;
  // Variants, as SdpaOptions' (attn/sdpa.hpp) with the queries bottom-right aligned as is_causal:
  // query i of a sequence of length S sits at i' = S - L_q + i. All combine with each other and
  // with is_causal. The scores go x = scale q.k; x = softcap tanh(x / softcap);
  // x -= slope_h |i' - j|; then the band hides keys (-inf, never added).
  // Sliding window: key j is visible iff i' - left <= j <= i' + right ({-1, -1}: none; -1 is
  // unbounded on that side). Only the pages inside the window are read: cost grows with the
  // window, not with S.
  WindowSize window_size;
  std::optional<double> softcap;           // > 0 (Gemma 2); unset: none
  std::optional<TensorView> alibi_slopes;  // float32 (H_q) or (N, H_q)
  // float32 (H_q): one more logit per row with no value; the LSE includes it, and a row that sees
  // no key has output 0 and LSE sinks[h] (gpt-oss).
  std::optional<TensorView> sinks;
};

// Attention of N sequences' newest L_q tokens over everything their caches hold:
//   query (N, L_q, H_q, head_dim) float32, bfloat16 or float16, H_q a multiple of heads_kv
//   (query head h reads kv head h / (H_q / heads_kv)); seq_ids: N live sequences, each already
//   holding its L_q new tokens (length >= L_q) -> SdpaResult with output (N, L_q, H_q,
//   head_dim_v) in the query's dtype and, with need_lse, lse (N, H_q, L_q).
// Equal, within float32 rounding, to scaled_dot_product_attention of each query against that
// sequence's gathered keys and values (enable_gqa, CausalAlignment::kBottomRight, the same
// variants; (N, H_q) slopes are row n's (H_q)).
// L_q is at most 16 (the decode kernel's range; prefill a long prompt with
// scaled_dot_product_attention). A sequence may appear more than once (it is only read).
// Errors: ShapeError, DTypeError, IndexError for a dead or unknown id, ValueError for L_q > 16
// or a sequence shorter than L_q; for the variants, as scaled_dot_product_attention's, naming
// options.window_size, options.softcap, options.alibi_slopes or options.sinks.
SdpaResult paged_attention(const TensorView& query, const PagedKvCache& cache,
                           std::span<const int64_t> seq_ids,
                           const PagedAttentionOptions& options = {});

}  // namespace attn

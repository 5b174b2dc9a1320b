// Packed variable-length attention: N sequences of different lengths in one call, without padding
// (PyTorch 2.10's torch.nn.attention.varlen.varlen_attn, FlashAttention's flash_attn_varlen_func).
//
//   query (total_q, H, E), key (total_k, H_kv, E), value (total_k, H_kv, Ev): token-major, the
//   tokens of sequence n at rows [cu_seq_q[n], cu_seq_q[n+1]) of query and
//   [cu_seq_k[n], cu_seq_k[n+1]) of key and value. cu_seq_q and cu_seq_k are int32 tensors of
//   N + 1 cumulative lengths: cu[0] = 0, non-decreasing, cu_seq_q[N] = total_q and
//   cu_seq_k[N] = total_k. Sequence n has L_n = cu_seq_q[n+1] - cu_seq_q[n] queries and
//   S_n = cu_seq_k[n+1] - cu_seq_k[n] keys; max_q and max_k bound them (a longer sequence is a
//   ValueError; they may be larger than the longest).
//
// Each sequence attends only within itself, exactly as scaled_dot_product_attention on that
// sequence alone with the same options: is_causal with either alignment (the alignment uses the
// sequence's own L_n and S_n), scale, enable_gqa, window_size, softcap, alibi_slopes (shape (H)
// only), sinks, need_lse, backend / kernel (chosen per sequence, as that call would choose it:
// a forced decode kernel refuses a sequence of more than 16 queries), num_threads. Nothing is
// computed for padding: the cost is proportional to sum_n L_n * S_n.
// Not supported: attn_mask (ValueError), need_weights (ValueError), dropout with
// DropoutRng::kTorch (ValueError: use kPhilox).
//
// Result: output (total_q, H, Ev) in query's dtype; with need_lse, lse of shape (H, total_q)
// (FlashAttention's varlen layout; float32, float64 for float64 inputs). Sequences of length 0
// are allowed: L_n = 0 adds no rows; S_n = 0 gives its rows output 0 and LSE -inf (s_h with
// sinks), the fully-masked-row policy of attn/sdpa.hpp.
//
// Dropout (kPhilox only): sequence n's weights are keyed by batch*head index n * H + h, so its
// mask is exactly that of batch element n of a padded (N, H, max_q, max_k) call with the same
// dropout_seed and dropout_offset.
//
// Threads: the sequences run one after another, each on all num_threads threads (split within
// the sequence as the kernel splits one batch element), so threads stay balanced however
// different the lengths are. Results are bit-identical for any thread count.
//
// Bad input throws the typed errors of attn/error.hpp naming the argument, the expected and the
// actual value, before any computation (a rejected call draws nothing and writes nothing).
#pragma once

#include <cstdint>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn {

SdpaResult varlen_attn(const TensorView& query, const TensorView& key, const TensorView& value,
                       const TensorView& cu_seq_q, const TensorView& cu_seq_k, int64_t max_q,
                       int64_t max_k, const SdpaOptions& options = {});

// Gradients of varlen_attn: forward is what varlen_attn returned for these inputs and options
// (run with need_lse = true; its output and lse are read). Returns grad_query (total_q, H, E),
// grad_key (total_k, H_kv, E), grad_value (total_k, H_kv, Ev) and, with sinks, grad_sinks (H)
// summed over the sequences (in sequence order, in float64, then rounded to float32; float64
// for float64 inputs). Keys of a sequence with no queries get zero gradients, as do queries of
// a sequence with no keys. Dropout masks are replayed from (dropout_seed, dropout_offset).
// Bad input throws like the forward, plus ShapeError / DTypeError when grad_output,
// forward.output or forward.lse do not have the forward's shapes and dtypes.
SdpaGrads varlen_attn_backward(const TensorView& grad_output, const TensorView& query,
                               const TensorView& key, const TensorView& value,
                               const TensorView& cu_seq_q, const TensorView& cu_seq_k,
                               int64_t max_q, int64_t max_k, const SdpaSaved& forward,
                               const SdpaOptions& options = {});

}  // namespace attn

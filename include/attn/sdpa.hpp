// Scaled dot-product attention: the one functional core behind every attention module.
//
//   out = softmax(q @ k^T * scale + mask) @ v        (dropout applied to the weights)
//
// Semantics are torch.nn.functional.scaled_dot_product_attention's:
//   query (..., L, E), key (..., S, E), value (..., S, Ev), output (..., L, Ev). The leading
//   dims are (B, H), (H) or none ("unbatched"); key and value share query's leading dims,
//   except that with enable_gqa they may have H_kv heads where query has H_q, H_q % H_kv == 0
//   (query head h reads key/value head h / (H_q / H_kv), PyTorch's enable_gqa).
//   attn_mask broadcasts to (..., L, S) and is either boolean (true = the key position TAKES
//   PART, as in PyTorch SDPA; the opposite of masked_fill's convention) or additive float.
//   is_causal masks key j > query i (top-left alignment, PyTorch's; or j > i + S - L with
//   CausalAlignment::kBottomRight). scale defaults to 1/sqrt(E). dropout_p drops attention
//   weights with 1/(1-p) scaling, from PyTorch's bernoulli stream (DropoutRng::kTorch: a seed
//   reproduces PyTorch's math path) or from counter-based Philox (kPhilox, attn/philox.hpp).
//
// Dtypes: query, key and value share one floating dtype (float32, bfloat16, float16, float64;
// else DTypeError naming all three), with one declared exception: float32 queries may read
// bfloat16 or float16 keys and values (a decode step over a low-precision KV cache; the output is
// float32), which the decode kernels take (at most 16 queries per head; beyond, DTypeError). Low precision follows PyTorch: float32 accumulation and softmax, output (and
// weights) in the input dtype, LSE in float32; float64 is computed in float64 by the reference.
// attn_mask may be boolean of any dtype or additive of any floating dtype.
//
// Variants (SdpaOptions' last block): sliding window, logit softcapping, ALiBi and learnable
// sinks, with FlashAttention's semantics, in every kernel family, forward and backward (the
// bfloat16 kernel refuses them, and the float32 kernels take the call on widened inputs).
//
// Numerics policy: a query row whose every key is masked gets weights 0 and output 0 (PyTorch's
// math path returns NaN there; a NaN would poison the rest of a model, so attn defines it); its
// LSE is -inf, or s_h with sinks.
// NaN in an included score propagates.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attn/dtype.hpp"
#include "attn/random.hpp"
#include "attn/tensor.hpp"

namespace attn {

// A mask with its meaning made explicit, so a float 0/1 tensor can never be silently read with
// the wrong convention.
struct AttnMask {
  enum class Kind {
    kBool,      // value != 0: the position takes part; value == 0: masked out
    kAdditive,  // added to the scaled scores (use -inf to mask)
  };
  TensorView values;
  Kind kind = Kind::kBool;

  static AttnMask boolean(TensorView v) { return {v, Kind::kBool}; }
  static AttnMask additive(TensorView v) { return {v, Kind::kAdditive}; }
};

// Which family of kernels computes the attention (SdpaOptions::kernel picks one kernel by name;
// sdpa_kernels() lists them).
//   kReference: materialises the L x S score matrix (src/sdpa/reference); everything is
//               tested against it, and the chapter's modules print through it.
//   kFused:     the fused CPU kernels (src/sdpa/cpu): tile over query and key blocks with an
//               online softmax, O(L) memory, one build per instruction set ("cpu.flash.avx512",
//               "cpu.flash.avx2", "cpu.flash.generic", and for bfloat16 "cpu.flash.avx512_bf16"),
//               the best one this CPU runs first.
//               Dropout needs DropoutRng::kPhilox there.
//               For a decode step (at most 16 queries per head, no weights, no dropout) the
//               split-KV decode kernels ("cpu.decode.avx512_bf16": AVX-512's with bf16 dot
//               products for a bf16 cache, "cpu.decode.avx512", "cpu.decode.avx2",
//               "cpu.decode.generic") come first: they split the keys across threads, read
//               each kv head once for its whole GQA group, and merge the splits through their
//               LSEs; results are bit-identical for any thread count, like the others'.
//               need_weights or dropout send a short call to the flash kernels instead, so
//               those options can change the output's last bits (PyTorch's
//               MultiheadAttention likewise takes another path with need_weights).
//   kAuto:      the highest-priority kernel that takes the call: the best fused build unless
//               the call uses something only the reference supports (dropout with
//               DropoutRng::kTorch), then the reference.
enum class SdpaBackend { kAuto, kReference, kFused };

// Where query i sits among the keys when L != S: its aligned position is i' = i (kTopLeft) or
// i' = i + S - L (kBottomRight). is_causal hides keys j > i'; the sliding window and ALiBi
// measure from i' too, so the alignment applies to them whether or not is_causal is set (with
// none of the three it is ignored).
//   kTopLeft (PyTorch's is_causal): query i sees keys j <= i.
//   kBottomRight (decoding with a KV cache; FlashAttention's only alignment): query i sees keys
//   j <= i + (S - L), so the last query sees every key (PyTorch's causal_lower_right). With
//   L > S the first L - S queries see no key: output 0, lse -inf (the fully-masked-row policy).
enum class CausalAlignment { kTopLeft, kBottomRight };

// A sliding window (FlashAttention's window_size): query i sees key j iff
//   i' - left <= j <= i' + right        (i' as in CausalAlignment; -1 = unbounded on that side)
// With is_causal the right side is also clipped at the diagonal (j <= i'). Hugging Face's
// `sliding_window = w` (Mistral, Gemma: each token sees itself and the w - 1 before it) is
// {w - 1, 0} with is_causal. Tiles wholly outside the band are skipped by the fused kernels, so
// their cost grows with L * window, not L * S. Values below -1: ValueError.
struct WindowSize {
  int64_t left = -1;
  int64_t right = -1;
  bool unbounded() const { return left < 0 && right < 0; }
};

// Which random stream drops attention weights.
//   kTorch:  PyTorch's CPU bernoulli stream from `generator`, in memory order of the (..., L, S)
//            weights: with the same seed, the same mask as PyTorch's math path (reference only).
//   kPhilox: counter-based Philox4x32-10 keyed by (dropout_seed, dropout_offset) and indexed by
//            (batch*head, query, key): the same mask whatever the tiling, backend or thread
//            count, so the fused kernel and the reference agree.
enum class DropoutRng { kTorch, kPhilox };

struct SdpaOptions {
  std::optional<AttnMask> attn_mask;
  float dropout_p = 0.0f;             // in [0, 1]; 1 drops every weight (no draws), as F.dropout
  bool is_causal = false;             // may not be combined with attn_mask (as in PyTorch)
  CausalAlignment causal_alignment = CausalAlignment::kTopLeft;
  std::optional<double> scale;        // default 1/sqrt(E); finite with |scale| <= FLT_MAX / log2(e)
                                      // (~2.36e38, the kernels' float32 range), else ValueError
  bool enable_gqa = false;            // key/value may have H_kv heads, H_q a multiple of H_kv
  bool need_weights = false;          // also return the (post-dropout) attention weights
  bool need_lse = false;              // also return the per-row log-sum-exp of the scaled scores
  // bf16/fp16 calls: also return output_residual, the float32 output's rounding error in the
  // dtype, for a backward that must not re-derive it (see SdpaResult). Ignored for float32 and
  // float64 calls, whose output is exact in its dtype. The decode kernels decline it (inference),
  // varlen_attn returns it, attn::dist refuses it. Training sets it: the forward then costs more
  // (cpu.flash.avx512_bf16 enters P into P.V as two bf16 terms: ~1.3x its time; its output,
  // computed from the more exact P, may differ from the call without in the last bit) and the
  // backward less (docs/NUMERICS.md).
  bool need_output_residual = false;
  // Backward only (the forward ignores it): also return SdpaGrads::grad_attn_mask, the gradient
  // of an additive attn_mask (a learned bias: T5's relative positions, Swin's), as PyTorch's
  // autograd gives a float mask that requires grad. ValueError without an additive mask. It is
  // dS = P * (dP - rowsum(dO * O)), the gradient of the final scores, summed over the dims the
  // mask broadcasts along (in a fixed order: deterministic). Memory: one (..., L, S) float32
  // buffer (float64 for float64 inputs) on top of the fused kernels' O(L) state: the L x S
  // storage PyTorch's math path, which it runs for such a mask, holds several of.
  bool need_attn_mask_grad = false;
  // bf16/fp16 calls: let the kernels round intermediates to the 16-bit type, as FlashAttention's
  // kernels and PyTorch's CPU flash kernel do (PyTorch's switch for its math path is
  // torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp). The backward of
  // cpu.flash.avx512_bf16 then enters P and dS into its products as one bf16 term each (rounded to
  // nearest) instead of two: 5 products per score instead of 8, about 1.4x faster. The bf16
  // forward keeps P in one term also when need_output_residual is set (the residual then carries
  // that output's float32 rounding, and costs one more store instead of ~1.3x the forward's time),
  // so the output is the same with or without the residual. Errors meet FlashAttention's rule
  // against a 16-bit math reference instead of attn's stricter default against float32 rounded
  // once (docs/NUMERICS.md). An allowance, not an order: a kernel may compute more exactly (the
  // others do so today). Ignored for float32 and float64 calls.
  bool allow_fp16_bf16_reduction = false;
  DropoutRng dropout_rng = DropoutRng::kTorch;
  Generator* generator = nullptr;     // kTorch draws; nullptr = default_generator()
  uint64_t dropout_seed = 0;          // kPhilox key
  uint64_t dropout_offset = 0;        // kPhilox: advance between calls for a fresh mask
  SdpaBackend backend = SdpaBackend::kAuto;
  // A registered kernel by name ("reference", "cpu.flash.avx512", "cpu.flash.avx2",
  // "cpu.flash.generic"; sdpa_kernels() lists them): that kernel runs, or the call throws
  // ValueError with the reason it cannot (this CPU lacks a feature its build assumes, the options
  // need something it lacks); an unknown name throws ValueError listing the registered ones.
  // Empty: the backend family's highest-priority kernel that takes the call.
  std::string kernel;
  int num_threads = 0;                // fused kernel threads; 0 = OpenMP's default
  // For float32 q, k, v: how their products may be computed (attn/dtype.hpp; PyTorch's
  // torch.set_float32_matmul_precision). kDefault follows set_float32_matmul_precision
  // (kHighest unless changed). kHigh and kMedium run the forward on cpu.flash.amx_bf16 where the
  // CPU has AMX-BF16 (elsewhere the float32 kernels run, as in PyTorch); the backward stays
  // float32.
  Float32MatmulPrecision float32_matmul_precision = Float32MatmulPrecision::kDefault;

  // ---- variants (FlashAttention's semantics; all combine with each other and with the above) --
  // The scores go through these steps, in this order, before the softmax:
  //   x = scale * q.k;  x = softcap * tanh(x / softcap);  x -= slope_h * |i' - j|;  masks
  // (attn_mask, then is_causal and window_size: hidden keys get -inf and are never added; a key
  // outside the window or the diagonal stays hidden whatever an additive mask adds there).
  WindowSize window_size;             // sliding window; {-1, -1} = none
  // Logit softcapping (Gemma 2, Grok): > 0, applied to the scaled score before ALiBi and the
  // masks; the backward goes through tanh. Unset = none; 0 or negative: ValueError, as is a
  // value outside float32's normal range [FLT_MIN, FLT_MAX / log2(e)] (~[1.18e-38, 2.36e38]),
  // where the kernels' float32 1/softcap or softcap * log2(e) would be infinite.
  std::optional<double> softcap;
  // ALiBi (BLOOM, MPT): float32 slopes of shape (H) or (B, H) (H = query heads; 1 for 2-D
  // inputs; (B, H) needs 4-D inputs); x -= slope * |i' - j|. Constants: no gradient.
  // Like attn_mask, alibi_slopes and sinks are views: their tensors must outlive the call.
  // Finite, |slope| <= FLT_MAX / log2(e) (as scale), else ValueError.
  std::optional<TensorView> alibi_slopes;
  // Learnable attention sinks (gpt-oss): float32 logits of shape (H). Each row's softmax gets one
  // more logit s_h, with no value, in the units of the final scores x (never capped, biased,
  // masked or dropped):  p_ij = exp(x_ij) / (exp(s_h) + sum_k exp(x_ik)). The LSE includes it,
  // so a row whose every key is masked has output 0 and LSE s_h. The backward returns
  // d(sinks) = -sum_i p_i,sink * (dO_i . O_i) (summed over batch). Finite, |s_h| <=
  // FLT_MAX / log2(e) (as scale), else ValueError.
  std::optional<TensorView> sinks;

  // ---- global positions (context parallelism: attn::dist, a slice of a longer sequence) ------
  // Query row i is token query_pos_offset + i and key j token key_pos_offset + j of the whole
  // sequence: is_causal, the window and ALiBi compare these positions (i' above becomes
  // i + query_pos_offset - key_pos_offset, plus S - L with kBottomRight), and Philox dropout
  // keys weight (i, j) by them, so a slice computes exactly its part of the whole call (its
  // mask included). attn_mask stays indexed by local (i, j). Each >= 0 with offset + length
  // <= 2^32 (Philox's 32-bit counters), else ValueError; varlen_attn refuses nonzero ones.
  int64_t query_pos_offset = 0;
  int64_t key_pos_offset = 0;
};

struct SdpaResult {
  Tensor output;        // (..., L, Ev)
  Tensor attn_weights;  // (..., L, S) when need_weights, else undefined
  Tensor lse;           // (..., L) when need_lse: log(sum_j exp(score_ij)) of the scaled,
                        // masked scores (dropout does not change it), -inf for a row with
                        // every key masked; else undefined
  // (..., L, Ev) in the output's dtype when need_output_residual and the dtype is bf16 or fp16:
  // the float32 output the kernel computed minus `output`, rounded to the dtype (0 where the
  // output is not finite), so output + output_residual carries 16 significant bits (bf16; fp16:
  // 22). The backward's D = rowsum(dO * O) needs the float32 output: with this saved it reads
  // it instead of recomputing it (one forward pass, or two of the low-precision backward's
  // products per score). Memory: one more 16-bit copy of the output. Else undefined.
  Tensor output_residual;
};

SdpaResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                        const TensorView& value, const SdpaOptions& options = {});

// What a backward reads of its forward: views of the output, the LSE and (kTorch dropout only)
// the weights, in any layout. Made implicitly from the forward's SdpaResult; a framework that
// keeps its own tensors (attn.torch's saved output and LSE) passes views of them instead, with
// no copy. Views: whatever they view must outlive the backward call (never bind one to a
// temporary SdpaResult, e.g. `SdpaSaved s = scaled_dot_product_attention(...)` dangles).
//
// output_residual (optional, 16-bit calls): the forward's SdpaResult::output_residual. With it the
// backward takes D from output + output_residual and skips re-deriving the float32 output;
// without it the gradients are the same up to float32 rounding, at that extra cost.
struct SdpaSaved {
  TensorView output, lse, attn_weights, output_residual;
  SdpaSaved() = default;
  SdpaSaved(const SdpaResult& r)  // NOLINT(google-explicit-constructor): a forward's result is one
      : output(r.output), lse(r.lse), attn_weights(r.attn_weights), output_residual(r.output_residual) {}
  SdpaSaved(TensorView out, TensorView log_sum_exp, TensorView weights = {}, TensorView residual = {})
      : output(out), lse(log_sum_exp), attn_weights(weights), output_residual(residual) {}
};

// ---- backward ------------------------------------------------------------------------------------
//
// Gradients of scaled_dot_product_attention with respect to query, key and value, given the
// gradient of the output. `forward` is what the forward call returned for these very inputs and
// `options` (same mask, scale, causal alignment, GQA, dropout settings): its output and its lse
// (run the forward with need_lse = true) are read, P is recomputed from the lse (no L x S buffer in
// the fused backend), and
//   dV = P_d^T dO,  dP_d = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K,
//   dK = scale dS^T Q
// where P_d is P after dropout. With enable_gqa, dK and dV of a key/value head sum the gradients
// of every query head reading it. An additive attn_mask gets dS itself, summed to its shape,
// with options.need_attn_mask_grad (it is added to the final scores, after softcap's tanh, so
// the chain through tanh is not in it); else no mask gets a gradient.
//
// Dropout: kPhilox masks are replayed from (dropout_seed, dropout_offset), exactly. A kTorch mask
// cannot be drawn again (the generator has moved on), so the backward needs the forward's
// post-dropout weights: run the forward with need_weights = true; without them it throws
// ValueError. The kernel is chosen as in the forward (options.kernel, else options.backend's
// family; kAuto: fused unless kTorch dropout). The fused backward is deterministic:
// bit-identical gradients for any thread count.
//
// Bad input throws like the forward, plus ShapeError when grad_output, forward.output or
// forward.lse do not have the forward's shapes and ValueError when forward.lse is missing.
struct SdpaGrads {
  Tensor grad_query;  // query's shape
  Tensor grad_key;    // key's shape (H_kv heads with GQA)
  Tensor grad_value;  // value's shape
  Tensor grad_sinks;  // (H) when options.sinks (float32; float64 for float64 inputs), else undefined
  // With options.need_attn_mask_grad: the attn_mask's own shape and dtype (summed over the dims
  // it broadcasts along, as torch's autograd sums them), else undefined.
  Tensor grad_attn_mask;
};

SdpaGrads scaled_dot_product_attention_backward(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const SdpaSaved& forward,
                                                const SdpaOptions& options = {});

// ---- kernels ---------------------------------------------------------------------------------
//
// Every kernel behind scaled_dot_product_attention (and its backward, which makes the same
// choice), highest priority first. runs_on_this_cpu is false when this CPU lacks a feature the
// kernel's build assumes; reason_if_not then says which ("needs CPU features avx512f ... (this
// CPU: avx2 fma f16c)").
struct SdpaKernelInfo {
  std::string name;
  SdpaBackend family;         // kReference or kFused
  std::vector<DType> dtypes;  // element types it computes in
  bool runs_on_this_cpu;
  std::string reason_if_not;
  // "" if kAuto may choose it here; else why kAuto prefers another kernel that is faster on this
  // CPU (measured once per process; e.g. the bf16 kernel where vdpbf16ps is slower than FMA).
  std::string auto_declines;
  // Also takes float32 q, k, v, but only at float32_matmul_precision kHigh or kMedium (computing
  // on bf16 terms; cpu.flash.amx_bf16); `dtypes` lists what it takes at every precision.
  bool reduced_float32 = false;
};
std::vector<SdpaKernelInfo> sdpa_kernels();

// The name of the kernel scaled_dot_product_attention(query, key, value, options) would run;
// throws exactly as that call would for arguments it rejects or a kernel that cannot take them.
std::string sdpa_kernel_name(const TensorView& query, const TensorView& key,
                             const TensorView& value, const SdpaOptions& options = {});

// The CPU model and the features the kernel choice sees, e.g.
// "Intel(R) Xeon(R) ... [avx2 fma f16c avx512f avx512dq avx512bw avx512vl]" (for bench output).
std::string cpu_description();

namespace reference {

// The same computation carried out entirely in float64 from the float32 inputs: the "truth"
// that float32 kernels are measured against in tests. Dropout draws the same mask from a copy
// of the generator state (kTorch) or from the same Philox counters (kPhilox), so results are
// comparable with dropout too.
struct SdpaResultF64 {
  Shape output_shape, weights_shape, lse_shape;
  std::vector<double> output, attn_weights;  // row-major
  std::vector<double> lse;  // (..., L) when need_lse (as SdpaResult::lse), else empty
};
SdpaResultF64 scaled_dot_product_attention_f64(const TensorView& query, const TensorView& key,
                                               const TensorView& value,
                                               const SdpaOptions& options = {});

// Float64 gradients (row-major, the shapes of query, key and value) of the float64 forward above,
// for grad_output given in float32: the truth the float32 backward kernels are measured against.
// kTorch dropout draws the mask from a copy of the generator state, as the forward does.
struct SdpaGradsF64 {
  std::vector<double> grad_query, grad_key, grad_value;
  std::vector<double> grad_sinks;  // (H) when options.sinks, else empty
  std::vector<double> grad_attn_mask;  // the mask's shape with options.need_attn_mask_grad, else empty
};
SdpaGradsF64 scaled_dot_product_attention_backward_f64(const TensorView& grad_output,
                                                       const TensorView& query,
                                                       const TensorView& key,
                                                       const TensorView& value,
                                                       const SdpaOptions& options = {});

}  // namespace reference

}  // namespace attn

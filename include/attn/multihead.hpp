// torch.nn.MultiheadAttention: PyTorch's own multi-head attention module, with its constructor,
// forward signature, parameter names (in_proj_weight, in_proj_bias, out_proj.weight,
// out_proj.bias; q/k/v_proj_weight with kdim or vdim; bias_k, bias_v) and initialisation, so a
// state_dict saved from PyTorch loads unchanged and manual_seed(s) gives the weights
// torch.manual_seed(s) gives. Like every attn module it only
// projects and calls scaled_dot_product_attention.
#pragma once

#include <cstdint>
#include <optional>

#include "attn/modules.hpp"

namespace attn::nn {

class MultiheadAttention : public Module {
 public:
  // As torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
  // add_zero_attn, kdim, vdim, batch_first). kdim/vdim 0 mean embed_dim; where either differs
  // from embed_dim the projections are torch's separate q_proj_weight (E, E), k_proj_weight
  // (E, kdim) and v_proj_weight (E, vdim), drawn in that order, and in_proj_weight is undefined.
  // add_bias_kv: learned bias_k, bias_v (1, 1, E) (xavier_normal_, after the weights) appended to
  // the projected keys and values as one more key; add_zero_attn: then a key and value of zeros.
  // Each adds a column to the weights, which the masks see as 0 (not masked), as in torch.
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, float dropout = 0.0f, bool bias = true,
                     bool add_bias_kv = false, bool add_zero_attn = false, int64_t kdim = 0,
                     int64_t vdim = 0, bool batch_first = false,
                     Generator& gen = default_generator());

  struct Result {
    Tensor output;        // (L, N, E), or (N, L, E) with batch_first, or (L, E) unbatched
    Tensor attn_weights;  // need_weights: (N, L, S) averaged over heads, or (N, H, L, S) with
                          // average_attn_weights = false (no N when unbatched); else undefined
  };

  // torch's forward(query, key, value, key_padding_mask, need_weights, attn_mask,
  // average_attn_weights, is_causal).
  //   query (L, N, E) / key (S, N, kdim), value (S, N, vdim) -- (N, L, E) / (N, S, kdim or
  //   vdim) with batch_first -- or unbatched (L, E) / (S, kdim or vdim).
  //   key_padding_mask (N, S) or (S) unbatched: torch's convention, nonzero = the key is IGNORED
  //   when `*_mask_is_bool`, else a float mask added to the scores. Same for attn_mask, (L, S) or
  //   (N * num_heads, L, S). (Torch tells the two kinds apart by dtype; attn tensors are float, so
  //   the kind is explicit.)
  //   is_causal: masks key j > query i. torch treats it as a hint that attn_mask already is the
  //   causal mask (and requires one); attn applies the causal mask itself, with or without
  //   attn_mask.
  // Dropout (training, p > 0) drops attention weights from the generator, as torch does; the
  // returned weights are the dropped ones. Unlike torch, a query whose every key is masked gets
  // output 0 (torch: NaN).
  Result forward(const TensorView& query, const TensorView& key, const TensorView& value,
                 const TensorView& key_padding_mask = {}, bool need_weights = true,
                 const TensorView& attn_mask = {}, bool average_attn_weights = true,
                 bool is_causal = false, bool key_padding_mask_is_bool = true,
                 bool attn_mask_is_bool = true) const;

  NamedTensors named_parameters() override;

  int64_t embed_dim, num_heads, head_dim, kdim, vdim;
  float dropout;
  bool batch_first;
  Tensor in_proj_weight;  // (3 * embed_dim, embed_dim): W_q, W_k, W_v stacked; undefined when
                          // kdim or vdim differs from embed_dim, which uses the three below
  Tensor q_proj_weight, k_proj_weight, v_proj_weight;  // (E, E), (E, kdim), (E, vdim) or undefined
  Tensor in_proj_bias;    // (3 * embed_dim) or undefined (bias = false)
  Tensor bias_k, bias_v;  // (1, 1, embed_dim) with add_bias_kv, else undefined
  bool add_zero_attn;
  Linear out_proj;
};

}  // namespace attn::nn

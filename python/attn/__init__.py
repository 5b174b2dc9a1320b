"""attn: transformer attention with PyTorch's semantics and PyTorch's numbers.

The functional core ``scaled_dot_product_attention`` (torch.nn.functional's), the chapter's
modules (SelfAttentionV1 ... MultiHeadAttention), torch.nn's Linear, Dropout, Embedding and
MultiheadAttention, a generator that reproduces PyTorch's weights and dropout masks
(``manual_seed``), and safetensors files with PyTorch's state_dict names.

Inputs are NumPy arrays or DLPack tensors (PyTorch CPU tensors), read in place when they are
float32 with non-negative strides (and, for ``scaled_dot_product_attention``, float64, float16
and bfloat16 too); outputs are NumPy arrays. Kernels run without the GIL. bfloat16 arrays are
``ml_dtypes.bfloat16`` NumPy arrays (NumPy has no bfloat16 of its own); ``ml_dtypes`` is only
imported when a bfloat16 array comes in or goes out.
"""
import numpy as _np

from ._attn import _scaled_dot_product_attention
from ._attn import (  # noqa: F401
    CausalAttention,
    Dropout,
    Embedding,
    FormatError,
    Linear,
    Module,
    MultiheadAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    cache_stats,
    empty_cache,
    get_float32_matmul_precision,
    load_file,
    load_metadata,
    manual_seed,
    rand,
    randn,
    save_file,
    sdpa_kernels,
    set_cache_limit,
    set_float32_matmul_precision,
)

__version__ = "0.1.0"

__all__ = [
    "CausalAttention", "Dropout", "Embedding", "FormatError", "Linear", "Module",
    "MultiheadAttention", "MultiHeadAttention", "MultiHeadAttentionWrapper", "SelfAttentionV1",
    "SelfAttentionV2", "load_file", "load_metadata", "manual_seed", "rand", "randn", "save_file",
    "scaled_dot_product_attention", "sdpa_kernels", "cache_stats", "set_cache_limit", "empty_cache",
    "set_float32_matmul_precision", "get_float32_matmul_precision",
]


def _is_bfloat16(x):
    """True for an ml_dtypes.bfloat16 NumPy array and a torch.bfloat16 tensor (by name, so that
    neither ml_dtypes nor torch is imported here)."""
    dt = getattr(x, "dtype", None)
    return dt is not None and str(dt) in ("bfloat16", "torch.bfloat16")


def _ml_bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            "attn returns bfloat16 results as ml_dtypes.bfloat16 NumPy arrays (NumPy has no "
            "bfloat16 of its own): install ml_dtypes (pip install ml_dtypes), or pass float32 "
            "inputs") from None
    return ml_dtypes.bfloat16


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, kernel=None,
                                 window_size=(-1, -1), softcap=None, alibi_slopes=None,
                                 sinks=None):
    """torch.nn.functional.scaled_dot_product_attention.

    query (..., L, E), key (..., S, E), value (..., S, Ev) -> (..., L, Ev), with leading dims
    (B, H), (H) or none. attn_mask: a bool array (True = the key takes part) or a float array
    (any floating dtype) added to the scores, broadcastable to (..., L, S). dropout_p draws from
    attn's default generator exactly as PyTorch's math path does (attn.manual_seed). scale
    defaults to 1/sqrt(E). enable_gqa lets key/value have fewer heads than query.

    dtypes: query, key and value must share one (mixed dtypes raise TypeError naming them), and
    the result has it:

    - float32 runs on attn's kernels (read in place when the strides allow);
    - float16 (NumPy's or torch.float16) and bfloat16 (``ml_dtypes.bfloat16`` NumPy arrays or
      torch.bfloat16 tensors) compute in float32 (softmax and accumulation; a native bfloat16
      kernel where the CPU has AVX512-BF16) and round the output to the input dtype once, as
      PyTorch does. A float16 result is a NumPy float16 array, a bfloat16 one an
      ``ml_dtypes.bfloat16`` array (TypeError asking to install ml_dtypes if it is missing);
    - float64 (NumPy's default) runs on the float64 reference: the inputs are read as float64
      (no rounding to float32) and every product and sum is in float64.

    kernel: a kernel name from :func:`sdpa_kernels` ("reference", "cpu.flash.avx2", ...) to run
    that kernel, ValueError if it is unknown or cannot take the call (this CPU lacks a feature,
    the dtype is not one it computes, dropout needs the reference); None picks the best one.

    Variants (FlashAttention's semantics; they combine with each other and with the above, and
    the scores go through them in this order: scale, softcap, ALiBi, then the masks):

    - window_size=(left, right): query i sees key j iff i - left <= j <= i + right (-1 =
      unbounded on that side; with is_causal the right side is also clipped at the diagonal).
      Hugging Face's ``sliding_window = w`` is ``window_size=(w - 1, 0)`` with is_causal=True.
      Values below -1: ValueError.
    - softcap: logit softcapping (Gemma 2), x = softcap * tanh(x / softcap) on the scaled
      scores; a float > 0 (ValueError otherwise), None for none.
    - alibi_slopes: ALiBi, a float32 array of shape (H) or (B, H) (H = query heads; (H) is (1)
      for 2-D inputs; (B, H) needs 4-D ones); x -= slope * |i - j|. float64 arrays are rounded
      to float32.
    - sinks: learnable attention sinks (gpt-oss), float32 logits of shape (H): each row's
      softmax gets one more logit s_h with no value, so the weights sum to less than 1, and a
      row whose every key is masked gives 0.

    A row whose every key is masked gives 0, not NaN. Raises TypeError for integer, bool or other
    dtypes, mixed dtypes and GPU tensors, ValueError for bad shapes or values.
    """
    bits = 0
    args = [query, key, value, attn_mask]
    for i, a in enumerate(args):
        if isinstance(a, _np.ndarray) and str(a.dtype) == "bfloat16":  # ml_dtypes.bfloat16
            args[i] = a.view(_np.uint16)
            bits |= 1 << i
    if all(_is_bfloat16(a) for a in (query, key, value)):
        _ml_bfloat16()  # the result will be bfloat16: fail before computing if it cannot be returned
    out = _scaled_dot_product_attention(*args, dropout_p=dropout_p, is_causal=is_causal,
                                        scale=scale, enable_gqa=enable_gqa, kernel=kernel,
                                        bf16_bits=bits, window_size=window_size,
                                        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if out.dtype == _np.uint16:  # bfloat16 bits
        out = out.view(_ml_bfloat16())
    return out


# ---- varlen_attn ------------------------------------------------------------------------------
from ._attn import _varlen_attn  # noqa: E402

__all__ += ["varlen_attn"]


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                causal_alignment="top_left", scale=None, enable_gqa=False, window_size=(-1, -1),
                softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0,
                dropout_offset=0, need_lse=False, kernel=None, num_threads=0):
    """Packed variable-length attention (torch.nn.attention.varlen.varlen_attn's arguments).

    query (total_q, H, E), key (total_k, H_kv, E), value (total_k, H_kv, Ev): the tokens of N
    sequences packed along dim 0, sequence n at rows cu_seq_q[n]:cu_seq_q[n+1] of query and
    cu_seq_k[n]:cu_seq_k[n+1] of key and value. cu_seq_q, cu_seq_k: N + 1 cumulative lengths
    (an integer array, read as int32), starting at 0, non-decreasing, ending at total_q and
    total_k. max_q, max_k: at least every sequence's query / key length (ValueError otherwise).

    Each sequence attends only within itself, with the result of
    :func:`scaled_dot_product_attention` on that sequence alone: is_causal (causal_alignment
    "top_left", PyTorch's, or "bottom_right", FlashAttention's, measured on each sequence's own
    lengths), scale (default 1/sqrt(E)), enable_gqa, and the variants with FlashAttention's
    semantics: window_size=(left, right) (-1 = unbounded), softcap (> 0), alibi_slopes (H,)
    and sinks (H,) (float arrays). No padding is computed. Sequences of length 0 are allowed; a
    query of a sequence without keys gets output 0 (LSE -inf, or its head's sink).

    dropout_p drops attention weights with counter-based Philox keyed by (dropout_seed,
    dropout_offset) -- not the default generator --: sequence n gets batch element n's mask of
    the padded (N, H, max_q, max_k) call with the same seed and offset.

    Returns the output (total_q, H, Ev) in the inputs' dtype, or (output, lse) with need_lse:
    lse of shape (H, total_q) (FlashAttention's varlen layout; float32, float64 for float64
    inputs). kernel: a name from :func:`sdpa_kernels`, chosen per sequence otherwise.
    num_threads: threads per sequence (0: OpenMP's default); every sequence runs on all of them.
    """
    bits = 0
    args = [query, key, value]
    for i, a in enumerate(args):
        if isinstance(a, _np.ndarray) and str(a.dtype) == "bfloat16":  # ml_dtypes.bfloat16
            args[i] = a.view(_np.uint16)
            bits |= 1 << i
    if all(_is_bfloat16(a) for a in (query, key, value)):
        _ml_bfloat16()  # fail before computing if the bfloat16 result cannot be returned
    res = _varlen_attn(*args, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal,
                       causal_alignment=causal_alignment, scale=scale, enable_gqa=enable_gqa,
                       window_size=tuple(window_size), softcap=softcap,
                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                       dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                       need_lse=need_lse, kernel=kernel, num_threads=num_threads,
                       bf16_bits=bits)
    out = res[0] if need_lse else res
    if out.dtype == _np.uint16:  # bfloat16 bits
        out = out.view(_ml_bfloat16())
    return (out, res[1]) if need_lse else out

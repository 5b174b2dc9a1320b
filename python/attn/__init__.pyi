"""Type stubs for attn (the extension module attn._attn). See docs/API.md."""
from typing import Any, Literal, Mapping, Optional, Sequence, Tuple, TypedDict, TypeVar, Union

import numpy as np
import numpy.typing as npt

# NumPy arrays, PyTorch CPU tensors and other DLPack tensors, nested sequences.
ArrayLike = Union[npt.ArrayLike, Any]
F32 = npt.NDArray[np.float32]

__version__: str

class FormatError(ValueError):
    """A malformed file (e.g. a safetensors header)."""

def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    kernel: Optional[str] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
) -> npt.NDArray[Any]:
    """torch.nn.functional.scaled_dot_product_attention; the result has the inputs' dtype:
    float32, float64 (computed in float64), float16, or bfloat16 (an ml_dtypes.bfloat16 array).
    kernel: a name from sdpa_kernels() to force one kernel (ValueError if unknown or unable).

    Variants (FlashAttention's semantics, C++ attn::SdpaOptions); they combine with each other
    and with the arguments above. Per key the scaled score x = scale * q.k goes through softcap,
    then ALiBi, then the masks (attn_mask, then is_causal and window_size, so a key outside the
    window stays hidden whatever an additive mask adds):

    window_size: (left, right), a sliding window: query i sees key j iff
        i - left <= j <= i + right, -1 = unbounded on that side; with is_causal the right side
        is also clipped at the diagonal. Hugging Face's ``sliding_window = w`` (Mistral, Gemma:
        each token sees itself and the w - 1 before it) is ``window_size=(w - 1, 0)`` with
        ``is_causal=True``. A value below -1 raises ValueError naming window_size; anything but
        a pair of ints TypeError.
    softcap: logit softcapping (Gemma 2, Grok): x = softcap * tanh(x / softcap), applied to the
        scaled score before ALiBi and the masks. Must be finite and > 0 (else ValueError naming
        softcap); None = none.
    alibi_slopes: ALiBi (BLOOM, MPT): slopes of shape (H) or (B, H) (H = query heads, 1 for 2-D
        inputs; (B, H) needs 4-D inputs); x -= slope * |i - j|. float32 (float64 is rounded to
        float32); another dtype raises TypeError, another shape or a non-finite slope
        ValueError, each naming alibi_slopes.
    sinks: learnable attention sinks (gpt-oss): logits of shape (H), float32 (float64 rounded).
        Each row's softmax gets one more logit s_h with no value, in the units of the final
        scores (never capped, biased or masked):
        p_ij = exp(x_ij) / (exp(s_h) + sum_k exp(x_ik)), so a row's weights sum to less than 1
        and a row whose every key is masked gives 0 (its log-sum-exp is s_h). Bad dtype
        TypeError, bad shape or non-finite values ValueError, each naming sinks.
    """
    ...

class SdpaKernel(TypedDict):
    name: str
    family: Literal["reference", "fused"]
    dtypes: list[str]
    runs_on_this_cpu: bool
    reason_if_not: str
    reduced_float32: bool

def sdpa_kernels() -> list[SdpaKernel]:
    """Every kernel behind scaled_dot_product_attention, highest priority first."""
    ...

def set_float32_matmul_precision(precision: Literal["highest", "high", "medium"]) -> None:
    """torch.set_float32_matmul_precision for attn's float32 attention."""
    ...

def get_float32_matmul_precision() -> Literal["highest", "high", "medium"]:
    ...
class CacheStats(TypedDict):
    limit_bytes: int
    cached_bytes: int
    cached_blocks: int
    hits: int
    misses: int

def cache_stats() -> CacheStats:
    """The reuse cache of freed tensor blocks of 1 MiB or more (attn/memory.hpp)."""
    ...
def set_cache_limit(bytes: int) -> None:
    """How many bytes of freed blocks may be kept (0: off); ValueError if negative."""
    ...
def empty_cache() -> None:
    """Frees every kept block; the limit stays."""
    ...
def manual_seed(seed: int) -> None: ...
def rand(size: Sequence[int]) -> F32: ...
def randn(size: Sequence[int]) -> F32: ...
def load_file(path: str) -> dict[str, F32]: ...
def load_metadata(path: str) -> dict[str, str]: ...
def save_file(tensors: Mapping[str, ArrayLike], path: str,
              metadata: Optional[Mapping[str, str]] = None) -> None: ...

_M = TypeVar("_M", bound="Module")

class Module:
    def train(self: _M, mode: bool = True) -> _M: ...
    def eval(self: _M) -> _M: ...
    @property
    def training(self) -> bool: ...
    def state_dict(self) -> dict[str, F32]: ...
    def load_state_dict(self, state_dict: Mapping[str, ArrayLike], strict: bool = True) -> None: ...
    def named_parameters(self) -> list[Tuple[str, F32]]: ...
    def num_parameters(self) -> int: ...
    def save_safetensors(self, path: str, metadata: Optional[Mapping[str, str]] = None) -> None: ...
    def load_safetensors(self, path: str, strict: bool = True) -> None: ...

class Linear(Module):
    in_features: int
    out_features: int
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class Dropout(Module):
    p: float
    def __init__(self, p: float = 0.5) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class Embedding(Module):
    num_embeddings: int
    embedding_dim: int
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None: ...
    def forward(self, input: ArrayLike) -> F32: ...
    def __call__(self, input: ArrayLike) -> F32: ...

class SelfAttentionV1(Module):
    def __init__(self, d_in: int, d_out: int) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class SelfAttentionV2(Module):
    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class CausalAttention(Module):
    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 qkv_bias: bool = False) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class MultiHeadAttentionWrapper(Module):
    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class MultiHeadAttention(Module):
    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False) -> None: ...
    def forward(self, x: ArrayLike) -> F32: ...
    def __call__(self, x: ArrayLike) -> F32: ...

class MultiheadAttention(Module):
    embed_dim: int
    num_heads: int
    head_dim: int
    batch_first: bool
    dropout: float
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False) -> None: ...
    def forward(self, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                key_padding_mask: Optional[ArrayLike] = None, need_weights: bool = True,
                attn_mask: Optional[ArrayLike] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[F32, Optional[F32]]: ...
    def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                 key_padding_mask: Optional[ArrayLike] = None, need_weights: bool = True,
                 attn_mask: Optional[ArrayLike] = None, average_attn_weights: bool = True,
                 is_causal: bool = False) -> Tuple[F32, Optional[F32]]: ...

def varlen_attn(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    cu_seq_q: ArrayLike,
    cu_seq_k: ArrayLike,
    max_q: int,
    max_k: int,
    *,
    is_causal: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
    need_lse: bool = False,
    kernel: Optional[str] = None,
    num_threads: int = 0,
) -> Union[npt.NDArray[Any], Tuple[npt.NDArray[Any], npt.NDArray[Any]]]:
    """Packed variable-length attention (torch.nn.attention.varlen.varlen_attn's arguments).

    query (total_q, H, E), key (total_k, H_kv, E), value (total_k, H_kv, Ev) hold N sequences
    packed along dim 0; cu_seq_q / cu_seq_k are their N + 1 cumulative lengths (integers, read
    as int32: 0 first, non-decreasing, total_q / total_k last); max_q / max_k bound the lengths.
    Each sequence attends only within itself, exactly as scaled_dot_product_attention on it
    alone with the same options (is_causal with causal_alignment on the sequence's own lengths,
    scale, enable_gqa, window_size, softcap, alibi_slopes (H,), sinks (H,)). Dropout is Philox's
    (dropout_seed, dropout_offset): sequence n gets batch element n's mask of the padded
    (N, H, max_q, max_k) call. Returns output (total_q, H, Ev) in the inputs' dtype, or
    (output, lse) with need_lse, lse of shape (H, total_q). kernel: a name from sdpa_kernels()."""
    ...

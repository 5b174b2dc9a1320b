"""attn inside PyTorch: scaled dot-product attention as a torch custom operator.

``scaled_dot_product_attention`` takes CPU torch tensors (float32, bfloat16, float16, float64;
any strides, read in place: plain tensors through their data pointer and strides, subclasses
through DLPack) and returns torch tensors, with PyTorch's argument
names and semantics plus attn's variants (window_size, softcap, alibi_slopes, sinks). It is the
custom operator ``torch.ops.attn.sdpa`` (``torch.library.custom_op``): autograd runs attn's
fused backward from the saved LSE (never the weights), and a fake implementation lets
``torch.compile(fullgraph=True)`` trace it. float64 computes in float64 end to end (attn's
float64 reference), so ``torch.autograd.gradcheck`` applies.

``patch()`` routes ``torch.nn.functional.scaled_dot_product_attention`` to attn for the calls
attn can take and to PyTorch's own for the others (with one warning per reason).

Dropout: attn's counter-based Philox masks (not PyTorch's), keyed by a seed drawn from torch's
default generator, so ``torch.manual_seed`` makes runs repeatable; the backward regenerates the
forward's mask from the same key. Threads: every call runs on ``torch.get_num_threads()``
threads.

Importing this module imports torch; ``import attn`` alone never does.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _attn

_attn._torch_init(torch)  # the bindings' view of torch.Tensor and its dtypes (torch_ops.cpp)

__all__ = ["scaled_dot_product_attention", "varlen_attention", "patch", "is_patched",
           "call_counts", "reset_call_counts"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_counts = {"sdpa_forward": 0, "sdpa_backward": 0, "varlen_forward": 0, "varlen_backward": 0,
           "fallback": 0}
_counts_lock = threading.Lock()


def call_counts() -> dict:
    """How many times each attn kernel entry ran (sdpa_forward, sdpa_backward, varlen_forward,
    varlen_backward) and how many patched calls fell back to PyTorch (fallback). Counted when
    the kernels run, so compiled graphs count too."""
    with _counts_lock:
        counts = dict(_counts)
    counts["sdpa_forward"] += _attn._torch_sdpa_plain_count()  # the fast path's, counted in C++
    return counts


def reset_call_counts() -> None:
    with _counts_lock:
        for k in _counts:
            _counts[k] = 0
        _attn._torch_sdpa_plain_count(reset=True)


def _count(what: str) -> None:
    with _counts_lock:
        _counts[what] += 1


def _key(rng: Tensor) -> Tuple[int, int]:
    """The Philox (seed, offset) from the int64 pair drawn by _draw_rng."""
    seed, offset = rng.tolist()
    return seed & 0xFFFFFFFFFFFFFFFF, offset & 0xFFFFFFFFFFFFFFFF


def _draw_rng(dropout_p: float) -> Tensor:
    # Two int64s from torch's default CPU generator (traceable, unlike .item()); no draw, and
    # so no change to the generator, without dropout.
    if dropout_p > 0.0:
        return torch.randint(0, 2**62, (2,), dtype=torch.int64)
    return _NO_RNG


_NO_RNG = torch.zeros(2, dtype=torch.int64)  # never written: saved and read only


def _options(dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left, window_right,
             softcap, alibi_slopes, sinks, rng, kernel, reduction=False) -> tuple:
    """The options tuple the bindings read (python/src/torch_ops.cpp's make_options)."""
    seed, offset = (0, 0) if rng is _NO_RNG else _key(rng)
    return (dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left, window_right,
            softcap, _detach(alibi_slopes), _detach(sinks), seed, offset, kernel,
            torch.get_num_threads(), bool(reduction))


def _grad_fakes(query, key, value, sinks):
    # Contiguous, like the real gradients (to_torch hands over attn's row-major tensors),
    # whatever the inputs' strides: a compiler lays out what follows from these.
    ds = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), ds


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- the operators ----------------------------------------------------------------------------
# Typed, fixed signatures (a custom op's schema); the keyword conveniences live in the wrappers.

# Whether a profiler is recording: the kernels' record_function ranges cost ~6 us a call, which
# a decoding loop (one small call per layer and token) would pay for nothing.
_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
# True while Dynamo traces (it folds the call to a constant), else a plain `return False`: half
# the cost of torch.compiler.is_compiling() on a cold cache. Other tracers hand the wrappers
# tensor subclasses, which take the general path anyway.
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _named(name: str):
    """A profiler range named `name` while a profiler records (on every path, eager included),
    else a no-op context."""
    return torch.profiler.record_function(name) if _profiler_enabled() else contextlib.nullcontext()


def _forward(query, key, value, attn_mask, dropout_p, is_causal, bottom_right, scale, enable_gqa,
             window_left, window_right, softcap, alibi_slopes, sinks, rng, kernel, reduction,
             need_weights, need_residual, need_lse=True):
    """attn's forward on the tensors as they are (read in place, never tracked: the bindings
    ignore requires_grad): (output, lse, weights, output_residual), None for what was not
    asked for."""
    options = _options(dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
                       window_right, softcap, alibi_slopes, sinks, rng, kernel, reduction)
    with _named("attn.sdpa_forward"):
        result = _attn._torch_sdpa_forward(query, key, value, attn_mask, options, need_weights,
                                           need_residual, need_lse)
    _count("sdpa_forward")
    return result


def _sdpa_impl(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
             dropout_p: float, is_causal: bool, bottom_right: bool, scale: Optional[float],
             enable_gqa: bool, window_left: int, window_right: int, softcap: Optional[float],
             alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], rng: Tensor, kernel: str,
             reduction: bool, need_weights: bool,
             need_residual: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, w, res = _forward(query, key, value, attn_mask, dropout_p, is_causal, bottom_right,
                                scale, enable_gqa, window_left, window_right, softcap,
                                alibi_slopes, sinks, rng, kernel, reduction, need_weights,
                                need_residual)
    # Two distinct empties: a custom op's outputs may not alias each other.
    return (out, lse, w if w is not None else query.new_empty(0),
            res if res is not None else query.new_empty(0))


_sdpa_op = torch.library.custom_op("attn::sdpa", mutates_args=(), device_types="cpu")(_sdpa_impl)


@_sdpa_op.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, bottom_right, scale,
               enable_gqa, window_left, window_right, softcap, alibi_slopes, sinks, rng, kernel,
               reduction, need_weights, need_residual):
    lead = query.shape[:-1]
    out = query.new_empty((*lead, value.shape[-1]))
    lse = query.new_empty(lead, dtype=_lse_dtype(query.dtype))
    w = query.new_empty((*lead, key.shape[-2])) if need_weights else query.new_empty(0)
    res = query.new_empty(out.shape) if need_residual and query.dtype in _SIXTEEN_BIT else query.new_empty(0)
    return out, lse, w, res


def _sdpa_backward_impl(grad_output: Tensor, query: Tensor, key: Tensor, value: Tensor,
                      output: Tensor, lse: Tensor, residual: Tensor,
                      attn_mask: Optional[Tensor], dropout_p: float,
                      is_causal: bool, bottom_right: bool, scale: Optional[float],
                      enable_gqa: bool, window_left: int, window_right: int,
                      softcap: Optional[float], alibi_slopes: Optional[Tensor],
                      sinks: Optional[Tensor], rng: Tensor, kernel: str,
                      reduction: bool,
                      need_mask_grad: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    args = (grad_output, query, key, value, output, lse,
            residual if residual.numel() > 0 else None, attn_mask,
            _options(dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
                     window_right, softcap, alibi_slopes, sinks, rng, kernel, reduction),
            need_mask_grad)
    with _named("attn.sdpa_backward"):
        dq, dk, dv, ds, dm = _attn._torch_sdpa_backward(*args)
    _count("sdpa_backward")
    ds = ds.to(sinks.dtype) if ds is not None else query.new_empty(0)
    return dq, dk, dv, ds, dm if dm is not None else query.new_empty(0)


_sdpa_backward_op = torch.library.custom_op("attn::sdpa_backward", mutates_args=(),
                                            device_types="cpu")(_sdpa_backward_impl)


@_sdpa_backward_op.register_fake
def _sdpa_backward_fake(grad_output, query, key, value, output, lse, residual, attn_mask, dropout_p,
                        is_causal, bottom_right, scale, enable_gqa, window_left, window_right,
                        softcap, alibi_slopes, sinks, rng, kernel, reduction, need_mask_grad=False):
    dm = attn_mask.new_empty(attn_mask.shape) if need_mask_grad else query.new_empty(0)
    return (*_grad_fakes(query, key, value, sinks), dm)


def _detach(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.detach() if t is not None else None


def _sdpa_setup(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, is_causal, bottom_right, scale, enable_gqa,
     window_left, window_right, softcap, alibi_slopes, sinks, rng, kernel, reduction, _,
     _) = inputs
    out, lse, w, res = output
    ctx.save_for_backward(query, key, value, out, lse, res, attn_mask, alibi_slopes, sinks, rng)
    ctx.options = (dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
                   window_right, softcap)
    ctx.kernel = kernel
    ctx.reduction = reduction
    ctx.mark_non_differentiable(lse, w, res)


def _sdpa_grads(ctx, grad_out, backward):
    query, key, value, out, lse, res, attn_mask, alibi_slopes, sinks, rng = ctx.saved_tensors
    (dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left, window_right,
     softcap) = ctx.options
    # An additive mask that requires grad gets one, as from torch's math path (a learned bias).
    need_mask_grad = (attn_mask is not None and attn_mask.dtype.is_floating_point
                      and ctx.needs_input_grad[3])
    dq, dk, dv, ds, dm = backward(grad_out, query, key, value, out, lse, res, attn_mask,
                                  dropout_p, is_causal, bottom_right, scale, enable_gqa,
                                  window_left, window_right, softcap, alibi_slopes, sinks, rng,
                                  ctx.kernel, ctx.reduction, need_mask_grad)
    return (dq, dk, dv, dm if need_mask_grad else None, None, None, None, None, None, None, None,
            None, None, ds if sinks is not None else None, None, None, None, None, None)


def _sdpa_grad(ctx, grad_out, _grad_lse, _grad_w, _grad_res):
    return _sdpa_grads(ctx, grad_out, _sdpa_backward_op)


_sdpa_op.register_autograd(_sdpa_grad, setup_context=_sdpa_setup)


class _SdpaEager(torch.autograd.Function):
    """The op's autograd without the dispatcher, for eager calls on plain tensors: the custom
    op's Python layers cost ~100 us a call, which a decoding loop (one small call per layer and
    token) would feel. Same implementation, same saved tensors, same backward."""

    @staticmethod
    def forward(ctx, *args):
        output = _sdpa_impl(*args)
        _sdpa_setup(ctx, args, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse, _grad_w, _grad_res):
        return _sdpa_grads(ctx, grad_out, _sdpa_backward_impl)


def _call_sdpa(args, need_lse=True):
    """The custom op while torch.compile traces or for tensor subclasses (fake, functional
    tensors...); the same implementation directly otherwise. A call that will need a backward
    in bf16/fp16 also returns the output's float32 residual (attn's need_output_residual),
    which the backward reads instead of re-deriving the float32 output. A call with no
    backward to come computes the LSE only when need_lse (else it is None)."""
    query, key, value, mask, sinks = args[0], args[1], args[2], args[3], args[13]
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (query, key, value, mask, sinks))
    args = (*args, grad and query.dtype in _SIXTEEN_BIT)
    if torch.compiler.is_compiling() or any(type(t) is not Tensor for t in (query, key, value)):
        return _sdpa_op(*args)
    if grad:
        return _SdpaEager.apply(*args)
    return _forward(*args, need_lse=need_lse)


@torch.library.custom_op("attn::varlen", mutates_args=(), device_types="cpu")
def _varlen_op(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
               max_q: int, max_k: int, dropout_p: float, is_causal: bool, bottom_right: bool,
               scale: Optional[float], enable_gqa: bool, window_left: int, window_right: int,
               softcap: Optional[float], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
               rng: Tensor, kernel: str) -> Tuple[Tensor, Tensor]:
    out, lse = _attn._torch_varlen_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
        _options(dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
                 window_right, softcap, alibi_slopes, sinks, rng, kernel))
    _count("varlen_forward")
    return out, lse


@_varlen_op.register_fake
def _varlen_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal,
                 bottom_right, scale, enable_gqa, window_left, window_right, softcap,
                 alibi_slopes, sinks, rng, kernel):
    out = query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))
    lse = query.new_empty((query.shape[1], query.shape[0]), dtype=_lse_dtype(query.dtype))
    return out, lse


@torch.library.custom_op("attn::varlen_backward", mutates_args=(), device_types="cpu")
def _varlen_backward_op(grad_output: Tensor, query: Tensor, key: Tensor, value: Tensor,
                        output: Tensor, lse: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
                        max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                        bottom_right: bool, scale: Optional[float], enable_gqa: bool,
                        window_left: int, window_right: int, softcap: Optional[float],
                        alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], rng: Tensor,
                        kernel: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, ds = _attn._torch_varlen_backward(
        grad_output, query, key, value, output, lse, cu_seq_q, cu_seq_k, max_q, max_k,
        _options(dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
                 window_right, softcap, alibi_slopes, sinks, rng, kernel))
    _count("varlen_backward")
    ds = ds.to(sinks.dtype) if ds is not None else query.new_empty(0)
    return dq, dk, dv, ds


@_varlen_backward_op.register_fake
def _varlen_backward_fake(grad_output, query, key, value, output, lse, cu_seq_q, cu_seq_k, max_q,
                          max_k, dropout_p, is_causal, bottom_right, scale, enable_gqa,
                          window_left, window_right, softcap, alibi_slopes, sinks, rng, kernel):
    return _grad_fakes(query, key, value, sinks)


def _varlen_setup(ctx, inputs, output):
    (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, is_causal, bottom_right,
     scale, enable_gqa, window_left, window_right, softcap, alibi_slopes, sinks, rng,
     kernel) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seq_q, cu_seq_k, alibi_slopes, sinks,
                          rng)
    ctx.options = (max_q, max_k, dropout_p, is_causal, bottom_right, scale, enable_gqa,
                   window_left, window_right, softcap)
    ctx.kernel = kernel
    ctx.mark_non_differentiable(lse)


def _varlen_grad(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, cu_seq_q, cu_seq_k, alibi_slopes, sinks, rng = ctx.saved_tensors
    (max_q, max_k, dropout_p, is_causal, bottom_right, scale, enable_gqa, window_left,
     window_right, softcap) = ctx.options
    dq, dk, dv, ds = _varlen_backward_op(grad_out, query, key, value, out, lse, cu_seq_q,
                                         cu_seq_k, max_q, max_k, dropout_p, is_causal,
                                         bottom_right, scale, enable_gqa, window_left,
                                         window_right, softcap, alibi_slopes, sinks, rng,
                                         ctx.kernel)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None,
            None, ds if sinks is not None else None, None, None)


_varlen_op.register_autograd(_varlen_grad, setup_context=_varlen_setup)


# ---- the wrappers -----------------------------------------------------------------------------

def _plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The common eager call in one binding call (python/src/torch_ops.cpp's sdpa_plain): plain
    CPU tensors, no dropout, no gradient to track, no profiler recording, not compiling. None
    when the call is not of that kind: the general path then checks it (and raises, or under
    the patch falls back, naming the reason)."""
    # Dynamo first: it folds _dynamo_compiling() to True and traces none of the rest.
    if (_dynamo_compiling() or type(query) is not Tensor or type(key) is not Tensor
            or type(value) is not Tensor or dropout_p or _profiler_enabled()):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    try:
        out = _attn._torch_sdpa_plain(query, key, value, attn_mask, bool(is_causal),
                                      None if scale is None else float(scale), bool(enable_gqa),
                                      torch.get_num_threads())
    except (TypeError, ValueError):
        return None  # the general path says why
    return out


def _check_tensors(named: Sequence[Tuple[str, Optional[Tensor]]], mask: Optional[Tensor]) -> None:
    """The checks PyTorch's dispatcher would make before attn's own (which name shapes and
    values): torch tensors, on the CPU, of a floating dtype, query/key/value of one dtype."""
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise TypeError(f"{name}: attn.torch runs on CPU tensors, got a tensor on {t.device} "
                            f"(use torch's own scaled_dot_product_attention there)")
    for name, t in named[:3]:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected float32, bfloat16, float16 or float64, got {t.dtype}")
    q, k, v = (t for _, t in named[:3])
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must have one dtype, got query {q.dtype}, "
                        f"key {k.dtype}, value {v.dtype}")
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor, got {type(mask).__name__}")
        if not mask.is_cpu:
            raise TypeError(f"attn_mask: expected a CPU tensor, got a tensor on {mask.device}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask: expected a bool or floating-point tensor, got {mask.dtype}")


def _head_params(alibi_slopes: Optional[Tensor], sinks: Optional[Tensor]):
    """attn takes slopes and sinks in float32: 16-bit ones are widened here (differentiably, so
    a bfloat16 model's sinks get a bfloat16 gradient); ALiBi slopes get no gradient."""
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise RuntimeError("alibi_slopes: attn computes no gradient for ALiBi slopes, and these "
                           "require grad; pass alibi_slopes.detach()")
    widen = (torch.bfloat16, torch.float16)
    if alibi_slopes is not None and alibi_slopes.dtype in widen:
        alibi_slopes = alibi_slopes.float()
    if sinks is not None and sinks.dtype in widen:
        sinks = sinks.float()
    return alibi_slopes, sinks


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), -1 = unbounded, "
                        f"got {window_size!r}") from None


def _alignment(causal_alignment: str) -> bool:
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got "
                         f"{causal_alignment!r}")
    return causal_alignment == "bottom_right"


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, window_size=(-1, -1),
                                 softcap: Optional[float] = None,
                                 alibi_slopes: Optional[Tensor] = None,
                                 sinks: Optional[Tensor] = None,
                                 causal_alignment: str = "top_left", need_lse: bool = False,
                                 need_weights: bool = False, kernel: Optional[str] = None,
                                 allow_fp16_bf16_reduction: bool = False):
    """torch.nn.functional.scaled_dot_product_attention on attn's kernels.

    query (..., L, E), key (..., S, E), value (..., S, Ev) with leading dims (B, H), (H) or
    none, CPU tensors of one dtype: float32, bfloat16, float16 (computed in float32, rounded
    once) or float64 (float64 throughout). attn_mask: bool (True = takes part) or floating
    (added), broadcastable to (..., L, S). Returns the output (..., L, Ev) in the inputs' dtype,
    differentiable in query, key, value, sinks and a floating attn_mask (a learned bias: its
    gradient has the mask's shape and dtype, as from torch's math path).

    attn's extras (keyword-only), as in :func:`attn.scaled_dot_product_attention`: window_size
    (left, right), softcap, alibi_slopes (H) or (B, H), sinks (H) (differentiable),
    causal_alignment ("top_left", PyTorch's, or "bottom_right", FlashAttention's), kernel (a
    name from attn.sdpa_kernels()), allow_fp16_bf16_reduction (bf16/fp16: FlashAttention's and
    PyTorch's flash numerics in the backward, ~1.4x faster where attn's native bf16 backward runs,
    errors within 2x a bf16 math reference's instead of attn's stricter default; the name follows
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp; docs/NUMERICS.md). With need_lse
    and/or need_weights the result is a tuple
    (output, lse or None, weights or None): lse (..., L) float32 (float64 for float64 inputs),
    natural log; weights (..., L, S) in the inputs' dtype; neither is differentiable.

    dropout_p uses attn's Philox masks, seeded from torch's generator (torch.manual_seed makes
    runs repeatable; the masks differ from PyTorch's). TypeError for non-tensors, GPU tensors,
    integer or mixed dtypes; ValueError (from attn) naming the argument for shapes and values.
    """
    # The fast path runs no backward, so allow_fp16_bf16_reduction changes nothing there.
    if (not (need_lse or need_weights or kernel) and softcap is None and alibi_slopes is None
            and sinks is None and causal_alignment == "top_left" and type(window_size) is tuple
            and window_size == (-1, -1)):
        out = _plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    _check_tensors([("query", query), ("key", key), ("value", value),
                    ("alibi_slopes", alibi_slopes), ("sinks", sinks)], attn_mask)
    alibi_slopes, sinks = _head_params(alibi_slopes, sinks)
    left, right = _window(window_size)
    bottom_right = _alignment(causal_alignment)
    out, lse, w, _ = _call_sdpa((query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                              bottom_right, None if scale is None else float(scale),
                              bool(enable_gqa), left, right,
                              None if softcap is None else float(softcap), alibi_slopes, sinks,
                              _draw_rng(dropout_p), kernel or "", bool(allow_fp16_bf16_reduction),
                              bool(need_weights)),
                             need_lse=need_lse)
    if not (need_lse or need_weights):
        return out
    return out, (lse if need_lse else None), (w if need_weights else None)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                     cu_seq_k: Tensor, max_q: int, max_k: int, *, dropout_p: float = 0.0,
                     is_causal: bool = False, causal_alignment: str = "top_left",
                     scale: Optional[float] = None, enable_gqa: bool = False,
                     window_size=(-1, -1), softcap: Optional[float] = None,
                     alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     need_lse: bool = False, kernel: Optional[str] = None):
    """Packed variable-length attention on torch tensors (attn.varlen_attn's semantics),
    differentiable in query, key, value and sinks.

    query (total_q, H, E), key/value (total_k, H_kv, E/Ev); cu_seq_q / cu_seq_k: N + 1
    cumulative lengths (an integer tensor). Returns the output (total_q, H, Ev), or (output,
    lse) with need_lse (lse (H, total_q), not differentiable).
    """
    _check_tensors([("query", query), ("key", key), ("value", value),
                    ("alibi_slopes", alibi_slopes), ("sinks", sinks)], None)
    for name, t in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer torch.Tensor of cumulative lengths, "
                            f"got {getattr(t, 'dtype', type(t).__name__)}")
    alibi_slopes, sinks = _head_params(alibi_slopes, sinks)
    left, right = _window(window_size)
    out, lse = _varlen_op(query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k),
                          float(dropout_p), bool(is_causal), _alignment(causal_alignment),
                          None if scale is None else float(scale), bool(enable_gqa), left, right,
                          None if softcap is None else float(softcap), alibi_slopes, sinks,
                          _draw_rng(dropout_p), kernel or "")
    return (out, lse) if need_lse else out


# ---- the drop-in --------------------------------------------------------------------------------

_torch_sdpa = torch.nn.functional.scaled_dot_product_attention
_patch_lock = threading.Lock()
_warned: set = set()
# The patch's allow_fp16_bf16_reduction (one slot, process-wide like the patch itself).
_patch_reduction = [False]


def _why_not(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str:
    """Why attn cannot take this call of F.scaled_dot_product_attention ("" when it can)."""
    ts = [query, key, value]
    if all(isinstance(t, Tensor) for t in ts) and any(t.is_nested for t in ts):
        return "nested tensors"
    try:  # what the wrapper itself would refuse: non-tensors, devices, dtypes, the mask's type
        _check_tensors([("query", query), ("key", key), ("value", value)], attn_mask)
    except (TypeError, RuntimeError) as e:
        return str(e)
    if not (2 <= query.dim() <= 4 and query.dim() == key.dim() == value.dim()):
        return f"{query.dim()}-D inputs (attn takes 2-D to 4-D)"
    if query.shape[:-3] != key.shape[:-3] or query.shape[:-3] != value.shape[:-3]:
        return "broadcast batch dims"
    if any(t.numel() == 0 for t in ts):  # PyTorch's answer: empty, or zeros when S = 0
        return "empty tensors (attn takes none)"
    if attn_mask is not None and attn_mask.dim() > 4:
        return "a mask of more than 4 dims"
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        return f"dropout_p={dropout_p!r}"
    return ""


def _fallback(reason: str, detail: str, query, key, value, attn_mask, dropout_p, is_causal, scale,
              enable_gqa):
    _count("fallback")
    with _patch_lock:
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"attn.torch.patch: F.scaled_dot_product_attention falls back to PyTorch's "
                      f"own for {reason}{detail} (warned once per reason)", RuntimeWarning,
                      stacklevel=3)
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if enable_gqa:  # torch < 2.5 has no enable_gqa argument
        kwargs["enable_gqa"] = enable_gqa
    return _torch_sdpa(query, key, value, **kwargs)


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    out = _plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    reason = _why_not(*args)
    if reason:
        return _fallback(reason, "", *args)
    try:  # scaled_dot_product_attention's body: _why_not made its checks, F's call has no extras
        return _call_sdpa((query, key, value, attn_mask, float(dropout_p), bool(is_causal), False,
                           None if scale is None else float(scale), bool(enable_gqa), -1, -1,
                           None, None, None, _draw_rng(dropout_p), "", _patch_reduction[0], False),
                          need_lse=False)[0]
    except (TypeError, ValueError) as e:  # PyTorch's own then raises if the call is invalid
        return _fallback(f"a call attn refused ({type(e).__name__})", f": {e}", *args)


def is_patched() -> bool:
    """True while F.scaled_dot_product_attention routes to attn."""
    return torch.nn.functional.scaled_dot_product_attention is _patched_sdpa


def _install(fn) -> None:
    torch.nn.functional.scaled_dot_product_attention = fn


class patch:
    """Routes torch.nn.functional.scaled_dot_product_attention to attn for CPU tensors.

    ``attn.torch.patch()`` / ``patch(True)`` turns it on at once, ``patch(False)`` off; used as a
    context manager (``with attn.torch.patch():``) it restores the previous state on exit.
    Calls attn cannot take (GPU or nested tensors, integer dtypes, more than 4 dims, empty
    tensors, ...) go to PyTorch's own, with one RuntimeWarning per
    reason. Code that bound the function before patching (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps PyTorch's. The patch is process-wide (it sets a
    module attribute), not per thread. Under torch.compile a call attn refuses only at run time
    (a shape or value its own checks reject) raises instead of falling back.

    ``allow_fp16_bf16_reduction=True`` gives the patched calls that option of
    :func:`scaled_dot_product_attention` (PyTorch's own CPU flash kernel has these numerics; attn's
    default is more exact and slower in the bf16 backward).
    """

    def __init__(self, enabled: bool = True, *, allow_fp16_bf16_reduction: bool = False):
        with _patch_lock:
            self._previous = torch.nn.functional.scaled_dot_product_attention
            self._previous_reduction = _patch_reduction[0]
            _install(_patched_sdpa if enabled else _torch_sdpa)
            _patch_reduction[0] = bool(allow_fp16_bf16_reduction)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with _patch_lock:
            _install(self._previous)  # whatever was there before, another wrapper included
            _patch_reduction[0] = self._previous_reduction
        return False

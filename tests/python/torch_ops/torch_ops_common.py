"""Shared by attn.torch's tests: the torch >= 2.4 gate and a float64 reference attention.

The suite needs PyTorch >= 2.4 (torch.library.custom_op) and, for the model tests, Hugging Face
transformers. scripts/test_python.sh runs it in a venv with both from PyPI and sets
ATTN_TORCH_OPS_REQUIRED=1 there, so a missing dependency fails instead of skipping; elsewhere
(e.g. Debian's torch 1.13) each module skips itself with the reason."""
import math
import os

import pytest

REQUIRED = os.environ.get("ATTN_TORCH_OPS_REQUIRED") == "1"


def require(module="torch"):
    """Imports `module` (torch: >= 2.4), or skips (fails when required) the calling module."""
    try:
        mod = __import__(module)
    except ImportError:
        reason = f"{module} is not installed"
    else:
        if module != "torch" or hasattr(mod.library, "custom_op"):
            return mod
        reason = f"torch {mod.__version__} has no torch.library.custom_op (needs >= 2.4)"
    if REQUIRED:
        pytest.fail(f"attn.torch tests required (ATTN_TORCH_OPS_REQUIRED=1) but {reason}",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
              window_size=(-1, -1), softcap=None, alibi_slopes=None, sinks=None,
              bottom_right=False, dropout_mask=None, dropout_p=0.0):
    """Attention written out in float64 torch ops (differentiable): the truth the tests compare
    attn and PyTorch's own SDPA with, including attn's variants (FlashAttention's semantics:
    scale, softcap, ALiBi, mask, then the band; a sink is one more logit with no value; a row
    with no visible key is 0)."""
    import torch
    q, k, v = (x.double() for x in (q, k, v))
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(E) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    off = S - L if bottom_right else 0
    i = torch.arange(L).unsqueeze(1) + off
    j = torch.arange(S).unsqueeze(0)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double()
        s = s - slopes[..., None, None] * (i - j).abs().double()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask.double()
    band = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        band &= j <= i
    if window_size[0] >= 0:
        band &= j >= i - window_size[0]
    if window_size[1] >= 0:
        band &= j <= i + window_size[1]
    s = s.masked_fill(~band, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], -1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / torch.where(denom > 0, denom, torch.ones_like(denom)),
                    torch.zeros_like(p))
    if sinks is not None:
        p = p[..., :S]
    if dropout_mask is not None:
        p = p * dropout_mask.double() / (1.0 - dropout_p)
    return p @ v

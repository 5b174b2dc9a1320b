"""attn.torch.varlen_attention: packed sequences against PyTorch's SDPA on each sequence alone,
forward and backward; gradcheck in float64; torch.compile; bad input."""
import pytest

from torch_ops_common import reference, require

torch = require("torch")
import torch.nn.functional as F  # noqa: E402

import attn.torch as at  # noqa: E402

LENGTHS = [5, 1, 17, 0, 9]


def packed(dtype, H=4, Hkv=2, E=16, Ev=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, H, E, generator=g).to(dtype).requires_grad_()
    k = torch.randn(total, Hkv, E, generator=g).to(dtype).requires_grad_()
    v = torch.randn(total, Hkv, Ev, generator=g).to(dtype).requires_grad_()
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("is_causal", [False, True])
def test_each_sequence_equals_sdpa_on_it_alone_with_gradients(is_causal):
    q, k, v, cu = packed(torch.float32)
    out = at.varlen_attention(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), is_causal=is_causal,
                              enable_gqa=True)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    for n in range(len(LENGTHS)):
        a, b = cu[n].item(), cu[n + 1].item()
        if a == b:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=is_causal, enable_gqa=True)
        assert (out[a:b].transpose(0, 1) - want).abs().max() < 1e-5
        wq, wk, wv = torch.autograd.grad(want, (q, k, v), g[a:b].transpose(0, 1))
        for got, w in ((dq, wq), (dk, wk), (dv, wv)):
            assert (got[a:b] - w[a:b]).abs().max() < 1e-5


def test_gradcheck_in_float64_with_lse():
    q, k, v, cu = packed(torch.float64, H=2, Hkv=2, E=4, Ev=3)
    out, lse = at.varlen_attention(q, k, v, cu, cu, 17, 17, is_causal=True, need_lse=True)
    assert lse.shape == (2, q.shape[0]) and lse.dtype == torch.float64 and not lse.requires_grad
    assert torch.autograd.gradcheck(
        lambda a, b, c: at.varlen_attention(a, b, c, cu, cu, 17, 17, is_causal=True,
                                            window_size=(3, 0)), (q, k, v))
    a, b = cu[2].item(), cu[3].item()
    want = reference(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                     is_causal=True)
    assert (out[a:b].transpose(0, 1) - want).abs().max() < 1e-12


def test_a_batch_of_empty_sequences_gives_empty_outputs_and_gradients():
    # A serving loop's batch can hold no tokens at all: torch's empty tensors (no storage,
    # data_ptr 0) were once read as undefined ("query is undefined") where NumPy's worked.
    q = torch.empty(0, 4, 16, requires_grad=True)
    kv = torch.empty(0, 2, 16, requires_grad=True)
    cu = torch.zeros(3, dtype=torch.int32)
    out = at.varlen_attention(q, kv, kv, cu, cu, 0, 0, is_causal=True, enable_gqa=True)
    assert out.shape == (0, 4, 16)
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    assert dq.shape == q.shape and dkv.shape == kv.shape


def test_compile_fullgraph():
    q, k, v, cu = packed(torch.float32)

    def f(a, b, c):
        return at.varlen_attention(a, b, c, cu, cu, 17, 17, is_causal=True, enable_gqa=True) * 3

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), f(q, k, v))


def test_bad_input():
    q, k, v, cu = packed(torch.float32)
    with pytest.raises(TypeError, match="cu_seq_q"):
        at.varlen_attention(q, k, v, cu.float(), cu, 17, 17, enable_gqa=True)
    with pytest.raises(ValueError, match="max_q"):
        at.varlen_attention(q, k, v, cu, cu, 3, 17, enable_gqa=True)

"""attn against PyTorch: torch.nn.functional.scaled_dot_product_attention, torch.nn.
MultiheadAttention and the chapter's modules (tests/fixtures/gen_demo.py), on random inputs and
the chapter's seeds, and weights moved between the two through safetensors files.

Needs torch (CI: Debian's python3-torch 1.13, which predates F.scaled_dot_product_attention;
there the comparison uses PyTorch's documented reference implementation of it, written in torch
ops below). Skipped with the reason when torch is missing."""
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the comparisons with PyTorch need it")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn  # noqa: E402
from gen_demo import (CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper,  # noqa: E402
                      SelfAttention_v1, SelfAttention_v2, batch, inputs)
from st_format import load_file as py_load_file  # noqa: E402
from st_format import save_file as py_save_file  # noqa: E402

TOL = 1e-6


def torch_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention where torch has it (and the arguments), else the reference
    implementation from PyTorch's documentation of it."""
    if hasattr(F, "scaled_dot_product_attention") and not enable_gqa and dropout_p == 0.0:
        kw = {} if scale is None else {"scale": scale}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)
    L, S = q.size(-2), k.size(-2)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    bias = torch.zeros(L, S, dtype=q.dtype)
    if is_causal:
        bias.masked_fill_(torch.ones(L, S, dtype=torch.bool).tril().logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = bias + attn_mask
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    w = torch.softmax(q @ k.transpose(-2, -1) * scale + bias, dim=-1)
    w = torch.dropout(w, dropout_p, train=True)
    return w @ v


def randn(*shape, seed):
    torch.manual_seed(seed)
    return torch.randn(*shape)


SDPA_CASES = {
    "unbatched": dict(q=(5, 8), kv=(5, 8)),
    "3d_cross": dict(q=(3, 4, 8), kv=(3, 7, 8)),
    "4d": dict(q=(2, 3, 6, 16), kv=(2, 3, 6, 16)),
    "causal": dict(q=(2, 2, 9, 8), kv=(2, 2, 9, 8), is_causal=True),
    "causal_l_lt_s": dict(q=(1, 2, 4, 8), kv=(1, 2, 7, 8), is_causal=True),
    "bool_mask": dict(q=(2, 2, 5, 8), kv=(2, 2, 6, 8), mask="bool"),
    "float_mask": dict(q=(2, 2, 5, 8), kv=(2, 2, 6, 8), mask="float"),
    "scale": dict(q=(2, 5, 8), kv=(2, 5, 8), scale=0.3),
    "gqa": dict(q=(2, 6, 5, 8), kv=(2, 2, 5, 8), enable_gqa=True),
}


@pytest.mark.parametrize("name", SDPA_CASES)
def test_sdpa_matches_torch(name):
    c = SDPA_CASES[name]
    q, k, v = randn(*c["q"], seed=1), randn(*c["kv"], seed=2), randn(*c["kv"], seed=3)
    mask = None
    L, S = c["q"][-2], c["kv"][-2]
    if c.get("mask") == "bool":
        mask = torch.rand(L, S) < 0.7
        mask[:, 0] = True  # no fully masked row (torch: NaN, attn: 0)
    elif c.get("mask") == "float":
        mask = torch.randn(L, S)
    kw = dict(is_causal=c.get("is_causal", False), scale=c.get("scale"), enable_gqa=c.get("enable_gqa", False))
    want = torch_sdpa(q, k, v, attn_mask=mask, **kw).numpy()
    # torch tensors (DLPack) and NumPy arrays both work, with the same result.
    got_t = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    got_n = attn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                              attn_mask=None if mask is None else mask.numpy(), **kw)
    assert got_t.dtype == np.float32
    np.testing.assert_allclose(got_t, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got_t, got_n)


def test_sdpa_float64_matches_torch_float64():
    q, k, v = (randn(2, 3, 7, 8, seed=s).double() for s in (4, 5, 6))
    q32 = [t.float().double() for t in (q, k, v)]  # attn's float64 path reads float32-rounded inputs
    want = torch_sdpa(*q32, is_causal=True).numpy()
    got = attn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_sdpa_dropout_reproduces_torch_math_path_with_the_same_seed():
    q, k, v = (randn(2, 2, 6, 8, seed=s) for s in (7, 8, 9))
    torch.manual_seed(42)
    want = torch_sdpa(q, k, v, dropout_p=0.3).numpy()  # math path: torch.dropout on the weights
    attn.manual_seed(42)
    got = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # Both generators moved on by the same number of draws.
    np.testing.assert_array_equal(attn.rand([4]), torch.rand(4).numpy())


def test_torch_views_are_read_in_place():
    x = randn(2, 6, 3, 8, seed=1).transpose(1, 2)  # (2, 3, 6, 8), non-contiguous
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(x, x, x),
                                  attn.scaled_dot_product_attention(*(x.contiguous(),) * 3))


# ---- the chapter's modules, built from the same seeds ------------------------------------------

MODULES = {
    "SelfAttentionV1": (SelfAttention_v1, attn.SelfAttentionV1, (3, 2), inputs),
    "SelfAttentionV2": (SelfAttention_v2, attn.SelfAttentionV2, (3, 2), inputs),
    "CausalAttention": (CausalAttention, attn.CausalAttention, (3, 2, 6, 0.0), batch),
    "MultiHeadAttentionWrapper": (MultiHeadAttentionWrapper, attn.MultiHeadAttentionWrapper,
                                  (3, 2, 6, 0.0, 2), batch),
    "MultiHeadAttention": (MultiHeadAttention, attn.MultiHeadAttention, (3, 2, 6, 0.0, 2), batch),
    "MultiHeadAttention_dropout": (MultiHeadAttention, attn.MultiHeadAttention, (3, 4, 6, 0.5, 2), batch),
}


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("seed", [123, 789])
def test_chapter_modules_match_torch(name, seed):
    t_cls, a_cls, args, x = MODULES[name]
    torch.manual_seed(seed)
    tm = t_cls(*args)
    attn.manual_seed(seed)
    am = a_cls(*args)
    tsd, asd = tm.state_dict(), am.state_dict()
    assert list(asd) == list(tsd)
    for key in tsd:
        np.testing.assert_array_equal(asd[key], tsd[key].numpy(), err_msg=key)  # bit for bit
    # Training mode (dropout from the same stream when p > 0), then eval.
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        want = tm(x).numpy()
    attn.manual_seed(seed + 1)
    np.testing.assert_allclose(am(x.numpy()), want, rtol=0, atol=1e-5)
    tm.eval()
    am.eval()
    with torch.no_grad():
        np.testing.assert_allclose(am(x), tm(x).numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", [-1, -2**63, 2**64 - 1, 12345])
def test_manual_seed_over_torchs_whole_range_gives_torchs_numbers(seed):
    torch.manual_seed(seed)
    want = torch.randn(5).numpy(), torch.rand(3).numpy()
    attn.manual_seed(seed)
    np.testing.assert_array_equal(attn.randn([5]), want[0])
    np.testing.assert_array_equal(attn.rand([3]), want[1])


def test_linear_and_embedding_match_torch():
    torch.manual_seed(3)
    tl, te = nn.Linear(5, 4), nn.Embedding(10, 3)
    attn.manual_seed(3)
    al, ae = attn.Linear(5, 4), attn.Embedding(10, 3)
    x = randn(2, 5, seed=1)
    with torch.no_grad():
        np.testing.assert_allclose(al(x), tl(x).numpy(), rtol=0, atol=1e-6)
        ids = torch.tensor([[1, 9], [0, 0]])
        np.testing.assert_array_equal(ae(ids), te(ids).numpy())


# ---- torch.nn.MultiheadAttention ---------------------------------------------------------------


def test_multihead_attention_seed_gives_torch_weights():
    for seed, kwargs in [(0, {}), (5, {"bias": False, "batch_first": True}),
                         (6, {"kdim": 7, "vdim": 5}), (8, {"kdim": 12, "vdim": 4, "bias": False}),
                         (9, {"add_bias_kv": True}), (10, {"add_bias_kv": True, "add_zero_attn": True, "kdim": 5})]:
        torch.manual_seed(seed)
        tm = nn.MultiheadAttention(12, 3, **kwargs)
        attn.manual_seed(seed)
        am = attn.MultiheadAttention(12, 3, **kwargs)
        assert list(am.state_dict()) == list(tm.state_dict())
        for key, val in tm.state_dict().items():
            np.testing.assert_array_equal(am.state_dict()[key], val.numpy(), err_msg=key)


def random_torch_mha(tmp_path, **kwargs):
    """A torch.nn.MultiheadAttention with random biases, saved to safetensors and loaded into a
    differently seeded attn module."""
    torch.manual_seed(11)
    tm = nn.MultiheadAttention(8, 2, **kwargs).eval()
    if tm.in_proj_bias is not None:
        with torch.no_grad():
            tm.in_proj_bias.normal_()
            tm.out_proj.bias.normal_()
    path = str(tmp_path / "torch_mha.safetensors")
    py_save_file(tm.state_dict(), path)
    attn.manual_seed(99)
    am = attn.MultiheadAttention(8, 2, **kwargs).eval()
    am.load_safetensors(path)
    return tm, am


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_forward_matches_torch(tmp_path, batch_first):
    tm, am = random_torch_mha(tmp_path, batch_first=batch_first)
    N, L, S = 3, 4, 6
    lay = (lambda n, t: (n, t, 8)) if batch_first else (lambda n, t: (t, n, 8))
    q, kv = randn(*lay(N, L), seed=1), randn(*lay(N, S), seed=2)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, 2] = kpm[2, 5] = True
    mask_f = randn(N * 2, L, S, seed=3)
    mask_b = torch.rand(L, S) < 0.3
    mask_b[:, 0] = False
    cases = [{}, {"average_attn_weights": False}, {"key_padding_mask": kpm}, {"attn_mask": mask_b},
             {"attn_mask": mask_f}, {"key_padding_mask": kpm, "attn_mask": mask_f[0]},
             {"need_weights": False}]
    for kw in cases:
        with torch.no_grad():
            t_out, t_w = tm(q, kv, kv, **kw)
        a_out, a_w = am(q, kv, kv, **kw)
        np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
        if t_w is None:
            assert a_w is None
        else:
            np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
    # Unbatched input, and is_causal (torch 1.13 has no is_causal: the causal mask instead).
    with torch.no_grad():
        t_out, _ = tm(q[0] if batch_first else q[:, 0], kv[0] if batch_first else kv[:, 0],
                      kv[0] if batch_first else kv[:, 0])
    a_out, _ = am(q[0] if batch_first else q[:, 0], kv[0] if batch_first else kv[:, 0],
                  kv[0] if batch_first else kv[:, 0])
    np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL)
    x = randn(*lay(N, L), seed=4)
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        t_out, t_w = tm(x, x, x, attn_mask=causal)
    a_out, a_w = am(x, x, x, is_causal=True)
    np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL)


def test_multihead_attention_with_kdim_and_vdim_matches_torch(tmp_path):
    # Cross-attention from another width: torch's separate q/k/v_proj_weight.
    tm, am = random_torch_mha(tmp_path, kdim=5, vdim=3, batch_first=True)
    assert am.state_dict().keys() == tm.state_dict().keys()
    q, k, v = randn(3, 4, 8, seed=1), randn(3, 6, 5, seed=2), randn(3, 6, 3, seed=3)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4] = True
    for kw in [{}, {"key_padding_mask": kpm, "average_attn_weights": False}]:
        with torch.no_grad():
            t_out, t_w = tm(q, k, v, **kw)
        a_out, a_w = am(q, k, v, **kw)
        np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
        np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
    with pytest.raises(ValueError, match="kdim = 5 for key and dim = vdim = 3 for value"):
        am(q, v, k)


@pytest.mark.parametrize("extras", [{"add_bias_kv": True}, {"add_zero_attn": True},
                                    {"add_bias_kv": True, "add_zero_attn": True, "batch_first": True}])
def test_multihead_attention_with_extra_keys_matches_torch(tmp_path, extras):
    # add_bias_kv / add_zero_attn: one or two keys more, which torch's masks do not cover.
    tm, am = random_torch_mha(tmp_path, **extras)
    assert am.state_dict().keys() == tm.state_dict().keys()
    N, L, S = 2, 3, 5
    lay = (lambda n, t: (n, t, 8)) if extras.get("batch_first") else (lambda n, t: (t, n, 8))
    q, kv = randn(*lay(N, L), seed=1), randn(*lay(N, S), seed=2)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[1, :] = True  # every real key of one sequence padded: the extra keys remain
    for kw in [{}, {"key_padding_mask": kpm, "attn_mask": randn(N * 2, L, S, seed=3)},
               {"average_attn_weights": False}]:
        with torch.no_grad():
            t_out, t_w = tm(q, kv, kv, **kw)
        a_out, a_w = am(q, kv, kv, **kw)
        np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
        np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
    # No real key at all: the extra keys alone (masks with no column, as torch takes them).
    none = randn(*lay(N, 0), seed=4)
    for kw in [{}, {"key_padding_mask": torch.zeros(N, 0, dtype=torch.bool), "attn_mask": torch.zeros(L, 0)}]:
        with torch.no_grad():
            t_out, t_w = tm(q, none, none, **kw)
        a_out, a_w = am(q, none, none, **kw)
        np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL, err_msg=str(kw))
        np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL, err_msg=str(kw))


def test_multihead_attention_random_configurations_match_torch(tmp_path):
    # Every constructor option at once, at random, with torch's parameters (all redrawn) loaded
    # into attn: kdim, vdim, extra keys (no real key then allowed), layouts, both masks.
    rng = random.Random(0)
    for it in range(120):
        H = rng.choice([1, 2, 4])
        E = H * rng.choice([1, 2, 3])
        kw = dict(bias=rng.random() < 0.7, add_bias_kv=rng.random() < 0.5,
                  add_zero_attn=rng.random() < 0.5, batch_first=rng.random() < 0.5)
        if rng.random() < 0.5:
            kw["kdim"] = rng.choice([1, 3, E])
        if rng.random() < 0.5:
            kw["vdim"] = rng.choice([2, 5, E])
        torch.manual_seed(it)
        tm = nn.MultiheadAttention(E, H, **kw).eval()
        with torch.no_grad():
            for p in tm.parameters():
                p.normal_()
        path = str(tmp_path / f"mha{it}.safetensors")
        py_save_file(tm.state_dict(), path)
        am = attn.MultiheadAttention(E, H, **kw).eval()
        am.load_safetensors(path)
        N, L = rng.choice([1, 2, 3]), rng.choice([1, 2, 5])
        S = rng.choice([1, 3, 6] + ([0] if kw["add_bias_kv"] or kw["add_zero_attn"] else []))
        unbatched = rng.random() < 0.2

        def shape(T, d):
            return (T, d) if unbatched else ((N, T, d) if kw["batch_first"] else (T, N, d))

        q, k, v = (torch.randn(*shape(T, d)) for T, d in ((L, E), (S, kw.get("kdim", E)), (S, kw.get("vdim", E))))
        fkw = {"average_attn_weights": rng.random() < 0.5}
        if rng.random() < 0.4 and S > 0:
            fkw["key_padding_mask"] = torch.rand(*(() if unbatched else (N,)), S) < 0.3
        if rng.random() < 0.4:
            fkw["attn_mask"] = torch.randn(L, S) if rng.random() < 0.5 else torch.randn(H if unbatched else N * H, L, S)
        with torch.no_grad():
            t_out, t_w = tm(q, k, v, **fkw)
        a_out, a_w = am(q, k, v, **fkw)
        assert a_out.shape == t_out.shape and a_w.shape == t_w.shape, (it, kw)
        seen = torch.isfinite(t_out).numpy()  # torch: NaN for a row whose every key is padded
        np.testing.assert_allclose(a_out[seen], t_out.numpy()[seen], rtol=0, atol=1e-4, err_msg=f"{it} {kw}")
        seen = torch.isfinite(t_w).numpy()
        np.testing.assert_allclose(a_w[seen], t_w.numpy()[seen], rtol=0, atol=1e-5, err_msg=f"{it} {kw}")


def test_multihead_attention_dropout_matches_torch(tmp_path):
    tm, am = random_torch_mha(tmp_path, dropout=0.2, bias=False)
    tm.train()
    am.train()
    q = randn(5, 2, 8, seed=1)
    torch.manual_seed(8)
    with torch.no_grad():
        t_out, t_w = tm(q, q, q)
    attn.manual_seed(8)
    a_out, a_w = am(q, q, q)
    np.testing.assert_allclose(a_out, t_out.numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(a_w, t_w.numpy(), rtol=0, atol=TOL)


# ---- safetensors both ways ---------------------------------------------------------------------


def test_chapter_module_saved_by_torch_loads_in_attn(tmp_path):
    torch.manual_seed(123)
    tm = MultiHeadAttention(6, 8, 10, 0.0, 2, qkv_bias=True).eval()
    path = str(tmp_path / "chapter.safetensors")
    py_save_file(tm.state_dict(), path)
    am = attn.MultiHeadAttention(6, 8, 10, 0.0, 2, qkv_bias=True).eval()
    am.load_safetensors(path)
    x = randn(2, 7, 6, seed=1)
    with torch.no_grad():
        np.testing.assert_allclose(am(x), tm(x).numpy(), rtol=0, atol=TOL)


def test_safetensors_files_written_by_gen_safetensors_load_in_python():
    import os

    from conftest import FIXTURES
    am = attn.MultiheadAttention(8, 2, batch_first=True).eval()
    am.load_safetensors(os.path.join(FIXTURES, "torch_mha.safetensors"))
    torch.manual_seed(123)
    tm = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in
                        py_load_file(os.path.join(FIXTURES, "torch_mha.safetensors")).items()})
    x = randn(2, 5, 8, seed=2)
    with torch.no_grad():
        np.testing.assert_allclose(am(x, x, x)[0], tm(x, x, x)[0].numpy(), rtol=0, atol=TOL)


def test_attn_saved_weights_load_in_torch(tmp_path):
    attn.manual_seed(21)
    am = attn.MultiheadAttention(8, 4).eval()
    path = str(tmp_path / "from_attn.safetensors")
    am.save_safetensors(path, metadata={"format": "pt"})
    tm = nn.MultiheadAttention(8, 4).eval()
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in py_load_file(path).items()})
    x = randn(3, 2, 8, seed=3)
    with torch.no_grad():
        np.testing.assert_allclose(am(x, x, x)[0], tm(x, x, x)[0].numpy(), rtol=0, atol=TOL)
    try:  # the reference implementation, where installed, reads attn's files too
        from safetensors.numpy import load_file as st_load
    except ImportError:
        return
    for k, v in st_load(path).items():
        np.testing.assert_array_equal(v, am.state_dict()[k])

"""scaled_dot_product_attention in bfloat16, float16 and float64, the kernel= argument and
sdpa_kernels().

Accuracy of 16-bit results (docs/NUMERICS.md's 2x rule): on the same rounded inputs, attn's
error against the float64 truth is at most twice the error of "compute in float32, round the
output to the dtype" (PyTorch's contract) plus a 1e-4 floor. Both references are computed here
in NumPy. bfloat16 NumPy arrays are ml_dtypes.bfloat16 (scripts/test_python.sh installs it).
"""
import subprocess
import sys

import numpy as np
import pytest

import attn

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def rnd(*shape, dtype=np.float32, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return x.astype(dtype)


def np_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, dtype=np.float64):
    """SDPA in NumPy, every step in `dtype` (float64: the truth; float32: the float32 reference)."""
    q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
    if enable_gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    L, S = q.shape[-2], k.shape[-2]
    s = (q @ np.swapaxes(k, -1, -2)) * dtype(1.0 / np.sqrt(q.shape[-1]))
    if is_causal:
        s = np.where(np.tril(np.ones((L, S), bool)), s, dtype(-np.inf))
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        s = np.where(m, s, dtype(-np.inf)) if m.dtype == bool else s + m.astype(dtype)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return (w @ v).astype(dtype)


def check_2x_rule(got, q, k, v, dtype, **kw):
    """got (attn's output in `dtype`) against the float64 truth of the same rounded inputs."""
    assert got.dtype == dtype
    truth = np_sdpa(q, k, v, dtype=np.float64, **kw)
    ref = np_sdpa(q, k, v, dtype=np.float32, **kw).astype(dtype)  # float32, rounded once
    err = np.abs(got.astype(np.float64) - truth).max()
    err_ref = np.abs(ref.astype(np.float64) - truth).max()
    assert err <= 2 * err_ref + 1e-4, f"error {err:.3g} > 2 * {err_ref:.3g} + 1e-4"


def kernels_for(dtype_name):
    """None (the default choice) and every kernel that runs here and computes `dtype_name`."""
    names = [k["name"] for k in attn.sdpa_kernels()
             if k["runs_on_this_cpu"] and dtype_name in k["dtypes"]]
    return [None] + names


CASES = {
    "plain": dict(shape=(2, 3, 17, 16), kw={}),
    "causal": dict(shape=(1, 2, 33, 32), kw=dict(is_causal=True)),
    "bool_mask": dict(shape=(2, 2, 9, 8), kw=dict(mask="bool")),
    "float_mask": dict(shape=(2, 2, 9, 8), kw=dict(mask="float")),
    "gqa": dict(shape=(1, 4, 12, 16), kw=dict(enable_gqa=True)),
    "unbatched": dict(shape=(7, 64), kw={}),
}


def make_case(name, dtype):
    case = CASES[name]
    shape, kw = case["shape"], dict(case["kw"])
    q = rnd(*shape, seed=1).astype(dtype)
    kv_shape = shape
    if kw.get("enable_gqa"):
        kv_shape = shape[:-3] + (shape[-3] // 2,) + shape[-2:]
    k = rnd(*kv_shape, seed=2, scale=1.5).astype(dtype)
    v = rnd(*kv_shape, seed=3).astype(dtype)
    mask = kw.pop("mask", None)
    if mask == "bool":
        kw["attn_mask"] = np.random.default_rng(4).random((shape[-2], shape[-2])) < 0.7
        kw["attn_mask"][:, 0] = True  # every row keeps a key
    elif mask == "float":
        kw["attn_mask"] = rnd(shape[-2], shape[-2], seed=5).astype(dtype)  # a mask in the same dtype
    return q, k, v, kw


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_numpy_16bit_returns_the_dtype_within_the_2x_rule(case, dtype):
    q, k, v, kw = make_case(case, dtype)
    for kernel in kernels_for(dtype.name):
        if kernel and kernel.startswith("cpu.decode.") and q.shape[-2] > 16:
            # the decode kernels take at most 16 queries per head, and say so
            with pytest.raises(ValueError, match="at most 16"):
                attn.scaled_dot_product_attention(q, k, v, kernel=kernel, **kw)
            continue
        got = attn.scaled_dot_product_attention(q, k, v, kernel=kernel, **kw)
        assert got.shape == q.shape[:-1] + (v.shape[-1],)
        check_2x_rule(got, q, k, v, dtype, **kw)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_16bit_strided_views_match_contiguous_copies(dtype):
    base = rnd(2, 9, 3, 16).astype(dtype)
    qt = base.transpose(0, 2, 1, 3)  # in place with its strides
    rev = base[:, ::-1].transpose(0, 2, 1, 3)  # negative stride: copied
    want = attn.scaled_dot_product_attention(*(np.ascontiguousarray(qt),) * 3)
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(qt, qt, qt), want)
    got = attn.scaled_dot_product_attention(rev, rev, rev)
    np.testing.assert_array_equal(got, attn.scaled_dot_product_attention(*(np.ascontiguousarray(rev),) * 3))


def test_16bit_masks_of_any_dtype():
    q = rnd(2, 5, 8)
    m = rnd(5, 5, seed=7)
    want = attn.scaled_dot_product_attention(q, q, q, attn_mask=m.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, q, q, attn_mask=m.astype(BF16)), want)
    want = attn.scaled_dot_product_attention(q, q, q, attn_mask=m.astype(F16).astype(np.float32))
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, q, q, attn_mask=m.astype(F16)), want)


def test_float64_is_computed_in_float64_without_rounding():
    q, k, v = (rnd(2, 3, 11, 16, dtype=np.float64, seed=s) for s in (1, 2, 3))
    q += 1e-9  # not representable in float32: a float32 rounding would show at ~1e-8
    for kw in ({}, dict(is_causal=True), dict(attn_mask=rnd(11, 11, dtype=np.float64, seed=4))):
        for kernel in (None, "reference"):
            got = attn.scaled_dot_product_attention(q, k, v, kernel=kernel, **kw)
            assert got.dtype == np.float64
            np.testing.assert_allclose(got, np_sdpa(q, k, v, **kw), rtol=0, atol=1e-12)
    rev = q[:, :, ::-1]  # a negative-stride float64 view is copied, still in float64
    np.testing.assert_allclose(attn.scaled_dot_product_attention(rev, k, v),
                               np_sdpa(rev, k, v), rtol=0, atol=1e-12)


def test_float64_dropout_is_seeded_and_advances_the_generator():
    q = rnd(1, 2, 6, 8, dtype=np.float64)
    attn.manual_seed(3)
    a = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    b = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    attn.manual_seed(3)
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5), a)
    assert not np.array_equal(a, b)  # the generator moved on
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, q, q, dropout_p=1.0),
                                  np.zeros_like(q))


@pytest.mark.parametrize("a,b", [(np.float16, np.float32), (BF16, np.float16), (np.float64, BF16),
                                 (np.float32, np.float64)])
def test_mixed_dtypes_raise_type_error_naming_both(a, b):
    q = rnd(2, 4, 8)
    na, nb = np.dtype(a).name, np.dtype(b).name
    with pytest.raises(TypeError, match=f"same dtype, got query {na}, key {nb}, value {na}"):
        attn.scaled_dot_product_attention(q.astype(a), q.astype(b), q.astype(a))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, bool])
def test_integer_and_bool_queries_raise_type_error(dtype):
    q = np.ones((2, 4, 8), dtype=dtype)
    with pytest.raises(TypeError):
        attn.scaled_dot_product_attention(q, q, q)


def test_kernel_argument():
    q = rnd(2, 3, 10, 16)
    want = np_sdpa(q, q, q, is_causal=True)
    np.testing.assert_allclose(attn.scaled_dot_product_attention(q, q, q, is_causal=True, kernel="reference"),
                               want, rtol=0, atol=1e-5)
    for name in kernels_for("float32")[1:]:
        np.testing.assert_allclose(attn.scaled_dot_product_attention(q, q, q, is_causal=True, kernel=name),
                                   want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown kernel 'no.such.kernel'.*reference"):
        attn.scaled_dot_product_attention(q, q, q, kernel="no.such.kernel")
    for k in attn.sdpa_kernels():
        if not k["runs_on_this_cpu"]:
            with pytest.raises(ValueError, match="needs CPU features"):
                attn.scaled_dot_product_attention(q, q, q, kernel=k["name"])
        elif "float64" not in k["dtypes"]:
            with pytest.raises(ValueError, match="dtype float64 not supported"):
                attn.scaled_dot_product_attention(q.astype(np.float64), q.astype(np.float64),
                                                  q.astype(np.float64), kernel=k["name"])


def test_sdpa_kernels_lists_the_reference():
    kernels = attn.sdpa_kernels()
    assert len({k["name"] for k in kernels}) == len(kernels)
    for k in kernels:
        assert set(k) == {"name", "family", "dtypes", "runs_on_this_cpu", "reason_if_not", "reduced_float32"}
        assert k["reduced_float32"] == (k["name"] == "cpu.flash.amx_bf16")
        assert k["family"] in ("reference", "fused")
        assert (k["reason_if_not"] == "") == k["runs_on_this_cpu"]
    ref = next(k for k in kernels if k["name"] == "reference")
    assert ref["family"] == "reference" and ref["runs_on_this_cpu"]
    assert set(ref["dtypes"]) == {"float32", "bfloat16", "float16", "float64"}


def test_float32_matmul_precision():
    """torch.set_float32_matmul_precision's levels: "high" keeps float32's accuracy (bf16x3 on the
    AMX tiles where present, float32 elsewhere); "medium" bf16's; a bad level changes nothing."""
    assert attn.get_float32_matmul_precision() == "highest"
    q, k, v = rnd(1, 2, 70, 64, seed=1), rnd(1, 2, 90, 64, seed=2), rnd(1, 2, 90, 64, seed=3)
    truth = np_sdpa(q, k, v)
    err32 = np.abs(np_sdpa(q, k, v, dtype=np.float32) - truth).max()
    try:
        attn.set_float32_matmul_precision("high")
        assert attn.get_float32_matmul_precision() == "high"
        out = attn.scaled_dot_product_attention(q, k, v)
        assert out.dtype == np.float32
        assert np.abs(out - truth).max() <= 2 * err32 + 1e-6
        attn.set_float32_matmul_precision("medium")
        out = attn.scaled_dot_product_attention(q, k, v)
        assert np.abs(out - truth).max() <= 1e-2
        with pytest.raises(ValueError, match="'highest', 'high' or 'medium', got 'fast'"):
            attn.set_float32_matmul_precision("fast")
        assert attn.get_float32_matmul_precision() == "medium"
    finally:
        attn.set_float32_matmul_precision("highest")


def test_import_does_not_need_ml_dtypes():
    code = ("import sys, attn, numpy as np; q = np.ones((2, 4), np.float16); "
            "print(attn.scaled_dot_product_attention(q, q, q).dtype, 'ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["float16", "False"]


# ---- PyTorch tensors -------------------------------------------------------------------------


def torch_math_sdpa(q, k, v, dtype, is_causal=False):
    """The math SDPA in torch (1.13 has no F.scaled_dot_product_attention), in `dtype`."""
    import torch

    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_torch_16bit_tensors(name, is_causal):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 16, generator=g).to(tdtype) for _ in range(3))
    got = attn.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert isinstance(got, np.ndarray)
    want_dtype = BF16 if name == "bfloat16" else F16
    assert got.dtype == want_dtype and got.shape == (2, 3, 13, 16)
    truth = torch_math_sdpa(q, k, v, torch.float64, is_causal).numpy()
    ref = torch_math_sdpa(q, k, v, torch.float32, is_causal).to(tdtype).to(torch.float64).numpy()
    err = np.abs(got.astype(np.float64) - truth).max()
    err_ref = np.abs(ref - truth).max()
    assert err <= 2 * err_ref + 1e-4, f"error {err:.3g} > 2 * {err_ref:.3g} + 1e-4"
    # The same bits as the NumPy route for the same values.
    as_np = [t.to(torch.float32).numpy().astype(want_dtype) for t in (q, k, v)]
    np.testing.assert_array_equal(got, attn.scaled_dot_product_attention(*as_np, is_causal=is_causal))


def test_torch_bfloat16_without_ml_dtypes_raises_a_clear_type_error(monkeypatch):
    torch = pytest.importorskip("torch")
    q = torch.ones(2, 4, 8, dtype=torch.bfloat16)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # `import ml_dtypes` raises ImportError
    with pytest.raises(TypeError, match=r"install ml_dtypes \(pip install ml_dtypes\)"):
        attn.scaled_dot_product_attention(q, q, q)
    h = q.to(torch.float16)  # float16 needs no ml_dtypes
    assert attn.scaled_dot_product_attention(h, h, h).dtype == np.float16


def test_torch_float64_is_not_rounded():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) + 1e-9 for _ in range(3))
    got = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, torch_math_sdpa(q, k, v, torch.float64, True).numpy(), rtol=0, atol=1e-12)

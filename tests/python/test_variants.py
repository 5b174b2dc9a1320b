"""The attention variants of attn.scaled_dot_product_attention (window_size, softcap,
alibi_slopes, sinks) against a float64 NumPy implementation written here from their documented
semantics, alone and combined, on every kernel that takes float32 and on the float64 routes; bad
values raise TypeError / ValueError naming the argument. NumPy only (one optional comparison with
torch math, skipped without torch)."""
import numpy as np
import pytest

import attn


def rnd(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def qkv(B=2, H=3, L=7, S=9, E=8, Ev=6, Hkv=None, seed=0, dtype=np.float32):
    Hkv = H if Hkv is None else Hkv
    return (rnd(B, H, L, E, seed=seed, dtype=dtype), rnd(B, Hkv, S, E, seed=seed + 1, dtype=dtype),
            rnd(B, Hkv, S, Ev, seed=seed + 2, dtype=dtype))


def ref_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, window_size=(-1, -1),
             softcap=None, alibi_slopes=None, sinks=None, enable_gqa=False, return_lse=False):
    """The documented semantics in float64: x = scale q.k; x = c tanh(x / c); x -= slope |i - j|;
    masks (-inf); softmax with one more logit s_h (no value); a row with no key and no sink is 0.
    Leading dims (B, H), (H) or none; key/value heads repeat for GQA."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    nd = q.ndim
    q4, k4, v4 = (t.reshape((1,) * (4 - nd) + t.shape) for t in (q, k, v))
    B, H, L, E = q4.shape
    S = k4.shape[2]
    group = H // k4.shape[1]
    k4, v4 = np.repeat(k4, group, axis=1), np.repeat(v4, group, axis=1)
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    x = q4 @ k4.transpose(0, 1, 3, 2) * scale
    if softcap is not None:
        x = softcap * np.tanh(x / softcap)
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    if alibi_slopes is not None:
        s = np.asarray(alibi_slopes, np.float64)
        s = s.reshape(1, H, 1, 1) if s.ndim == 1 else s.reshape(B, H, 1, 1)
        x = x - s * np.abs(i - j)
    visible = np.ones((L, S), bool)
    if is_causal:
        visible &= j <= i
    left, right = window_size
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    x = np.where(visible, x, -np.inf)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape) if m.ndim < 4 else m
        x = np.where(m, x, -np.inf) if m.dtype == bool else x + m.astype(np.float64)
    sink = np.full((1, H, 1, 1), -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64).reshape(1, H, 1, 1)
    mx = np.maximum(x.max(-1, keepdims=True), sink)
    safe = np.where(np.isneginf(mx), 0.0, mx)
    e = np.exp(x - safe)
    total = e.sum(-1, keepdims=True) + np.exp(sink - safe)
    w = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    out = (w @ v4).reshape(q.shape[:-1] + (v.shape[-1],))
    lse = np.where(total[..., 0] > 0, safe[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)), -np.inf)
    return (out, lse.reshape(q.shape[:-1])) if return_lse else out


def float32_kernels():
    """Every kernel that runs here and computes float32 (the reference and the fused builds; the
    decode kernels refuse the variants with their reason)."""
    return [k["name"] for k in attn.sdpa_kernels() if k["runs_on_this_cpu"] and "float32" in k["dtypes"]]


def check(kwargs, q, k, v, atol32=2e-5, **ref_kw):
    """kwargs through attn in float32 (kernel chosen, and every flash/reference kernel forced)
    and float64, against ref_sdpa."""
    want = ref_sdpa(q, k, v, **{**kwargs, **ref_kw})
    q64, k64, v64 = (t.astype(np.float64) for t in (q, k, v))
    got64 = attn.scaled_dot_product_attention(q64, k64, v64, **kwargs)
    assert got64.dtype == np.float64
    np.testing.assert_allclose(got64, want, rtol=0, atol=1e-12)
    got = attn.scaled_dot_product_attention(q, k, v, **kwargs)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=atol32)
    for name in float32_kernels():
        if name.startswith("cpu.decode."):
            continue
        out = attn.scaled_dot_product_attention(q, k, v, kernel=name, **kwargs)
        np.testing.assert_allclose(out, want, rtol=0, atol=atol32, err_msg=name)


# ---- window_size ---------------------------------------------------------------------------------

WINDOWS = [(0, 0), (2, 0), (3, 1), (-1, 2), (1, -1), (0, -1), (100, 100), (-1, -1)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_is_the_band_mask(window, is_causal):
    q, k, v = qkv(L=11, S=11)
    check({"window_size": window, "is_causal": is_causal}, q, k, v)
    # The same as an explicit boolean mask of the band (where is_causal adds the diagonal).
    i, j = np.arange(11)[:, None], np.arange(11)[None, :]
    band = np.ones((11, 11), bool)
    if window[0] >= 0:
        band &= j >= i - window[0]
    if window[1] >= 0:
        band &= j <= i + window[1]
    if is_causal:
        band &= j <= i
    for dtype in (np.float32, np.float64):
        a, b, c = (t.astype(dtype) for t in (q, k, v))
        got = attn.scaled_dot_product_attention(a, b, c, window_size=window, is_causal=is_causal)
        masked = attn.scaled_dot_product_attention(a, b, c, attn_mask=band)
        np.testing.assert_allclose(got, masked, rtol=0, atol=1e-6 if dtype == np.float32 else 1e-13)


def test_hugging_face_sliding_window():
    """sliding_window = w (each token sees itself and the w - 1 before it) is window_size=(w-1, 0)
    with is_causal=True."""
    w = 4
    q, k, v = qkv(B=1, H=2, L=10, S=10)
    i, j = np.arange(10)[:, None], np.arange(10)[None, :]
    hf_mask = (j <= i) & (i - j < w)
    got = attn.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(w - 1, 0))
    np.testing.assert_allclose(got, attn.scaled_dot_product_attention(q, k, v, attn_mask=hf_mask),
                               rtol=0, atol=1e-6)


def test_window_with_l_not_s_and_a_list():
    q, k, v = qkv(L=5, S=13)  # top-left alignment: query i sits at key i
    check({"window_size": [2, 3]}, q, k, v)
    q, k, v = qkv(L=13, S=5)  # queries 8.. see no key at all with a window of (1, 1): 0
    out = attn.scaled_dot_product_attention(q, k, v, window_size=(1, 1))
    assert np.all(out[:, :, 6:] == 0)
    check({"window_size": (1, 1)}, q, k, v)


# ---- softcap -------------------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [0.5, 1.0, 5.0, 30.0, 1e6])
def test_softcap(softcap):
    q, k, v = qkv()
    q *= 4  # scores well beyond the cap
    check({"softcap": softcap}, q, k, v)
    check({"softcap": softcap, "scale": 0.7, "is_causal": True}, q, k, v)


def test_softcap_bounds_the_scores():
    """With a tiny cap every score is ~0: the weights are uniform over the visible keys."""
    q, k, v = qkv(L=4, S=6)
    q *= 100
    got = attn.scaled_dot_product_attention(q, k, v, softcap=1e-6)
    want = np.broadcast_to(v.astype(np.float64).mean(-2, keepdims=True), got.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# ---- alibi_slopes --------------------------------------------------------------------------------

def alibi(H):
    """BLOOM's slopes for a power-of-two head count: 2^(-8 h / H), h = 1..H."""
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)


def test_alibi_per_head():
    q, k, v = qkv(H=4)
    check({"alibi_slopes": alibi(4)}, q, k, v)
    check({"alibi_slopes": alibi(4), "is_causal": True}, q, k, v)


def test_alibi_per_batch_and_head():
    q, k, v = qkv(B=2, H=3)
    slopes = np.abs(rnd(2, 3, seed=5))
    check({"alibi_slopes": slopes}, q, k, v)
    # A (B, H) of identical rows is the (H) form.
    same = np.stack([slopes[0], slopes[0]])
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, k, v, alibi_slopes=same),
                                  attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes[0]))


def test_alibi_3d_2d_gqa_and_strided_slopes():
    q, k, v = (t[0] for t in qkv(H=4))
    check({"alibi_slopes": alibi(4)}, q, k, v)
    check({"alibi_slopes": np.array([0.5], np.float32)}, q[0], k[0], v[0])
    qg, kg, vg = qkv(H=4, Hkv=2)
    check({"alibi_slopes": alibi(4), "enable_gqa": True}, qg, kg, vg)
    # Strided and negative-stride slopes (read in place / copied) and float64 slopes (rounded).
    wide = np.arange(8, dtype=np.float32) / 8
    for s in (wide[::2], wide[::-2], wide[::2].astype(np.float64)):
        np.testing.assert_array_equal(
            attn.scaled_dot_product_attention(qg, kg, vg, enable_gqa=True, alibi_slopes=s),
            attn.scaled_dot_product_attention(qg, kg, vg, enable_gqa=True,
                                              alibi_slopes=np.ascontiguousarray(s, np.float32)))


def test_alibi_is_an_additive_bias():
    q, k, v = qkv(H=4, L=6, S=6)
    slopes = alibi(4)
    bias = -slopes[:, None, None] * np.abs(np.arange(6)[:, None] - np.arange(6)[None, :])
    np.testing.assert_allclose(attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes),
                               attn.scaled_dot_product_attention(q, k, v, attn_mask=bias.astype(np.float32)),
                               rtol=0, atol=1e-6)


# ---- sinks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("magnitude", [0.0, 1.0, 10.0, 80.0])
def test_sinks(magnitude):
    q, k, v = qkv(H=3)
    sinks = rnd(3, seed=9) * magnitude
    check({"sinks": sinks}, q, k, v)
    check({"sinks": sinks, "is_causal": True}, q, k, v)


def test_a_sink_takes_weight_from_the_keys():
    """A very large sink takes (almost) all the weight: the output goes to 0; a very small one
    none: the output is plain attention's."""
    q, k, v = qkv(H=2)
    big = attn.scaled_dot_product_attention(q, k, v, sinks=np.array([1e4, 1e4], np.float32))
    assert np.all(big == 0)
    small = attn.scaled_dot_product_attention(q, k, v, sinks=np.array([-1e4, -1e4], np.float32))
    np.testing.assert_allclose(small, attn.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-6)


def test_sinks_fully_masked_row_is_zero():
    q, k, v = qkv(B=1, H=2, L=4, S=5)
    mask = np.ones((4, 5), bool)
    mask[2] = False  # query 2 sees no key: output 0 (its lse is the sink, see ref_sdpa)
    sinks = np.array([0.5, -2.0], np.float32)
    want, lse = ref_sdpa(q, k, v, attn_mask=mask, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(lse[0, :, 2], sinks.astype(np.float64))
    for dtype in (np.float32, np.float64):
        a, b, c = (t.astype(dtype) for t in (q, k, v))
        out = attn.scaled_dot_product_attention(a, b, c, attn_mask=mask, sinks=sinks)
        assert np.all(out[:, :, 2] == 0) and not np.any(np.isnan(out))
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-6)
    check({"attn_mask": mask, "sinks": sinks}, q, k, v)
    # Rows that a window leaves without keys: queries 5.. of 8 sit past the last of 5 keys.
    q, k, v = qkv(B=1, H=2, L=8, S=5)
    out = attn.scaled_dot_product_attention(q, k, v, window_size=(-1, -1), sinks=sinks)
    np.testing.assert_allclose(out, ref_sdpa(q, k, v, sinks=sinks), rtol=0, atol=2e-6)
    out = attn.scaled_dot_product_attention(q, k, v, window_size=(0, 0), sinks=sinks)
    assert np.all(out[:, :, 5:] == 0)
    check({"window_size": (0, 0), "sinks": sinks}, q, k, v)


def test_sinks_gqa_2d_and_3d():
    qg, kg, vg = qkv(H=4, Hkv=2)
    check({"sinks": rnd(4, seed=3), "enable_gqa": True}, qg, kg, vg)
    q, k, v = qkv(H=3)
    check({"sinks": rnd(3, seed=4)}, q[1], k[1], v[1])
    check({"sinks": np.array([1.5], np.float32)}, q[1, 0], k[1, 0], v[1, 0])


# ---- combinations --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(6))
def test_combinations(case):
    rng = np.random.default_rng(100 + case)
    H, Hkv = [(4, 4), (4, 2), (2, 1), (3, 3), (4, 1), (2, 2)][case]
    L, S = [(9, 9), (7, 12), (12, 7), (1, 9), (16, 16), (5, 3)][case]
    q, k, v = qkv(B=2, H=H, Hkv=Hkv, L=L, S=S, seed=case)
    kwargs = {
        "window_size": [(3, 0), (2, 2), (-1, 1), (0, 0), (5, -1), (1, 1)][case],
        "softcap": [20.0, 2.0, None, 5.0, 50.0, 1.0][case],
        "alibi_slopes": [alibi(4), np.abs(rnd(2, H, seed=case)), None, alibi(4)[:3],
                         np.abs(rnd(H, seed=case)), np.abs(rnd(2, H, seed=case))][case],
        "sinks": [rnd(H, seed=case), None, rnd(H, seed=case) * 3, rnd(H, seed=case),
                  rnd(H, seed=case), rnd(H, seed=case)][case],
        "is_causal": case % 2 == 0,
        "enable_gqa": H != Hkv,
    }
    if case == 5:  # with an explicit mask instead of is_causal
        kwargs["is_causal"] = False
        kwargs["attn_mask"] = rng.random((L, S)) < 0.7
    if case == 1:
        kwargs["scale"] = 0.3
        kwargs["attn_mask"] = rng.standard_normal((2, H, L, S)).astype(np.float32)
    check(kwargs, q, k, v)


def test_variants_reach_the_float64_dropout_route():
    """float64 with PyTorch-stream dropout runs the float64 reference on a route of its own: the
    variants reach it (the same mask as float32 on the reference, which uses them too)."""
    q, k, v = qkv(H=4)
    kw = dict(dropout_p=0.3, is_causal=True, window_size=(2, 0), softcap=3.0,
              alibi_slopes=alibi(4), sinks=rnd(4, seed=7))
    attn.manual_seed(7)
    got64 = attn.scaled_dot_product_attention(*(t.astype(np.float64) for t in (q, k, v)), **kw)
    attn.manual_seed(7)
    got32 = attn.scaled_dot_product_attention(q, k, v, kernel="reference", **kw)
    attn.manual_seed(7)
    plain = attn.scaled_dot_product_attention(*(t.astype(np.float64) for t in (q, k, v)),
                                              dropout_p=0.3, is_causal=True)
    assert got64.dtype == np.float64
    np.testing.assert_allclose(got64, got32, rtol=0, atol=2e-5)
    assert np.abs(got64 - plain).max() > 1e-2


def test_variants_on_16_bit_inputs():
    """float16 inputs: the kernels without the variants refuse and a float32 kernel takes the
    call (widened); the result is float16 and close to the float64 truth."""
    q, k, v = (t.astype(np.float16) for t in qkv(H=2))
    kw = dict(window_size=(2, 1), softcap=5.0, alibi_slopes=alibi(2), sinks=rnd(2, seed=1))
    out = attn.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), ref_sdpa(q, k, v, **kw), rtol=0, atol=2e-3)


def test_decode_kernels_compute_every_variant():
    decode = [n for n in float32_kernels() if n.startswith("cpu.decode.")]
    if not decode:
        pytest.skip("no decode kernel runs on this CPU")
    q, k, v = qkv(H=2, L=1, S=20)
    kw = dict(window_size=(5, 0), softcap=2.0, alibi_slopes=alibi(2), sinks=rnd(2, seed=3))
    want = ref_sdpa(q, k, v, **kw)
    for name in decode:
        np.testing.assert_allclose(attn.scaled_dot_product_attention(q, k, v, kernel=name, **kw),
                                   want, rtol=0, atol=2e-5)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-100, -100)])
def test_bad_window_raises_value_error(window):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size"):
        attn.scaled_dot_product_attention(q, k, v, window_size=window)


@pytest.mark.parametrize("window", [(1, 2, 3), (1,), 3, "ab", (1.5, 0), (None, 0), None, (2**70, 0)])
def test_window_not_a_pair_of_ints_raises_type_error(window):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size"):
        attn.scaled_dot_product_attention(q, k, v, window_size=window)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf"), -float("inf"),
                                     1e-300, 1e300])  # the last two: beyond float32's range
def test_bad_softcap_raises_value_error(softcap):
    q, k, v = qkv()
    for dtype in (np.float32, np.float64):
        with pytest.raises(ValueError, match="softcap"):
            attn.scaled_dot_product_attention(*(t.astype(dtype) for t in (q, k, v)), softcap=softcap)


def test_softcap_not_a_number_raises_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError):
        attn.scaled_dot_product_attention(q, k, v, softcap="1.0")


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
def test_bad_head_parameters(name):
    q, k, v = qkv(B=2, H=3)
    call = lambda x, a=q, b=k, c=v: attn.scaled_dot_product_attention(a, b, c, **{name: x})  # noqa: E731
    # Shapes: not (H) (or, for slopes, (B, H) of 4-D inputs).
    bad_shapes = [(4,), (2,), (1, 3), (3, 1), (2, 3, 1)] + ([(2, 3)] if name == "sinks" else [(3, 3)])
    for shape in bad_shapes:
        with pytest.raises(ValueError, match=name):
            call(np.zeros(shape, np.float32))
    if name == "alibi_slopes":  # (B, H) needs 4-D inputs
        with pytest.raises(ValueError, match=name):
            call(np.zeros((1, 3), np.float32), q[0], k[0], v[0])
    with pytest.raises(ValueError, match=name):  # more than 4 dims
        call(np.zeros((1, 1, 1, 1, 3), np.float32))
    # Values: finite.
    for bad in (np.nan, np.inf, -np.inf, 3e38):  # 3e38 * log2(e) overflows float32
        x = np.zeros(3, np.float32)
        x[1] = bad
        with pytest.raises(ValueError, match=name):
            call(x)
        with pytest.raises(ValueError, match=name):
            call(x, *(t.astype(np.float64) for t in (q, k, v)))
    # Dtypes: float32 or float64.
    for dtype in (np.int64, np.int32, np.float16, bool, np.complex64):
        with pytest.raises(TypeError, match=name):
            call(np.ones(3, dtype))
    with pytest.raises(TypeError, match=name):
        call("abc")


def test_bad_variants_on_the_float64_dropout_route():
    q, k, v = (t.astype(np.float64) for t in qkv())
    with pytest.raises(ValueError, match="window_size"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5, window_size=(-3, 0))
    with pytest.raises(ValueError, match="sinks"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5, sinks=np.zeros(5, np.float32))


# ---- torch (optional) ----------------------------------------------------------------------------

def test_against_torch_math():
    """Every variant at once, against the same formulas written in torch ops (float64), with the
    slopes and sinks passed as torch tensors (DLPack)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    B, H, L, S, E = 2, 4, 9, 9, 16
    q, k, v = (torch.randn(B, H, n, E, generator=g) for n in (L, S, S))
    slopes = torch.rand(H, generator=g)
    sinks = torch.randn(H, generator=g)
    cap, left = 4.0, 3
    x = (q.double() @ k.double().transpose(-1, -2)) / E ** 0.5
    x = cap * torch.tanh(x / cap)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    x = x - slopes.double()[:, None, None] * (i - j).abs().double()
    x = x.masked_fill(~((j <= i) & (j >= i - left)), float("-inf"))
    x = torch.cat([x, sinks.double()[None, :, None, None].expand(B, H, L, 1)], dim=-1)
    want = (torch.softmax(x, dim=-1)[..., :-1] @ v.double()).numpy()
    got = attn.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(left, 0),
                                            softcap=cap, alibi_slopes=slopes, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)

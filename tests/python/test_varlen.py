"""attn.varlen_attn: packed variable-length sequences, against attn.scaled_dot_product_attention
on each sequence alone and against a float64 NumPy definition of the variants. NumPy only (the
comparison with torch.nn.attention.varlen skips itself where that is missing)."""
import numpy as np
import pytest

import attn

L_Q = [1, 7, 0, 30, 5, 0]
L_K = [7, 1, 5, 40, 0, 0]


def rnd(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(H=4, H_kv=2, E=16, Ev=12, dtype=np.float32, seed=0):
    q = rnd(sum(L_Q), H, E, dtype=dtype, seed=seed)
    k = rnd(sum(L_K), H_kv, E, dtype=dtype, seed=seed + 1)
    v = rnd(sum(L_K), H_kv, Ev, dtype=dtype, seed=seed + 2)
    return q, k, v, cu(L_Q), cu(L_K), max(L_Q), max(L_K)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kernel", [None, "reference"])
def test_matches_scaled_dot_product_attention_per_sequence(is_causal, kernel):
    q, k, v, cq, ck, mq, mk = packed()
    out, lse = attn.varlen_attn(q, k, v, cq, ck, mq, mk, is_causal=is_causal, enable_gqa=True,
                                need_lse=True, kernel=kernel)
    assert out.shape == (q.shape[0], 4, 12) and out.dtype == np.float32
    assert lse.shape == (4, q.shape[0]) and lse.dtype == np.float32
    for n in range(len(L_Q)):
        qs, ks = slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])
        if L_Q[n] == 0:
            continue
        if L_K[n] == 0:  # no keys: output 0, LSE -inf
            assert (out[qs] == 0).all() and (lse[:, qs] == -np.inf).all()
            continue
        want = attn.scaled_dot_product_attention(
            q[qs].transpose(1, 0, 2), k[ks].transpose(1, 0, 2), v[ks].transpose(1, 0, 2),
            is_causal=is_causal, enable_gqa=True, kernel=kernel)
        np.testing.assert_allclose(out[qs].transpose(1, 0, 2), want, rtol=0, atol=1e-6)


def naive(q, k, v, cq, ck, *, scale, is_causal, bottom_right, window, softcap, slopes, sinks):
    """The definition in include/attn/sdpa.hpp, per sequence, in float64."""
    H, H_kv = q.shape[1], k.shape[1]
    out = np.zeros((q.shape[0], H, v.shape[2]))
    lse = np.full((H, q.shape[0]), -np.inf)
    for n in range(len(cq) - 1):
        L, S = cq[n + 1] - cq[n], ck[n + 1] - ck[n]
        for h in range(H):
            qh = q[cq[n]:cq[n + 1], h].astype(np.float64)
            kh = k[ck[n]:ck[n + 1], h // (H // H_kv)].astype(np.float64)
            vh = v[ck[n]:ck[n + 1], h // (H // H_kv)].astype(np.float64)
            x = scale * qh @ kh.T
            if softcap:
                x = softcap * np.tanh(x / softcap)
            i = np.arange(L)[:, None] + (S - L if bottom_right else 0)
            j = np.arange(S)[None, :]
            if slopes is not None:
                x = x - slopes[h] * np.abs(i - j)
            hide = np.zeros((L, S), bool)
            if is_causal:
                hide |= j > i
            if window[0] >= 0:
                hide |= j < i - window[0]
            if window[1] >= 0:
                hide |= j > i + window[1]
            x = np.where(hide, -np.inf, x)
            sink = sinks[h] if sinks is not None else -np.inf
            m = np.maximum(x.max(axis=1, initial=-np.inf), sink)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(x - m[:, None])
            total = e.sum(axis=1) + np.exp(sink - m)
            with np.errstate(divide="ignore", invalid="ignore"):
                p = np.where(total[:, None] > 0, e / total[:, None], 0.0)
                lse[h, cq[n]:cq[n + 1]] = np.log(total) + m
            out[cq[n]:cq[n + 1], h] = p @ vh
    return out, lse


@pytest.mark.parametrize("bottom_right", [False, True])
def test_variants_follow_their_definition_in_float64(bottom_right):
    q, k, v, cq, ck, mq, mk = packed(dtype=np.float64, seed=3)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])  # exact in float32 (the slopes are float32)
    sinks = rnd(4, dtype=np.float64, seed=9)
    out, lse = attn.varlen_attn(
        q, k, v, cq, ck, mq, mk, is_causal=True,
        causal_alignment="bottom_right" if bottom_right else "top_left", scale=0.4,
        enable_gqa=True, window_size=(6, 1), softcap=3.0, alibi_slopes=slopes, sinks=sinks,
        need_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    want, want_lse = naive(q, k, v, cq, ck, scale=0.4, is_causal=True, bottom_right=bottom_right,
                           window=(6, 1), softcap=3.0, slopes=slopes,
                           sinks=sinks.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)


def test_dropout_is_keyed_by_seed_and_offset():
    q, k, v, cq, ck, mq, mk = packed(seed=5)
    a = attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True, dropout_p=0.3, dropout_seed=1)
    b = attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True, dropout_p=0.3, dropout_seed=1,
                         num_threads=1)
    c = attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True, dropout_p=0.3, dropout_seed=1,
                         dropout_offset=1)
    plain = attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True)
    np.testing.assert_array_equal(a, b)  # the same mask, whatever the thread count
    assert not np.array_equal(a, c) and not np.array_equal(a, plain)


def test_integer_cu_seq_of_any_width_and_torch_style_lists():
    q, k, v, cq, ck, mq, mk = packed(seed=6)
    want = attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True)
    got = attn.varlen_attn(q, k, v, cq.astype(np.int64), list(ck), mq, mk, enable_gqa=True)
    np.testing.assert_array_equal(got, want)


def test_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, cq, ck, mq, mk = packed(seed=7)
    qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    out = attn.varlen_attn(qb, kb, vb, cq, ck, mq, mk, enable_gqa=True, is_causal=True)
    assert out.dtype == ml_dtypes.bfloat16
    want = attn.varlen_attn(*(x.astype(np.float32) for x in (qb, kb, vb)), cq, ck, mq, mk,
                            enable_gqa=True, is_causal=True)
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=0, atol=2e-2)


def test_bad_input_raises_with_the_argument_named():
    q, k, v, cq, ck, mq, mk = packed()
    with pytest.raises(TypeError, match="cu_seq_q: expected an integer array of cumulative sequence lengths"):
        attn.varlen_attn(q, k, v, cq.astype(np.float32), ck, mq, mk, enable_gqa=True)
    bad = cq.copy()
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="cu_seq_q must be non-decreasing"):
        attn.varlen_attn(q, k, v, bad, ck, mq, mk, enable_gqa=True)
    with pytest.raises(ValueError, match=r"cu_seq_k\[N\] must equal key.size\(0\) = 53"):
        attn.varlen_attn(q, k, v, cq, np.append(ck[:-1], 54), mq, mk, enable_gqa=True)
    with pytest.raises(ValueError, match="cu_seq_q and cu_seq_k must both hold N \\+ 1 entries"):
        attn.varlen_attn(q, k, v, cq, np.append(ck, ck[-1]), mq, mk, enable_gqa=True)
    with pytest.raises(ValueError, match="max_q = 29 is smaller than sequence 3's query length 30"):
        attn.varlen_attn(q, k, v, cq, ck, 29, mk, enable_gqa=True)
    with pytest.raises(ValueError, match="without enable_gqa"):
        attn.varlen_attn(q, k, v, cq, ck, mq, mk)
    with pytest.raises(ValueError, match="query must have 3 dims"):
        attn.varlen_attn(q[None], k, v, cq, ck, mq, mk, enable_gqa=True)
    with pytest.raises(ValueError, match="causal_alignment"):
        attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True, causal_alignment="diagonal")
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        attn.varlen_attn(q, k, v, cq, ck, mq, mk, enable_gqa=True, alibi_slopes=np.ones((1, 4)))


def test_matches_torch_varlen_attn_where_available():
    torch = pytest.importorskip("torch")
    try:
        from torch.nn.attention.varlen import varlen_attn as torch_varlen
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (PyTorch 2.10+)")
    q, k, v, cq, ck, mq, mk = packed(H=2, H_kv=2, seed=8)
    try:
        want = torch_varlen(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                            torch.from_numpy(cq), torch.from_numpy(ck), mq, mk)
    except (RuntimeError, NotImplementedError) as e:  # e.g. CUDA-only builds of the op
        pytest.skip(f"torch varlen_attn does not run on this CPU build: {e}")
    got = attn.varlen_attn(q, k, v, cq, ck, mq, mk)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)

"""Bad and unusual inputs: every case either works (copying explicitly) or raises TypeError /
ValueError / IndexError with the C++ library's message -- never crashes. NumPy only."""
import threading

import numpy as np
import pytest

import attn


def rnd(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_float32_views_are_read_in_place_and_strided_views_work():
    q = rnd(2, 3, 5, 8)
    full = attn.scaled_dot_product_attention(q, q, q)
    assert full.dtype == np.float32 and full.shape == (2, 3, 5, 8)
    # Transposed, sliced and negative-stride views give the same numbers as contiguous copies.
    qt = rnd(2, 5, 3, 8).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(attn.scaled_dot_product_attention(qt, qt, qt),
                               attn.scaled_dot_product_attention(*(np.ascontiguousarray(qt),) * 3),
                               rtol=0, atol=1e-6)
    rev = q[:, :, ::-1, :]
    np.testing.assert_allclose(attn.scaled_dot_product_attention(rev, q, q),
                               attn.scaled_dot_product_attention(rev.copy(), q, q), rtol=0, atol=0)


def test_float64_runs_the_float64_reference_and_returns_float64():
    q = rnd(3, 4, 6, dtype=np.float64)
    out = attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == np.float64
    s = q @ q.transpose(0, 2, 1) / np.sqrt(6)  # the float64 path reads float64, never rounded
    s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, w @ q, rtol=0, atol=1e-12)


def test_python_lists_follow_numpy_dtypes():
    out = attn.scaled_dot_product_attention([[1.0, 2.0]], [[1.0, 2.0]], [[3.0, 4.0]])
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [[3.0, 4.0]])


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint16, np.complex64])
def test_other_dtypes_raise_type_error(dtype):
    q = np.ones((2, 3), dtype=dtype)
    with pytest.raises(TypeError, match=r"^query: expected a float32, float64, float16 or bfloat16 array, got "):
        attn.scaled_dot_product_attention(q, q, q)
    with pytest.raises(TypeError, match=r"^x: expected a float32 or float64 array, got "):
        attn.Linear(3, 2)(q)  # the modules compute in float32


def test_bool_query_raises_type_error():
    q = np.ones((2, 3), dtype=bool)
    with pytest.raises(TypeError, match="query, key and value must be float32, float64, float16 or bfloat16 arrays, got bool"):
        attn.scaled_dot_product_attention(q, q, q)


def test_mixed_dtypes_raise_type_error():
    q = rnd(2, 3)
    with pytest.raises(TypeError, match="must have the same dtype, got query float32, key float64"):
        attn.scaled_dot_product_attention(q, q.astype(np.float64), q)


def test_shape_errors_carry_the_cpp_message():
    q, k = rnd(1, 2, 4, 8), rnd(1, 2, 4, 6)
    with pytest.raises(ValueError) as e:
        attn.scaled_dot_product_attention(q, k, k)
    assert str(e.value) == ("scaled_dot_product_attention: key's embed dim must equal query's (8), "
                            "got key shape [1, 2, 4, 6] (query shape [1, 2, 4, 8])")
    with pytest.raises(ValueError, match="at most 4 dimensions, got 5"):
        attn.scaled_dot_product_attention(rnd(1, 1, 1, 2, 3), q, q)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        attn.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="is_causal"):
        attn.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((4, 4), bool), is_causal=True)


def test_non_arrays_and_gpu_tensors_raise_type_error():
    with pytest.raises(TypeError, match="query: expected a NumPy array or a tensor supporting DLPack, got <class 'str'>"):
        attn.scaled_dot_product_attention("q", rnd(2, 2), rnd(2, 2))

    class FakeCudaTensor:  # what a CUDA tensor reports through DLPack
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            raise AssertionError("attn must not ask a GPU tensor for its data")

    with pytest.raises(TypeError, match=r"key: expected an array in CPU memory, got a tensor on cuda .*tensor\.cpu\(\)"):
        attn.scaled_dot_product_attention(rnd(2, 2), FakeCudaTensor(), rnd(2, 2))


def test_embedding_ids():
    attn.manual_seed(1)
    emb = attn.Embedding(6, 4)
    w = emb.state_dict()["weight"]
    for dtype in (np.int64, np.int32, np.uint8):
        np.testing.assert_array_equal(emb(np.array([[0, 5], [2, 2]], dtype=dtype)), w[[[0, 5], [2, 2]]])
    with pytest.raises(IndexError):
        emb(np.array([6]))
    with pytest.raises(TypeError, match="input: expected an integer array of token ids, got float64"):
        emb(np.array([1.0]))


def test_manual_seed_takes_torchs_range_and_int_conversion():
    # torch.manual_seed: int(seed) in [-2**63, 2**64 - 1], negatives modulo 2**64 (its -1 seeds
    # with 2**64 - 1); test_torch.py checks the numbers against PyTorch's own.
    def draws(seed):
        attn.manual_seed(seed)
        return attn.randn([6])

    np.testing.assert_array_equal(draws(-1), draws(2**64 - 1))
    np.testing.assert_array_equal(draws(-2**63), draws(2**63))
    np.testing.assert_array_equal(draws(7.9), draws(7))
    np.testing.assert_array_equal(draws(np.int64(7)), draws(7))
    assert not np.array_equal(draws(-1), draws(1))
    for bad in (2**64, -2**63 - 1):
        with pytest.raises(ValueError, match=r"^manual_seed: seed must be in \[-2\*\*63, 2\*\*64 - 1\] .*, got "):
            attn.manual_seed(bad)
    with pytest.raises(TypeError):
        attn.manual_seed(None)


def test_module_argument_errors():
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        attn.MultiheadAttention(8, 3)
    m = attn.MultiHeadAttention(3, 4, 6, 0.0, 2)
    with pytest.raises(ValueError):
        m(rnd(2, 7, 3))  # longer than context_length
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.bias'\]: expected shape \[4\]"):
        sd = m.state_dict()
        sd["out_proj.bias"] = np.zeros(5, np.float32)
        m.load_state_dict(sd)
    with pytest.raises(ValueError, match="missing keys 'mask'"):
        sd = m.state_dict()
        del sd["mask"]
        m.load_state_dict(sd)


def test_malformed_safetensors_raise_format_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}         ")
    with pytest.raises(attn.FormatError, match=r"bad\.safetensors: tensor 'a': expected an object") as e:
        attn.load_file(str(bad))
    assert isinstance(e.value, ValueError)
    with pytest.raises(OSError, match="missing.safetensors"):
        attn.load_file(str(tmp_path / "missing.safetensors"))


def test_save_file_round_trip_and_metadata(tmp_path):
    from st_format import load_file as py_load

    path = str(tmp_path / "t.safetensors")
    a, b = rnd(2, 3), rnd(4, dtype=np.float64)
    attn.save_file({"a": a, "b": b, "c": a.T}, path, metadata={"format": "pt"})
    back = attn.load_file(path)
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["b"], b.astype(np.float32))
    np.testing.assert_array_equal(back["c"], a.T)
    assert attn.load_metadata(path) == {"format": "pt"}
    np.testing.assert_array_equal(py_load(path)["c"], a.T)  # readable without attn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]  # no temp file left


def test_threads_get_the_same_results():
    q = rnd(1, 4, 256, 64)
    want = attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    results = [None] * 4

    def work(i):
        results[i] = attn.scaled_dot_product_attention(q, q, q, is_causal=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, want)

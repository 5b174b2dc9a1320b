"""The reuse cache of large tensor blocks from Python: stats, limit, empty_cache, and that a
reused block never changes a result. NumPy only."""
import numpy as np
import pytest

import attn


@pytest.fixture
def cache():
    saved = attn.cache_stats()["limit_bytes"]
    attn.set_cache_limit(64 << 20)
    attn.empty_cache()
    yield
    attn.empty_cache()
    attn.set_cache_limit(saved)


def test_freed_outputs_are_kept_and_reused_with_the_same_results(cache):
    q = np.random.default_rng(0).standard_normal((1, 4, 2048, 64)).astype(np.float32)  # 2 MiB
    first = attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    want = first.copy()
    del first  # the 2 MiB output goes back to the cache
    assert attn.cache_stats()["cached_bytes"] >= 2 << 20
    hits = attn.cache_stats()["hits"]
    again = attn.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert attn.cache_stats()["hits"] > hits
    np.testing.assert_array_equal(again, want)


def test_limit_and_empty_cache(cache):
    q = np.ones((1, 1, 8192, 64), np.float32)
    out = attn.scaled_dot_product_attention(q, q, q)  # 2 MiB
    del out
    assert attn.cache_stats()["cached_blocks"] >= 1
    attn.empty_cache()
    s = attn.cache_stats()
    assert s["cached_blocks"] == 0 and s["cached_bytes"] == 0 and s["limit_bytes"] == 64 << 20
    attn.set_cache_limit(0)
    out = attn.scaled_dot_product_attention(q, q, q)
    del out
    assert attn.cache_stats()["cached_blocks"] == 0


def test_negative_limit_is_a_value_error(cache):
    with pytest.raises(ValueError, match="set_cache_limit: bytes must be >= 0, got -1"):
        attn.set_cache_limit(-1)
    assert attn.cache_stats()["limit_bytes"] == 64 << 20

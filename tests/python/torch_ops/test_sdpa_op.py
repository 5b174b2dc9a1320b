"""attn.torch.scaled_dot_product_attention: the custom op against PyTorch's math SDPA and a
float64 truth, forward and backward, in float32, bfloat16 and float16; gradcheck in float64;
torch.compile; zero-copy; threads; dropout; bad input.

Accuracy rule (FlashAttention's): attn's max error against the float64 truth is at most twice
PyTorch's math path's (same dtype, same inputs) plus a small floor."""
import math
import re
import threading
import warnings

import pytest

from torch_ops_common import reference, require

torch = require("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attn  # noqa: E402
import attn.torch as at  # noqa: E402

FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (B, H, H_kv, L, S, E, Ev, mask, is_causal)
CASES = [
    (1, 1, 1, 1, 1, 8, 8, None, False),
    (2, 3, 3, 17, 23, 16, 16, None, False),
    (2, 4, 4, 33, 33, 64, 64, None, True),
    (1, 2, 2, 40, 70, 32, 24, "bool", False),
    (2, 2, 2, 9, 130, 80, 80, "float", False),
    (1, 8, 2, 65, 65, 64, 64, None, True),   # GQA
    (2, 1, 1, 128, 128, 128, 128, "bool", False),
    (1, 3, 3, 50, 20, 8, 5, None, True),
]


def make(case, dtype, seed=0):
    B, H, Hkv, L, S, E, Ev, mask_kind, causal = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, Hkv, S, E, generator=g)
    v = torch.randn(B, Hkv, S, Ev, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, L, S, generator=g) > 0.3
        mask[..., 0] = True  # no row fully masked (PyTorch's math path gives NaN there)
    elif mask_kind == "float":
        mask = torch.randn(B, 1, L, S, generator=g).to(dtype)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    return q, k, v, mask, dict(is_causal=causal, enable_gqa=H != Hkv)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"-{c[7]}-{c[8]}")
def test_forward_and_backward_within_twice_torchs_error(case, dtype):
    q, k, v, mask, kw = make(case, dtype)
    g = torch.randn(*q.shape[:-1], v.shape[-1]).to(dtype)
    out = at.scaled_dot_product_attention(q, k, v, mask, **kw)
    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's math path: the same-precision reference
        ref = F.scaled_dot_product_attention(q, k, v, mask, **kw)
    truth = reference(q, k, v, mask, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    assert max_err(out, truth) <= 2 * max_err(ref, truth) + FLOOR[dtype]

    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    true_grads = torch.autograd.grad(truth, (q, k, v), g.double())
    for name, a, r, t in zip("qkv", grads, ref_grads, true_grads):
        assert a.dtype == dtype and a.shape == r.shape
        scale = max(1.0, t.abs().max().item())
        assert max_err(a, t) <= 2 * max_err(r, t) + FLOOR[dtype] * scale, f"grad {name}"


@pytest.mark.parametrize("kw", [
    dict(is_causal=True),
    dict(window_size=(3, 1)),
    dict(softcap=2.0),
    dict(is_causal=True, causal_alignment="bottom_right", window_size=(4, 0)),
    dict(enable_gqa=True),
], ids=lambda kw: ",".join(kw))
def test_gradcheck_in_float64(kw):
    gen = torch.Generator().manual_seed(1)
    hkv = 1 if kw.get("enable_gqa") else 2
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, hkv, 7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, hkv, 7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: at.scaled_dot_product_attention(a, b, c, **kw),
                                    (q, k, v))


def test_float64_is_computed_in_float64():
    q, k, v, mask, kw = make(CASES[3], torch.float64)
    out = at.scaled_dot_product_attention(q, k, v, mask, **kw)
    assert out.dtype == torch.float64
    assert max_err(out, reference(q, k, v, mask, **kw)) < 1e-12


def test_variants_match_the_float64_formulas_with_gradients():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 20, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 3, 24, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 3, 24, 8, generator=gen, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125])
    sinks = torch.tensor([0.3, -1.0, 2.0], requires_grad=True)
    kw = dict(is_causal=True, window_size=(6, 0), softcap=3.0, alibi_slopes=slopes, sinks=sinks)
    out = at.scaled_dot_product_attention(q, k, v, **kw)
    truth = reference(q, k, v, **kw)
    assert max_err(out, truth) < 2e-5
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    want = torch.autograd.grad(truth, (q, k, v, sinks), g.double())
    for name, a, t in zip(("q", "k", "v", "sinks"), got, want):
        assert a.dtype == torch.float32
        assert max_err(a, t) < 1e-4 * max(1.0, t.abs().max().item()), name


# (mask shape, extras): a learned bias per (batch, head), per head (T5's relative positions),
# shared, and a key-padding bias; the gradient sums over the broadcast dims as torch's autograd.
MASK_GRAD_CASES = [((2, 3, 17, 23), {}), ((1, 3, 17, 23), {}), ((17, 23), {}),
                   ((2, 1, 1, 23), {}), ((3, 17, 23), dict(enable_gqa=True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,kw", MASK_GRAD_CASES, ids=lambda c: str(c))
def test_float_mask_gradient_within_twice_torchs_error(shape, kw, dtype):
    gen = torch.Generator().manual_seed(3)
    hkv = 1 if kw.get("enable_gqa") else 3
    q = torch.randn(2, 3, 17, 16, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, hkv, 23, 16, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(2, hkv, 23, 16, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(shape, generator=gen).to(dtype)
    bias.view(-1)[::7] = float("-inf")  # hidden keys: gradient 0
    bias.requires_grad_()
    g = torch.randn(2, 3, 17, 16, generator=gen).to(dtype)
    out = at.scaled_dot_product_attention(q, k, v, bias, **kw)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, bias, **kw)
    truth = reference(q, k, v, bias, **kw)
    got = torch.autograd.grad(out, (q, k, v, bias), g)
    want = torch.autograd.grad(ref, (q, k, v, bias), g)
    true = torch.autograd.grad(truth, (q, k, v, bias), g.double())
    for name, a, r, t in zip(("q", "k", "v", "attn_mask"), got, want, true):
        assert a.dtype == dtype and a.shape == r.shape, name
        scale = max(1.0, t.abs().max().item())
        assert max_err(a, t) <= 2 * max_err(r, t) + FLOOR[dtype] * scale, name
    assert torch.all(got[3].reshape(-1)[::7] == 0)  # a -inf bias hides every score it reaches


def test_float_mask_gradient_alone_and_in_float64_gradcheck():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    bias = torch.randn(2, 5, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    # Only the mask requires grad: the general path (not the no-grad fast path) takes it.
    at.reset_call_counts()
    out = at.scaled_dot_product_attention(q, k, v, bias, softcap=2.0)
    assert out.requires_grad
    (gb,) = torch.autograd.grad(out.sum(), (bias,))
    (want,) = torch.autograd.grad(reference(q, k, v, bias, softcap=2.0).sum(), (bias,))
    assert max_err(gb, want) < 1e-12 and at.call_counts()["sdpa_backward"] == 1
    for t in (q, k, v):
        t.requires_grad_()
    for kw in (dict(), dict(softcap=2.0), dict(window_size=(2, 1))):
        assert torch.autograd.gradcheck(
            lambda a, b, c, m: at.scaled_dot_product_attention(a, b, c, m, **kw), (q, k, v, bias))


def test_float_mask_gradient_under_compile_and_the_patch():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 12, 12, generator=gen, requires_grad=True)

    def f(a, b, c, m):
        return at.scaled_dot_product_attention(a, b, c, m).sum(-1) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, bias)
    got = torch.autograd.grad(out.sum(), (q, k, v, bias))
    want = torch.autograd.grad(f(q, k, v, bias).sum(), (q, k, v, bias))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # A module with a learned bias through F.scaled_dot_product_attention: attn, no fallback.
    at.reset_call_counts()
    with at.patch():
        out = F.scaled_dot_product_attention(q, k, v, bias)
        got = torch.autograd.grad(out.sum(), (q, k, v, bias))
    counts = at.call_counts()
    assert counts["fallback"] == 0 and counts["sdpa_backward"] == 1, counts
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, bias).sum(), (q, k, v, bias))
    for a, b in zip(got, want):
        assert max_err(a, b) < 1e-5


def test_lse_and_weights_from_the_fast_path():
    q, k, v, mask, kw = make(CASES[3], torch.float32)
    out, lse, w = at.scaled_dot_product_attention(q, k, v, mask, need_lse=True, need_weights=True, **kw)
    scores = (q @ k.transpose(-2, -1)).double() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    assert max_err(lse, torch.logsumexp(scores, -1)) < 1e-5
    assert max_err(w, torch.softmax(scores, -1)) < 1e-6
    assert not lse.requires_grad and not w.requires_grad and out.requires_grad
    only_lse = at.scaled_dot_product_attention(q, k, v, mask, need_lse=True, **kw)
    assert only_lse[2] is None and torch.equal(only_lse[1], lse)
    # With no backward to come the forward skips the LSE unless asked (attn.torch._forward).
    with torch.no_grad():
        out_ng, lse_ng, w_ng = at.scaled_dot_product_attention(q, k, v, mask, need_lse=True, **kw)
        plain = at.scaled_dot_product_attention(q, k, v, mask, **kw)
    assert w_ng is None and torch.equal(lse_ng, lse) and torch.equal(out_ng, only_lse[0].detach())
    assert torch.equal(plain, out_ng)


def test_compile_fullgraph_forward_and_backward():
    q, k, v, mask, kw = make(CASES[2], torch.float32)

    def f(a, b, c):
        return at.scaled_dot_product_attention(a, b, c, is_causal=True).sum(-1) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    at.reset_call_counts()
    out = compiled(q, k, v)
    assert torch.equal(out, f(q, k, v))
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(f(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    counts = at.call_counts()
    assert counts["sdpa_forward"] >= 2 and counts["sdpa_backward"] >= 2


def test_opcheck_passes():
    q, k, v, _, _ = make(CASES[1], torch.float32)
    args = (q, k, v, None, 0.0, False, False, None, False, -1, -1, None, None, None,
            torch.zeros(2, dtype=torch.int64), "", False, False, False)
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    # bf16 with the output residual a backward reads (the fourth output).
    qh, kh, vh = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attn.sdpa.default, (qh, kh, vh, *args[3:-1], True))
    # The backward with a float mask's gradient (its fifth output).
    # (Inputs that do not require grad: the backward op has no backward of its own.)
    q, k, v, mask = (t.detach() for t in (q, k, v, torch.randn(17, 23)))
    out, lse, _, res = torch.ops.attn.sdpa.default(q, k, v, mask, *args[4:])
    bargs = (torch.randn_like(out), q, k, v, out, lse, res, mask, 0.0, False, False, None, False,
             -1, -1, None, None, None, torch.zeros(2, dtype=torch.int64), "", False, True)
    torch.library.opcheck(torch.ops.attn.sdpa_backward.default, bargs)


def test_contiguous_and_strided_inputs_are_read_in_place():
    x = torch.randn(2, 3, 10, 16)
    strided = torch.randn(2, 10, 3, 16).transpose(1, 2)  # (B, L, H, E) memory, the HF layout
    half = torch.randn(2, 3, 10, 16).bfloat16()
    expanded = torch.randn(1, 3, 1, 16).expand(2, 3, 10, 16)  # zero strides
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    # Plain tensors are read through their attributes; a subclass (here a Parameter that
    # requires grad) through DLPack, detached: in place either way.
    param = torch.nn.Parameter(torch.randn(2, 3, 10, 16))
    for t in (x, strided, half, expanded, mask, param):
        (addr, copied), = at._attn._input_addresses(t)
        assert addr == t.data_ptr() and not copied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_fast_path_gives_the_general_paths_bits(dtype):
    # A plain eager call with nothing to track goes through one binding call (attn.torch._plain);
    # asking for the LSE takes the general path. Same kernels, same bits, and the fast one counts.
    for case in CASES:
        q, k, v, mask, kw = make(case, dtype)
        with torch.no_grad():
            before = at._attn._torch_sdpa_plain_count()
            fast = at.scaled_dot_product_attention(q, k, v, mask, **kw)
            assert at._attn._torch_sdpa_plain_count() == before + 1, case
            general, _, _ = at.scaled_dot_product_attention(q, k, v, mask, need_lse=True, **kw)
            assert at._attn._torch_sdpa_plain_count() == before + 1, case
            with at.patch():
                patched = F.scaled_dot_product_attention(q, k, v, mask, **kw)
        assert at._attn._torch_sdpa_plain_count() == before + 2, case
        assert fast.dtype == dtype and torch.equal(fast, general) and torch.equal(patched, fast), case


def test_plain_tensors_and_subclasses_give_the_same_bits():
    q, k, v, mask, kw = make(CASES[3], torch.float32)
    plain = at.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), mask, **kw)
    params = [torch.nn.Parameter(t.detach().clone()) for t in (q, k, v)]
    out = at.scaled_dot_product_attention(*params, mask, **kw)
    assert torch.equal(out, plain)
    got = torch.autograd.grad(out.sum(), params)
    want = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v, mask, **kw).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_results_are_torch_tensors_owning_attns_memory():
    q, k, v, _, _ = make(CASES[1], torch.bfloat16)
    out = at.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert out.data_ptr() % 64 == 0  # attn's 64-byte aligned storage, handed over via DLPack


def test_dropout_is_repeatable_under_torch_manual_seed_and_backward_uses_the_same_mask():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(a, b, c):
        torch.manual_seed(7)
        return at.scaled_dot_product_attention(a, b, c, dropout_p=0.3)

    assert torch.equal(f(q, k, v), f(q, k, v))
    torch.manual_seed(8)
    other = at.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not torch.equal(f(q, k, v), other)
    # The weights (with the dropout mask applied) times V is the output; gradcheck's repeated
    # calls see the same mask, so the backward regenerates the forward's.
    torch.manual_seed(7)
    out, _, w = at.scaled_dot_product_attention(q, k, v, dropout_p=0.3, need_weights=True)
    assert (w == 0).any()
    assert max_err(out, w @ v) < 1e-12
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_threads_follow_torch_and_give_the_same_bits():
    q, k, v, mask, kw = make(CASES[6], torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = at.scaled_dot_product_attention(q, k, v, mask, **kw)
        torch.set_num_threads(2)
        two = at.scaled_dot_product_attention(q, k, v, mask, **kw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_concurrent_calls_from_python_threads():
    q, k, v, mask, kw = make(CASES[4], torch.float32)
    want = at.scaled_dot_product_attention(q, k, v, mask, **kw)
    results, errors = [], []

    def run():
        try:
            for _ in range(5):
                results.append(at.scaled_dot_product_attention(q, k, v, mask, **kw))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 15
    assert all(torch.equal(r, want) for r in results)


def test_bad_input_raises_a_clear_error_naming_the_argument():
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match="key: .*cpu|key: .*meta"):
        at.scaled_dot_product_attention(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="query, key and value must have one dtype"):
        at.scaled_dot_product_attention(q, k.double(), v)
    with pytest.raises(TypeError, match="query: expected float32"):
        at.scaled_dot_product_attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="attn_mask"):
        at.scaled_dot_product_attention(q, k, v, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask: expected a bool or floating"):
        at.scaled_dot_product_attention(q, k, v, torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout_p"):
        at.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="causal_alignment"):
        at.scaled_dot_product_attention(q, k, v, causal_alignment="middle")
    with pytest.raises(ValueError, match="softcap"):
        at.scaled_dot_product_attention(q, k, v, softcap=-1.0)
    # torch's empty tensors have no storage (data_ptr 0): named empty, as NumPy's are, not
    # "undefined" (the patch hands them to PyTorch: test_patch_models.py).
    for qq, kk, vv, name, shape in [(q[:0], k[:0], v[:0], "query", "[0, 2, 4, 8]"),
                                    (q[:, :, :0], k, v, "query", "[1, 2, 0, 8]"),
                                    (q, k[:, :, :0], v[:, :, :0], "key", "[1, 2, 0, 8]"),
                                    (q, k, v[..., :0], "value", "[1, 2, 5, 0]")]:
        want = rf"^scaled_dot_product_attention: {name} is empty \(shape {re.escape(shape)}\)$"
        fresh = [torch.empty(x.shape) for x in (qq, kk, vv)]
        with pytest.raises(ValueError, match=want):  # the eager plain path
            at.scaled_dot_product_attention(*fresh)
        with pytest.raises(ValueError, match=want):  # the autograd path
            at.scaled_dot_product_attention(fresh[0].requires_grad_(), *fresh[1:])


def test_one_openmp_runtime_serves_attn_and_torch():
    # The torch wheel bundles its own libgomp.so.1; attn's extension asks for the same soname,
    # so the loader gives both one runtime and one thread pool, whichever is imported first:
    # no second pool of torch.get_num_threads() threads competing for the cores.
    q, k, v, mask, kw = make(CASES[2], torch.float32)
    at.scaled_dot_product_attention(q, k, v, mask, **kw)
    torch.ones(64, 64) @ torch.ones(64, 64)
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps
                    if "libgomp" in line or "libiomp" in line or "libomp" in line}
    # A copy another wheel vendors (auditwheel's <package>.libs/, e.g. scikit-learn's, loaded when
    # transformers imports it) serves that package alone; seen on a machine whose torch uses the
    # system's libgomp.
    runtimes = {p for p in runtimes
                if not any(d.endswith(".libs") and d != "torch.libs" for d in p.split("/"))}
    assert len(runtimes) == 1, runtimes


def test_eager_path_equals_the_custom_op_forward_and_backward():
    # Eager calls skip the dispatcher (attn.torch._SdpaEager); compiled ones go through
    # torch.ops.attn.sdpa: same results and gradients, bit for bit.
    q, k, v, mask, kw = make(CASES[3], torch.float32)
    sinks = torch.tensor([0.5, -0.5], requires_grad=True)
    out = at.scaled_dot_product_attention(q, k, v, mask, sinks=sinks, **kw)
    args = (q, k, v, mask, 0.0, False, False, None, False, -1, -1, None, None, sinks,
            torch.zeros(2, dtype=torch.int64), "", False, False, False)
    op_out = torch.ops.attn.sdpa(*args)[0]
    assert torch.equal(out, op_out)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    want = torch.autograd.grad(op_out, (q, k, v, sinks), g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(at.scaled_dot_product_attention(q, k, v, mask, sinks=sinks, **kw), out)


def test_compiled_backward_on_the_hugging_face_layout_matches_eager():
    # The fake gradients must have the real ones' (contiguous) strides whatever the inputs'
    # strides, or the compiled graph lays out what follows wrongly.
    qkv = torch.randn(2, 33, 3 * 4 * 16, requires_grad=True)

    def f(x):
        q, k, v = (t.view(2, 33, 4, 16).transpose(1, 2) for t in x.split(64, 2))
        return (at.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) * 2).sum(-1)

    g = torch.randn(2, 33, 4)
    want = torch.autograd.grad(f(qkv), qkv, g)[0]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(qkv), qkv, g)[0]
    assert torch.equal(got, want)
    q = torch.randn(1, 2, 5, 8).transpose(2, 3).contiguous().transpose(2, 3)  # strided
    out, lse, _, res = torch.ops.attn.sdpa(q, q, q, None, 0.0, False, False, None, False, -1, -1,
                                           None, None, None, torch.zeros(2, dtype=torch.int64), "",
                                           False, False, False)
    torch.library.opcheck(torch.ops.attn.sdpa_backward.default,
                          (torch.randn_like(out), q, q, q, out, lse, res, None, 0.0, False, False, None,
                           False, -1, -1, None, None, None, torch.zeros(2, dtype=torch.int64), "",
                           False))


def test_sixteen_bit_sinks_get_their_gradient_and_slopes_that_require_grad_are_refused():
    q, k, v, _, kw = make(CASES[1], torch.bfloat16)
    sinks = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    out = at.scaled_dot_product_attention(q, k, v, sinks=sinks)
    (ds,) = torch.autograd.grad(out.float().sum(), (sinks,))
    assert ds.dtype == torch.bfloat16 and ds.abs().sum() > 0
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        at.scaled_dot_product_attention(q, k, v, alibi_slopes=torch.ones(3, requires_grad=True))
    qf = q.float().detach().requires_grad_()
    o = at.scaled_dot_product_attention(qf, k.float().detach(), v.float().detach())
    (gq,) = torch.autograd.grad(o.sum(), qf, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable|does not require grad"):
        gq.sum().backward()  # no silent second derivative


def test_sixteen_bit_training_saves_the_output_residual():
    # A bf16 call that needs a backward also returns the output's float32 residual (attn's
    # need_output_residual): output + residual is the float32 attention, and the backward reads it
    # instead of re-deriving the float32 output. Both backward paths meet the accuracy rule.
    q, k, v, _, kw = make(CASES[2], torch.bfloat16)
    rng = torch.zeros(2, dtype=torch.int64)
    head = (q, k, v, None, 0.0, True, False, None, False, -1, -1, None, None, None, rng, "", False)
    out, lse, _, res = torch.ops.attn.sdpa(*head, False, True)
    assert res.dtype == torch.bfloat16 and res.shape == out.shape
    assert torch.ops.attn.sdpa(*head, False, False)[3].numel() == 0
    truth = reference(q, k, v, None, **kw)
    assert max_err(out.float() + res.float(), truth) <= max_err(out, truth) / 16
    g = torch.randn(out.shape).bfloat16()
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    true_grads = torch.autograd.grad(truth, (q, k, v), g.double())
    tail = (None, 0.0, True, False, None, False, -1, -1, None, None, None, rng, "", False)
    for saved in (res, res.new_empty(0)):
        grads = torch.ops.attn.sdpa_backward(g, q, k, v, out, lse, saved, *tail)[:3]
        for name, a, r, t in zip("qkv", grads, ref_grads, true_grads):
            scale = max(1.0, t.abs().max().item())
            assert max_err(a, t) <= 2 * max_err(r, t) + FLOOR[torch.bfloat16] * scale, f"grad {name}"
    # The eager training path saves it: its gradients are the residual path's, bit for bit.
    eager = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
    with_res = torch.ops.attn.sdpa_backward(g, q, k, v, out, lse, res, *tail)[:3]
    for a, b in zip(eager, with_res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES[1:7], ids=lambda c: "x".join(map(str, c[:7])) + f"-{c[7]}-{c[8]}")
def test_fp16_bf16_reduction_within_twice_torchs_reduced_math_error(case, dtype):
    # allow_fp16_bf16_reduction: FlashAttention's numerics (one 16-bit term for P and dS in the
    # backward, D from the 16-bit output, no residual saved), held to FlashAttention's rule against
    # PyTorch's math path computing in the same 16-bit type, which PyTorch's own switch of that
    # name selects (by default the math path upcasts to float32).
    q, k, v, mask, kw = make(case, dtype, seed=3)
    g = torch.randn(*q.shape[:-1], v.shape[-1]).to(dtype)
    out = at.scaled_dot_product_attention(q, k, v, mask, allow_fp16_bf16_reduction=True, **kw)
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, mask, **kw)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
    truth = reference(q, k, v, mask, **kw)
    assert max_err(out, truth) <= 2 * max_err(ref, truth) + FLOOR[dtype]
    grads = torch.autograd.grad(out, (q, k, v), g)
    true_grads = torch.autograd.grad(truth, (q, k, v), g.double())
    for name, a, r, t in zip("qkv", grads, ref_grads, true_grads):
        scale = max(1.0, t.abs().max().item())
        assert max_err(a, t) <= 2 * max_err(r, t) + FLOOR[dtype] * scale, f"grad {name}"


def test_fp16_bf16_reduction_reaches_the_forward_and_the_backward():
    # The forward still saves the residual for the backward, now of its one-term output, so the
    # output is the same with and without it; the eager path's gradients are the op's backward
    # given that residual and the allowance.
    q, k, v, _, kw = make(CASES[2], torch.bfloat16, seed=4)
    rng = torch.zeros(2, dtype=torch.int64)
    head = (q, k, v, None, 0.0, True, False, None, False, -1, -1, None, None, None, rng, "", True)
    out, lse, _, res = torch.ops.attn.sdpa(*head, False, True)
    assert res.dtype == torch.bfloat16 and res.shape == out.shape
    assert torch.equal(out, torch.ops.attn.sdpa(*head, False, False)[0])
    g = torch.randn(out.shape).bfloat16()
    eager = torch.autograd.grad(
        at.scaled_dot_product_attention(q, k, v, allow_fp16_bf16_reduction=True, **kw), (q, k, v), g)
    tail = (None, 0.0, True, False, None, False, -1, -1, None, None, None, rng, "")
    reduced = torch.ops.attn.sdpa_backward(g, q, k, v, out, lse, res, *tail, True)[:3]
    for a, b in zip(eager, reduced):
        assert torch.equal(a, b)
    kernels = {info["name"]: info for info in attn.sdpa_kernels()}
    if kernels["cpu.flash.avx512_bf16"]["runs_on_this_cpu"]:
        forced = tail[:-1] + ("cpu.flash.avx512_bf16",)
        one = torch.ops.attn.sdpa_backward(g, q, k, v, out, lse, res, *forced, True)[:3]
        two = torch.ops.attn.sdpa_backward(g, q, k, v, out, lse, res, *forced, False)[:3]
        assert not all(torch.equal(a, b) for a, b in zip(one, two))


def test_patch_passes_fp16_bf16_reduction_and_restores_it():
    q, k, v, _, kw = make(CASES[5], torch.bfloat16, seed=5)
    g = torch.randn(*q.shape[:-1], v.shape[-1]).bfloat16()
    want = torch.autograd.grad(
        at.scaled_dot_product_attention(q, k, v, allow_fp16_bf16_reduction=True, **kw), (q, k, v), g)
    default = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
    with at.patch(allow_fp16_bf16_reduction=True):
        got = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
        with at.patch():  # a nested patch has its own setting, and gives the outer one back
            inner = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
        again = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
    for a, b, c, d, e in zip(got, want, inner, default, again):
        assert torch.equal(a, b) and torch.equal(e, b) and torch.equal(c, d)
    assert not at.is_patched()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (attn.torch refuses GPU tensors; "
                    "this checks the refusal and the patch's fallback on real ones)")
def test_cuda_tensors_are_refused_and_the_patch_falls_back():
    q, k, v = (torch.randn(1, 2, 33, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with pytest.raises(TypeError, match="query: .*cuda"):
        at.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="key: .*cuda"):
        at.scaled_dot_product_attention(q.detach().cpu(), k, v.detach().cpu())
    at.reset_call_counts()
    with at.patch():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert sum("falls back" in str(w.message) for w in caught) == 1
    assert out.device.type == "cuda"
    assert torch.equal(out, at._torch_sdpa(q, k, v, is_causal=True))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.device.type == "cuda" and torch.isfinite(g.float()).all() for g in grads)
    counts = at.call_counts()
    assert counts["fallback"] == 2 and counts["sdpa_forward"] == 0

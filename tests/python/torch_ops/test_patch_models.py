"""attn.torch.patch(): F.scaled_dot_product_attention routed to attn inside real models built
here (no download): torch.nn.TransformerEncoder, Hugging Face BERT, T5 (its learned position
bias: a float attn_mask that requires grad) and GPT-2 from configs with random weights
(attn_implementation="sdpa"), and the book's GPT (the architecture of attn's tiny
GPT) written in PyTorch. Outputs and gradients equal PyTorch's own within float32 rounding, a
few training steps give the same losses, and each test asserts attn actually ran (the counts
of attn.torch.call_counts()). Attention dropout is 0 for the equality."""
import copy
import warnings

import pytest

from torch_ops_common import require

torch = require("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn.torch as at  # noqa: E402

RTOL = 1e-4  # float32 results of the two attention kernels, through a few layers


def close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= RTOL * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def sdpa_model(model):
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def run_both(model_fn, forward, steps=3, lr=1e-2):
    """Runs `steps` SGD steps of the same model with PyTorch's SDPA and with attn's; returns
    the (torch, attn) losses and checks the first step's gradients parameter by parameter."""
    torch.manual_seed(0)
    ref_model = model_fn()
    attn_model = copy.deepcopy(ref_model)
    losses = {}
    grads = {}
    for name, model, patched in (("torch", ref_model, False), ("attn", attn_model, True)):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses[name] = []
        at.reset_call_counts()
        with at.patch(patched):
            for step in range(steps):
                opt.zero_grad()
                loss = forward(model)
                loss.backward()
                if step == 0:
                    grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()
                                   if p.grad is not None}
                opt.step()
                losses[name].append(loss.item())
        counts = at.call_counts()
        if patched:
            assert counts["sdpa_forward"] >= steps and counts["sdpa_backward"] >= steps, counts
            assert counts["fallback"] == 0, counts
        else:
            assert counts["sdpa_forward"] == 0, counts
    assert not at.is_patched()
    assert grads["torch"].keys() == grads["attn"].keys()
    for n in grads["torch"]:
        close(grads["attn"][n], grads["torch"][n], f"grad of {n}")
    for a, b in zip(losses["attn"], losses["torch"]):
        assert abs(a - b) <= RTOL * max(1.0, abs(b)), (losses["attn"], losses["torch"])
    return losses


def test_transformer_encoder_in_training_mode():
    # In eval mode TransformerEncoder takes a fused fast path that never calls SDPA; in training
    # mode (dropout 0) every layer's MultiheadAttention calls F.scaled_dot_product_attention.
    def model_fn():
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    x = torch.randn(3, 11, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(11)
    run_both(model_fn, lambda m: m(x, mask=mask, is_causal=True).pow(2).mean())


def test_hugging_face_bert_with_padding():
    transformers = require("transformers")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")
    ids = torch.randint(0, 99, (2, 13), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 13, dtype=torch.long)
    attention_mask[1, 9:] = 0  # padding: HF passes a 4-D mask to SDPA

    def model_fn():
        return sdpa_model(transformers.BertModel(config))

    def forward(m):
        out = m(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        return (out * attention_mask[..., None]).pow(2).mean()

    run_both(model_fn, forward)


def test_hugging_face_t5_learns_its_relative_position_bias():
    # T5 adds a learned relative-position bias (an embedding of the key-query offset) to the
    # scores: Hugging Face passes it to SDPA as a float attn_mask that requires grad (PyTorch's
    # CPU SDPA runs its math backend for it). attn's backward returns the mask's gradient, so the
    # bias embeddings train as with PyTorch's own.
    transformers = require("transformers")
    config = transformers.T5Config(vocab_size=91, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0,
                                   attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 91, (2, 12), generator=gen)
    labels = torch.randint(1, 91, (2, 9), generator=gen)
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0

    def model_fn():
        return sdpa_model(transformers.T5ForConditionalGeneration(config))

    def forward(m):
        return m(input_ids=ids, attention_mask=attention_mask, labels=labels).loss

    run_both(model_fn, forward)
    m = model_fn()
    bias = m.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    forward(m).backward()
    assert bias.grad is not None and bias.grad.abs().max() > 0


def test_hugging_face_gpt2_language_model_loss():
    transformers = require("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_implementation="sdpa")
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(2))

    def model_fn():
        return sdpa_model(transformers.GPT2LMHeadModel(config))

    losses = run_both(model_fn, lambda m: m(input_ids=ids, labels=ids).loss)
    assert losses["torch"][-1] < losses["torch"][0]  # the steps trained something


class BookGPT(nn.Module):
    """The book's GPTModel (chapter 4), attn's tiny GPT architecture: token and position
    embeddings, pre-LayerNorm blocks of causal multi-head attention (F.scaled_dot_product_
    attention) and a GELU MLP, a final LayerNorm and an untied output head."""

    def __init__(self, vocab=50, context=32, d=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d, bias=False), proj=nn.Linear(d, d),
                ln2=nn.LayerNorm(d), ff=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                                      nn.Linear(4 * d, d)))))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(B, T, -1))
            x = x + blk["ff"](blk["ln2"](x))
        return self.head(self.ln(x))


def test_book_gpt_training_steps():
    ids = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(3))

    def forward(m):
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    losses = run_both(BookGPT, forward, steps=4, lr=0.1)
    assert losses["attn"][-1] < losses["attn"][0]


def test_bfloat16_gpt2_under_the_patch_stays_close_to_torch():
    transformers = require("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_implementation="sdpa")
    torch.manual_seed(4)
    model = sdpa_model(transformers.GPT2LMHeadModel(config)).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 33))
    want = model(input_ids=ids).logits.float()
    at.reset_call_counts()
    with at.patch():
        got = model(input_ids=ids).logits.float()
    assert at.call_counts()["sdpa_forward"] == 2
    truth = model.float()(input_ids=ids).logits
    # bf16 end to end: attn's logits are no further from float32's than PyTorch's own are.
    assert (got - truth).abs().max() <= 2 * (want - truth).abs().max() + 1e-2


def test_patch_falls_back_for_what_attn_cannot_take_and_warns_once():
    q = torch.randn(1, 1, 2, 3, 4, 8)  # 5-D: attn takes at most 4 dims
    at.reset_call_counts()
    with at.patch():
        assert at.is_patched()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(q, q, q)
            F.scaled_dot_product_attention(q, q, q)
        assert sum("falls back" in str(w.message) for w in caught) == 1
        ints = torch.ones(2, 3, 4, dtype=torch.int64)
        with pytest.raises(RuntimeError):  # PyTorch's own error: the fallback, not attn's
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(ints, ints, ints)
    assert not at.is_patched()
    assert torch.equal(out, at._torch_sdpa(q, q, q))
    assert at.call_counts()["fallback"] == 3 and at.call_counts()["sdpa_forward"] == 0


def test_patch_hands_empty_tensors_to_pytorch():
    # PyTorch answers them (an empty output, or zeros for no keys); attn takes none.
    q, none = torch.randn(1, 2, 4, 8), torch.empty(1, 2, 0, 8)
    at.reset_call_counts()
    with at.patch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        no_keys = F.scaled_dot_product_attention(q, none, none)
        no_batch = F.scaled_dot_product_attention(q[:0], q[:0], q[:0])
    assert no_keys.shape == (1, 2, 4, 8) and torch.equal(no_keys, at._torch_sdpa(q, none, none))
    assert no_batch.shape == (0, 2, 4, 8)
    assert sum("falls back to PyTorch's own for empty tensors" in str(w.message) for w in caught) == 1
    assert at.call_counts()["fallback"] == 2 and at.call_counts()["sdpa_forward"] == 0


def test_patch_true_and_false_switch_it_globally():
    try:
        at.patch(True)
        assert at.is_patched()
        at.patch(True)  # idempotent
        assert F.scaled_dot_product_attention is not at._torch_sdpa
    finally:
        at.patch(False)
    assert not at.is_patched() and F.scaled_dot_product_attention is at._torch_sdpa


def test_patch_restores_whatever_was_installed_before_it():
    def other_wrapper(*args, **kwargs):
        return at._torch_sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = other_wrapper
    try:
        with at.patch():
            assert at.is_patched()
            with at.patch(False):
                assert F.scaled_dot_product_attention is at._torch_sdpa
            assert at.is_patched()
        assert F.scaled_dot_product_attention is other_wrapper
    finally:
        F.scaled_dot_product_attention = at._torch_sdpa

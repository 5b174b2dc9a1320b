import numpy as np
import attn

# torch.nn.functional.scaled_dot_product_attention on NumPy arrays (or PyTorch CPU tensors).
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 8, 16), dtype=np.float32) for _ in range(3))
out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
print(out.shape, out.dtype)  # (2, 4, 8, 16) float32

# The chapter's MultiHeadAttention with torch.manual_seed(123)'s weights.
attn.manual_seed(123)
mha = attn.MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
x = attn.randn([2, 6, 3])
print(mha(x).shape)  # (2, 6, 2)

# torch.nn.MultiheadAttention, weights saved to and loaded from safetensors.
attn.manual_seed(0)
m = attn.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True).eval()
e = rng.standard_normal((2, 5, 8), dtype=np.float32)  # (batch, tokens, embed_dim)
y, w = m(e, e, e, is_causal=True)
m.save_safetensors("mha.safetensors")
m2 = attn.MultiheadAttention(8, 2, batch_first=True).eval()
m2.load_safetensors("mha.safetensors")
print(np.array_equal(m2(e, e, e, is_causal=True)[0], y), w.shape)  # True (2, 5, 5)

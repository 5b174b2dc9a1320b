// The README's C++ example, built and run by the test suite so it stays correct.
#include <attn/attn.hpp>
#include <iostream>

int main() {
  attn::manual_seed(123);                                   // torch.manual_seed(123)
  attn::nn::MultiHeadAttention mha(/*d_in=*/3, /*d_out=*/2, /*context_length=*/6,
                                   /*dropout=*/0.0f, /*num_heads=*/2);
  attn::Tensor x = attn::randn({2, 6, 3});                  // (batch, tokens, d_in)
  std::cout << attn::format_tensor(mha.forward(x)) << "\n"; // same digits as PyTorch

  // The functional core, PyTorch SDPA semantics: (B, H, L, E) or unbatched (L, E).
  attn::Tensor q = attn::randn({1, 4, 8, 16}), k = attn::randn({1, 4, 8, 16}),
               v = attn::randn({1, 4, 8, 16});
  attn::SdpaOptions opt;
  opt.is_causal = true;
  opt.need_weights = true;
  attn::SdpaResult r = attn::scaled_dot_product_attention(q, k, v, opt);
  // r.output: (1, 4, 8, 16); r.attn_weights: (1, 4, 8, 8)
}

#include <attn/attn.hpp>
#include <iostream>

int main() {
  // torch.nn.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True) with
  // torch.manual_seed(0)'s weights.
  attn::manual_seed(0);
  attn::nn::MultiheadAttention mha(/*embed_dim=*/8, /*num_heads=*/2, /*dropout=*/0.0f,
                                   /*bias=*/true, false, false, 0, 0, /*batch_first=*/true);
  mha.eval();
  attn::Tensor x = attn::randn({2, 5, 8});                  // (batch, tokens, embed_dim)
  auto [out, weights] = mha.forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/true,
                                    /*attn_mask=*/{}, /*average_attn_weights=*/true,
                                    /*is_causal=*/true);
  std::cout << "output " << out.shape().str() << ", weights " << weights.shape().str() << "\n";

  // Weights in and out with PyTorch's state_dict names (safetensors.torch.save_file's format).
  attn::nn::save_safetensors(mha, "mha.safetensors");
  attn::nn::MultiheadAttention copy(8, 2, 0.0f, true, false, false, 0, 0, true);
  attn::nn::load_safetensors(copy, "mha.safetensors");
  copy.eval();
  // The same call as above (need_weights too: with it a short sequence runs on another kernel,
  // as PyTorch's MultiheadAttention takes another path, and the last bits may differ).
  attn::Tensor again = copy.forward(x, x, x, {}, true, {}, true, true).output;
  std::cout << "reloaded output equal: " << std::boolalpha
            << (again.to_vector() == out.to_vector()) << "\n";

  // The functional core: torch.nn.functional.scaled_dot_product_attention.
  attn::Tensor q = attn::randn({1, 4, 8, 16}), k = attn::randn({1, 4, 8, 16}),
               v = attn::randn({1, 4, 8, 16});
  attn::SdpaOptions opt;
  opt.is_causal = true;
  attn::Tensor o = attn::scaled_dot_product_attention(q, k, v, opt).output;
  std::cout << "sdpa output " << o.shape().str() << "\n";
  return again.to_vector() == out.to_vector() ? 0 : 1;
}

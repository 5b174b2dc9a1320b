#include <attn/attn.hpp>
#include <attn/flex_attention.hpp>
#include <algorithm>
#include <cmath>
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

  // flex_attention: your own score_mod and mask_mod, compiled into the kernel. Here a tanh
  // softcap of the scores (with its derivative, for the backward) and a causal sliding window
  // of 4 keys, checked against the definition written out as a plain loop.
  const float cap = 2.0f;
  const auto softcap = attn::flex::with_grad(
      [cap](float s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
      [cap](float s, int64_t, int64_t, int64_t, int64_t) {
        const float t = std::tanh(s / cap);
        return 1.0f - t * t;
      });
  const auto window = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i && i - j < 4; };
  const attn::flex::BlockMask blocks = attn::flex::create_block_mask(window, 1, 1, 8, 8, 2, 16);
  attn::FlexOptions fopt;
  fopt.block_mask = &blocks;
  fopt.need_lse = true;
  const attn::SdpaResult flex = attn::flex_attention(q, k, v, softcap, window, fopt);
  double worst = 0.0;
  for (int64_t h = 0; h < 4; ++h) {
    for (int64_t i = 0; i < 8; ++i) {
      double w[8], mx = -INFINITY, sum = 0.0;
      for (int64_t j = 0; j < 8; ++j) {
        double dot = 0.0;
        for (int64_t e = 0; e < 16; ++e) dot += double(q.at({0, h, i, e})) * k.at({0, h, j, e});
        w[j] = window(0, h, i, j) ? cap * std::tanh(dot / 4.0 / cap) : -INFINITY;  // scale 1/sqrt(16)
        mx = std::max(mx, w[j]);
      }
      for (double& x : w) sum += x = std::exp(x - mx);
      for (int64_t e = 0; e < 16; ++e) {
        double ref = 0.0;
        for (int64_t j = 0; j < 8; ++j) ref += w[j] / sum * v.at({0, h, j, e});
        worst = std::max(worst, std::fabs(ref - flex.output.at({0, h, i, e})));
      }
    }
  }
  const attn::SdpaGrads grads = attn::flex_attention_backward(attn::Tensor::ones({1, 4, 8, 16}), q, k, v, flex,
                                                              softcap, window, fopt);
  std::cout << "flex_attention max error vs loop " << worst << ", dQ " << grads.grad_query.shape().str() << "\n";
  if (!(worst < 1e-5)) return 1;
  return again.to_vector() == out.to_vector() ? 0 : 1;
}

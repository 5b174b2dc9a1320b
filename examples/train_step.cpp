// Gradients without an autograd engine: the chapter's MultiHeadAttention, one SGD step on a
// toy loss, and the functional SDPA backward the module uses inside.
#include <attn/attn.hpp>
#include <iostream>

int main() {
  attn::manual_seed(123);
  attn::nn::MultiHeadAttention mha(/*d_in=*/3, /*d_out=*/4, /*context_length=*/6,
                                   /*dropout=*/0.0f, /*num_heads=*/2);
  const attn::Tensor x = attn::randn({2, 6, 3});
  const attn::Tensor target = attn::randn({2, 6, 4});

  float previous = 1e30f;
  for (int step = 0; step < 3; ++step) {
    const attn::Tensor out = mha.forward(x);          // saves what backward needs
    const attn::Tensor diff = attn::sub(out, target);  // loss = mean(diff^2)
    const float loss = attn::mean(attn::mul(diff, diff)).item();
    const attn::Tensor grad_out = attn::mul(diff, 2.0f / static_cast<float>(diff.numel()));
    mha.zero_grad();
    mha.backward(grad_out);                            // dL/dx, parameter grads summed in
    for (const attn::nn::ParameterWithGrad& p : mha.parameters_with_grads()) {
      for (int64_t i = 0; i < p.param->numel(); ++i) p.param->data()[i] -= 0.5f * p.grad->data()[i];
    }
    std::cout << "step " << step << " loss " << loss << "\n";
    if (!(loss < previous)) return 1;  // gradient descent must lower the loss
    previous = loss;
  }

  // The functional core: forward with the log-sum-exp, then dQ, dK, dV (fused, O(L) memory).
  const attn::Tensor q = attn::randn({1, 2, 8, 16}), k = attn::randn({1, 2, 8, 16}),
                     v = attn::randn({1, 2, 8, 16});
  attn::SdpaOptions options;
  options.is_causal = true;
  options.need_lse = true;
  const attn::SdpaResult fwd = attn::scaled_dot_product_attention(q, k, v, options);
  const attn::SdpaGrads g = attn::scaled_dot_product_attention_backward(
      attn::Tensor::ones(fwd.output.shape()), q, k, v, fwd, options);
  std::cout << "dQ " << g.grad_query.shape().str() << ", dK " << g.grad_key.shape().str()
            << ", dV " << g.grad_value.shape().str() << "\n";
}

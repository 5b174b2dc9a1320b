// Must NOT compile: flex_attention_backward with a score_mod that has no `grad` member. The CMake
// test FlexAttention.BackwardWithoutGradFailsToCompile checks that the compiler says why.
#include <attn/flex_attention.hpp>

attn::SdpaGrads call(const attn::TensorView& d, const attn::TensorView& q, const attn::TensorView& k,
                     const attn::TensorView& v, const attn::SdpaResult& f) {
  const auto no_grad = [](float s, int64_t, int64_t, int64_t, int64_t) { return 2.0f * s; };
  return attn::flex_attention_backward(d, q, k, v, f, no_grad, attn::flex::NoMask{});
}

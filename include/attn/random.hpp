// A random generator that reproduces PyTorch's CPU default generator bit for bit.
//
// `manual_seed(123)` followed by the same calls gives the same numbers as
// `torch.manual_seed(123)` in PyTorch: MT19937 engine, `rand`/`uniform_`, `randn`/`normal_`
// (vector path for contiguous float32 tensors of >= 16 elements, scalar Box-Muller path with its
// cached value otherwise), `bernoulli_` (the default kernel used by dropout), and the default
// initialisation of nn.Linear and nn.Embedding. The algorithms are specified in
// shared/reference/RNG_SPEC.md; this file is compiled with -ffp-contract=off and every fused
// multiply-add is written out, because one fused or unfused product changes the last bit.
#pragma once

#include <cstdint>
#include <optional>

#include "attn/tensor.hpp"

namespace attn {

// Which of PyTorch's CPU kernels to reproduce for float32 uniform_ (with or without FMA) and
// the vector normal path (Cephes avx_mathfun vs. libm logf/sinf/cosf).
enum class RngFlavor {
  kX86Avx2,  // default: what PyTorch prints on x86 CPUs with AVX2 (Linux/Windows)
  kScalar,   // ATEN_CPU_CAPABILITY=default kernels: no FMA in uniform_, libm log/sin/cos
};

class Generator {
 public:
  explicit Generator(uint64_t seed = 67280421310721ULL, RngFlavor flavor = RngFlavor::kX86Avx2);

  // torch.manual_seed: only the low 32 bits reach the engine; clears the cached normal.
  void manual_seed(uint64_t seed);
  uint64_t initial_seed() const { return seed_; }
  RngFlavor flavor() const { return flavor_; }
  void set_flavor(RngFlavor flavor) { flavor_ = flavor; }

  uint32_t random();    // one MT19937 output
  uint64_t random64();  // two outputs, the first is the high word

  // One float32 in [from, to) exactly as Tensor.uniform_(from, to) draws it (1 engine output).
  float uniform_float(double from, double to);
  // One float64 in [0, 1) with 53 random bits (2 engine outputs).
  double uniform_double();
  // One value of the scalar normal path (uses and refills the cached second value).
  double normal_double(double mean, double stddev);

 private:
  uint32_t mt_[624];
  int index_ = 624;
  uint64_t seed_ = 0;
  RngFlavor flavor_;
  std::optional<double> cached_normal_;
};

// The process-wide generator used when none is passed, like torch's default CPU generator.
Generator& default_generator();
// torch.manual_seed(seed) on the default generator.
void manual_seed(uint64_t seed);

// In-place fills, in memory order of `t` (as PyTorch's TensorIterator does).
void uniform_(TensorView t, double from = 0.0, double to = 1.0, Generator& gen = default_generator());
void normal_(TensorView t, double mean = 0.0, double stddev = 1.0, Generator& gen = default_generator());
// Each element becomes 1 with probability p (strict `u < p` on a 53-bit double), else 0.
void bernoulli_(TensorView t, double p, Generator& gen = default_generator());

Tensor rand(Shape shape, Generator& gen = default_generator());
Tensor randn(Shape shape, Generator& gen = default_generator());

// nn.init.kaiming_uniform_(w, a=sqrt(5)) for a 2-D (out, in) weight: the bound nn.Linear uses.
void kaiming_uniform_linear_(TensorView weight, Generator& gen = default_generator());

}  // namespace attn

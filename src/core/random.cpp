// PyTorch-compatible random generator (spec: shared/reference/RNG_SPEC.md, torch 1.13.1).
//
// Design:
//  * `Generator` is torch's CPUGeneratorImpl: an MT19937 engine plus the cached second value of
//    the scalar Box-Muller normal. Every distribution is a pure function of engine outputs, so
//    matching torch bit for bit means consuming the same outputs in the same order and repeating
//    the same float32/float64 roundings.
//  * Tensors are filled in *memory* order (TensorIterator sorts dims by stride), which we get by
//    permuting the view's dims by decreasing stride and walking it row-major.
//  * Two kernel flavours (RngFlavor): torch's AVX2 kernels were compiled with FMA contraction and
//    use the Cephes `avx_mathfun` log/sincos in the normal vector path; the DEFAULT kernels use
//    plain float arithmetic and libm logf/sinf/cosf. The AVX2 lanes are emulated one at a time in
//    scalar C++: this file is compiled with -ffp-contract=off and every fused multiply-add torch's
//    binary performs is written out with std::fma, every other operation rounds on its own.
//  * A Generator is not thread-safe (torch takes a mutex; here the caller serialises).
#include "attn/random.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <numbers>
#include <numeric>

#include <fmt/format.h>

#include "attn/error.hpp"

namespace attn {

namespace {

constexpr int kStateSize = 624;
constexpr int kShift = 397;
constexpr uint32_t kMatrixA = 0x9908B0DFu;
constexpr uint32_t kUpperMask = 0x80000000u;
constexpr uint32_t kLowerMask = 0x7FFFFFFFu;

constexpr float kTwoPow24Inv = 1.0f / 16777216.0f;                 // 2^-24, exact
constexpr double kTwoPow53Inv = 1.0 / 9007199254740992.0;          // 2^-53, exact
constexpr uint64_t kMask53 = (uint64_t{1} << 53) - 1;

// ---- The float32 normal vector path (spec §4.1) ------------------------------------------------

// Bit-exact float32 constants of avx_mathfun.h, given as bit patterns so nothing depends on how
// the compiler rounds decimal literals.
struct CephesConstants {
  float sqrthf, q1, q2, minus_dp1, minus_dp2, minus_dp3, four_over_pi, two_pi;
  std::array<float, 9> log_p;
  std::array<float, 3> sin_coef, cos_coef;
};

const CephesConstants& cephes() {
  static const CephesConstants c = [] {
    auto f = [](uint32_t bits) { return std::bit_cast<float>(bits); };
    CephesConstants k{};
    k.sqrthf = f(0x3F3504F3);
    k.q1 = f(0xB95E8083);
    k.q2 = f(0x3F318000);
    k.minus_dp1 = f(0xBF490000);
    k.minus_dp2 = f(0xB97DA000);
    k.minus_dp3 = f(0xB3222169);
    k.four_over_pi = f(0x3FA2F983);
    k.two_pi = f(0x40C90FDB);
    const uint32_t p[9] = {0x3D9021BB, 0xBDEBD1B8, 0x3DEF251A, 0xBDFE5D4F, 0x3E11E9BF,
                           0xBE2AAE50, 0x3E4CCEAC, 0xBE7FFFFC, 0x3EAAAAAA};
    for (int i = 0; i < 9; ++i) k.log_p[i] = f(p[i]);
    k.sin_coef = {f(0xB94CA1F9), f(0x3C08839E), f(0xBE2AAAA3)};
    k.cos_coef = {f(0x37CCF5CE), f(0xBAB6061A), f(0x3D2AAAA5)};
    return k;
  }();
  return c;
}

// One lane of avx_mathfun's log256_ps for x in (0, 1], with the contractions GCC made when it
// compiled torch's AVX2 kernel (spec §4.1: only this exact pattern reproduces torch).
float cephes_log(float x) {
  const CephesConstants& k = cephes();
  x = std::max(x, std::bit_cast<float>(0x00800000u));  // smallest normal: keeps the exponent trick valid
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const int32_t e_int = static_cast<int32_t>(bits >> 23) - 127;
  const float m = std::bit_cast<float>((bits & 0x807FFFFFu) | 0x3F000000u);  // mantissa in [0.5, 1)
  float e = static_cast<float>(e_int) + 1.0f;
  // Fold the mantissa into [sqrt(1/2) - 1, sqrt(2) - 1): the polynomial's range.
  if (m < k.sqrthf) {
    e = e - 1.0f;
    x = (m - 1.0f) + m;
  } else {
    x = m - 1.0f;
  }
  const float z = x * x;
  float y = k.log_p[0];
  for (int i = 1; i < 9; ++i) y = std::fma(y, x, k.log_p[i]);
  y = y * x;
  y = std::fma(y, z, e * k.q1);  // y*z fused, e*q1 rounded first
  y = std::fma(-z, 0.5f, y);     // y - 0.5*z
  return std::fma(e, k.q2, x + y);
}

// One lane of avx_mathfun's sincos256_ps for t >= 0 (theta in [0, 2*pi)), same contractions.
void cephes_sincos(float t, float* sin_out, float* cos_out) {
  const CephesConstants& k = cephes();
  const bool sign_in = std::signbit(t);
  t = std::fabs(t);
  // Octant index, rounded up to even so the reduced argument lies in [-pi/4, pi/4].
  int32_t j = static_cast<int32_t>(t * k.four_over_pi);
  j = (j + 1) & ~1;
  const float y = static_cast<float>(j);
  const bool swap_sign_sin = (j & 4) != 0;
  const bool use_sin_poly_for_sin = (j & 2) == 0;
  const bool flip_cos = ((~(j - 2)) & 4) != 0;
  // Extended-precision reduction t - j*pi/4 with pi/4 split in three parts.
  float x = std::fma(y, k.minus_dp1, t);
  x = std::fma(y, k.minus_dp2, x);
  x = std::fma(y, k.minus_dp3, x);
  const float z = x * x;

  float yc = k.cos_coef[0];
  yc = std::fma(yc, z, k.cos_coef[1]);
  yc = std::fma(yc, z, k.cos_coef[2]);
  yc = yc * z;
  yc = std::fma(yc, z, -(0.5f * z));  // yc*z*z - 0.5*z with the second product fused
  yc = yc + 1.0f;

  float ys = k.sin_coef[0];
  ys = std::fma(ys, z, k.sin_coef[1]);
  ys = std::fma(ys, z, k.sin_coef[2]);
  ys = ys * z;
  ys = std::fma(ys, x, x);

  float s = use_sin_poly_for_sin ? ys : yc;
  float c = use_sin_poly_for_sin ? yc : ys;
  if (sign_in != swap_sign_sin) s = -s;
  if (flip_cos) c = -c;
  *sin_out = s;
  *cos_out = c;
}

// torch's normal_fill_16 (DEFAULT kernel) or normal_fill_16_AVX2: Box-Muller on 8 lanes, the
// first 8 uniforms give the radius, the next 8 the angle. `mean`/`stddev` are float, as torch
// casts them before the vector path.
void box_muller_16(float* d, float mean, float stddev, RngFlavor flavor) {
  const CephesConstants& k = cephes();
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - d[j];  // [0, 1) -> (0, 1] for the log
    const float u2 = d[j + 8];
    float s = 0.0f, c = 0.0f;
    if (flavor == RngFlavor::kX86Avx2) {
      const float radius = std::sqrt(-2.0f * cephes_log(u1));
      cephes_sincos(k.two_pi * u2, &s, &c);
      d[j] = std::fma(radius * c, stddev, mean);  // _mm256_fmadd_ps
      d[j + 8] = std::fma(radius * s, stddev, mean);
    } else {
      const float radius = std::sqrt(-2.0f * std::log(u1));  // logf
      // `2.0f * c10::pi<double> * u2`: the product is taken in double, then rounded.
      const float theta = static_cast<float>(6.283185307179586 * static_cast<double>(u2));
      c = std::cos(theta);  // cosf / sinf of the C library
      s = std::sin(theta);
      d[j] = radius * c * stddev + mean;  // every step rounds (no FMA in the DEFAULT kernel)
      d[j + 8] = radius * s * stddev + mean;
    }
  }
}

// The view with its dims reordered by decreasing stride: walking it row-major visits the
// elements in memory order, which is the order TensorIterator hands them to the generator.
TensorView memory_order(const TensorView& t) {
  const int n = t.dim();
  std::array<int, kMaxDims> perm{};
  std::iota(perm.begin(), perm.begin() + n, 0);
  std::stable_sort(perm.begin(), perm.begin() + n,
                   [&](int a, int b) { return t.strides()[a] > t.strides()[b]; });
  Shape shape, strides;
  for (int i = 0; i < n; ++i) {
    shape.push_back(t.shape()[perm[i]]);
    strides.push_back(t.strides()[perm[i]]);
  }
  return TensorView(t.data(), shape, strides);
}

template <typename F>
void fill_in_memory_order(const TensorView& t, F&& next_value) {
  const TensorView ordered = memory_order(t);
  float* data = t.data();
  for_each_offset(ordered, [&](int64_t off) { data[off] = next_value(); });
}

void check_defined(const TensorView& t, const char* fn) {
  if (!t.defined() && t.numel() != 0) {
    throw ValueError(fmt::format("{}: the tensor is undefined (null data)", fn));
  }
}

}  // namespace

// ---- Generator ---------------------------------------------------------------------------------

Generator::Generator(uint64_t seed, RngFlavor flavor) : flavor_(flavor) { manual_seed(seed); }

void Generator::manual_seed(uint64_t seed) {
  seed_ = seed;
  // Only the low 32 bits reach the engine (at::mt19937 takes a uint64 and truncates).
  mt_[0] = static_cast<uint32_t>(seed & 0xFFFFFFFFu);
  for (int j = 1; j < kStateSize; ++j) {
    mt_[j] = 1812433253u * (mt_[j - 1] ^ (mt_[j - 1] >> 30)) + static_cast<uint32_t>(j);
  }
  index_ = kStateSize;  // the first draw twists
  cached_normal_.reset();
}

uint32_t Generator::random() {
  if (index_ >= kStateSize) {
    for (int i = 0; i < kStateSize; ++i) {
      const uint32_t y = (mt_[i] & kUpperMask) | (mt_[(i + 1) % kStateSize] & kLowerMask);
      mt_[i] = mt_[(i + kShift) % kStateSize] ^ (y >> 1) ^ ((y & 1u) ? kMatrixA : 0u);
    }
    index_ = 0;
  }
  uint32_t y = mt_[index_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9D2C5680u;
  y ^= (y << 15) & 0xEFC60000u;
  y ^= y >> 18;
  return y;
}

uint64_t Generator::random64() {
  const uint64_t hi = random();  // torch draws the high word first
  const uint64_t lo = random();
  return (hi << 32) | lo;
}

float Generator::uniform_float(double from, double to) {
  const float f = static_cast<float>(from);
  const float range = static_cast<float>(to) - f;
  const float x = static_cast<float>(random() & 0x00FFFFFFu) * kTwoPow24Inv;  // exact
  // GCC contracted `x * range + from` into one FMA in torch's AVX2 kernel, not in DEFAULT.
  return flavor_ == RngFlavor::kX86Avx2 ? std::fma(x, range, f) : x * range + f;
}

double Generator::uniform_double() {
  return static_cast<double>(random64() & kMask53) * kTwoPow53Inv;
}

double Generator::normal_double(double mean, double stddev) {
  double v = 0.0;
  if (cached_normal_) {
    v = *cached_normal_;
    cached_normal_.reset();
  } else {
    const double u1 = uniform_double();  // angle
    const double u2 = uniform_double();  // radius
    const double r = std::sqrt(-2.0 * std::log(1.0 - u2));
    const double theta = 2.0 * std::numbers::pi * u1;
    cached_normal_ = r * std::sin(theta);
    v = r * std::cos(theta);
  }
  return flavor_ == RngFlavor::kX86Avx2 ? std::fma(v, stddev, mean) : v * stddev + mean;
}

Generator& default_generator() {
  static Generator gen;
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

// ---- Tensor fills ------------------------------------------------------------------------------

void uniform_(TensorView t, double from, double to, Generator& gen) {
  check_defined(t, "uniform_");
  if (!(from <= to)) {
    throw ValueError(fmt::format("uniform_: expects a [from, to) range, got from={} > to={}", from, to));
  }
  if (!std::isfinite(from) || !std::isfinite(to)) {
    throw ValueError(fmt::format("uniform_: from={} and to={} must be finite", from, to));
  }
  fill_in_memory_order(t, [&] { return gen.uniform_float(from, to); });
}

void normal_(TensorView t, double mean, double stddev, Generator& gen) {
  check_defined(t, "normal_");
  if (!(stddev >= 0.0)) {
    throw ValueError(fmt::format("normal_: expects stddev >= 0, got stddev={}", stddev));
  }
  const int64_t n = t.numel();
  if (n < 16 || !t.is_contiguous()) {
    // Scalar path: double Box-Muller with the generator's cached second value.
    fill_in_memory_order(t, [&] { return static_cast<float>(gen.normal_double(mean, stddev)); });
    return;
  }
  // Vector path: n uniforms, Box-Muller in blocks of 16, then a final block of 16 fresh uniforms
  // over the last 16 slots when n is not a multiple of 16. The cached normal is not touched.
  const float mean_f = static_cast<float>(mean);
  const float std_f = static_cast<float>(stddev);
  float* data = t.data();
  for (int64_t i = 0; i < n; ++i) data[i] = gen.uniform_float(0.0, 1.0);
  for (int64_t i = 0; i + 16 <= n; i += 16) box_muller_16(data + i, mean_f, std_f, gen.flavor());
  if (n % 16 != 0) {
    float* tail = data + n - 16;
    for (int i = 0; i < 16; ++i) tail[i] = gen.uniform_float(0.0, 1.0);
    box_muller_16(tail, mean_f, std_f, gen.flavor());
  }
}

void bernoulli_(TensorView t, double p, Generator& gen) {
  check_defined(t, "bernoulli_");
  if (!(p >= 0.0 && p <= 1.0)) {
    throw ValueError(fmt::format("bernoulli_: expects p in [0, 1], got p={}", p));
  }
  // torch's default kernel (bernoulli_scalar_kernel_default): strict `u < p` on a 53-bit double.
  fill_in_memory_order(t, [&] { return gen.uniform_double() < p ? 1.0f : 0.0f; });
}

Tensor rand(Shape shape, Generator& gen) {
  Tensor out = Tensor::empty(shape);
  uniform_(out, 0.0, 1.0, gen);
  return out;
}

Tensor randn(Shape shape, Generator& gen) {
  Tensor out = Tensor::empty(shape);
  normal_(out, 0.0, 1.0, gen);
  return out;
}

void kaiming_uniform_linear_(TensorView weight, Generator& gen) {
  if (weight.dim() != 2) {
    throw ShapeError(fmt::format("kaiming_uniform_linear_: expects a 2-D (out, in) weight, got shape {}",
                                 weight.shape().str()));
  }
  if (weight.numel() == 0) return;  // torch warns and draws nothing
  // The same double arithmetic as nn.init.kaiming_uniform_(w, a=sqrt(5)) in Python; the bound is
  // deliberately not simplified to 1/sqrt(fan_in), which differs in the last bit.
  const double fan_in = static_cast<double>(weight.size(1));
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1.0 + a * a));
  const double stddev = gain / std::sqrt(fan_in);
  const double bound = std::sqrt(3.0) * stddev;
  uniform_(weight, -bound, bound, gen);
}

}  // namespace attn

// The SDPA kernel table and the choice among its entries (see registry.hpp).
//
// One fused driver (src/sdpa/cpu/flash_fwd.cpp, flash_bwd.cpp) runs with the function table of
// one ISA build; each build is its own entry here so that it can be listed, forced by name and
// skipped with a reason when this CPU lacks a feature its compile flags assume. The `needs`
// masks must match the -m flags CMakeLists.txt gives each flash_<isa>.cpp.
#include "sdpa/registry.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <fmt/format.h>
#include <omp.h>

#include "attn/error.hpp"
#include "sdpa/cpu/decode.hpp"
#include "sdpa/cpu/flash_bf16.hpp"
#include "sdpa/cpu/flash_inputs.hpp"
#include "sdpa/cpu/flash_isa.hpp"
#include "sdpa/cpu/unit_rates.hpp"
#include "sdpa/mask_grad.hpp"

namespace attn::detail {
namespace {

// The float32 kernels take 16-bit inputs widened (see widening_forward); the reference also
// computes float64 inputs in float64; the AVX512-BF16 kernel computes bf16 natively.
constexpr std::array<DType, 3> kFusedDtypes{DType::kFloat32, DType::kBFloat16, DType::kFloat16};
constexpr std::array<DType, 4> kReferenceDtypes{DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                                DType::kFloat64};
constexpr std::array<DType, 1> kBFloat16Only{DType::kBFloat16};
constexpr std::array<DType, 2> kSixteenBit{DType::kBFloat16, DType::kFloat16};

using ForwardFn = SdpaResult (*)(const TensorView&, const TensorView&, const TensorView&,
                                 const SdpaOptions&, const SdpaProblem&);
using BackwardFn = SdpaGrads (*)(const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const SdpaSaved&, const SdpaOptions&,
                                 const SdpaProblem&);

// SdpaResult::output_residual of a float32 output out32 rounded to out (contiguous, same shape):
// (out32 - out) in out's dtype, 0 where out is not finite.
Tensor output_residual(const Tensor& out32, const Tensor& out) {
  Tensor diff = Tensor::empty(out.shape());
  const Tensor wide = out.to(DType::kFloat32);
  const float *a = out32.data(), *b = wide.data();
  float* d = diff.data();
  for (int64_t i = 0; i < diff.numel(); ++i) d[i] = std::isfinite(b[i]) ? a[i] - b[i] : 0.0f;
  return diff.to(out.dtype());
}

// output + output_residual in float32: the forward's float32 output to 16 (bf16) or 22 (fp16)
// significant bits.
Tensor output_from_residual(const SdpaSaved& forward) {
  Tensor o = forward.output.to(DType::kFloat32);
  const Tensor r = forward.output_residual.to(DType::kFloat32);
  float* d = o.data();
  const float* e = r.data();
  for (int64_t i = 0; i < o.numel(); ++i) d[i] += e[i];
  return o;
}

// bfloat16 / float16 inputs on a float32 kernel: widened once (exactly), computed in float32,
// and the outputs rounded to the input dtype once; the LSE stays float32. This is PyTorch's
// contract for low-precision SDPA (float32 accumulation and softmax, output in the input dtype),
// the "float32 reference rounded to the dtype" of the accuracy rule, and the fallback wherever
// no kernel computes the dtype natively.
template <ForwardFn F32>
SdpaResult widening_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const SdpaOptions& options, const SdpaProblem& p) {
  if (p.dtype == DType::kFloat32) return F32(q, k, v, options, p);
  SdpaProblem p32 = p;
  p32.dtype = p32.kv_dtype = DType::kFloat32;
  SdpaResult r = F32(q.to(DType::kFloat32), k.to(DType::kFloat32), v.to(DType::kFloat32), options, p32);
  Tensor out = r.output.to(p.dtype);
  if (options.need_output_residual) r.output_residual = output_residual(r.output, out);
  r.output = std::move(out);
  if (r.attn_weights.defined()) r.attn_weights = r.attn_weights.to(p.dtype);
  return r;
}

// The backward widens likewise. A kernel that reads the forward's output (the fused ones form
// D = rowsum(dO * O) from it) gets it recomputed in float32 by its own forward (FwdF32, not null;
// one more forward pass, deterministic and with the same Philox mask): the output rounded to
// 16 bits would put its rounding into every dS (FlashAttention's and PyTorch's bf16 backwards
// do), which wrecks the gradient of a row that sees one key, whose true dQ is exactly 0.
// A call on a slice of the keys (SdpaOptions::key_pos_offset, context parallelism) recomputes
// only its block's output, normalised by the block's LSE, while D needs the whole row's: rows
// whose recomputed LSE is not the saved one take the saved output, widened, instead.
void keep_rows_of_the_whole_call(Tensor& out32, const Tensor& lse32, const SdpaSaved& forward) {
  const int64_t rows = lse32.numel(), X = rows == 0 ? 0 : out32.numel() / rows;
  const Tensor saved_lse = forward.lse.contiguous();
  Tensor saved_out;
  for (int64_t i = 0; i < rows; ++i) {
    const float a = lse32.data()[i], b = saved_lse.data()[i];
    // The same row up to float32 summation order: a few dozen ulps of the LSE. (A key slice
    // holding all but a fraction below that of the row's mass passes as the row: float32 LSEs
    // cannot tell them apart, and its D is then off by about that fraction.)
    if (a == b || std::fabs(a - b) <= 64.0f * std::numeric_limits<float>::epsilon() * std::max(1.0f, std::fabs(b))) continue;
    if (!saved_out.defined()) saved_out = forward.output.to(DType::kFloat32);
    std::copy_n(saved_out.data() + i * X, X, out32.data() + i * X);
  }
}

template <BackwardFn F32, ForwardFn FwdF32>
SdpaGrads widening_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const SdpaSaved& forward,
                            const SdpaOptions& options, const SdpaProblem& p) {
  if (p.dtype == DType::kFloat32) return F32(dout, q, k, v, forward, options, p);
  SdpaProblem p32 = p;
  p32.dtype = p32.kv_dtype = DType::kFloat32;
  const Tensor q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
  Tensor out32, w32;
  if (FwdF32 != nullptr && forward.output_residual.defined()) {
    out32 = output_from_residual(forward);  // the whole call's, also for a slice of the keys
  } else if (FwdF32 != nullptr) {
    SdpaOptions fo = options;
    fo.need_weights = false;
    fo.need_lse = true;
    SdpaResult r = FwdF32(q32, k32, v32, fo, p32);
    out32 = std::move(r.output);
    keep_rows_of_the_whole_call(out32, r.lse, forward);
  } else {
    out32 = forward.output.to(DType::kFloat32);
  }
  if (forward.attn_weights.defined()) w32 = forward.attn_weights.to(DType::kFloat32);
  SdpaGrads g = F32(dout.to(DType::kFloat32), q32, k32, v32, SdpaSaved(out32, forward.lse, w32), options, p32);
  g.grad_query = g.grad_query.to(p.dtype);
  g.grad_key = g.grad_key.to(p.dtype);
  g.grad_value = g.grad_value.to(p.dtype);
  return g;
}

// Float64 inputs: the float64 reference (every product and sum in double) as tensors.
Tensor f64_tensor(const Shape& shape, const std::vector<double>& values) {
  Tensor t = Tensor::empty(shape, DType::kFloat64);
  std::copy(values.begin(), values.end(), t.data_as<double>());
  return t;
}

SdpaResult reference_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                             const SdpaOptions& options, const SdpaProblem& p) {
  if (p.dtype != DType::kFloat64) return widening_forward<reference::sdpa_forward>(q, k, v, options, p);
  const reference::SdpaResultF64 r = reference::scaled_dot_product_attention_f64(q, k, v, options, p);
  SdpaResult out;
  out.output = f64_tensor(r.output_shape, r.output);
  if (options.need_weights) out.attn_weights = f64_tensor(r.weights_shape, r.attn_weights);
  if (options.need_lse) out.lse = f64_tensor(r.lse_shape, r.lse);
  return out;
}

SdpaGrads reference_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const SdpaSaved& forward,
                             const SdpaOptions& options, const SdpaProblem& p) {
  if (p.dtype != DType::kFloat64) {
    // The reference's D is rowsum(P * dP): it never reads the forward's output.
    return widening_backward<reference::sdpa_backward, nullptr>(dout, q, k, v, forward, options, p);
  }
  const reference::SdpaGradsF64 g = reference::scaled_dot_product_attention_backward_f64(dout, q, k, v, options, p);
  return {f64_tensor(q.shape(), g.grad_query), f64_tensor(k.shape(), g.grad_key),
          f64_tensor(v.shape(), g.grad_value),
          g.grad_sinks.empty() ? Tensor() : f64_tensor({p.heads_q}, g.grad_sinks),
          options.need_attn_mask_grad ? mask_grad_tensor(g.grad_attn_mask, options.attn_mask->values) : Tensor()};
}

// The float64 path draws kTorch dropout from a copy of the generator (it is the tests' truth),
// which would give every call the same mask.
std::string reference_why_not(const SdpaKernel&, const SdpaProblem& p, const SdpaOptions& options) {
  if (p.dtype == DType::kFloat64 && p.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kTorch) {
    return "float64 inputs with DropoutRng::kTorch dropout are not supported; use DropoutRng::kPhilox";
  }
  return "";
}

std::string family_name(SdpaBackend b) {
  switch (b) {
    case SdpaBackend::kReference: return "reference";
    case SdpaBackend::kFused: return "fused";
    case SdpaBackend::kAuto: return "auto";
  }
  return "?";
}

// The fused kernels compute dropout from Philox counters; PyTorch's sequential stream depends on
// drawing every weight in memory order, which a tiled kernel cannot do.
std::string flash_why_not(const SdpaKernel&, const SdpaProblem&, const SdpaOptions& options) {
  if (options.dropout_p > 0.0f && options.dropout_rng == DropoutRng::kTorch) {
    return "dropout with DropoutRng::kTorch (PyTorch's sequential stream) is reference-only; use "
           "DropoutRng::kPhilox";
  }
  return "";
}

template <const cpu::FlashKernel& (*Table)()>
SdpaResult fused_forward_f32(const TensorView& q, const TensorView& k, const TensorView& v,
                             const SdpaOptions& options, const SdpaProblem& problem) {
  return cpu::flash_forward(Table(), q, k, v, options, problem);
}

template <const cpu::FlashKernel& (*Table)()>
SdpaGrads fused_backward_f32(const TensorView& grad_output, const TensorView& q, const TensorView& k,
                             const TensorView& v, const SdpaSaved& forward,
                             const SdpaOptions& options, const SdpaProblem& problem) {
  return cpu::flash_backward(Table(), grad_output, q, k, v, forward, options, problem);
}

template <const cpu::FlashKernel& (*Table)()>
constexpr ForwardFn fused_forward = widening_forward<fused_forward_f32<Table>>;
template <const cpu::FlashKernel& (*Table)()>
constexpr BackwardFn fused_backward = widening_backward<fused_backward_f32<Table>, fused_forward_f32<Table>>;

// The split-KV decode kernel (src/sdpa/cpu/decode.cpp) for a few queries against many keys. It
// computes inference only: the weights, dropout and long query blocks go to the flash kernels.
std::string decode_why_not(const SdpaKernel&, const SdpaProblem& p, const SdpaOptions& options) {
  if (p.L > cpu::kDecodeMaxQueries) {
    return fmt::format("{} queries per head: the decode kernel takes at most {} (prefill runs on "
                       "cpu.flash)", p.L, cpu::kDecodeMaxQueries);
  }
  if (options.need_weights) return "need_weights is served by the cpu.flash kernels";
  if (options.dropout_p > 0.0f) return "dropout is served by the cpu.flash kernels (decoding is inference)";
  if (options.need_output_residual && is_sixteen_bit_float(p.dtype)) {
    return "need_output_residual (for a backward) is served by the cpu.flash kernels (decoding is inference)";
  }
  return "";
}

template <const cpu::DecodeKernel& (*Table)()>
SdpaResult decode_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                          const SdpaOptions& options, const SdpaProblem& problem) {
  return cpu::decode_forward(Table(), q, k, v, options, problem);
}

// The backward of a short query block is the flash backward of the same ISA. Float32 queries
// against 16-bit keys/values are widened; dK and dV come back in the keys' dtype.
template <const cpu::FlashKernel& (*Table)()>
SdpaGrads decode_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const SdpaSaved& forward,
                          const SdpaOptions& options, const SdpaProblem& p) {
  if (p.kv_dtype == p.dtype) return fused_backward<Table>(dout, q, k, v, forward, options, p);
  SdpaProblem p32 = p;
  p32.kv_dtype = DType::kFloat32;
  const Tensor k32 = k.to(DType::kFloat32), v32 = v.to(DType::kFloat32);
  SdpaGrads g = fused_backward<Table>(dout, q, k32, v32, forward, options, p32);
  g.grad_key = g.grad_key.to(p.kv_dtype);
  g.grad_value = g.grad_value.to(p.kv_dtype);
  return g;
}

#if defined(ATTN_HAVE_X86_KERNELS)
// The native 16-bit forwards (AMX-BF16 tiles for bf16 and fp16, AVX512-BF16 dot products for
// bf16) compute what the float32 kernels compute except in two cases they leave to them: the
// attention weights (no second pass of their own yet: refused, so kAuto takes the next kernel)
// and values they cannot multiply as float32 would (tiles_take_values: a V holding NaN/Inf, and
// NaN/Inf in q or k where values are split into terms; they hand the call to the AVX-512 float32
// kernel, widened, themselves). Their backward (bf16_backward) is native for bf16 (vdpbf16ps, on
// AMX machines too) and the float32 AVX-512 kernel's on widened inputs otherwise: fp32
// accumulation, gradients rounded to the dtype once.
std::string bf16_why_not(const SdpaKernel& k, const SdpaProblem& p, const SdpaOptions& options) {
  if (std::string r = flash_why_not(k, p, options); !r.empty()) return r;
  const char* widened = p.dtype == DType::kFloat32 ? "" : " (widened)";
  if (options.need_weights) return fmt::format("need_weights is served by the float32 kernels{}", widened);
  if (std::string v = p.variants_used(); !v.empty()) {
    return fmt::format("{} is served by the float32 kernels{}", v, widened);
  }
  return "";
}

// The per-CPU table (sdpa/cpu/unit_rates.hpp): where vdpbf16ps does fewer multiply-adds per
// second than the FMA units, the float32 kernel on widened inputs is the faster bf16 path.
constexpr double kBf16DotMinSpeedup = 0.9;

std::string dot_unit_declines(const char* instead) {
  const double s = cpu::unit_rates().bf16_dot_speedup();
  if (s >= kBf16DotMinSpeedup) return "";
  return fmt::format("kAuto prefers {} on this CPU: vdpbf16ps measured at {:.2f}x the float32 FMA "
                     "rate", instead, s);
}
std::string bf16_auto_declines() { return dot_unit_declines("cpu.flash.avx512 (widened)"); }
// The bf16 decode build differs from cpu.decode.avx512 only where it multiplies on the dot unit.
std::string decode_bf16_auto_declines() { return dot_unit_declines("cpu.decode.avx512"); }

// The table for the call: the AVX512-BF16 kernel takes bf16 only, the AMX one also fp16 and
// float32 at precision "high" (three bf16 terms) or "medium" (one). A bf16 call asking for
// output_residual (unless it allows fp16/bf16 reduction), or with Ev under 32, gets the AMX table
// that enters P into P.V as two terms (cpu::bf16_p_two_terms; the AVX512-BF16 kernel decides so by
// itself).
const cpu::Bf16ForwardKernel& avx512_bf16_table(const SdpaProblem&, const SdpaOptions&) {
  return cpu::bf16_kernel_avx512();
}
const cpu::Bf16ForwardKernel& amx_table(const SdpaProblem& p, const SdpaOptions& options) {
  if (p.dtype == DType::kFloat16) return cpu::fp16_kernel_amx();
  if (p.dtype == DType::kBFloat16) {
    const bool residual = options.need_output_residual && !options.allow_fp16_bf16_reduction;
    return cpu::bf16_p_two_terms(p.Ev, residual) ? cpu::bf16_two_term_kernel_amx() : cpu::bf16_kernel_amx();
  }
  return p.f32_precision == Float32MatmulPrecision::kMedium ? cpu::fp32_medium_kernel_amx()
                                                            : cpu::fp32_high_kernel_amx();
}

// bf16 gradients on vdpbf16ps (flash_bwd_avx512_bf16.cpp) where every input is bf16 and finite;
// fp16, float32 at reduced precision and NaN/Inf go to the float32 AVX-512 kernel, widened.
// The native backward does 10 vdpbf16ps products per (query, key) pair's 5 (two terms for P and
// dS, two more for D) against the widened path's 5 FMA products plus a recomputed forward (2);
// with the forward's output_residual saved, 8 against 5 (neither re-derives D): where vdpbf16ps
// does under kBf16BackwardMinSpeedup x the FMA multiply-adds (Intel Sapphire Rapids: 0.50x; AMD
// Zen 5: 2.0x) the widened path is the faster one, and kAuto takes it. The
// AVX512-BF16 kernel forced by name runs its own backward wherever the CPU has the unit.
constexpr double kBf16BackwardMinSpeedup = 1.5;

template <bool kNamedRunsNative>
SdpaGrads bf16_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const SdpaSaved& forward, const SdpaOptions& options, const SdpaProblem& p) {
  const int n = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  const bool pays = (kNamedRunsNative && !options.kernel.empty()) ||
                    cpu::unit_rates().bf16_dot_speedup() >= kBf16BackwardMinSpeedup;
  const bool native = p.dtype == DType::kBFloat16 && p.kv_dtype == DType::kBFloat16 &&
                      dout.dtype() == DType::kBFloat16 && pays && cpu::all_finite_16(q, n) &&
                      cpu::all_finite_16(k, n) && cpu::all_finite_16(v, n) && cpu::all_finite_16(dout, n);
  if (!native) return fused_backward<cpu::flash_kernel_avx512>(dout, q, k, v, forward, options, p);
  return cpu::flash_backward_bf16(cpu::bf16_backward_avx512(), dout, q, k, v, forward, options, p);
}

template <const cpu::Bf16ForwardKernel& (*Table)(const SdpaProblem&, const SdpaOptions&)>
SdpaResult bf16_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SdpaOptions& options, const SdpaProblem& p) {
  const int threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  if (!tiles_take_values(q, k, v, p, threads)) return fused_forward<cpu::flash_kernel_avx512>(q, k, v, options, p);
  const cpu::Bf16ForwardKernel& table = Table(p, options);
  // A table whose float32 output is not the float32 attention's (P in one bf16 term) cannot form
  // output_residual; the tables above pick one that can, and this keeps it so.
  if (options.need_output_residual && is_sixteen_bit_float(p.dtype) && !table.residual_ok &&
      !options.allow_fp16_bf16_reduction) {
    return fused_forward<cpu::flash_kernel_avx512>(q, k, v, options, p);
  }
  return cpu::flash_forward_bf16(table, q, k, v, options, p);
}
#endif

using namespace attn::cpu;  // the feature bits

// Highest priority first. Priorities leave room for builds between the present ones.
const SdpaKernel kKernels[] = {
#if defined(ATTN_HAVE_X86_KERNELS)
    {"cpu.decode.avx512_bf16", SdpaBackend::kFused,
     kAvx512f | kAvx512vl | kAvx512dq | kAvx512bw | kAvx512Bf16 | kFma, kFusedDtypes, 510,
     decode_why_not, decode_forward<decode_kernel_avx512_bf16>, decode_backward<flash_kernel_avx512>,
     decode_bf16_auto_declines, true, decode_kernel_avx512_bf16},
    {"cpu.decode.avx512", SdpaBackend::kFused, kAvx512f | kAvx512vl | kAvx512dq | kFma,
     kFusedDtypes, 500, decode_why_not, decode_forward<decode_kernel_avx512>,
     decode_backward<flash_kernel_avx512>, nullptr, true, decode_kernel_avx512},
    {"cpu.decode.avx2", SdpaBackend::kFused, kAvx2 | kFma | kF16c, kFusedDtypes, 490,
     decode_why_not, decode_forward<decode_kernel_avx2>, decode_backward<flash_kernel_avx2>,
     nullptr, true, decode_kernel_avx2},
#endif
    {"cpu.decode.generic", SdpaBackend::kFused, 0, kFusedDtypes, 480, decode_why_not,
     decode_forward<decode_kernel_generic>, decode_backward<flash_kernel_generic>, nullptr, true,
     decode_kernel_generic},
#if defined(ATTN_HAVE_X86_KERNELS)
    {"cpu.flash.amx_bf16", SdpaBackend::kFused,
     kAvx512f | kAvx512vl | kAvx512dq | kAvx512bw | kAvx512Bf16 | kFma | kAmxTile | kAmxBf16,
     kSixteenBit, 450, bf16_why_not, bf16_forward<amx_table>, bf16_backward<false>, nullptr, false, nullptr, /*reduced_float32=*/true},
    {"cpu.flash.avx512_bf16", SdpaBackend::kFused,
     kAvx512f | kAvx512vl | kAvx512dq | kAvx512bw | kAvx512Bf16 | kFma, kBFloat16Only, 400,
     bf16_why_not, bf16_forward<avx512_bf16_table>, bf16_backward<true>,
     bf16_auto_declines},
    {"cpu.flash.avx512", SdpaBackend::kFused, kAvx512f | kAvx512vl | kAvx512dq | kFma,
     kFusedDtypes, 300, flash_why_not, fused_forward<flash_kernel_avx512>,
     fused_backward<flash_kernel_avx512>, nullptr},
    {"cpu.flash.avx2", SdpaBackend::kFused, kAvx2 | kFma | kF16c, kFusedDtypes, 200, flash_why_not,
     fused_forward<flash_kernel_avx2>, fused_backward<flash_kernel_avx2>, nullptr},
#endif
    {"cpu.flash.generic", SdpaBackend::kFused, 0, kFusedDtypes, 100, flash_why_not,
     fused_forward<flash_kernel_generic>, fused_backward<flash_kernel_generic>, nullptr},
    {"reference", SdpaBackend::kReference, 0, kReferenceDtypes, 0, reference_why_not,
     reference_forward, reference_backward, nullptr},
};

// "" if this CPU has every feature the kernel's build assumes, else which ones it lacks.
std::string missing_features(const SdpaKernel& kernel) {
  const cpu::CpuFeatures& cpu = cpu::cpu_features();
  if (cpu.has(kernel.needs)) return "";
  return fmt::format("needs CPU features {} (this CPU: {})",
                     cpu::feature_names(kernel.needs & ~cpu.mask), cpu.describe());
}

std::string known_names() {
  std::string s;
  for (const SdpaKernel& k : kKernels) s += fmt::format("{}{}", s.empty() ? "" : ", ", k.name);
  return s;
}

}  // namespace

// See registry.hpp. fp16 and float32 "high" are computed as products of split terms: an
// infinite element is all in its hi term (the others 0), so Inf times another value's zero
// term is NaN where a float32 product gives +-Inf (a key that a -inf score should drop would
// turn the row NaN). bf16 and "medium" are one term: only V matters for them.
bool tiles_take_values(const TensorView& q, const TensorView& k, const TensorView& v, const SdpaProblem& p,
                       int threads) {
  auto finite = [&](const TensorView& t) {
    return t.dtype() == DType::kFloat32 ? cpu::all_finite(t, threads) : cpu::all_finite_16(t, threads);
  };
  if (!finite(v)) return false;
  const bool split = p.dtype == DType::kFloat16 ||
                     (p.dtype == DType::kFloat32 && p.f32_precision == Float32MatmulPrecision::kHigh);
  return !split || (finite(q) && finite(k));
}

std::span<const SdpaKernel> sdpa_registry() { return kKernels; }

const cpu::DecodeKernel& select_decode_kernel(std::string_view name, std::string_view caller) {
  std::string decoders;
  for (const SdpaKernel& k : kKernels) {
    if (k.decode == nullptr) continue;
    decoders += fmt::format("{}{}", decoders.empty() ? "" : ", ", k.name);
    if (!name.empty() && k.name != name) continue;
    const std::string missing = missing_features(k);
    if (name.empty() && missing.empty() && k.auto_declines != nullptr && !k.auto_declines().empty()) continue;
    if (missing.empty()) return k.decode();
    if (!name.empty()) {
      throw ValueError(fmt::format("{}: kernel '{}' cannot run here: {}", caller, k.name, missing));
    }
  }
  throw ValueError(fmt::format("{}: kernel '{}' is not a decode kernel (decode kernels: {})", caller,
                               name, decoders));
}

std::string kernel_why_not(const SdpaKernel& kernel, const SdpaProblem& problem,
                           const SdpaOptions& options) {
  if (std::string missing = missing_features(kernel); !missing.empty()) return missing;
  bool dtype_ok = false;
  std::string takes;
  for (DType d : kernel.dtypes) {
    dtype_ok = dtype_ok || d == problem.dtype;
    takes += fmt::format("{}{}", takes.empty() ? "" : ", ", dtype_name(d));
  }
  const bool reduced = kernel.reduced_float32 && problem.dtype == DType::kFloat32;
  if (reduced) {
    dtype_ok = problem.f32_precision != Float32MatmulPrecision::kHighest;
    takes += ", and float32 at float32_matmul_precision 'high' or 'medium'";
  }
  if (!dtype_ok) {
    return fmt::format("dtype {}{} not supported (takes {})", dtype_name(problem.dtype),
                       reduced ? " at float32_matmul_precision 'highest'" : "", takes);
  }
  if (problem.kv_dtype != problem.dtype && !kernel.mixed_kv) {
    return fmt::format("query {} with key/value {}: mixed dtypes are taken by the cpu.decode "
                       "kernels only", dtype_name(problem.dtype), dtype_name(problem.kv_dtype));
  }
  return kernel.why_not != nullptr ? kernel.why_not(kernel, problem, options) : "";
}

const SdpaKernel& select_sdpa_kernel(const SdpaProblem& problem, const SdpaOptions& options,
                                     std::string_view caller) {
  if (!options.kernel.empty()) {
    for (const SdpaKernel& k : kKernels) {
      if (k.name != options.kernel) continue;
      if (options.backend != SdpaBackend::kAuto && options.backend != k.family) {
        throw ValueError(fmt::format(
            "{}: kernel '{}' is a {} kernel but options.backend asks for {} (leave backend at "
            "kAuto when naming a kernel)",
            caller, k.name, family_name(k.family), family_name(options.backend)));
      }
      const std::string reason = kernel_why_not(k, problem, options);
      if (!reason.empty()) {
        throw ValueError(fmt::format("{}: kernel '{}' cannot take this problem: {}", caller,
                                     k.name, reason));
      }
      return k;
    }
    throw ValueError(fmt::format("{}: unknown kernel '{}' (registered: {})", caller,
                                 options.kernel, known_names()));
  }

  for (const SdpaKernel& k : kKernels) {  // highest priority first
    if (options.backend != SdpaBackend::kAuto && options.backend != k.family) continue;
    if (k.auto_declines != nullptr && !k.auto_declines().empty()) continue;
    if (kernel_why_not(k, problem, options).empty()) return k;
  }
  // The message callers have relied on since kFused existed.
  if (options.backend == SdpaBackend::kFused && options.dropout_p > 0.0f &&
      options.dropout_rng == DropoutRng::kTorch) {
    throw ValueError(fmt::format(
        "{}: backend kFused does not support dropout with DropoutRng::kTorch (PyTorch's "
        "sequential stream); use DropoutRng::kPhilox or kAuto",
        caller));
  }
  std::string reasons;
  for (const SdpaKernel& k : kKernels) {
    std::string r = (options.backend != SdpaBackend::kAuto && options.backend != k.family)
                        ? fmt::format("not of backend {}", family_name(options.backend))
                        : kernel_why_not(k, problem, options);
    if (r.empty() && k.auto_declines != nullptr) r = k.auto_declines();
    reasons += fmt::format("; {}: {}", k.name, r);
  }
  const std::string message = fmt::format("{}: no kernel can take this problem (backend {}){}",
                                          caller, family_name(options.backend), reasons);
  if (problem.kv_dtype != problem.dtype) throw DTypeError(message);  // names both dtypes
  throw ValueError(message);
}

}  // namespace attn::detail

namespace attn {

std::vector<SdpaKernelInfo> sdpa_kernels() {
  std::vector<SdpaKernelInfo> out;
  for (const detail::SdpaKernel& k : detail::sdpa_registry()) {
    SdpaKernelInfo info;
    info.name = std::string(k.name);
    info.family = k.family;
    info.dtypes.assign(k.dtypes.begin(), k.dtypes.end());
    info.reason_if_not = detail::missing_features(k);
    info.runs_on_this_cpu = info.reason_if_not.empty();
    info.reduced_float32 = k.reduced_float32;
    if (info.runs_on_this_cpu && k.auto_declines != nullptr) info.auto_declines = k.auto_declines();
    out.push_back(std::move(info));
  }
  return out;
}

std::string cpu_description() {
  const cpu::CpuFeatures& cpu = cpu::cpu_features();
  return fmt::format("{} [{}]", cpu.model.empty() ? "unknown CPU" : cpu.model, cpu.describe());
}

}  // namespace attn

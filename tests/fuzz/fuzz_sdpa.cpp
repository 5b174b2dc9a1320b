// Fuzz target: scaled_dot_product_attention, fused kernel against the reference and the float64
// truth.
//
// The bytes decode to a small problem (see decode() for the byte layout; tests/fuzz/seeds.py
// writes the seed corpus in it): rank 2-4, B, Hq, Hkv (GQA), L, S, E, Ev in 1..40, a mask
// (none, causal with either alignment, boolean or additive, with a broadcast shape and a
// layout of its own), scale (default, or odd values), Philox or torch dropout, need_weights,
// need_lse, 1 or 2 threads, the fused kernel's instruction set, a layout per input
// (contiguous, transposed, sliced, expanded, selected; view padding is filled with NaN so a
// read outside the view shows), values from a seeded generator at a per-tensor magnitude, and
// "pokes" that plant NaN, Inf, huge and tiny values at chosen elements, and the variants
// (SdpaOptions' last block): a sliding window (each side -1, 0, small, beyond L and S, up to
// INT64_MAX), softcap (1e-30 .. 2e38), ALiBi slopes (H) or (B, H) (zero, tiny, huge, signed,
// strided) and sinks (zero to 6e37 in magnitude). About one input in 8 is made invalid on purpose
// (mismatched dims, empty, bad rank, bad dropout, mask that does not broadcast, mask with
// is_causal, non-finite scale or one beyond float32's range, undefined tensor, a window side
// below -1, softcap <= 0, non-finite or beyond float32's range, slopes or sinks of the wrong
// shape or dtype, non-finite, too large or undefined).
//
// Properties (a violation aborts, so libFuzzer keeps the input):
//  * Invalid arguments throw an attn::Error subclass from every backend and from the float64
//    truth; nothing else is thrown, and valid arguments never throw (except kFused with torch
//    dropout, which must throw ValueError).
//  * Shapes of output, attn_weights and lse are as documented, present exactly when asked for.
//  * One valid problem in four again with q, k, v rounded to bfloat16 and float16, on kAuto and
//    every runnable kernel taking the dtype (see "16-bit inputs" at the end of run()).
//  * One valid problem in four (other seed bits) through the float32 backward, the additive
//    mask's gradient included: fuzz_sdpa_backward.hpp lists its properties.
//  * Fused output, weights and lse are bit-identical for 1 and 2 threads; kAuto gives the
//    fused result (the reference's with torch dropout).
//  * A row whose every key is masked (causal, window, boolean 0, or additive -inf on finite
//    scores) has output 0, weights 0 and lse -inf (with sinks: the row's sink), in both backends.
//  * Unless the problem is in the overflow domain (below), per row:
//      - NaN pattern: fused, reference and float64 truth have NaN at the same elements of the
//        output, the weights and the lse;
//      - error against the truth: err(ref) <= tol and err(fused) <= 2 * err(ref) + tol, with
//          tol(output)  = inv_keep * (1e-5 * (1 + max|v|) + 2 * max|v| * expm1(4 * delta))
//          tol(weights) = inv_keep * (1e-5 + 2 * expm1(4 * delta))
//          tol(lse)     = 1e-5 * (1 + |lse|) + 2 * delta
//        where inv_keep = 1 / (1 - dropout_p) and delta bounds the float32 rounding error of
//        the row's scores: delta = u * ((E + 6) * max_j sum_e |q_e k_e| * |scale|
//        + 4 * max_j |additive mask| + 8 + variants), u = 2^-24, where the variants add
//        4 |slope| (L + S) (ALiBi's bias), 4 |sink| (its base-2 rounding) and, with softcap c,
//        amax + 8 min(c, amax) (division, tanh and product; 8 c when a visible score is
//        infinite, capped to +-c and then rounded like any score of that size), plus c * 2^-149 outside u (for
//        c near float32's top 1/c is subnormal). For well-scaled rows delta is ~1e-6 and
//        the rule is FlashAttention's "2x the reference's error plus a floor"; for rows with
//        huge scores (where float32 softmax itself is ill-conditioned) it widens accordingly.
//        The truth is computed with a custom scale rounded to float32, the multiplier both
//        float32 backends actually apply (so a scale that underflows float32 is 0 for all).
//      - every finite weight lies in [0, inv_keep * (1 + 1e-6)].
//    The overflow domain: some |q.k| (unscaled or scaled, in log2 units), |q| * scale, finite
//    additive mask value or max|v| * inv_keep * S reaches 1e30, so that float32 intermediates
//    may overflow in one backend and not the other (the same for an ALiBi bias |slope| (L + S)
//    or a sink reaching 1e30 in base-2 units); it also takes in a custom scale so tiny
//    that the fused kernel's pre-scaled q (q * float(scale * log2 e)) underflows to 0 for a
//    nonzero q while some key is non-finite (0 * Inf = NaN there, +-Inf in the reference).
//    Only the structural properties are checked there.
//    Documented exemption (docs/NUMERICS.md, "dropout_p = 1"): with torch-stream dropout and
//    dropout_p == 1, attn::dropout returns zeros without multiplying (the reference's weights
//    and output are 0) while the float64 truth multiplies by 0 (a NaN score stays NaN): the
//    reference-vs-truth NaN rule is not applied there.
//    A row is exempt from the NaN-pattern rule for the output when a non-finite value of V sits
//    at a visible, kept key whose true weight is below 1e-30 * exp(4 * delta) (0 included):
//    float32 backends flush such weights to zero at different thresholds (the fused exp2 at
//    2^-126, the reference's expf at the denormal limit; float64 much later), a zero weight
//    never multiplies V, and with a large delta (e.g. an additive mask of 1e15, which float32
//    scores cannot resolve) a weight that is 0 in float64 can be anything in float32.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <numbers>
#include <string>
#include <tuple>
#include <vector>

#include "attn/attn.hpp"
#include "attn/philox.hpp"
#include "fuzz_util.hpp"
#include "fuzz_sdpa_backward.hpp"
#if defined(ATTN_FUZZ_AMX_EMULATED)
#include "sdpa/cpu/amx_emulated.hpp"
#include "sdpa/problem.hpp"
#include "sdpa/registry.hpp"
#endif

namespace {

using namespace attn;
using attn::fuzz::ByteReader;
using attn::fuzz::SplitMix;
using attn::fuzz::throws_attn_error;

#if defined(ATTN_FUZZ_AMX_EMULATED)
// The AMX-BF16 kernel (src/sdpa/cpu/flash_amx_kernel.hpp) on emulated tiles, fuzzed beside the
// registered 16-bit kernels where the CPU runs its AVX-512 part but has no tiles of its own.
const std::string kAmxEmulated = "cpu.flash.amx_bf16 (emulated tiles)";
#endif

constexpr double kU = 0x1p-24;      // float32 unit roundoff
constexpr double kOverflow = 1e30;  // beyond this, float32 intermediates may overflow
constexpr float kInf = std::numeric_limits<float>::infinity();

const float kSpecials[16] = {NAN,   kInf,  -kInf, 0.0f,  -0.0f, 1e4f,  -1e4f, 3e4f,
                             1e6f,  -1e6f, 1e15f, 3e38f, 1e-30f, 1.0f, -1.0f, 1e-3f};
const float kMagnitudes[8] = {1.0f, 1.0f, 0.1f, 3.0f, 10.0f, 100.0f, 1e-3f, 1e3f};
const double kScales[16] = {0.0,  -1.0,  0.125, 1.0,   1e-3,  1e3,   1e-20, 1e20,
                            -0.5, 2e38, 1e-40, 5e-324, 2.0,  -1e-3, 1e-8, 30.0};
const float kDropouts[8] = {0.1f, 0.5f, 0.9f, 1.0f, 1e-7f, 0.99999994f, 1e-30f, 0.25f};
const float kBadDropouts[6] = {-0.1f, 1.5f, NAN, kInf, -kInf, 1.0000001f};
// Non-finite, or finite in float64 but with scale * log2(e) beyond float32's range (the fused
// kernel's multiplier; check_sdpa rejects above FLT_MAX / log2(e) = 2.36e38).
const double kBadScales[6] = {NAN, std::numeric_limits<double>::infinity(),
                              -std::numeric_limits<double>::infinity(), 1e40, -3e38,
                              std::numeric_limits<double>::max()};
// The fused kernel a problem forces (SdpaOptions::kernel): "" lets the registry choose (the best
// build), the others force a lower build. A build this CPU cannot run falls back to the choice,
// so an input replays on any machine.
const char* const kKernels[3] = {"", "cpu.flash.avx2", "cpu.flash.generic"};

const char* runnable_kernel(int pick) {
  static const std::vector<std::string> here = [] {
    std::vector<std::string> names;
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      if (k.runs_on_this_cpu) names.push_back(k.name);
    }
    return names;
  }();
  const char* name = kKernels[pick];
  for (const std::string& h : here) {
    if (h == name) return name;
  }
  return "";
}

// Variants. Window sides: 0 in the byte is -1 (unbounded), else one of these (beyond L and S
// too, up to INT64_MAX, where i' + right must not overflow).
const int64_t kWindows[12] = {0, 1, 2, 3, 5, 8, 17, 39, 41, 1000, int64_t{1} << 62,
                              std::numeric_limits<int64_t>::max()};
// Softcaps from tiny (every score ~0) to near float32's top (1/c subnormal in the fused kernel).
const double kSoftcaps[16] = {1.0, 2.0, 5.0, 20.0, 30.0, 50.0, 0.1,  1e-3,
                              1e-6, 1e-20, 1e-30, 1e3, 1e6, 1e20, 1e30, 2e38};
// ALiBi slope magnitudes (0: BLOOM's geometric 2^(-8 h / H)) and sink magnitudes (values are
// normal(0, 1) * magnitude, |normal| <= 3.5: at most 2.1e38, inside the accepted range).
const float kSlopeMags[8] = {0.0f, -1.0f, 0.01f, 0.1f, 1.0f, 10.0f, 1e3f, 1e30f};  // -1: all 0
const float kSinkMags[8] = {1.0f, 0.0f, 10.0f, 100.0f, 1e4f, 1e30f, 6e37f, 1e-3f};
const int64_t kBadWindows[4] = {-2, -3, -1000, std::numeric_limits<int64_t>::min()};
// <= 0, non-finite, or outside float32's normal range [FLT_MIN, FLT_MAX / log2(e)].
const double kBadSoftcaps[12] = {0.0, -0.0, -1.0, NAN, std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::infinity(), 1e-39, 1e-300, 2.4e38,
                                 1e300, 5e-324, -1e-30};
// Non-finite slopes / sinks, or finite ones whose base-2 form overflows float32.
const float kBadHeadValues[4] = {NAN, kInf, -kInf, 3e38f};

enum Invalid {
  kEmbedMismatch, kValueLengthMismatch, kRankMismatch, kLeadMismatch, kGqaNotDivisible,
  kKvHeadsDiffer, kEmpty, kBadRank, kBadDropout, kMaskNoBroadcast, kMaskWithCausal,
  kBadScale, kUndefined, kBadWindow, kBadSoftcap, kBadSlopes, kBadSinks, kNumInvalid
};

// ---- problem ------------------------------------------------------------------------------------

struct Problem {
  bool invalid = false;
  int invalid_kind = 0;
  int invalid_arg = 0;
  int rank = 2;
  int64_t B = 1, Hq = 1, Hkv = 1, group = 1, L = 1, S = 1, E = 1, Ev = 1;
  int mask_mode = 0;  // 0 none, 1 causal, 2 boolean, 3 additive
  bool bottom_right = false;
  int mask_rank = 2;
  uint8_t mask_full_bits = 0xff;
  int mask_layout = 0;
  float mask_density = 0;
  std::optional<double> scale;
  float dropout_p = 0;
  bool torch_rng = false;
  uint64_t dropout_seed = 0;
  uint32_t dropout_offset = 0;
  bool need_weights = false, need_lse = false, enable_gqa = false;
  int threads = 1;
  int kernel = 0;  // index into kKernels
  int layout[3] = {0, 0, 0};
  uint64_t value_seed = 0;
  float mag[4] = {1, 1, 1, 1};
  // Variants (0 bytes: none).
  WindowSize window;
  std::optional<double> softcap;
  int alibi = 0;           // 0 none, 1 slopes (H), 2 slopes (B, H) (4-D inputs; else (H))
  float alibi_mag = 0;     // kSlopeMags
  bool alibi_signed = false;
  int alibi_layout = 0;    // of (B, H) slopes, as make_operand's
  bool sinks = false;
  float sink_mag = 0;
};

// Byte layout (every read past the end gives 0):
//   0 mode (mode % 8 == 7: invalid)   1 invalid kind   2 invalid argument
//   3 rank   4 B   5 Hkv   6 group   7 gqa flag   8 L   9 S   10 E   11 Ev
//   12 mask mode   13 flags (1 bottom-right, 2 need_weights, 4 need_lse, 8 two threads)
//   14 mask rank   15 mask full/broadcast bits   16 mask layout   17 mask density
//   18 scale   19 dropout   20 torch rng   21-28 dropout seed   29-32 dropout offset
//   33 kernel   34-36 layouts of q, k, v   37-44 value seed   45-48 magnitudes of q, k, v, mask
//   49 window left, 50 window right (0: -1, else kWindows[(x - 1) % 12])
//   51 softcap (0: none, else kSoftcaps[(x - 1) % 16])
//   52 ALiBi (0: none; bit 0 (B, H) slopes, bits 1-3 magnitude, bit 4 random signs, bits 5-7
//      layout)   53 sinks (0: none, else kSinkMags[(x - 1) % 8])
//   then pokes of 4 bytes: tensor (q, k, v, mask), element index (u16), special value.
Problem decode(ByteReader& in) {
  Problem p;
  p.invalid = (in.u8() & 7) == 7;
  p.invalid_kind = in.pick(kNumInvalid);
  p.invalid_arg = in.u8();
  p.rank = 2 + in.pick(3);
  p.B = 1 + in.pick(2);
  p.Hkv = 1 + in.pick(2);
  p.group = 1 + in.pick(3);
  const bool gqa_flag = in.flag();
  p.L = 1 + in.pick(40);
  p.S = 1 + in.pick(40);
  p.E = 1 + in.pick(40);
  p.Ev = 1 + in.pick(40);
  if (p.rank == 2) p.Hkv = 1, p.group = 1;
  if (p.rank <= 3) p.B = 1;
  p.Hq = p.Hkv * p.group;
  p.enable_gqa = p.group > 1 || gqa_flag;
  p.mask_mode = in.pick(4);
  const uint8_t flags = in.u8();
  p.bottom_right = flags & 1;
  p.need_weights = flags & 2;
  p.need_lse = flags & 4;
  p.threads = (flags & 8) ? 2 : 1;
  p.mask_rank = 1 + in.pick(p.rank);
  p.mask_full_bits = in.u8();
  p.mask_layout = in.pick(3);
  p.mask_density = in.u8() / 255.0f;
  const uint8_t sc = in.u8();
  if (sc >= 208) {
    p.scale = kScales[sc % 16];
  } else if (sc >= 160) {
    p.scale = (static_cast<int>(sc) - 184) / 8.0;
  }
  const uint8_t dp = in.u8();
  if (dp >= 176) p.dropout_p = kDropouts[dp % 8];
  p.torch_rng = in.u8() >= 224;
  p.dropout_seed = in.u64();
  p.dropout_offset = in.u32();
  p.kernel = in.pick(3);
  for (int& l : p.layout) l = in.pick(7);
  p.value_seed = in.u64();
  for (float& m : p.mag) m = kMagnitudes[in.u8() % 8];
  const uint8_t wl = in.u8(), wr = in.u8();
  p.window.left = wl == 0 ? -1 : kWindows[(wl - 1) % 12];
  p.window.right = wr == 0 ? -1 : kWindows[(wr - 1) % 12];
  if (const uint8_t c = in.u8(); c != 0) p.softcap = kSoftcaps[(c - 1) % 16];
  if (const uint8_t a = in.u8(); a != 0) {
    p.alibi = 1 + (a & 1);
    p.alibi_mag = kSlopeMags[(a >> 1) % 8];
    p.alibi_signed = (a >> 4) & 1;
    p.alibi_layout = (a >> 5) % 7;
  }
  if (const uint8_t k = in.u8(); k != 0) {
    p.sinks = true;
    p.sink_mag = kSinkMags[(k - 1) % 8];
  }
  return p;
}

// ---- operands -----------------------------------------------------------------------------------

struct Operand {
  TensorView view;
  std::vector<int64_t> offsets;  // of every logical element, row-major
};

// A view of logical shape `shape` in one of several layouts over NaN-filled storage, with its
// logical elements filled by `fill(k)`.
template <typename Fill>
Operand make_operand(const Shape& shape, int layout, std::deque<Tensor>& owned, Fill&& fill) {
  const int n = shape.ndim();
  bool empty = false;
  for (int64_t d : shape) empty = empty || d <= 0;
  if (n < 2 || empty) layout = 0;
  if (layout == 2 && n < 3) layout = 1;
  if (layout == 5 && n < 3) layout = 3;
  if (layout == 6 && n == kMaxDims) layout = 4;
  Shape st = shape;
  switch (layout) {
    case 1: std::swap(st[n - 1], st[n - 2]); break;
    case 2: std::swap(st[n - 2], st[n - 3]); break;
    case 3: st[n - 1] += 3; break;
    case 4: st[n - 2] += 2; break;
    case 5: st[n - 3] = 1; break;
    case 6: {
      Shape s;
      s.push_back(3);
      for (int64_t d : shape) s.push_back(d);
      st = s;
      break;
    }
    default: break;
  }
  owned.push_back(Tensor::full(st, NAN));
  const Tensor& t = owned.back();
  TensorView v = t;
  switch (layout) {
    case 1: v = t.transpose(-1, -2); break;
    case 2: v = t.transpose(-2, -3); break;
    case 3: v = t.slice(-1, 1, 1 + shape[n - 1]); break;
    case 4: v = t.slice(-2, 2, 2 + shape[n - 2]); break;
    case 5: v = t.expand(shape); break;
    case 6: v = t.select(0, 1); break;
    default: break;
  }
  Operand op{v, {}};
  for_each_offset(v, [&](int64_t off) { op.offsets.push_back(off); });
  for (size_t k = 0; k < op.offsets.size(); ++k) v.data()[op.offsets[k]] = fill(k);
  return op;
}

// ---- comparisons --------------------------------------------------------------------------------

using attn::fuzz::same_bits;  // fuzz_sdpa_backward.hpp

bool same_result(const SdpaResult& a, const SdpaResult& b) {
  return same_bits(a.output, b.output) && same_bits(a.attn_weights, b.attn_weights) && same_bits(a.lse, b.lse);
}

// |x - t|, 0 when equal (also equal infinities), inf when only one is finite. NaN: not here.
double err(double x, double t) {
  if (x == t) return 0.0;
  if (!std::isfinite(x) || !std::isfinite(t)) return std::numeric_limits<double>::infinity();
  return std::fabs(x - t);
}

// The bf16 backward of a kernel (the native vdpbf16ps one where it runs) with dO = the output
// (the gradient of |O|^2 / 2): nothing throws, bf16 gradients of the inputs' shapes, 1 and 2
// threads agree bit for bit, and where the problem is moderate each gradient's error against
// the float64 truth is at most twice the widened reference's (rounded to bf16) plus a floor of
// 4 bf16 units of (1 + the gradient's largest magnitude), dQ and dK also a few float32 units of
// dS's cancelling terms (below). The forward saves output_residual (as
// training does; the decode kernels decline it), and the backward runs with it and without it.
// Then all of it again under allow_fp16_bf16_reduction (FlashAttention's numerics; the forward
// forms its residual from one-term P): the same checks, but only a gross bound, 8x the
// reference's error plus the floor (that mode's own rule, against a bf16 math reference, is
// tests/sdpa/test_reduced_precision.cpp's).
// An additive mask's gradient rides along on every one of these backwards, the mask given in
// float32 or, with bf16_mask, rounded to bf16 (the query's dtype, as PyTorch's users give it; the
// native kernel then rounds each dS as it writes it): the mask's dtype and shape, 1 and 2 threads
// bit for bit, and on moderate problems each element x within twice the reference's largest error
// (rounded to the mask's dtype) plus 4 bf16 units of |truth_x| (bf16 masks) plus
// 2 (eps + 2^-14) T_x, T_x the first-order bound of fuzz_sdpa_backward.hpp (the sum over the
// scores x collects of 2 P_ij |dO_i|_1 vmax inv_keep): 2^-14 because D = rowsum(dO * (O +
// residual)) carries the float32 output to 16 significant bits only (2^-7 under
// allow_fp16_bf16_reduction, whose residual is that of a one-term P, with the gross factor 8).
// A planted 5 % error in the largest element of a bf16 mask's gradient is caught (1 % is under
// the 4 units), 1 % in a float32 mask's.
void check_bf16_backward(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& ko,
                         bool moderate, bool bf16_mask, double delta, const std::string& desc) {
  auto must_not_throw = [&](const char* what, auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      attn::fuzz::fuzz_fail("%s threw on valid arguments: %s\n  problem: %s", what, e.what(), desc.c_str());
    }
  };
  const bool additive = ko.attn_mask && ko.attn_mask->kind == AttnMask::Kind::kAdditive && ko.attn_mask->values.defined();
  Tensor mask16, mask16f;  // the bf16 mask, and its values in float32 for the reference and the truth
  SdpaOptions bo = ko;
  if (additive && bf16_mask) {
    mask16 = ko.attn_mask->values.to(DType::kBFloat16);
    mask16f = mask16.to(DType::kFloat32);
    bo.attn_mask = AttnMask::additive(mask16);
  }
  const DType mask_dtype = !additive ? DType::kFloat32 : bf16_mask ? DType::kBFloat16 : ko.attn_mask->values.dtype();
  bo.need_attn_mask_grad = additive;
  bo.need_lse = true;
  bo.need_output_residual = !ko.kernel.starts_with("cpu.decode.");
  SdpaResult f;
  must_not_throw("16-bit forward for the backward", [&] { f = scaled_dot_product_attention(q, k, v, bo); });
  ATTN_FUZZ_CHECKF(f.output_residual.defined() == bo.need_output_residual, "'%s': output_residual %s; %s",
                   ko.kernel.c_str(), f.output_residual.defined() ? "unasked" : "missing", desc.c_str());
  const Tensor& dout = f.output;
  const SdpaSaved without(f.output, f.lse, f.attn_weights);
  SdpaGrads g1, g2, g0;
  bo.num_threads = 1;
  must_not_throw("bf16 backward", [&] { g1 = scaled_dot_product_attention_backward(dout, q, k, v, f, bo); });
  must_not_throw("bf16 backward without output_residual", [&] { g0 = scaled_dot_product_attention_backward(dout, q, k, v, without, bo); });
  bo.num_threads = 2;
  must_not_throw("bf16 backward (2 threads)", [&] { g2 = scaled_dot_product_attention_backward(dout, q, k, v, f, bo); });
  SdpaOptions red = bo;
  red.allow_fp16_bf16_reduction = true;
  SdpaResult fr;
  must_not_throw("16-bit forward with allow_fp16_bf16_reduction", [&] { fr = scaled_dot_product_attention(q, k, v, red); });
  ATTN_FUZZ_CHECKF(fr.output_residual.defined() == red.need_output_residual,
                   "'%s' with allow_fp16_bf16_reduction: output_residual %s; %s", ko.kernel.c_str(),
                   fr.output_residual.defined() ? "unasked" : "missing", desc.c_str());
  const SdpaSaved red_without(fr.output, fr.lse, fr.attn_weights);
  SdpaGrads gr1, gr2, gr0;
  for (int threads : {1, 2}) {
    red.num_threads = threads;
    must_not_throw("bf16 backward with allow_fp16_bf16_reduction",
                   [&] { (threads == 1 ? gr1 : gr2) = scaled_dot_product_attention_backward(dout, q, k, v, fr, red); });
  }
  must_not_throw("bf16 backward with allow_fp16_bf16_reduction, without output_residual",
                 [&] { gr0 = scaled_dot_product_attention_backward(dout, q, k, v, red_without, red); });
  ATTN_FUZZ_CHECKF(gr1.grad_query.dtype() == DType::kBFloat16 && gr1.grad_key.shape() == k.shape() &&
                       same_bits(gr1.grad_query, gr2.grad_query) && same_bits(gr1.grad_key, gr2.grad_key) &&
                       same_bits(gr1.grad_value, gr2.grad_value),
                   "bf16 backward '%s' with allow_fp16_bf16_reduction: dtype/shape, or differs between 1 and 2 "
                   "threads; %s", ko.kernel.c_str(), desc.c_str());
  const std::pair<const Tensor*, const Tensor*> pairs[] = {{&g1.grad_query, &q}, {&g1.grad_key, &k}, {&g1.grad_value, &v}};
  for (const auto& [g, in] : pairs) {
    ATTN_FUZZ_CHECKF(g->dtype() == DType::kBFloat16 && g->shape() == in->shape(), "bf16 backward '%s': gradient dtype/shape; %s",
                     ko.kernel.c_str(), desc.c_str());
  }
  ATTN_FUZZ_CHECKF(same_bits(g1.grad_query, g2.grad_query) && same_bits(g1.grad_key, g2.grad_key) &&
                       same_bits(g1.grad_value, g2.grad_value),
                   "bf16 backward '%s' differs between 1 and 2 threads; %s", ko.kernel.c_str(), desc.c_str());
  for (const SdpaGrads* g : {&g1, &g0, &gr1, &gr0}) {
    const Tensor& m = g->grad_attn_mask;
    ATTN_FUZZ_CHECKF(m.defined() == additive && (!additive || (m.dtype() == mask_dtype && m.shape() == bo.attn_mask->values.shape())),
                     "bf16 backward '%s': grad_attn_mask %s; %s", ko.kernel.c_str(),
                     !m.defined() ? (additive ? "missing" : "none asked") : "dtype/shape", desc.c_str());
  }
  ATTN_FUZZ_CHECKF(same_bits(g1.grad_attn_mask, g2.grad_attn_mask) && same_bits(gr1.grad_attn_mask, gr2.grad_attn_mask),
                   "bf16 backward '%s': grad_attn_mask differs between 1 and 2 threads; %s", ko.kernel.c_str(),
                   desc.c_str());
  if (!moderate) return;
  for (const Tensor* t : {&g1.grad_query, &g1.grad_key, &g1.grad_value, &g0.grad_query, &g0.grad_key, &g0.grad_value,
                          &gr1.grad_query, &gr1.grad_key, &gr1.grad_value, &gr0.grad_query, &gr0.grad_key,
                          &gr0.grad_value}) {
    for (float x : t->to_vector()) if (!std::isfinite(x)) return;  // overflow of a moderate problem's gradient
  }
  SdpaOptions ro = bo;
  if (mask16f.defined()) ro.attn_mask = AttnMask::additive(mask16f);
  ro.kernel = "reference";
  ro.need_output_residual = false;
  ro.num_threads = 0;
  const Tensor d32 = dout.to(DType::kFloat32), q32 = q.to(DType::kFloat32), k32 = k.to(DType::kFloat32),
               v32 = v.to(DType::kFloat32);
  reference::SdpaGradsF64 truth;
  SdpaGrads rg;
  must_not_throw("f64 backward truth", [&] { truth = reference::scaled_dot_product_attention_backward_f64(d32, q32, k32, v32, ro); });
  must_not_throw("reference backward", [&] {
    const SdpaResult rf = scaled_dot_product_attention(q32, k32, v32, ro);
    rg = scaled_dot_product_attention_backward(d32, q32, k32, v32, rf, ro);
  });
  const std::tuple<const Tensor*, const Tensor*, const std::vector<double>*, const char*, double> sets[] = {
      {&g1.grad_query, &rg.grad_query, &truth.grad_query, "dq", 2.0},
      {&g1.grad_key, &rg.grad_key, &truth.grad_key, "dk", 2.0},
      {&g1.grad_value, &rg.grad_value, &truth.grad_value, "dv", 2.0},
      {&g0.grad_query, &rg.grad_query, &truth.grad_query, "dq (no output_residual)", 2.0},
      {&g0.grad_key, &rg.grad_key, &truth.grad_key, "dk (no output_residual)", 2.0},
      {&g0.grad_value, &rg.grad_value, &truth.grad_value, "dv (no output_residual)", 2.0},
      {&gr1.grad_query, &rg.grad_query, &truth.grad_query, "dq (allow_fp16_bf16_reduction)", 8.0},
      {&gr1.grad_key, &rg.grad_key, &truth.grad_key, "dk (allow_fp16_bf16_reduction)", 8.0},
      {&gr1.grad_value, &rg.grad_value, &truth.grad_value, "dv (allow_fp16_bf16_reduction)", 8.0},
      {&gr0.grad_query, &rg.grad_query, &truth.grad_query, "dq (allow_fp16_bf16_reduction, no output_residual)", 8.0},
      {&gr0.grad_key, &rg.grad_key, &truth.grad_key, "dk (allow_fp16_bf16_reduction, no output_residual)", 8.0},
      {&gr0.grad_value, &rg.grad_value, &truth.grad_value, "dv (allow_fp16_bf16_reduction, no output_residual)", 8.0}};
  // dQ and dK hold dS = P (dP - D), a difference of two float32 sums of Ev products each: where
  // they cancel (a key with P = 1, so D = dP exactly), the float32 reference may get an exact 0
  // by adding in the same order, while a kernel that forms dP on the bf16 dot unit and D from the
  // forward's output rounds them differently, a few float32 units of the products' magnitude
  // apart (found by this target: S 1, |v| ~ 200, dK 0.023 against a true 0). So dQ and dK are
  // also allowed a few float32 units of that magnitude, carried through their products:
  // |dO_i| |v|max per row (D's terms are bounded alike, |o| <= |v|max), times |scale|, times |k|max
  // (dQ: the row's P sums to 1) or |q|max and the query rows sharing a kv head (dK).
  const auto absmax = [](const Tensor& x) {
    double m = 0;
    for (float y : x.to_vector()) m = std::max(m, static_cast<double>(std::fabs(y)));
    return m;
  };
  const int64_t E = q.shape()[q.dim() - 1], Ev = v.shape()[v.dim() - 1];
  double do_row = 0;  // the largest sum_e |dO_ie| over the rows
  {
    const std::vector<float> d = dout.to_vector();
    for (size_t r0 = 0; r0 < d.size(); r0 += static_cast<size_t>(Ev)) {
      double sum = 0;
      for (int64_t e = 0; e < Ev; ++e) sum += std::fabs(d[r0 + static_cast<size_t>(e)]);
      do_row = std::max(do_row, sum);
    }
  }
  const double scale_abs = ko.scale ? std::fabs(*ko.scale) : 1.0 / std::sqrt(static_cast<double>(E));
  const int64_t S = k.shape()[k.dim() - 2];
  const double rows_per_kv = std::max<double>(1.0, static_cast<double>(q.numel() / E) / static_cast<double>(k.numel() / (S * E)));
  const double ds_units = 4 * 0x1p-24 * do_row * absmax(v) * scale_abs;
  const double cancel_dq = ds_units * absmax(k), cancel_dk = ds_units * absmax(q) * rows_per_kv;
  if (additive && delta <= 1.0) {
    // Per element x of the mask, the first-order bound of its float32 terms that the float32 check
    // uses (mask_grad_bound): T_x = sum over the scores it collects of 2 P_ij |dO_i|_1 vmax
    // inv_keep (|dS_ij| <= that), P the float64 truth's without dropout.
    SdpaOptions po = ro;
    po.dropout_p = 0.0f;
    po.need_weights = true;
    po.need_attn_mask_grad = false;
    reference::SdpaResultF64 plain;
    must_not_throw("f64 forward truth (no dropout)", [&] { plain = reference::scaled_dot_product_attention_f64(q32, k32, v32, po); });
    const float dp = ko.dropout_p;
    const double inv_keep = dp > 0.0f && dp < 1.0f ? 1.0 / (1.0 - static_cast<double>(dp)) : 1.0;
    const attn::fuzz::MaskGradBound mb = attn::fuzz::mask_grad_bound(
        plain.attn_weights, dout.to_vector(), Ev, absmax(v), inv_keep, q.shape(), S, bo.attn_mask->values.shape());
    const std::vector<double>& bound = mb.bound;
    const double terms = mb.terms;
    const std::vector<double>& t = truth.grad_attn_mask;
    const std::vector<float> r = rg.grad_attn_mask.to(mask_dtype).to_vector();
    const double u = 0x1p-24, eps = 2 * std::expm1(4 * delta) + static_cast<double>(Ev + 16) * u + (terms + 8) * u;
    const double mask_ulp = mask_dtype == DType::kBFloat16 ? 0x1p-8 : 0.0;
    const std::tuple<const Tensor*, const char*, double, double> masks[] = {
        {&g1.grad_attn_mask, "d(mask)", 2.0, 0x1p-14},
        {&g0.grad_attn_mask, "d(mask) (no output_residual)", 2.0, 0x1p-14},
        {&gr1.grad_attn_mask, "d(mask) (allow_fp16_bf16_reduction)", 8.0, 0x1p-7},
        {&gr0.grad_attn_mask, "d(mask) (allow_fp16_bf16_reduction, no output_residual)", 8.0, 0x1p-7}};
    bool finite = r.size() == t.size();
    double er = 0;
    for (size_t x = 0; finite && x < t.size(); ++x) {
      finite = std::isfinite(t[x]);
      er = std::max(er, err(r[x], t[x]));
    }
    for (const auto& [got, what, factor, d_rel] : masks) {
      if (!finite) break;
      const std::vector<float> a = got->to_vector();
      ATTN_FUZZ_CHECKF(a.size() == t.size(), "bf16 backward '%s' %s: %zu elements, truth %zu; %s", ko.kernel.c_str(),
                       what, a.size(), t.size(), desc.c_str());
      for (size_t x = 0; x < t.size(); ++x) {
        const double e = err(a[x], t[x]);
        const double tol = factor * er + 4 * mask_ulp * std::fabs(t[x]) + 2 * (eps + d_rel) * bound[x] + 1e-36;
        if (!(e <= tol)) {
          attn::fuzz::fuzz_fail("bf16 backward '%s' %s (%s mask): element %zu is %.9g, truth %.9g (error %.3g > %g * "
                                "reference error %.3g + %.3g)\n  problem: %s", ko.kernel.c_str(), what,
                                std::string(dtype_name(mask_dtype)).c_str(), x, static_cast<double>(a[x]), t[x], e,
                                factor, er, tol, desc.c_str());
        }
      }
    }
  }
  for (const auto& [got, ref, t, what, factor] : sets) {
    const std::vector<float> a = got->to_vector(), r = ref->to(DType::kBFloat16).to_vector();
    double e = 0, er = 0, gmax = 0;
    for (size_t i = 0; i < t->size(); ++i) {
      if (!std::isfinite((*t)[i])) return;
      e = std::max(e, err(a[i], (*t)[i]));
      er = std::max(er, err(r[i], (*t)[i]));
      gmax = std::max(gmax, std::fabs((*t)[i]));
    }
    const double cancel = got == &g1.grad_query || got == &g0.grad_query || got == &gr1.grad_query || got == &gr0.grad_query
                              ? cancel_dq
                              : got == &g1.grad_key || got == &g0.grad_key || got == &gr1.grad_key || got == &gr0.grad_key
                                    ? cancel_dk
                                    : 0.0;
    const double floor = 4 * 0x1p-8 * (1 + gmax) + cancel;
    if (!(e <= factor * er + floor)) {
      attn::fuzz::fuzz_fail("bf16 backward '%s' %s: error %.3g > %g * reference error %.3g + %.3g\n  problem: %s",
                            ko.kernel.c_str(), what, e, factor, er, floor, desc.c_str());
    }
  }
}

std::string describe(const Problem& p) {
  char buf[768];
  std::snprintf(buf, sizeof buf,
                "rank %d B %lld Hq %lld Hkv %lld L %lld S %lld E %lld Ev %lld gqa %d mask_mode %d br %d "
                "mask_rank %d scale %s%g dropout %g torch %d weights %d lse %d threads %d kernel '%s' "
                "layouts %d %d %d window (%lld, %lld) softcap %g alibi %d (mag %g signed %d layout %d) "
                "sinks %d (mag %g)",
                p.rank, (long long)p.B, (long long)p.Hq, (long long)p.Hkv, (long long)p.L, (long long)p.S,
                (long long)p.E, (long long)p.Ev, p.enable_gqa, p.mask_mode, p.bottom_right, p.mask_rank,
                p.scale ? "" : "default ", p.scale ? *p.scale : 0.0, p.dropout_p, p.torch_rng,
                p.need_weights, p.need_lse, p.threads, runnable_kernel(p.kernel), p.layout[0], p.layout[1], p.layout[2],
                (long long)p.window.left, (long long)p.window.right, p.softcap ? *p.softcap : 0.0, p.alibi,
                p.alibi_mag, p.alibi_signed, p.alibi_layout, p.sinks, p.sink_mag);
  return buf;
}

#define CHECK_ROW(cond, what)                                                                       \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      dump_row(b, i);                                                                               \
      attn::fuzz::fuzz_fail("%s:%d: %s (row b=%lld i=%lld): '%s' failed\n  problem: %s", __FILE__,   \
                            __LINE__, what, (long long)b, (long long)i, #cond, desc.c_str());        \
    }                                                                                               \
  } while (0)

void run(ByteReader& in) {
  Problem p = decode(in);
  std::deque<Tensor> owned;
  SplitMix rng(p.value_seed);

  // Shapes, possibly made invalid.
  int q_rank = p.rank, k_rank = p.rank, v_rank = p.rank;
  int64_t qB = p.B, kB = p.B, vB = p.B, qH = p.Hq, kH = p.Hkv, vH = p.Hkv;
  int64_t qL = p.L, kS = p.S, vS = p.S, qE = p.E, kE = p.E, vEv = p.Ev;
  bool mask_with_causal = false, undefined_mask = false;
  int undefined_operand = -1;
  int mask_bad_dim = 0;  // 1: last dim S + 1, 2: dim -2 L + 1
  std::optional<double> scale = p.scale;
  float dropout_p = p.dropout_p;
  WindowSize window = p.window;
  std::optional<double> softcap = p.softcap;
  int bad_slopes = -1, bad_sinks = -1;  // how the slopes / sinks are made invalid (head_param)
  if (p.invalid) {
    const int a = p.invalid_arg;
    switch (p.invalid_kind) {
      case kEmbedMismatch: kE = p.E + 1 + a % 3; break;
      case kValueLengthMismatch: vS = p.S + 1 + a % 3; break;
      case kRankMismatch:
        if (a & 1) {
          k_rank = p.rank == 2 ? 3 : p.rank - 1;
        } else {
          v_rank = p.rank == 4 ? 3 : p.rank + 1;
        }
        break;
      case kLeadMismatch:
        if (p.rank == 4 && (a & 1)) {
          kB = vB = p.B + 1;
        } else if (p.rank >= 3) {
          kH = vH = qH + 1;  // not a divisor of Hq either
        } else {
          kE = p.E + 1;
        }
        break;
      case kGqaNotDivisible:
        if (p.rank >= 3) {
          qH = 3, kH = vH = 2;
          p.enable_gqa = true;
        } else {
          vS = p.S + 1;
        }
        break;
      case kKvHeadsDiffer:
        if (p.rank >= 3) {
          vH = kH + 1;
        } else {
          kE = p.E + 1;
        }
        break;
      case kEmpty:
        switch (a % 5) {
          case 0: qL = 0; break;
          case 1: kS = vS = 0; break;
          case 2: qE = kE = 0; break;
          case 3: vEv = 0; break;
          default:
            if (p.rank == 4) {
              qB = kB = vB = 0;
            } else {
              qL = 0;
            }
            break;
        }
        break;
      case kBadRank: {
        const int which = a % 3;
        (which == 0 ? q_rank : which == 1 ? k_rank : v_rank) = (a & 4) ? 0 : 1;
        break;
      }
      case kBadDropout: dropout_p = kBadDropouts[a % 6]; break;
      case kMaskNoBroadcast:
        if (p.mask_mode < 2) p.mask_mode = 2 + (a & 1);
        mask_bad_dim = 1 + ((a >> 1) & 1);
        break;
      case kMaskWithCausal:
        if (p.mask_mode < 2) p.mask_mode = 2 + (a & 1);
        mask_with_causal = true;
        break;
      case kBadScale: scale = kBadScales[a % 6]; break;
      case kBadWindow: ((a & 1) ? window.left : window.right) = kBadWindows[(a >> 1) % 4]; break;
      case kBadSoftcap: softcap = kBadSoftcaps[a % 12]; break;
      case kBadSlopes:
        bad_slopes = a % 7;
        if (p.alibi == 0) p.alibi = 1;
        break;
      case kBadSinks:
        bad_sinks = a % 7;
        p.sinks = true;
        break;
      default:  // kUndefined
        if (a % 4 == 3) {
          if (p.mask_mode < 2) p.mask_mode = 2 + (a & 1);
          undefined_mask = true;
        } else {
          undefined_operand = a % 4;
        }
        break;
    }
  }

  auto shape_for = [&](int rank, int64_t b, int64_t h, int64_t rows, int64_t cols) {
    Shape s;
    if (rank >= 4) s.push_back(b);
    if (rank >= 3) s.push_back(h);
    if (rank >= 2) s.push_back(rows);
    s.push_back(cols);
    return rank == 0 ? Shape{} : s;
  };
  const Shape q_shape = shape_for(q_rank, qB, qH, qL, qE);
  const Shape k_shape = shape_for(k_rank, kB, kH, kS, kE);
  const Shape v_shape = shape_for(v_rank, vB, vH, vS, vEv);
  auto gen_value = [&](int t) { return [&rng, &p, t](size_t) { return rng.normal() * p.mag[t]; }; };
  Operand q = make_operand(q_shape, p.layout[0], owned, gen_value(0));
  Operand k = make_operand(k_shape, p.layout[1], owned, gen_value(1));
  Operand v = make_operand(v_shape, p.layout[2], owned, gen_value(2));

  // The mask: the last mask_rank dims of lead + (L, S), each either full or 1.
  Operand mask;
  const bool is_bool = p.mask_mode == 2, is_add = p.mask_mode == 3;
  if (is_bool || is_add) {
    Shape target;
    if (q_rank >= 4) target.push_back(qB);
    if (q_rank >= 3) target.push_back(qH);
    target.push_back(qL);
    target.push_back(kS);
    const int mr = std::min(p.mask_rank, target.ndim());
    Shape ms;
    for (int i = target.ndim() - mr; i < target.ndim(); ++i) {
      const bool full = (p.mask_full_bits >> i) & 1;
      ms.push_back(full ? target[i] : 1);
    }
    if (mask_bad_dim == 1) ms[ms.ndim() - 1] = kS + 1;
    if (mask_bad_dim == 2) {
      if (ms.ndim() >= 2) {
        ms[ms.ndim() - 2] = qL + 1;
      } else {
        ms[0] = kS + 2;
      }
    }
    const float density = p.mask_density;
    const float mag = p.mag[3];
    mask = make_operand(ms, p.mask_layout == 2 ? 3 : p.mask_layout, owned, [&](size_t) {
      const bool masked = rng.uniform() < density;
      if (is_bool) return masked ? 0.0f : 1.0f;
      return masked ? -kInf : rng.normal() * mag;
    });
  }

  // ALiBi slopes and sinks: per query head (slopes (B, H) per batch too), or made invalid by
  // `bad`: 0 one head too many, 1 (B, H) where it is not allowed (sinks; slopes of 2-D and 3-D
  // inputs) or B + 1 rows, 2 (1, H, 1), 3 float64, 4 bfloat16, 5 a non-finite or too large
  // value, 6 undefined.
  auto head_param = [&](bool per_batch, int bad, bool is_sinks, int layout, auto&& value) -> TensorView {
    Shape shape = per_batch ? Shape{p.B, p.Hq} : Shape{p.Hq};
    if (bad == 0) shape[shape.ndim() - 1] += 1;
    if (bad == 1) shape = is_sinks ? Shape{p.B, p.Hq} : q_rank == 4 ? Shape{p.B + 1, p.Hq} : Shape{1, p.Hq};
    if (bad == 2) shape = Shape{1, p.Hq, 1};
    Operand op = make_operand(shape, shape.ndim() == 2 ? layout : 0, owned, value);
    TensorView t = op.view;
    if (bad == 3 || bad == 4) {
      owned.push_back(t.to(bad == 3 ? DType::kFloat64 : DType::kBFloat16));
      t = owned.back();
    }
    if (bad == 5) t.data()[op.offsets[p.invalid_arg % op.offsets.size()]] = kBadHeadValues[(p.invalid_arg >> 3) % 4];
    if (bad == 6) t = TensorView();
    return t;
  };
  TensorView slopes, sinks;
  if (p.alibi != 0) {
    slopes = head_param(p.alibi == 2 && q_rank == 4, bad_slopes, false, p.alibi_layout, [&](size_t k) {
      if (p.alibi_mag == 0.0f) {  // BLOOM's geometric slopes
        const float h = static_cast<float>(static_cast<int64_t>(k) % p.Hq + 1);
        return std::exp2(-8.0f * h / static_cast<float>(p.Hq));
      }
      if (p.alibi_mag < 0.0f) return 0.0f;
      const float x = p.alibi_mag * (0.25f + rng.uniform());
      return p.alibi_signed && rng.uniform() < 0.5f ? -x : x;
    });
  }
  if (p.sinks) {
    sinks = head_param(false, bad_sinks, true, 0, [&](size_t) { return rng.normal() * p.sink_mag; });
  }

  // Pokes: special values at chosen logical elements.
  while (in.remaining() >= 4) {
    const int t = in.pick(4);
    const uint16_t idx = in.u16();
    const float val = kSpecials[in.u8() % 16];
    Operand* op = t == 0 ? &q : t == 1 ? &k : t == 2 ? &v : &mask;
    if (op->offsets.empty()) continue;
    op->view.data()[op->offsets[idx % op->offsets.size()]] = val;
  }

  SdpaOptions o;
  if (is_bool) o.attn_mask = AttnMask::boolean(undefined_mask ? TensorView() : mask.view);
  if (is_add) o.attn_mask = AttnMask::additive(undefined_mask ? TensorView() : mask.view);
  o.is_causal = p.mask_mode == 1 || mask_with_causal;
  o.causal_alignment = p.bottom_right ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
  o.scale = scale;
  o.enable_gqa = p.enable_gqa;
  o.need_weights = p.need_weights;
  o.need_lse = p.need_lse;
  o.dropout_p = dropout_p;
  o.dropout_rng = p.torch_rng ? DropoutRng::kTorch : DropoutRng::kPhilox;
  o.dropout_seed = p.dropout_seed;
  o.dropout_offset = p.dropout_offset;
  o.num_threads = p.threads;
  o.window_size = window;
  o.softcap = softcap;
  if (p.alibi != 0) o.alibi_slopes = slopes;
  if (p.sinks) o.sinks = sinks;

  const TensorView qv = undefined_operand == 0 ? TensorView() : q.view;
  const TensorView kv = undefined_operand == 1 ? TensorView() : k.view;
  const TensorView vv = undefined_operand == 2 ? TensorView() : v.view;
  const std::string desc = describe(p);

  auto call = [&](SdpaBackend backend, uint64_t gen_seed, SdpaResult* out, int threads = 0) {
    SdpaOptions oo = o;
    oo.backend = backend;
    // The forced build serves kAuto too (so that kAuto and kFused must agree bit for bit),
    // except where kAuto must fall back to the reference (torch-stream dropout).
    const bool torch_stream = o.dropout_p > 0.0f && o.dropout_rng == DropoutRng::kTorch;
    if (backend == SdpaBackend::kFused || (backend == SdpaBackend::kAuto && !torch_stream)) {
      oo.kernel = runnable_kernel(p.kernel);
    }
    if (threads > 0) oo.num_threads = threads;
    Generator gen(gen_seed);
    oo.generator = &gen;
    SdpaResult r = scaled_dot_product_attention(qv, kv, vv, oo);
    if (out != nullptr) *out = std::move(r);
  };
  const uint64_t gen_seed = p.dropout_seed ^ 0x5eed;

  if (p.invalid) {
    const char* names[3] = {"reference", "fused", "auto"};
    const SdpaBackend backends[3] = {SdpaBackend::kReference, SdpaBackend::kFused, SdpaBackend::kAuto};
    for (int b = 0; b < 3; ++b) {
      const bool threw = throws_attn_error(names[b], [&] { call(backends[b], gen_seed, nullptr); });
      if (!threw) {
        attn::fuzz::fuzz_fail("invalid arguments (kind %d, arg %d) accepted by %s backend\n  problem: %s",
                              p.invalid_kind, p.invalid_arg, names[b], desc.c_str());
      }
    }
    Generator gen(gen_seed);
    SdpaOptions oo = o;
    oo.generator = &gen;
    const bool threw = throws_attn_error("f64", [&] { reference::scaled_dot_product_attention_f64(qv, kv, vv, oo); });
    if (!threw) {
      attn::fuzz::fuzz_fail("invalid arguments (kind %d, arg %d) accepted by the float64 truth\n  problem: %s",
                            p.invalid_kind, p.invalid_arg, desc.c_str());
    }
    return;
  }

  // ---- valid: run everything; nothing may throw ------------------------------------------------
  const bool torch_dropout = o.dropout_p > 0.0f && o.dropout_rng == DropoutRng::kTorch;
  SdpaResult ref, fused, fused_other, autor;
  reference::SdpaResultF64 truth;
  auto must_not_throw = [&](const char* what, auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      attn::fuzz::fuzz_fail("%s threw on valid arguments: %s\n  problem: %s", what, e.what(), desc.c_str());
    }
  };
  must_not_throw("reference", [&] { call(SdpaBackend::kReference, gen_seed, &ref); });
  must_not_throw("f64 truth", [&] {
    Generator gen(gen_seed);
    SdpaOptions oo = o;
    oo.generator = &gen;
    oo.need_lse = true;  // for the messages below
    // The truth multiplies by the scale both float32 backends use: the float32 rounding of a
    // custom scale (5e-324 is 0 there, and inf * 0 is NaN; in float64 it would be -inf).
    if (oo.scale) oo.scale = static_cast<double>(static_cast<float>(*oo.scale));
    truth = reference::scaled_dot_product_attention_f64(qv, kv, vv, oo);
  });
  must_not_throw("auto", [&] { call(SdpaBackend::kAuto, gen_seed, &autor); });
  if (torch_dropout) {
    try {
      call(SdpaBackend::kFused, gen_seed, nullptr);
      attn::fuzz::fuzz_fail("fused accepted torch-stream dropout\n  problem: %s", desc.c_str());
    } catch (const ValueError&) {
    } catch (const std::exception& e) {
      attn::fuzz::fuzz_fail("fused with torch dropout threw the wrong type: %s", e.what());
    }
    ATTN_FUZZ_CHECKF(same_result(autor, ref), "kAuto differs from kReference with torch dropout; %s", desc.c_str());
  } else {
    must_not_throw("fused", [&] { call(SdpaBackend::kFused, gen_seed, &fused); });
    must_not_throw("fused (other thread count)", [&] { call(SdpaBackend::kFused, gen_seed, &fused_other, 3 - p.threads); });
    ATTN_FUZZ_CHECKF(same_result(fused, fused_other), "fused differs between 1 and 2 threads; %s", desc.c_str());
    ATTN_FUZZ_CHECKF(same_result(autor, fused), "kAuto differs from kFused; %s", desc.c_str());
  }

  // ---- shapes ---------------------------------------------------------------------------------
  Shape lead;
  for (int i = 0; i < p.rank - 2; ++i) lead.push_back(q_shape[i]);
  Shape out_shape = lead, w_shape = lead, lse_shape = lead;
  out_shape.push_back(p.L), out_shape.push_back(p.Ev);
  w_shape.push_back(p.L), w_shape.push_back(p.S);
  lse_shape.push_back(p.L);
  std::vector<const SdpaResult*> results = {&ref};
  if (!torch_dropout) results.push_back(&fused);
  for (const SdpaResult* r : results) {
    ATTN_FUZZ_CHECKF(r->output.shape() == out_shape, "output shape %s, expected %s; %s", r->output.shape().str().c_str(),
                     out_shape.str().c_str(), desc.c_str());
    ATTN_FUZZ_CHECK(r->attn_weights.defined() == p.need_weights);
    if (p.need_weights) ATTN_FUZZ_CHECK(r->attn_weights.shape() == w_shape);
    ATTN_FUZZ_CHECK(r->lse.defined() == p.need_lse);
    if (p.need_lse) ATTN_FUZZ_CHECK(r->lse.shape() == lse_shape);
  }
  ATTN_FUZZ_CHECK(truth.output_shape == out_shape);

  // ---- values -----------------------------------------------------------------------------------
  const std::vector<float> qx = q.view.to_vector(), kx = k.view.to_vector(), vx = v.view.to_vector();
  std::vector<float> mx;
  if (o.attn_mask) {
    Shape target = lead;
    target.push_back(p.L);
    target.push_back(p.S);
    mx = mask.view.expand(target).to_vector();
  }
  const int64_t batch = lead.numel();
  const int64_t L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const double scale_eff = o.scale ? std::fabs(*o.scale) : 1.0 / std::sqrt(static_cast<double>(E));
  const double inv_keep = (o.dropout_p > 0.0f && o.dropout_p < 1.0f) ? 1.0 / (1.0 - o.dropout_p) : 1.0;
  const bool philox = o.dropout_p > 0.0f && !torch_dropout;
  const int64_t causal_off = o.is_causal && p.bottom_right ? S - L : 0;
  // Variants: query i sits at i' = i + diag among the keys (window, ALiBi); each batch-head's
  // slope and sink (-inf: none), as the options hold them (float32).
  const int64_t diag = p.bottom_right ? S - L : 0;
  const WindowSize win = o.window_size;
  const double cap = o.softcap.value_or(0.0);
  std::vector<float> slope_of(static_cast<size_t>(batch), 0.0f), sink_of(static_cast<size_t>(batch), -kInf);
  double bias_max = 0, sink_max = 0;
  if (o.alibi_slopes) {
    const std::vector<float> sv = o.alibi_slopes->to_vector();
    for (int64_t b = 0; b < batch; ++b) {
      slope_of[b] = sv[static_cast<size_t>(sv.size() == static_cast<size_t>(p.Hq) ? b % p.Hq : b)];
      bias_max = std::max(bias_max, std::fabs(static_cast<double>(slope_of[b])) * static_cast<double>(L + S));
    }
  }
  if (o.sinks) {
    const std::vector<float> kv = o.sinks->to_vector();
    for (int64_t b = 0; b < batch; ++b) {
      sink_of[b] = kv[static_cast<size_t>(b % p.Hq)];
      sink_max = std::max(sink_max, std::fabs(static_cast<double>(sink_of[b])));
    }
  }

  // The overflow domain.
  double vmax = 0, qmax = 0, mmax = 0;
  for (float x : vx) if (std::isfinite(x)) vmax = std::max(vmax, std::fabs(static_cast<double>(x)));
  for (float x : qx) if (std::isfinite(x)) qmax = std::max(qmax, std::fabs(static_cast<double>(x)));
  if (is_add) for (float x : mx) if (std::isfinite(x)) mmax = std::max(mmax, std::fabs(static_cast<double>(x)));
  // Sum of |q_e k_e| over finite products, per (b, i, j).
  std::vector<double> absdot(static_cast<size_t>(batch * L * S));
  double dotmax = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kb = (b / p.Hq) * p.Hkv + (b % p.Hq) / p.group;
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) {
          const double a = qx[static_cast<size_t>((b * L + i) * E + e)], c = kx[static_cast<size_t>((kb * S + j) * E + e)];
          if (std::isfinite(a) && std::isfinite(c)) s += std::fabs(a * c);
        }
        absdot[static_cast<size_t>((b * L + i) * S + j)] = s;
        dotmax = std::max(dotmax, s);
      }
    }
  }
  // Whether each key row of k and each value row of v is all finite, per (kv head, key).
  const int64_t kv_rows = static_cast<int64_t>(kx.size()) / E;
  std::vector<uint8_t> k_row_finite(static_cast<size_t>(kv_rows), 1), v_row_finite(static_cast<size_t>(kv_rows), 1);
  for (int64_t r = 0; r < kv_rows; ++r) {
    for (int64_t e = 0; e < E; ++e) k_row_finite[r] &= std::isfinite(kx[static_cast<size_t>(r * E + e)]);
    for (int64_t e = 0; e < Ev; ++e) v_row_finite[r] &= std::isfinite(vx[static_cast<size_t>(r * Ev + e)]);
  }
  const double log2e = std::numbers::log2e;
  // The fused kernel pre-scales q by float(scale * log2(e)); with a tiny custom scale a tiny
  // nonzero q_e can underflow to 0 there, and 0 * Inf (an infinite key) is NaN where the
  // reference has +-Inf. Such problems (tiny scale, tiny q, non-finite k) join the overflow domain.
  bool prescale_underflow = false;
  if (o.scale) {
    const float sl = static_cast<float>(*o.scale * log2e);
    for (float x : qx) prescale_underflow = prescale_underflow || (x != 0.0f && std::isfinite(x) && x * sl == 0.0f);
    bool k_all_finite = true;
    for (uint8_t f : k_row_finite) k_all_finite = k_all_finite && f;
    prescale_underflow = prescale_underflow && !k_all_finite;
  }
  const bool overflow = dotmax >= kOverflow || dotmax * scale_eff * log2e >= kOverflow ||
                        qmax * scale_eff * log2e >= kOverflow || mmax * log2e >= kOverflow ||
                        vmax * inv_keep * static_cast<double>(S) >= kOverflow || prescale_underflow ||
                        bias_max * log2e >= kOverflow || sink_max * log2e >= kOverflow;

  const std::vector<float> rout = ref.output.to_vector();
  const std::vector<float> fout = torch_dropout ? std::vector<float>() : fused.output.to_vector();
  const std::vector<float> rw = p.need_weights ? ref.attn_weights.to_vector() : std::vector<float>();
  const std::vector<float> fw = p.need_weights && !torch_dropout ? fused.attn_weights.to_vector() : std::vector<float>();
  const std::vector<float> rl = p.need_lse ? ref.lse.to_vector() : std::vector<float>();
  const std::vector<float> fl = p.need_lse && !torch_dropout ? fused.lse.to_vector() : std::vector<float>();
  const bool have_fused = !torch_dropout;
  const bool torch_drop_all = torch_dropout && o.dropout_p == 1.0f;  // see "Known exemption"

  // With ATTN_FUZZ_VERBOSE set, a failing row prints its inputs and results.
  auto dump_row = [&](int64_t b, int64_t i) {
    if (std::getenv("ATTN_FUZZ_VERBOSE") == nullptr) return;
    const int64_t kb = (b / p.Hq) * p.Hkv + (b % p.Hq) / p.group;
    const size_t row = static_cast<size_t>(b * L + i);
    auto print = [](const char* name, auto first, int64_t n) {
      std::fprintf(stderr, "%s:", name);
      for (int64_t x = 0; x < n; ++x) std::fprintf(stderr, " %.9g", static_cast<double>(first[x]));
      std::fprintf(stderr, "\n");
    };
    print("q", qx.begin() + row * E, E);
    for (int64_t j = 0; j < S; ++j) {
      std::fprintf(stderr, "key %lld ", (long long)j);
      print("k", kx.begin() + (kb * S + j) * E, E);
      std::fprintf(stderr, "key %lld ", (long long)j);
      print("v", vx.begin() + (kb * S + j) * Ev, Ev);
    }
    if (!mx.empty()) print("mask", mx.begin() + row * S, S);
    print("truth weights", truth.attn_weights.begin() + row * S, S);
    if (!rw.empty()) print("reference weights", rw.begin() + row * S, S);
    if (!fw.empty()) print("fused weights", fw.begin() + row * S, S);
    print("truth out", truth.output.begin() + row * Ev, Ev);
    print("reference out", rout.begin() + row * Ev, Ev);
    if (!fout.empty()) print("fused out", fout.begin() + row * Ev, Ev);
    std::fprintf(stderr, "lse truth %.9g reference %.9g fused %.9g\n", truth.lse[row], rl.empty() ? NAN : rl[row],
                 fl.empty() ? NAN : fl[row]);
  };

  double delta_max = 0;  // for the backward's bound
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kb = (b / p.Hq) * p.Hkv + (b % p.Hq) / p.group;
    for (int64_t i = 0; i < L; ++i) {
      const size_t row = static_cast<size_t>(b * L + i);
      bool q_finite = true;
      for (int64_t e = 0; e < E; ++e) q_finite = q_finite && std::isfinite(qx[row * E + e]);
      // Which keys are certainly masked, and the row's score-error bound.
      bool all_masked = true, ambiguous = false;
      double amax = 0, madd = 0;
      bool infinite_score = false;  // absdot skips non-finite products; softcap makes them +-c
      for (int64_t j = 0; j < S; ++j) {
        const bool k_finite = k_row_finite[static_cast<size_t>(kb * S + j)];
        bool masked = o.is_causal && j > i + causal_off;
        const float m = mx.empty() ? 0.0f : mx[row * S + j];
        // A key outside the window is hidden whatever an additive mask adds there (NaN, +inf):
        // the band is applied last.
        if (win.left >= 0 && (i + diag) - j > win.left) masked = true;
        if (win.right >= 0 && j - (i + diag) > win.right) masked = true;
        if (is_bool && m == 0.0f) masked = true;
        if (is_add && m == -kInf && q_finite && k_finite && !overflow) masked = true;
        if (masked) continue;
        if (is_add && m == -kInf) {  // not certainly masked (a NaN/Inf score may survive it)
          all_masked = false;
          continue;
        }
        all_masked = false;
        amax = std::max(amax, absdot[row * S + j] * scale_eff);
        infinite_score = infinite_score || !q_finite || !k_finite;
        if (is_add && std::isfinite(m)) madd = std::max(madd, std::fabs(static_cast<double>(m)));
      }
      double variants = 4 * std::fabs(static_cast<double>(slope_of[b])) * static_cast<double>(L + S);
      if (o.sinks) variants += 4 * std::fabs(static_cast<double>(sink_of[b]));
      if (cap > 0) variants += amax + 8 * std::min(cap, infinite_score ? cap : amax);
      const double delta = kU * ((E + 6) * amax + 4 * madd + 8 + variants) + cap * 0x1p-149;
      delta_max = std::max(delta_max, delta);
      for (int64_t j = 0; j < S && !all_masked; ++j) {
        if (v_row_finite[static_cast<size_t>(kb * S + j)]) continue;
        if (philox && !philox_dropout_keep(o.dropout_seed, o.dropout_offset, b, i, j, o.dropout_p)) continue;
        const double w = truth.attn_weights[row * S + j] / inv_keep;
        if (w < 1e-30 * std::exp(std::min(4 * delta, 700.0))) ambiguous = true;
      }

      // Fully masked rows: exactly 0 / -inf everywhere.
      if (all_masked) {
        for (int64_t e = 0; e < Ev; ++e) {
          CHECK_ROW(rout[row * Ev + e] == 0.0f, "fully masked row: reference output not 0");
          if (have_fused) CHECK_ROW(fout[row * Ev + e] == 0.0f, "fully masked row: fused output not 0");
          CHECK_ROW(truth.output[row * Ev + e] == 0.0, "fully masked row: truth output not 0");
        }
        const float sink = sink_of[b];
        if (sink == -kInf) {
          if (p.need_lse) {
            CHECK_ROW(rl[row] == -kInf, "fully masked row: reference lse not -inf");
            if (have_fused) CHECK_ROW(fl[row] == -kInf, "fully masked row: fused lse not -inf");
          }
        } else {  // the sink is the row's only logit: lse = s_h (to a few ulps in base 2)
          const double s = sink, tol = 1e-6 * std::fabs(s) + 1e-7;
          CHECK_ROW(truth.lse[row] == s, "fully masked row with a sink: truth lse not the sink");
          if (p.need_lse) {
            CHECK_ROW(std::fabs(rl[row] - s) <= tol, "fully masked row with a sink: reference lse not the sink");
            if (have_fused) CHECK_ROW(std::fabs(fl[row] - s) <= tol, "fully masked row with a sink: fused lse not the sink");
          }
        }
        if (p.need_weights) {
          for (int64_t j = 0; j < S; ++j) {
            CHECK_ROW(rw[row * S + j] == 0.0f, "fully masked row: reference weight not 0");
            if (have_fused) CHECK_ROW(fw[row * S + j] == 0.0f, "fully masked row: fused weight not 0");
          }
        }
        continue;
      }
      if (overflow) continue;

      // Output.
      if (!ambiguous) {
        double err_r = 0, err_f = 0;
        for (int64_t e = 0; e < Ev; ++e) {
          const double t = truth.output[row * Ev + e], r = rout[row * Ev + e];
          CHECK_ROW(torch_drop_all || std::isnan(r) == std::isnan(t), "output NaN pattern: reference vs truth");
          if (have_fused) {
            const double f = fout[row * Ev + e];
            CHECK_ROW(std::isnan(f) == std::isnan(t), "output NaN pattern: fused vs truth/reference");
            if (!std::isnan(t)) err_f = std::max(err_f, err(f, t));
          }
          if (!std::isnan(t)) err_r = std::max(err_r, err(r, t));
        }
        const double cond = vmax > 0 ? 2 * vmax * std::expm1(4 * delta) : 0.0;  // never 0 * inf
        const double tol = inv_keep * (1e-5 * (1 + vmax) + cond);
        CHECK_ROW(err_r <= tol, "output: reference error vs truth above the bound");
        if (have_fused) {
          if (!(err_f <= 2 * err_r + tol)) {
            dump_row(b, i);
            attn::fuzz::fuzz_fail("output: fused error %.3g > 2 * reference error %.3g + tol %.3g (delta %.3g) "
                                  "at row b=%lld i=%lld\n  problem: %s", err_f, err_r, tol, delta,
                                  (long long)b, (long long)i, desc.c_str());
          }
        }
      }

      // Weights.
      if (p.need_weights) {
        double err_r = 0, err_f = 0;
        const double wmax = inv_keep * (1 + 1e-6);
        for (int64_t j = 0; j < S; ++j) {
          const double t = truth.attn_weights[row * S + j], r = rw[row * S + j];
          CHECK_ROW(torch_drop_all || std::isnan(r) == std::isnan(t), "weights NaN pattern: reference vs truth");
          CHECK_ROW(std::isnan(r) || (r >= 0 && r <= wmax), "reference weight outside [0, 1/(1-p)]");
          if (!std::isnan(t)) err_r = std::max(err_r, err(r, t));
          if (have_fused) {
            const double f = fw[row * S + j];
            CHECK_ROW(std::isnan(f) == std::isnan(t), "weights NaN pattern: fused vs truth/reference");
            if (!(std::isnan(f) || (f >= 0 && f <= wmax))) {
              attn::fuzz::fuzz_fail("fused weight %.9g at row b=%lld i=%lld key %lld outside [0, %g] (reference %.9g; "
                                    "lse: truth %.9g, reference %.9g, fused %.9g)\n  problem: %s", f, (long long)b,
                                    (long long)i, (long long)j, wmax, r, truth.lse[row], p.need_lse ? rl[row] : NAN,
                                    p.need_lse ? fl[row] : NAN, desc.c_str());
            }
            if (!std::isnan(t)) err_f = std::max(err_f, err(f, t));
          }
        }
        const double tol = inv_keep * (1e-5 + 2 * std::expm1(4 * delta));
        CHECK_ROW(err_r <= tol, "weights: reference error vs truth above the bound");
        if (have_fused) {
          if (!(err_f <= 2 * err_r + tol)) {
            dump_row(b, i);
            attn::fuzz::fuzz_fail("weights: fused error %.3g > 2 * reference error %.3g + tol %.3g at row b=%lld "
                                  "i=%lld\n  problem: %s", err_f, err_r, tol, (long long)b, (long long)i, desc.c_str());
          }
        }
      }

      // LSE.
      if (p.need_lse) {
        const double t = truth.lse[row], r = rl[row];
        CHECK_ROW(std::isnan(r) == std::isnan(t), "lse NaN pattern: reference vs truth");
        CHECK_ROW((r == -kInf) == (t == -HUGE_VAL), "lse -inf pattern: reference vs truth");
        const double tol = 1e-5 * (1 + std::fabs(t)) + 2 * delta;
        if (std::isfinite(t)) CHECK_ROW(err(r, t) <= tol, "lse: reference error vs truth above the bound");
        if (have_fused) {
          const double f = fl[row];
          CHECK_ROW(std::isnan(f) == std::isnan(t), "lse NaN pattern: fused vs truth/reference");
          CHECK_ROW((f == -kInf) == (t == -HUGE_VAL), "lse -inf pattern: fused vs truth/reference");
          if (std::isfinite(t) && !(err(f, t) <= 2 * err(r, t) + tol)) {
            attn::fuzz::fuzz_fail("lse: fused %.9g, reference %.9g, truth %.9g (tol %.3g) at row b=%lld i=%lld\n"
                                  "  problem: %s", f, r, t, tol, (long long)b, (long long)i, desc.c_str());
          }
        }
      }
    }
  }

  // ---- float32 backward (fuzz_sdpa_backward.hpp) -------------------------------------------------
  // One valid problem in four (by its value seed's next two bits), on the kernel the problem
  // forces, with the mask's gradient whenever the mask is additive. Torch-stream dropout has no
  // fused backward (its masks cannot be replayed): the forward above already checks the refusal.
  if (!torch_dropout && ((p.value_seed >> 2) & 3) == 0) {
    attn::fuzz::BackwardCase bc;
    bc.q = q.view, bc.k = k.view, bc.v = v.view;
    bc.options = o;
    bc.options.kernel = runnable_kernel(p.kernel);
    bc.out_shape = out_shape;
    bc.additive_mask = is_add;
    bool finite = !overflow;
    for (const std::vector<float>* xs : {&qx, &kx, &vx}) {
      for (float x : *xs) finite = finite && std::isfinite(x);
    }
    if (is_add) for (float x : mx) finite = finite && (std::isfinite(x) || x == -kInf);
    bc.moderate = finite;
    bc.delta = delta_max;
    bc.seed = p.value_seed;
    bc.desc = desc;
    attn::fuzz::check_f32_backward(bc);
  }

  // ---- 16-bit inputs -----------------------------------------------------------------------------
  // The same problem with q, k, v rounded to bfloat16 and to float16, on kAuto and on every
  // runnable kernel that takes the dtype: nothing throws, the dtype and shape come back, 1 and 2
  // threads agree bit for bit (NaN for NaN). Where the rounded problem is moderate
  // (finite inputs below 1e3, a scale of at most 10, finite or -inf additive masks, no overflow),
  // each kernel's error against the float64 truth of the rounded inputs is at most twice the
  // widened reference's plus a floor of a few units of the dtype's last place.
  // One valid input in four (by its value seed) takes this path: it costs two more float64
  // truths and a run per kernel, and the float32 checks above deserve most of the executions.
  if (torch_dropout || (p.value_seed & 3) != 0) return;
  const bool variants_used = !win.unbounded() || o.softcap || o.alibi_slopes || o.sinks;
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Tensor q16 = q.view.to(dtype), k16 = k.view.to(dtype), v16 = v.view.to(dtype);
    bool moderate = !overflow && !(o.scale && std::fabs(*o.scale) > 10.0) && mmax < 1e3 &&
                    bias_max <= 100 && sink_max <= 100;
    for (const Tensor* t : {&q16, &k16, &v16}) {
      for (float x : t->to_vector()) moderate = moderate && std::isfinite(x) && std::fabs(x) < 1e3f;
    }
    SdpaOptions lo = o;
    if (lo.scale) lo.scale = static_cast<double>(static_cast<float>(*lo.scale));
    reference::SdpaResultF64 t16;
    SdpaResult r16;
    must_not_throw("f64 truth (16-bit)", [&] { t16 = reference::scaled_dot_product_attention_f64(q16, k16, v16, lo); });
    SdpaOptions ro = lo;
    ro.kernel = "reference";
    must_not_throw("reference (16-bit)", [&] { r16 = scaled_dot_product_attention(q16, k16, v16, ro); });
    double vmax16 = 0;
    for (float x : v16.to_vector()) if (std::isfinite(x)) vmax16 = std::max(vmax16, std::fabs(static_cast<double>(x)));
    auto max_err = [&](const SdpaResult& r) {
      double m = 0;
      const std::vector<float> got = r.output.to_vector();
      for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(t16.output[i]) || std::isnan(got[i])) continue;
        m = std::max(m, err(got[i], t16.output[i]));
      }
      return m;
    };
    const double ulp = dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
    const double ref_err = max_err(r16);
    std::vector<std::string> kernels = {""};
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      const bool takes = std::find(k.dtypes.begin(), k.dtypes.end(), dtype) != k.dtypes.end();
      if (takes && k.runs_on_this_cpu && k.name != "reference") kernels.push_back(k.name);
    }
#if defined(ATTN_FUZZ_AMX_EMULATED)
    // The AMX kernel's code on emulated tiles where the real tiles are absent: called through
    // the driver directly, it sees only what the registry would give it (a finite V).
    const bool emulate = cpu::amx_emulation_runs_here() &&
                         std::find(kernels.begin(), kernels.end(), "cpu.flash.amx_bf16") == kernels.end();
    if (emulate && !lo.need_weights && !variants_used && cpu::all_finite_16(v16)) kernels.push_back(kAmxEmulated);
#endif
    auto run16 = [&](const SdpaOptions& ko) {
#if defined(ATTN_FUZZ_AMX_EMULATED)
      if (ko.kernel == kAmxEmulated) {
        SdpaOptions eo = ko;
        eo.kernel.clear();
        const detail::SdpaProblem prob = detail::check_sdpa(q16, k16, v16, eo);
        const bool two = cpu::bf16_p_two_terms(v16.size(-1), eo.need_output_residual);
        const auto& table = cpu::amx_kernel_emulated(dtype, Float32MatmulPrecision::kHigh, two);
        return cpu::flash_forward_bf16(table, q16, k16, v16, eo, prob);
      }
#endif
      return scaled_dot_product_attention(q16, k16, v16, ko);
    };
    for (const std::string& name : kernels) {
      SdpaOptions ko = lo;
      ko.kernel = name;
      if (name == kAmxEmulated) {
        // Not a registered kernel: straight to the checks below.
      } else if (const bool native_bf16 = name == "cpu.flash.avx512_bf16" || name == "cpu.flash.amx_bf16";
                 native_bf16 && ko.need_weights) {
        continue;  // refused by design
      } else if (native_bf16 && variants_used) {  // refused by design, with the reason
        try {
          (void)sdpa_kernel_name(q16, k16, v16, ko);
          attn::fuzz::fuzz_fail("'%s' accepted the variants it lacks\n  problem: %s", name.c_str(), desc.c_str());
        } catch (const ValueError&) {
        }
        continue;
      }
      if (name.starts_with("cpu.decode.")) {  // short inference problems only, by design
        bool refused = false;
        try {
          (void)sdpa_kernel_name(q16, k16, v16, ko);
        } catch (const ValueError&) {
          refused = true;
        }
        if (refused) continue;
      }
      SdpaResult a, b2;
      must_not_throw("16-bit kernel", [&] { a = run16(ko); });
      ko.num_threads = 3 - p.threads;
      must_not_throw("16-bit kernel (other thread count)", [&] { b2 = run16(ko); });
      ATTN_FUZZ_CHECKF(a.output.dtype() == dtype && a.output.shape() == out_shape,
                       "16-bit kernel '%s': output dtype/shape; %s", name.c_str(), desc.c_str());
      const std::vector<float> x1 = a.output.to_vector(), x2 = b2.output.to_vector();
      bool same_bits = x1.size() == x2.size();
      for (size_t i = 0; same_bits && i < x1.size(); ++i) {
        same_bits = x1[i] == x2[i] || (std::isnan(x1[i]) && std::isnan(x2[i]));
      }
      ATTN_FUZZ_CHECKF(same_bits, "16-bit kernel '%s' differs between 1 and 2 threads; %s", name.c_str(), desc.c_str());
      if (moderate) {
        const double e = max_err(a);
        const double floor = 4 * ulp * (1 + vmax16) * inv_keep;
        if (!(e <= 2 * ref_err + floor)) {
          attn::fuzz::fuzz_fail("%s kernel '%s': error %.3g > 2 * reference error %.3g + %.3g\n  problem: %s",
                                std::string(dtype_name(dtype)).c_str(), name.c_str(), e, ref_err, floor, desc.c_str());
        }
      }
      if (dtype == DType::kBFloat16 && name != kAmxEmulated && !ko.need_weights) {
        const bool bf16_mask = ((p.value_seed * 0x9E3779B97F4A7C15u) >> 63) != 0;  // a bit uncorrelated with the 3 tested
        check_bf16_backward(q16, k16, v16, ko, moderate, bf16_mask, delta_max, desc);
      }
    }
  }

#if defined(ATTN_FUZZ_AMX_EMULATED)
  // float32 at float32_matmul_precision "high" (three bf16 terms) and "medium" (one) on the AMX
  // kernel's code on emulated tiles, fed what the registry would give it (no weights, no
  // variants, values tiles_take_values accepts): nothing throws, a float32 output of the right
  // shape, 1 and 2 threads agree bit for bit. Where every score is small (|scale q.k| <= 30 over
  // finite inputs, so that the float32 kernels' own error is a few units of the last place), the
  // error against the float64 truth: "high" within 4x the fused float32 kernel's plus 8 float32
  // units of (1 + max|v|), "medium" within 8 bf16 units of it.
  if (!cpu::amx_emulation_runs_here() || o.need_weights || variants_used) return;
  SdpaOptions fo = o;
  if (fo.scale) fo.scale = static_cast<double>(static_cast<float>(*fo.scale));
  fo.generator = nullptr;
  for (const Float32MatmulPrecision level : {Float32MatmulPrecision::kHigh, Float32MatmulPrecision::kMedium}) {
    fo.float32_matmul_precision = level;
    fo.num_threads = p.threads;
    detail::SdpaProblem prob;
    must_not_throw("float32 high/medium problem", [&] { prob = detail::check_sdpa(q.view, k.view, v.view, fo); });
    if (!detail::tiles_take_values(q.view, k.view, v.view, prob)) continue;
    const cpu::Bf16ForwardKernel& kern = cpu::amx_kernel_emulated(DType::kFloat32, level);
    SdpaResult a, b2;
    must_not_throw("float32 high/medium", [&] { a = cpu::flash_forward_bf16(kern, q.view, k.view, v.view, fo, prob); });
    fo.num_threads = 3 - p.threads;
    must_not_throw("float32 high/medium (other thread count)",
                   [&] { b2 = cpu::flash_forward_bf16(kern, q.view, k.view, v.view, fo, prob); });
    const char* what = level == Float32MatmulPrecision::kHigh ? "high" : "medium";
    ATTN_FUZZ_CHECKF(a.output.dtype() == DType::kFloat32 && a.output.shape() == out_shape,
                     "float32 '%s': output dtype/shape; %s", what, desc.c_str());
    const std::vector<float> x1 = a.output.to_vector(), x2 = b2.output.to_vector();
    bool same_bits = x1.size() == x2.size();
    for (size_t i = 0; same_bits && i < x1.size(); ++i) same_bits = x1[i] == x2[i] || (std::isnan(x1[i]) && std::isnan(x2[i]));
    ATTN_FUZZ_CHECKF(same_bits, "float32 '%s' differs between 1 and 2 threads; %s", what, desc.c_str());

    bool small = !overflow && dotmax * scale_eff <= 30.0;
    for (float x : qx) small = small && std::isfinite(x);
    for (float x : kx) small = small && std::isfinite(x);
    for (float x : vx) small = small && std::isfinite(x);
    if (!small || torch_dropout) continue;
    const std::vector<float> fx = fused.output.to_vector();
    double e = 0, e_fused = 0;
    for (size_t i = 0; i < x1.size(); ++i) {
      if (std::isnan(truth.output[i])) continue;
      e = std::max(e, err(x1[i], truth.output[i]));
      e_fused = std::max(e_fused, err(fx[i], truth.output[i]));
    }
    const double bound = level == Float32MatmulPrecision::kHigh ? 4 * e_fused + 8 * kU * (1 + vmax) * inv_keep
                                                                : 8 * 0x1p-8 * (1 + vmax) * inv_keep;
    if (!(e <= bound)) {
      attn::fuzz::fuzz_fail("float32 '%s': error %.3g > %.3g (fused float32 error %.3g)\n  problem: %s", what, e,
                            bound, e_fused, desc.c_str());
    }
  }
#endif
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  run(in);
  return 0;
}

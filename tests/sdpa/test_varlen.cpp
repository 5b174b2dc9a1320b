// varlen_attn and varlen_attn_backward (attn/varlen.hpp): packed variable-length sequences.
//
// 1. Against scaled_dot_product_attention on each sequence alone with the same options, for the
//    reference and every fused kernel this CPU runs, every variant option, causal with both
//    alignments, GQA, sequences of lengths 0, 1, 7 and 300 with L != S: output, LSE and
//    gradients bit-equal (the same kernel runs the same problem), grad_sinks the sum of the
//    per-sequence ones; rows without keys give output 0 and LSE -inf (or the sink).
// 2. Dropout: sequence n's mask is batch element n's of the padded (N, H, max_q, max_k) call with
//    a key-padding mask (the valid rows and gradients agree), for float32, float64 and the
//    native bfloat16 forward.
// 3. Bit-identical for 1 and 2 threads; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "sdpa/cpu/sdpa_cases.hpp"

namespace attn {
namespace {

// Sequence lengths (queries L, keys S per sequence) and head shapes.
struct Packing {
  std::vector<int64_t> L, S;
  int64_t H, H_kv, E, Ev;
};

// Lengths 0, 1, 7 and 300 mixed, L != S in most sequences, a sequence without keys and one
// without queries.
Packing long_packing(int64_t H, int64_t H_kv) {
  return {{1, 7, 300, 0, 5, 13, 0, 7}, {7, 1, 280, 5, 0, 300, 0, 7}, H, H_kv, 24, 20};
}
// At most 16 queries a sequence: what the decode kernels take.
Packing short_packing(int64_t H, int64_t H_kv) {
  return {{1, 7, 0, 16, 3, 2}, {7, 300, 5, 40, 0, 1}, H, H_kv, 32, 32};
}

struct Packed {
  Packing pk;
  Tensor q, k, v, dout, cu_q, cu_k, slopes, sinks;
  std::vector<int64_t> q0, k0;  // first row of each sequence
  int64_t max_q = 0, max_k = 0;
  int64_t N() const { return static_cast<int64_t>(pk.L.size()); }
};

Tensor cu_tensor(const std::vector<int64_t>& lens, std::vector<int64_t>& starts) {
  Tensor t = Tensor::empty({static_cast<int64_t>(lens.size()) + 1}, DType::kInt32);
  int32_t* d = t.data_as<int32_t>();
  d[0] = 0;
  starts.clear();
  for (size_t i = 0; i < lens.size(); ++i) {
    starts.push_back(d[i]);
    d[i + 1] = d[i] + static_cast<int32_t>(lens[i]);
  }
  return t;
}

Packed make_packed(const Packing& pk, uint64_t seed) {
  manual_seed(seed);
  Packed p;
  p.pk = pk;
  int64_t tq = 0, tk = 0;
  for (size_t n = 0; n < pk.L.size(); ++n) {
    tq += pk.L[n];
    tk += pk.S[n];
    p.max_q = std::max(p.max_q, pk.L[n]);
    p.max_k = std::max(p.max_k, pk.S[n]);
  }
  p.q = randn({tq, pk.H, pk.E});
  p.k = randn({tk, pk.H_kv, pk.E});
  p.v = randn({tk, pk.H_kv, pk.Ev});
  p.dout = randn({tq, pk.H, pk.Ev});
  p.cu_q = cu_tensor(pk.L, p.q0);
  p.cu_k = cu_tensor(pk.S, p.k0);
  p.slopes = Tensor::empty({pk.H});
  for (int64_t h = 0; h < pk.H; ++h) p.slopes.data()[h] = 0.3f / static_cast<float>(h + 1);
  p.sinks = randn({pk.H});
  return p;
}

// Rows [r0, r0 + rows) of a token-major (total, H, X) tensor as (1, H, rows, X).
TensorView seq_view(const TensorView& t, int64_t r0, int64_t rows) {
  return t.slice(0, r0, r0 + rows).transpose(0, 1).unsqueeze(0);
}
// Columns [c0, c0 + rows) of an (H, total_q) LSE as (1, H, rows).
TensorView lse_view(const TensorView& lse, int64_t c0, int64_t rows) {
  return lse.slice(1, c0, c0 + rows).unsqueeze(0);
}

// Element-wise equality (tol == 0: bit-equal values; NaN equals NaN) of any two views of one
// shape.
void expect_close(const TensorView& got, const TensorView& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> a = got.contiguous().to_double_vector(), b = want.contiguous().to_double_vector();
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) continue;
    const double d = std::fabs(a[i] - b[i]);
    if (tol > 0 && d <= tol) continue;
    ++bad;
    worst = std::isnan(d) ? d : std::max(worst, d);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.size() << " elements differ (worst " << worst
                    << ", tolerance " << tol << ")";
}

void expect_all(const TensorView& t, double value, const std::string& what) {
  for (double x : t.contiguous().to_double_vector()) {
    if (x != value) {
      ADD_FAILURE() << what << ": expected every element " << value << ", got " << x;
      return;
    }
  }
}

// varlen_attn and its backward against scaled_dot_product_attention (and its backward) on each
// sequence alone, with the same options: bit-equal.
void check_per_sequence(const Packed& p, SdpaOptions o, const std::string& what) {
  o.need_lse = true;
  const SdpaResult vr = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
  const SdpaGrads vg =
      varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, vr, o);
  ASSERT_EQ(vr.output.shape(), (Shape{p.q.size(0), p.pk.H, p.pk.Ev})) << what;
  ASSERT_EQ(vr.lse.shape(), (Shape{p.pk.H, p.q.size(0)})) << what;
  ASSERT_EQ(vg.grad_query.shape(), p.q.shape()) << what;
  ASSERT_EQ(vg.grad_key.shape(), p.k.shape()) << what;
  ASSERT_EQ(vg.grad_value.shape(), p.v.shape()) << what;
  ASSERT_EQ(vg.grad_sinks.defined(), o.sinks.has_value()) << what;
  const bool residual = o.need_output_residual && (p.q.dtype() == DType::kBFloat16 || p.q.dtype() == DType::kFloat16);
  ASSERT_EQ(vr.output_residual.defined(), residual) << what;
  std::vector<double> dsinks(static_cast<size_t>(p.pk.H), 0.0);
  for (int64_t n = 0; n < p.N(); ++n) {
    const size_t i = static_cast<size_t>(n);
    const int64_t L = p.pk.L[i], S = p.pk.S[i], q0 = p.q0[i], k0 = p.k0[i];
    const std::string at = what + " sequence " + std::to_string(n) + " (L " + std::to_string(L) +
                           ", S " + std::to_string(S) + ")";
    if (L > 0 && S > 0) {
      const Tensor qn = seq_view(p.q, q0, L).contiguous(), kn = seq_view(p.k, k0, S).contiguous(),
                   vn = seq_view(p.v, k0, S).contiguous(), dn = seq_view(p.dout, q0, L).contiguous();
      const SdpaResult r = scaled_dot_product_attention(qn, kn, vn, o);
      const SdpaGrads g = scaled_dot_product_attention_backward(dn, qn, kn, vn, r, o);
      expect_close(seq_view(vr.output, q0, L), r.output, 0, at + " output");
      if (residual) expect_close(seq_view(vr.output_residual, q0, L), r.output_residual, 0, at + " output_residual");
      expect_close(lse_view(vr.lse, q0, L), r.lse, 0, at + " lse");
      expect_close(seq_view(vg.grad_query, q0, L), g.grad_query, 0, at + " grad_query");
      expect_close(seq_view(vg.grad_key, k0, S), g.grad_key, 0, at + " grad_key");
      expect_close(seq_view(vg.grad_value, k0, S), g.grad_value, 0, at + " grad_value");
      if (o.sinks) {
        const std::vector<double> d = g.grad_sinks.to_double_vector();
        for (size_t h = 0; h < dsinks.size(); ++h) dsinks[h] += d[h];
      }
    } else {
      // No keys: output 0, LSE -inf or the sink, dQ 0. No queries: dK, dV 0.
      expect_all(seq_view(vr.output, q0, L), 0.0, at + " output");
      if (residual) expect_all(seq_view(vr.output_residual, q0, L), 0.0, at + " output_residual");
      expect_all(seq_view(vg.grad_query, q0, L), 0.0, at + " grad_query");
      expect_all(seq_view(vg.grad_key, k0, S), 0.0, at + " grad_key");
      expect_all(seq_view(vg.grad_value, k0, S), 0.0, at + " grad_value");
      for (int64_t h = 0; h < p.pk.H; ++h) {
        const double want = o.sinks ? static_cast<double>(o.sinks->data()[h]) : -INFINITY;
        expect_all(lse_view(vr.lse, q0, L).select(1, h), want, at + " lse");
      }
    }
  }
  if (o.sinks) {
    Tensor want = Tensor::empty({p.pk.H});
    for (int64_t h = 0; h < p.pk.H; ++h) want.data()[h] = static_cast<float>(dsinks[static_cast<size_t>(h)]);
    expect_close(vg.grad_sinks, want, 0, what + " grad_sinks");
  }
}

struct OptionCase {
  const char* name;
  std::function<void(SdpaOptions&, const Packed&)> set;
};

const std::vector<OptionCase>& option_cases() {
  static const std::vector<OptionCase> cases = {
      {"plain", [](SdpaOptions&, const Packed&) {}},
      {"causal_top_left", [](SdpaOptions& o, const Packed&) { o.is_causal = true; }},
      {"causal_bottom_right",
       [](SdpaOptions& o, const Packed&) {
         o.is_causal = true;
         o.causal_alignment = CausalAlignment::kBottomRight;
       }},
      {"scale", [](SdpaOptions& o, const Packed&) { o.scale = 0.31; }},
      {"window", [](SdpaOptions& o, const Packed&) { o.window_size = {17, 5}; }},
      {"window_causal_bottom_right",
       [](SdpaOptions& o, const Packed&) {
         o.window_size = {40, -1};
         o.is_causal = true;
         o.causal_alignment = CausalAlignment::kBottomRight;
       }},
      {"softcap", [](SdpaOptions& o, const Packed&) { o.softcap = 2.0; }},
      {"alibi", [](SdpaOptions& o, const Packed& p) { o.alibi_slopes = p.slopes; }},
      {"sinks", [](SdpaOptions& o, const Packed& p) { o.sinks = p.sinks; }},
      {"all_variants",
       [](SdpaOptions& o, const Packed& p) {
         o.window_size = {25, 2};
         o.softcap = 4.0;
         o.alibi_slopes = p.slopes;
         o.sinks = p.sinks;
         o.is_causal = true;
         o.causal_alignment = CausalAlignment::kBottomRight;
       }},
  };
  return cases;
}

// The reference and the float32 fused kernels that take sequences of any length.
std::vector<std::string> long_kernels() {
  std::vector<std::string> out{"reference"};
  for (const std::string& k : test::runnable_fused_kernels()) {
    if (k.rfind("cpu.decode.", 0) != 0) out.push_back(k);
  }
  return out;
}

TEST(Varlen, MatchesPerSequenceCallsOnEveryKernelAndOption) {
  for (const std::string& kernel : long_kernels()) {
    for (const auto& [H, H_kv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
      const Packed p = make_packed(long_packing(H, H_kv), 7);
      for (const OptionCase& oc : option_cases()) {
        SdpaOptions o;
        o.kernel = kernel;
        o.enable_gqa = H != H_kv;
        oc.set(o, p);
        check_per_sequence(p, o, kernel + " H" + std::to_string(H) + "/" + std::to_string(H_kv) + " " + oc.name);
      }
    }
  }
}

// kAuto chooses per sequence, as the per-sequence call does: a short sequence takes a decode
// kernel, a long one a flash kernel.
TEST(Varlen, AutoChoosesPerSequence) {
  const Packed p = make_packed(long_packing(4, 2), 8);
  for (const OptionCase& oc : option_cases()) {
    SdpaOptions o;
    o.enable_gqa = true;
    oc.set(o, p);
    check_per_sequence(p, o, std::string("auto ") + oc.name);
  }
}

TEST(Varlen, DecodeKernelsOnShortSequences) {
  for (const std::string& kernel : test::runnable_kernels_named("cpu.decode.")) {
    for (const auto& [H, H_kv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 1}}) {
      const Packed p = make_packed(short_packing(H, H_kv), 9);
      for (int causal = 0; causal < 3; ++causal) {
        SdpaOptions o;
        o.kernel = kernel;
        o.enable_gqa = H != H_kv;
        o.is_causal = causal > 0;
        if (causal == 2) o.causal_alignment = CausalAlignment::kBottomRight;
        check_per_sequence(p, o, kernel + " H" + std::to_string(H) + "/" + std::to_string(H_kv) +
                                     " causal " + std::to_string(causal));
      }
    }
  }
}

TEST(Varlen, LowPrecisionInputs) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    Packed p = make_packed(long_packing(4, 2), 10);
    p.q = p.q.to(dt);
    p.k = p.k.to(dt);
    p.v = p.v.to(dt);
    p.dout = p.dout.to(dt);
    for (const std::string& kernel : {std::string(), std::string("reference")}) {
      for (bool residual : {false, true}) {  // the backward's D re-derived, or read from output_residual
        SdpaOptions o;
        o.kernel = kernel;
        o.enable_gqa = true;
        o.is_causal = true;
        o.need_output_residual = residual;
        check_per_sequence(p, o, std::string(dtype_name(dt)) + " kernel '" + kernel + "'" +
                                     (residual ? " with output_residual" : ""));
      }
    }
  }
}

// The padded batch: q (N, H, max_q, E), k/v (N, H_kv, max_k, .), zeros past each sequence, and
// a boolean key-padding mask (N, 1, 1, max_k).
struct Padded {
  Tensor q, k, v, dout, mask;
};

Tensor pad(const Packed& p, const Tensor& t, const std::vector<int64_t>& starts,
           const std::vector<int64_t>& lens, int64_t max_len) {
  Tensor out = Tensor::zeros({p.N(), t.size(1), max_len, t.size(2)});
  for (int64_t n = 0; n < p.N(); ++n) {
    for (int64_t h = 0; h < t.size(1); ++h) {
      for (int64_t i = 0; i < lens[static_cast<size_t>(n)]; ++i) {
        for (int64_t e = 0; e < t.size(2); ++e) {
          out.at({n, h, i, e}) = t.at({starts[static_cast<size_t>(n)] + i, h, e});
        }
      }
    }
  }
  return out;
}

Padded make_padded(const Packed& p) {
  Padded d;
  d.q = pad(p, p.q, p.q0, p.pk.L, p.max_q);
  d.k = pad(p, p.k, p.k0, p.pk.S, p.max_k);
  d.v = pad(p, p.v, p.k0, p.pk.S, p.max_k);
  d.dout = pad(p, p.dout, p.q0, p.pk.L, p.max_q);
  d.mask = Tensor::zeros({p.N(), 1, 1, p.max_k});
  for (int64_t n = 0; n < p.N(); ++n) {
    for (int64_t j = 0; j < p.pk.S[static_cast<size_t>(n)]; ++j) d.mask.at({n, 0, 0, j}) = 1.0f;
  }
  return d;
}

// Dropout: the valid rows of the padded call (and its gradients) are varlen's.
TEST(Varlen, DropoutMaskIsThePaddedBatchsMask) {
  std::vector<std::pair<std::string, DType>> runs;
  for (const std::string& k : long_kernels()) runs.push_back({k, DType::kFloat32});
  runs.push_back({"reference", DType::kFloat64});
  for (const auto& [kernel, dt] : runs) {
    Packed p = make_packed(long_packing(4, 2), 11);
    Padded d = make_padded(p);
    if (dt == DType::kFloat64) {
      for (Tensor* t : {&p.q, &p.k, &p.v, &p.dout, &d.q, &d.k, &d.v, &d.dout}) *t = t->to(dt);
    }
    SdpaOptions o;
    o.kernel = kernel;
    o.enable_gqa = true;
    o.dropout_p = 0.3f;
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 2024;
    o.dropout_offset = 5;
    o.need_lse = true;
    o.sinks = p.sinks;
    const SdpaResult vr = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
    const SdpaGrads vg = varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, vr, o);
    SdpaOptions po = o;
    po.attn_mask = AttnMask::boolean(d.mask);
    const SdpaResult pr = scaled_dot_product_attention(d.q, d.k, d.v, po);
    const SdpaGrads pg = scaled_dot_product_attention_backward(d.dout, d.q, d.k, d.v, pr, po);
    const double tol = dt == DType::kFloat64 ? 1e-12 : 2e-5;
    const std::string what = kernel + " " + std::string(dtype_name(dt));
    for (int64_t n = 0; n < p.N(); ++n) {
      const size_t i = static_cast<size_t>(n);
      const int64_t L = p.pk.L[i], S = p.pk.S[i];
      const std::string at = what + " sequence " + std::to_string(n);
      expect_close(seq_view(vr.output, p.q0[i], L), pr.output.select(0, n).slice(1, 0, L).unsqueeze(0), tol, at + " output");
      expect_close(lse_view(vr.lse, p.q0[i], L), pr.lse.select(0, n).slice(1, 0, L).unsqueeze(0), tol, at + " lse");
      expect_close(seq_view(vg.grad_query, p.q0[i], L), pg.grad_query.select(0, n).slice(1, 0, L).unsqueeze(0),
                   10 * tol, at + " grad_query");
      expect_close(seq_view(vg.grad_key, p.k0[i], S), pg.grad_key.select(0, n).slice(1, 0, S).unsqueeze(0),
                   10 * tol, at + " grad_key");
      expect_close(seq_view(vg.grad_value, p.k0[i], S), pg.grad_value.select(0, n).slice(1, 0, S).unsqueeze(0),
                   10 * tol, at + " grad_value");
    }
    // The padded call's sink gradient also sums its padding rows (their dO is 0: no term).
    expect_close(vg.grad_sinks, pg.grad_sinks, 10 * tol, what + " grad_sinks");
  }
}

// The native bfloat16 forward keys its Philox counters likewise (its backward is the float32
// kernel's, covered above).
TEST(Varlen, DropoutOnTheBFloat16Kernel) {
  const std::vector<std::string> bf16 = test::runnable_kernels_named("cpu.flash.avx512_bf16");
  if (bf16.empty()) GTEST_SKIP() << "cpu.flash.avx512_bf16 does not run on this CPU";
  Packed p = make_packed(long_packing(4, 2), 15);
  Padded d = make_padded(p);
  for (Tensor* t : {&p.q, &p.k, &p.v, &d.q, &d.k, &d.v}) *t = t->to(DType::kBFloat16);
  SdpaOptions o;
  o.kernel = bf16[0];
  o.enable_gqa = true;
  o.dropout_p = 0.3f;
  o.dropout_rng = DropoutRng::kPhilox;
  o.dropout_seed = 99;
  o.need_lse = true;
  const SdpaResult vr = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
  SdpaOptions po = o;
  po.attn_mask = AttnMask::boolean(d.mask);
  const SdpaResult pr = scaled_dot_product_attention(d.q, d.k, d.v, po);
  for (int64_t n = 0; n < p.N(); ++n) {
    const size_t i = static_cast<size_t>(n);
    const int64_t L = p.pk.L[i];
    // One bfloat16 rounding step (2^-7 relative) where the float32 sums differ in the last bits.
    expect_close(seq_view(vr.output, p.q0[i], L), pr.output.select(0, n).slice(1, 0, L).unsqueeze(0),
                 3e-2, "sequence " + std::to_string(n) + " output");
    expect_close(lse_view(vr.lse, p.q0[i], L), pr.lse.select(0, n).slice(1, 0, L).unsqueeze(0), 2e-5,
                 "sequence " + std::to_string(n) + " lse");
  }
}

TEST(Varlen, BitIdenticalForOneAndTwoThreads) {
  const Packed p = make_packed(long_packing(4, 2), 12);
  for (const std::string& kernel : long_kernels()) {
    SdpaOptions o;
    o.kernel = kernel;
    o.enable_gqa = true;
    o.is_causal = true;
    o.sinks = p.sinks;
    o.window_size = {100, -1};
    o.dropout_p = 0.2f;
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 3;
    o.need_lse = true;
    SdpaResult r[2];
    SdpaGrads g[2];
    for (int t = 0; t < 2; ++t) {
      o.num_threads = t + 1;
      r[t] = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
      g[t] = varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, r[t], o);
    }
    expect_close(r[0].output, r[1].output, 0, kernel + " output");
    expect_close(r[0].lse, r[1].lse, 0, kernel + " lse");
    expect_close(g[0].grad_query, g[1].grad_query, 0, kernel + " grad_query");
    expect_close(g[0].grad_key, g[1].grad_key, 0, kernel + " grad_key");
    expect_close(g[0].grad_value, g[1].grad_value, 0, kernel + " grad_value");
    expect_close(g[0].grad_sinks, g[1].grad_sinks, 0, kernel + " grad_sinks");
  }
}

TEST(Varlen, EmptySequencesOnly) {
  for (int64_t N : {0, 3}) {
    Packed p = make_packed({std::vector<int64_t>(N, 0), std::vector<int64_t>(N, 0), 2, 2, 8, 8}, 13);
    if (N == 3) {  // keys but no queries in sequence 1
      p.pk.S[1] = 4;
      p.k = randn({4, 2, 8});
      p.v = randn({4, 2, 8});
      p.cu_k = cu_tensor(p.pk.S, p.k0);
      p.max_k = 4;
    }
    SdpaOptions o;
    o.need_lse = true;
    o.sinks = p.sinks;
    const SdpaResult r = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, 0, p.max_k, o);
    EXPECT_EQ(r.output.shape(), (Shape{0, 2, 8}));
    EXPECT_EQ(r.lse.shape(), (Shape{2, 0}));
    const SdpaGrads g = varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, 0, p.max_k, r, o);
    EXPECT_EQ(g.grad_key.shape(), p.k.shape());
    expect_all(g.grad_key, 0.0, "grad_key");
    expect_all(g.grad_sinks, 0.0, "grad_sinks");
  }
}

template <typename E>
void expect_error(const std::function<void()>& f, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": message lacks '" << needle << "': " << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("varlen_attn", 0), 0u) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong exception type: " << e.what();
  }
}

TEST(Varlen, BadInput) {
  const Packed p = make_packed(long_packing(4, 2), 14);
  SdpaOptions gqa;
  gqa.enable_gqa = true;
  auto call = [&](const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cq,
                  const TensorView& ck, int64_t mq, int64_t mk, const SdpaOptions& o) {
    return [=] { (void)varlen_attn(q, k, v, cq, ck, mq, mk, o); };
  };
  const Tensor cq_f = p.cu_q.to(DType::kFloat32);
  expect_error<DTypeError>(call(p.q, p.k, p.v, cq_f, p.cu_k, p.max_q, p.max_k, gqa), "cu_seq_q", "float cu_seq_q");
  const Tensor ck_2d = Tensor::zeros({1, p.cu_k.size(0)}, DType::kInt32);
  expect_error<ShapeError>(call(p.q, p.k, p.v, p.cu_q, ck_2d, p.max_q, p.max_k, gqa), "cu_seq_k", "2-D cu_seq_k");
  Tensor cq = p.cu_q;
  cq.data_as<int32_t>()[0] = 1;
  expect_error<ValueError>(call(p.q, p.k, p.v, cq, p.cu_k, p.max_q, p.max_k, gqa), "cu_seq_q[0] must be 0", "start");
  cq = p.cu_q;
  cq.data_as<int32_t>()[2] = cq.data_as<int32_t>()[1] - 1;
  expect_error<ValueError>(call(p.q, p.k, p.v, cq, p.cu_k, p.max_q, p.max_k, gqa), "non-decreasing", "decreasing");
  cq = p.cu_q;
  cq.data_as<int32_t>()[cq.size(0) - 1] -= 1;
  expect_error<ValueError>(call(p.q, p.k, p.v, cq, p.cu_k, p.max_q, p.max_k, gqa), "query.size(0)", "total");
  // One sequence fewer in cu_seq_q (its last entry still the total): the lengths differ.
  Tensor cq_short = p.cu_q.slice(0, 0, p.cu_q.size(0) - 1).contiguous();
  cq_short.data_as<int32_t>()[cq_short.size(0) - 1] = static_cast<int32_t>(p.q.size(0));
  expect_error<ShapeError>(call(p.q, p.k, p.v, cq_short, p.cu_k, p.max_q, p.max_k, gqa), "N + 1", "lengths differ");
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q - 1, p.max_k, gqa), "max_q", "max_q");
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, 299, gqa), "max_k", "max_k");
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, -1, p.max_k, gqa), "max_q", "negative max_q");
  SdpaOptions masked = gqa;
  const Tensor mask = Tensor::ones({1, 1});
  masked.attn_mask = AttnMask::boolean(mask);
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, masked), "attn_mask", "attn_mask");
  const TensorView q4 = p.q.unsqueeze(0);
  expect_error<ShapeError>(call(q4, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, gqa), "query", "4-D query");
  expect_error<ShapeError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, {}), "heads", "no enable_gqa");
  const Tensor k3 = randn({p.k.size(0), 3, p.pk.E}), v3 = randn({p.k.size(0), 3, p.pk.Ev});
  expect_error<ShapeError>(call(p.q, k3, v3, p.cu_q, p.cu_k, p.max_q, p.max_k, gqa), "multiple", "4 % 3");
  expect_error<ShapeError>(call(p.q, p.k, v3, p.cu_q, p.cu_k, p.max_q, p.max_k, gqa), "value", "k/v heads");
  const Tensor k_e = randn({p.k.size(0), 2, p.pk.E + 1});
  expect_error<ShapeError>(call(p.q, k_e, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, gqa), "embed", "E");
  SdpaOptions torch_drop = gqa;
  torch_drop.dropout_p = 0.1f;
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, torch_drop), "kPhilox", "kTorch");
  SdpaOptions weights = gqa;
  weights.need_weights = true;
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, weights), "need_weights", "weights");
  SdpaOptions alibi = gqa;
  const Tensor slopes2 = Tensor::ones({1, 4});
  alibi.alibi_slopes = slopes2;
  expect_error<ShapeError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, alibi), "alibi_slopes", "alibi (1, H)");
  SdpaOptions cap = gqa;
  cap.softcap = -1.0;
  expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, cap), "softcap", "softcap");
  const Tensor q64 = p.q.to(DType::kFloat64);
  expect_error<DTypeError>(call(q64, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, gqa), "dtype", "mixed dtypes");
  // A forced decode kernel refuses the 300-query sequence, naming it.
  for (const std::string& k : test::runnable_kernels_named("cpu.decode.")) {
    SdpaOptions forced = gqa;
    forced.kernel = k;
    expect_error<ValueError>(call(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, forced), "sequence 2", k);
  }
  // The backward: the forward's shapes and its LSE.
  SdpaOptions o = gqa;
  o.need_lse = true;
  const SdpaResult r = varlen_attn(p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
  const Tensor bad_dout = randn({p.q.size(0), 4, p.pk.Ev + 1});
  expect_error<ShapeError>([&] { (void)varlen_attn_backward(bad_dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, r, o); },
                           "grad_output", "grad_output shape");
  SdpaResult no_lse = r;
  no_lse.lse = Tensor();
  expect_error<ValueError>([&] { (void)varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, no_lse, o); },
                           "need_lse", "missing lse");
  expect_error<ValueError>([&] { (void)varlen_attn_backward(p.dout, p.q, p.k, p.v, cq, p.cu_k, p.max_q, p.max_k, r, o); },
                           "cu_seq_q", "backward cu_seq_q");
  // output_residual: only for 16-bit calls, of the output's shape and dtype.
  SdpaResult f32_res = r;
  f32_res.output_residual = r.output.to(DType::kBFloat16);
  expect_error<ValueError>([&] { (void)varlen_attn_backward(p.dout, p.q, p.k, p.v, p.cu_q, p.cu_k, p.max_q, p.max_k, f32_res, o); },
                           "forward.output_residual", "residual of a float32 call");
  const Tensor qh = p.q.to(DType::kBFloat16), kh = p.k.to(DType::kBFloat16), vh = p.v.to(DType::kBFloat16),
               dh = p.dout.to(DType::kBFloat16);
  o.need_output_residual = true;
  const SdpaResult rh = varlen_attn(qh, kh, vh, p.cu_q, p.cu_k, p.max_q, p.max_k, o);
  ASSERT_TRUE(rh.output_residual.defined());
  SdpaResult short_res = rh;
  short_res.output_residual = rh.output_residual.slice(0, 0, qh.size(0) - 1).contiguous();
  expect_error<ShapeError>([&] { (void)varlen_attn_backward(dh, qh, kh, vh, p.cu_q, p.cu_k, p.max_q, p.max_k, short_res, o); },
                           "forward.output_residual", "residual shape");
  SdpaResult half_res = rh;
  half_res.output_residual = rh.output_residual.to(DType::kFloat16);
  expect_error<DTypeError>([&] { (void)varlen_attn_backward(dh, qh, kh, vh, p.cu_q, p.cu_k, p.max_q, p.max_k, half_res, o); },
                           "forward.output_residual", "residual dtype");
}

// Rows no kernel writes (a sequence without keys: output and dQ; without queries: dK, dV) are
// zeroed explicitly, not left to fresh memory: here every output block is reused from the tensor
// cache (attn/memory.hpp) after holding NaN.
TEST(Varlen, RowsWithoutAKernelAreZeroInReusedMemory) {
  const std::size_t saved = cache_stats().limit_bytes;
  set_cache_limit(std::size_t{256} << 20);
  empty_cache();
  const int64_t H = 4, E = 64, T = 4096;  // (T, H, E) float32: 4 MiB, cached when freed
  Generator gen(11);
  const Tensor q = randn({T, H, E}, gen), k = randn({T, H, E}, gen), v = randn({T, H, E}, gen),
               dout = randn({T, H, E}, gen);
  Tensor cu_q = Tensor::empty({4}, DType::kInt32), cu_k = Tensor::empty({4}, DType::kInt32);
  const int32_t cq[4] = {0, 3000, T, T}, ck[4] = {0, 0, 1096, T};  // (L, S): (3000, 0), (1096, 1096), (0, 3000)
  for (int i = 0; i < 4; ++i) cu_q.data_as<int32_t>()[i] = cq[i], cu_k.data_as<int32_t>()[i] = ck[i];
  std::vector<const void*> dirty_blocks;
  {
    std::vector<Tensor> dirty;
    for (int i = 0; i < 8; ++i) {
      dirty.push_back(Tensor::full({T, H, E}, NAN));
      dirty_blocks.push_back(dirty.back().raw_data());
    }
  }
  ASSERT_EQ(cache_stats().cached_blocks, 8u);
  SdpaOptions o;
  o.is_causal = true;
  o.need_lse = true;
  const SdpaResult r = varlen_attn(q, k, v, cu_q, cu_k, 3000, 3000, o);
  const SdpaGrads g = varlen_attn_backward(dout, q, k, v, cu_q, cu_k, 3000, 3000, r, o);
  for (const Tensor* t : {&r.output, &g.grad_query, &g.grad_key, &g.grad_value}) {  // all reused
    EXPECT_NE(std::find(dirty_blocks.begin(), dirty_blocks.end(), t->raw_data()), dirty_blocks.end());
  }
  expect_all(r.output.slice(0, 0, 3000), 0.0, "output of the sequence without keys");
  expect_all(g.grad_query.slice(0, 0, 3000), 0.0, "grad_query of the sequence without keys");
  expect_all(g.grad_key.slice(0, 1096, T), 0.0, "grad_key of the sequence without queries");
  expect_all(g.grad_value.slice(0, 1096, T), 0.0, "grad_value of the sequence without queries");
  for (const Tensor* t : {&r.output, &g.grad_query, &g.grad_key, &g.grad_value}) {
    for (int64_t i = 0; i < t->numel(); ++i) ASSERT_TRUE(std::isfinite(t->data()[i])) << i;
  }
  empty_cache();
  set_cache_limit(saved);
}

}  // namespace
}  // namespace attn

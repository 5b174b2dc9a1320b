// `attn bench --varlen N`: N packed sequences of random lengths (uniform in [--varlen-min,
// --varlen-max], a fixed seed) through attn::varlen_attn, against the same sequences padded to
// the longest through scaled_dot_product_attention (B = N, L = S = the longest; a key-padding
// mask without --causal; with top-left --causal the padding keys are hidden already), timed
// alternately in one run. Layouts: q (total, H, E), k, v (total, H_kv, E) packed; padded
// (N, H, Lmax, E). The figure of merit is padded time / varlen time: the padded call computes
// N * Lmax^2 (query, key) pairs, varlen sum L_i^2 (halved when causal for both).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <fmt/format.h>
#include <omp.h>

#include "attn/attn.hpp"
#include "attn/varlen.hpp"
#include "bench.hpp"
#include "peak.hpp"

namespace attn::bench {

namespace {
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Rows [from, from + n) of the packed (total, H, E) tensor into batch b of padded (N, H, Lmax, E).
void pad_into(const Tensor& packed, int64_t from, int64_t n, int64_t b, Tensor& padded) {
  const int64_t H = packed.size(1), E = packed.size(2), Lmax = padded.size(2);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(padded.data() + ((b * H + h) * Lmax + t) * E, packed.data() + ((from + t) * H + h) * E,
                  static_cast<size_t>(E) * sizeof(float));
    }
  }
}
}  // namespace

VarlenResult run_varlen_bench(const BenchConfig& c) {
  const int threads = c.threads_or_default();
  omp_set_num_threads(threads);
  VarlenResult r;
  std::mt19937_64 rng(20261124);
  std::uniform_int_distribution<int64_t> len(c.varlen_min, c.varlen_max);
  r.lengths.resize(static_cast<size_t>(c.varlen));
  for (int64_t& l : r.lengths) l = len(rng);
  const int64_t N = c.varlen, H = c.heads, Hkv = c.kv_heads_or_default(), E = c.dim;
  const int64_t Lmax = *std::max_element(r.lengths.begin(), r.lengths.end());
  Tensor cu = Tensor::empty({N + 1}, DType::kInt32);
  int32_t* cup = cu.data_as<int32_t>();
  cup[0] = 0;
  for (int64_t i = 0; i < N; ++i) cup[i + 1] = cup[i] + static_cast<int32_t>(r.lengths[static_cast<size_t>(i)]);
  r.tokens = cup[N];
  r.padded_tokens = N * Lmax;

  Generator gen(7);
  const Tensor q = randn({r.tokens, H, E}, gen), k = randn({r.tokens, Hkv, E}, gen), v = randn({r.tokens, Hkv, E}, gen);
  Tensor qp = Tensor::zeros({N, H, Lmax, E}), kp = Tensor::zeros({N, Hkv, Lmax, E}), vp = Tensor::zeros({N, Hkv, Lmax, E});
  Tensor keep = Tensor::zeros({N, 1, 1, Lmax});  // key padding: 1 = a real key
  for (int64_t b = 0; b < N; ++b) {
    const int64_t n = r.lengths[static_cast<size_t>(b)];
    pad_into(q, cup[b], n, b, qp);
    pad_into(k, cup[b], n, b, kp);
    pad_into(v, cup[b], n, b, vp);
    for (int64_t j = 0; j < n; ++j) keep.data()[b * Lmax + j] = 1.0f;
  }
  SdpaOptions o;
  o.is_causal = c.causal;
  o.enable_gqa = Hkv != H;
  o.num_threads = threads;
  o.need_lse = c.backward;
  o.window_size = {c.window_left, c.window_right};
  o.softcap = c.softcap;
  SdpaOptions op = o;
  if (!c.causal) op.attn_mask = AttnMask::boolean(keep);

  SdpaResult fv, fp;
  Tensor dv, dp;
  if (c.backward) {
    fv = varlen_attn(q, k, v, cu, cu, Lmax, Lmax, o);
    fp = scaled_dot_product_attention(qp, kp, vp, op);
    dv = randn(fv.output.shape(), gen);
    dp = randn(fp.output.shape(), gen);
  }
  auto run_varlen = [&] {
    if (c.backward) return varlen_attn_backward(dv, q, k, v, cu, cu, Lmax, Lmax, fv, o).grad_query;
    return varlen_attn(q, k, v, cu, cu, Lmax, Lmax, o).output;
  };
  auto run_padded = [&] {
    if (c.backward) return scaled_dot_product_attention_backward(dp, qp, kp, vp, fp, op).grad_query;
    return scaled_dot_product_attention(qp, kp, vp, op).output;
  };
  for (int i = 0; i < c.warmup; ++i) {
    run_varlen();
    run_padded();
  }
  for (int i = 0; i < c.repeats; ++i) {  // alternating, so a slow stretch hits both
    auto t0 = Clock::now();
    run_varlen();
    r.varlen_ms.push_back(ms_since(t0));
    t0 = Clock::now();
    run_padded();
    r.padded_ms.push_back(ms_since(t0));
  }
  return r;
}

std::string format_varlen(const BenchConfig& c, const VarlenResult& r) {
  const double v = median(r.varlen_ms), p = median(r.padded_ms);
  std::string lengths;
  for (int64_t l : r.lengths) lengths += (lengths.empty() ? "" : ", ") + std::to_string(l);
  if (c.json) {
    return fmt::format(
        "{{\"varlen\": {{\"sequences\": {}, \"tokens\": {}, \"padded_tokens\": {}, \"lengths\": [{}], "
        "\"varlen_ms\": {:.4f}, \"padded_ms\": {:.4f}}}, \"heads\": {}, \"kv_heads\": {}, \"dim\": {}, "
        "\"causal\": {}, \"pass\": \"{}\", \"threads\": {}, \"repeats\": {}}}\n",
        c.varlen, r.tokens, r.padded_tokens, lengths, v, p, c.heads, c.kv_heads_or_default(), c.dim,
        c.causal, c.backward ? "backward" : "forward", c.threads_or_default(), c.repeats);
  }
  return fmt::format(
      "{:<12} varlen_attn vs scaled_dot_product_attention on the same sequences padded\n"
      "{:<12} {} sequences ({}), {} tokens, padded to {} tokens\n"
      "{:<12} H={} Hkv={} E={}{}, {}, {} threads\n"
      "{:<12} {:.3f} ms varlen, {:.3f} ms padded (medians of {})\n{:<12} {:.2f}x\n",
      "bench", "sequences", c.varlen, lengths, r.tokens, r.padded_tokens, "shape", c.heads,
      c.kv_heads_or_default(), c.dim, c.causal ? ", causal" : ", not causal",
      c.backward ? "backward" : "forward", c.threads_or_default(), "median", v, p, c.repeats,
      "padded/var", p / v);
}

}  // namespace attn::bench

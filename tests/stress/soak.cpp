// attn_soak: random scaled_dot_product_attention problems for a given time, the fused kernel held
// to the float32 reference against the float64 truth (scripts/soak.sh).
//
//   attn_soak SECONDS [--seed N] [--replay SEED] [--verbose] [--accuracy-warn-only]
//
// Every iteration draws, from its own seed (base seed + iteration number, so any failure can be
// replayed alone with --replay), a problem: rank 2-4, B, H_q, H_kv (GQA), L, S, E, Ev from 1 up to
// moderate sizes with the kernel's block edges (31..33, 63..65, 127..129) favoured; no mask, a
// boolean or additive mask (full, broadcast, or a strided view; sometimes with fully masked rows),
// or is_causal with either alignment; Philox dropout; a custom scale; need_lse / need_weights;
// inputs that are contiguous, (B, L, H, E) transposed views, row-padded slices, column-strided
// (copied by the kernel) or stride-0 expanded heads; the kernel build (AVX-512, AVX2, generic)
// and 1-4 OpenMP threads. Checks, each a failure if broken:
//   output:  max|fused - f64| <= 2 * max|reference - f64| + floor      (FlashAttention's rule)
//            floor = 1e-6 + 2^-23 * max|lse| * max(1, max|v|) / (1 - dropout_p): a float32
//            logit of magnitude |s| is itself rounded by up to 2^-24 |s| (then exp2/exp adds as
//            much), a relative error of every weight near the row's max that no float32 kernel
//            avoids; at |logits| ~ 100 it is ~1e-5 and both kernels land anywhere below it
//   weights: the same rule without the max|v| factor, when asked for
//   lse:     max|fused - f64| <= 2 * max|reference - f64| + 1e-5 * max(1, max|lse|)
//   NaN only where the float64 truth has NaN (the inputs are finite, so nowhere)
//   the fused output is bit-identical for a second thread count
// A broken error bound is an accuracy failure; anything else (NaN or infinity where the truth is
// finite, different bits per thread count, an exception, a non-finite reference) is a hard one.
// Prints a summary (iterations, failures, the largest error ratio fused/reference) and exits 1
// if anything failed (with --accuracy-warn-only, as sanitize.sh runs it: if a hard failure
// occurred), 2 on bad arguments.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace {

using attn::AttnMask;
using attn::CausalAlignment;
using attn::DropoutRng;
using attn::SdpaBackend;
using attn::SdpaOptions;
using attn::SdpaResult;
using attn::Shape;
using attn::Tensor;
using attn::TensorView;

constexpr float kInf = std::numeric_limits<float>::infinity();

// True if `kernel` is "" (the registry chooses) or a registered kernel this CPU runs: a lower
// build is forced by name only where it can run, so a run means the same on any machine.
bool runs_here(const std::string& kernel) {
  if (kernel.empty()) return true;
  for (const attn::SdpaKernelInfo& k : attn::sdpa_kernels()) {
    if (k.name == kernel) return k.runs_on_this_cpu;
  }
  return false;
}

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  bool coin(double p) { return real(0.0, 1.0) < p; }
  template <typename T>
  T pick(std::initializer_list<T> xs) {
    return xs.begin()[uniform(0, static_cast<int64_t>(xs.size()) - 1)];
  }
  // A length with the kernel's block edges (32 queries, 64 keys; 16 on AVX2) over-represented.
  int64_t length(int64_t max) {
    int64_t n;
    switch (uniform(0, 3)) {
      case 0: n = uniform(1, 16); break;
      case 1: n = pick<int64_t>({15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193}); break;
      default: n = uniform(1, max); break;
    }
    return std::min(n, max);
  }
  int64_t dim() {
    switch (uniform(0, 2)) {
      case 0: return uniform(1, 12);
      case 1: return pick<int64_t>({16, 24, 31, 32, 33, 48, 64, 65, 80, 96, 112, 128, 160, 256});
      default: return uniform(1, 160);
    }
  }
};

enum class Layout { kContiguous, kTransposedHeads, kPaddedRows, kColumnStrided, kExpandedHeads };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contig";
    case Layout::kTransposedHeads: return "BLHE";
    case Layout::kPaddedRows: return "padded";
    case Layout::kColumnStrided: return "colstrided";
    case Layout::kExpandedHeads: return "expanded";
  }
  return "?";
}

// An input tensor of logical shape `shape` (rank 2-4, (..., rows, cols)) in the given layout: the
// storage is owned by `store`, the returned view has the requested shape and the layout's strides.
TensorView make_input(Rng& rng, const Shape& shape, Layout layout, float scale, Tensor& store) {
  const int nd = shape.ndim();
  const int64_t rows = shape[nd - 2], cols = shape[nd - 1];
  auto fill = [&](Tensor& t) {
    std::normal_distribution<float> n(0.0f, scale);
    for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = n(rng.g);
  };
  switch (layout) {
    case Layout::kTransposedHeads:
      if (nd >= 3) {  // (.., rows, H, cols) viewed as (.., H, rows, cols)
        Shape s = shape;
        s[nd - 3] = rows;
        s[nd - 2] = shape[nd - 3];
        store = Tensor::empty(s);
        fill(store);
        return store.transpose(nd - 3, nd - 2);
      }
      break;
    case Layout::kPaddedRows: {  // rows of cols + pad floats, sliced to cols
      Shape s = shape;
      s[nd - 1] = cols + rng.uniform(1, 9);
      store = Tensor::empty(s);
      fill(store);
      return store.slice(nd - 1, 0, cols);
    }
    case Layout::kColumnStrided: {  // (.., cols, rows) transposed: last-dim stride = rows
      Shape s = shape;
      s[nd - 2] = cols;
      s[nd - 1] = rows;
      store = Tensor::empty(s);
      fill(store);
      return store.transpose(nd - 2, nd - 1);
    }
    case Layout::kExpandedHeads:
      if (nd >= 3 && shape[nd - 3] > 1) {  // one head's data, stride 0 over the heads
        Shape s = shape;
        s[nd - 3] = 1;
        store = Tensor::empty(s);
        fill(store);
        return store.expand(shape);
      }
      break;
    case Layout::kContiguous:
      break;
  }
  store = Tensor::empty(shape);
  fill(store);
  return store;
}

struct Problem {
  uint64_t seed = 0;
  std::string text;  // one line describing everything drawn
  Tensor qs, ks, vs, ms;
  TensorView q, k, v;
  SdpaOptions options;
  int threads_a = 1, threads_b = 2;
  std::string kernel;  // fused kernel forced by name; "" = the registry's choice
  double cost = 0;  // B*H*L*S*(E+Ev)
};

Problem draw(uint64_t seed) {
  Rng rng(seed);
  Problem p;
  p.seed = seed;
  const int nd = static_cast<int>(rng.pick<int64_t>({4, 4, 4, 3, 2}));
  int64_t B = rng.uniform(1, 3), Hkv = rng.uniform(1, 3), group = rng.pick<int64_t>({1, 1, 2, 3, 4});
  if (nd == 2) Hkv = group = 1;
  const int64_t Hq = Hkv * group;
  int64_t L = rng.length(320), S = rng.length(320);
  int64_t E = rng.dim(), Ev = rng.dim();
  // Keep the float64 truth affordable: at most ~1.2e7 multiply-adds per iteration.
  const int64_t lead = (nd == 4 ? B : 1) * (nd >= 3 ? Hq : 1);
  while (static_cast<double>(lead) * L * S * (E + Ev) > 1.2e7) {
    if (L >= S && L > 1) L = (L + 1) / 2;
    else if (S > 1) S = (S + 1) / 2;
    else if (E >= Ev && E > 1) E = (E + 1) / 2;
    else Ev = (Ev + 1) / 2;
  }
  p.cost = static_cast<double>(lead) * L * S * (E + Ev);
  auto shape_of = [&](int64_t heads, int64_t rows, int64_t cols) {
    if (nd == 4) return Shape{B, heads, rows, cols};
    if (nd == 3) return Shape{heads, rows, cols};
    return Shape{rows, cols};
  };
  SdpaOptions& o = p.options;
  o.enable_gqa = group > 1 || (nd >= 3 && rng.coin(0.1));

  const Layout layouts[] = {Layout::kContiguous, Layout::kContiguous, Layout::kTransposedHeads,
                            Layout::kPaddedRows, Layout::kColumnStrided, Layout::kExpandedHeads};
  const Layout lq = layouts[rng.uniform(0, 4)];  // no stride-0 heads for the query (it is fine,
  const Layout lk = layouts[rng.uniform(0, 5)];  // but the output would repeat; keep q varied)
  const Layout lv = layouts[rng.uniform(0, 5)];
  const float qscale = rng.pick<float>({1.0f, 1.0f, 2.0f, 4.0f});
  p.q = make_input(rng, shape_of(Hq, L, E), lq, qscale, p.qs);
  p.k = make_input(rng, shape_of(Hkv, S, E), lk, 1.0f, p.ks);
  p.v = make_input(rng, shape_of(Hkv, S, Ev), lv, 1.0f, p.vs);

  // Masking.
  std::string mask_text = "none";
  const int64_t mask_kind = rng.uniform(0, 6);
  if (mask_kind == 1 || mask_kind == 2) {
    o.is_causal = true;
    o.causal_alignment = mask_kind == 1 ? CausalAlignment::kTopLeft : CausalAlignment::kBottomRight;
    mask_text = mask_kind == 1 ? "causal-TL" : "causal-BR";
  } else if (mask_kind == 3 || mask_kind == 4) {
    const bool boolean = mask_kind == 3;
    // Shape: the full (lead..., L, S), or a broadcast one.
    Shape ms = shape_of(Hq, L, S);
    const int64_t form = rng.uniform(0, 3);
    std::string form_text = "full";
    if (form == 1) {
      ms = Shape{L, S};
      form_text = "LS";
    } else if (form == 2 && nd == 4) {
      ms = Shape{B, 1, L, S};
      form_text = "B1LS";
    }
    const bool strided = form == 3;  // a transposed (S, L) tensor viewed as (L, S)
    if (strided) {
      p.ms = Tensor::empty(Shape{S, L});
      form_text = "LS-strided";
    } else {
      p.ms = Tensor::empty(ms);
    }
    const double keep = rng.pick<double>({0.9, 0.7, 0.4, 0.1});
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int64_t i = 0; i < p.ms.numel(); ++i) {
      const bool in = rng.coin(keep);
      p.ms.data()[i] = boolean ? (in ? 1.0f : 0.0f) : (in ? n(rng.g) : -kInf);
    }
    TensorView mv = strided ? p.ms.t() : TensorView(p.ms);
    if (rng.coin(0.3)) {  // a fully masked row
      const int64_t row = rng.uniform(0, L - 1);
      TensorView r = mv;
      while (r.dim() > 2) r = r.select(0, 0);
      for (int64_t j = 0; j < S; ++j) r.at({row, j}) = boolean ? 0.0f : -kInf;
      form_text += "+deadrow";
    }
    o.attn_mask = boolean ? AttnMask::boolean(mv) : AttnMask::additive(mv);
    mask_text = std::string(boolean ? "bool-" : "add-") + form_text + "-keep" + std::to_string(keep).substr(0, 3);
  }
  if (rng.coin(0.3)) {
    o.dropout_p = rng.pick<float>({0.1f, 0.3f, 0.5f, 0.9f, 1.0f});
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = rng.g();
    o.dropout_offset = rng.g() % 1000;
  }
  if (rng.coin(0.2)) o.scale = rng.real(0.01, 1.5);
  o.need_lse = rng.coin(0.5);
  o.need_weights = rng.coin(0.3);
  p.threads_a = static_cast<int>(rng.uniform(0, 4));  // 0: OpenMP's default
  p.threads_b = static_cast<int>(rng.uniform(1, 4));
  p.kernel = rng.pick<std::string>({"", "", "cpu.flash.avx2", "cpu.flash.generic"});
  if (!runs_here(p.kernel)) p.kernel.clear();

  char buf[512];
  std::snprintf(buf, sizeof buf,
                "rank%d B%lld Hq%lld Hkv%lld%s L%lld S%lld E%lld Ev%lld q:%s*%g k:%s v:%s mask:%s p%.1f "
                "scale:%s lse%d w%d threads%d/%d kernel:%s",
                nd, static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Hkv),
                o.enable_gqa ? "(gqa)" : "", static_cast<long long>(L), static_cast<long long>(S),
                static_cast<long long>(E), static_cast<long long>(Ev), layout_name(lq), qscale, layout_name(lk),
                layout_name(lv), mask_text.c_str(), o.dropout_p,
                o.scale ? std::to_string(*o.scale).c_str() : "default", o.need_lse, o.need_weights,
                p.threads_a, p.threads_b, p.kernel.empty() ? "best" : p.kernel.c_str());
  p.text = buf;
  return p;
}

// max |a - truth| over elements; NaN where the truth is not NaN (or the reverse) is infinite
// error; equal values (including equal infinities) are 0.
double max_err(const std::vector<float>& a, const std::vector<double>& truth) {
  if (a.size() != truth.size()) return std::numeric_limits<double>::infinity();
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], t = truth[i];
    if (std::isnan(x) || std::isnan(t)) {
      if (std::isnan(x) != std::isnan(t)) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (x == t) continue;
    const double d = std::fabs(x - t);
    m = std::max(m, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
  }
  return m;
}

double max_abs_finite(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

struct Stats {
  long iterations = 0, failures = 0, hard_failures = 0;
  double max_ratio = 0.0;     // max err_fused / err_ref (over outputs with err_ref > 0)
  double max_budget = 0.0;    // max err_fused / (2 err_ref + 1e-6): must stay <= 1
  std::string worst;          // the problem with max_budget
  long with_mask = 0, causal = 0, dropout = 0, gqa = 0, strided = 0, weights = 0, lse = 0;
  double cost = 0;
};

std::vector<float> values(const Tensor& t) { return t.defined() ? t.to_vector() : std::vector<float>{}; }

// Runs one problem; returns an empty string when every check holds, else what failed, with
// `hard` set unless only error bounds were exceeded.
std::string check(const Problem& p, Stats& st, bool verbose, bool& hard) {
  hard = false;
  SdpaOptions ref = p.options;
  ref.backend = SdpaBackend::kReference;
  SdpaOptions fused = p.options;
  fused.backend = SdpaBackend::kFused;
  fused.kernel = p.kernel;
  fused.num_threads = p.threads_a;

  const SdpaResult r = attn::scaled_dot_product_attention(p.q, p.k, p.v, ref);
  const SdpaResult f = attn::scaled_dot_product_attention(p.q, p.k, p.v, fused);
  SdpaOptions truth_options = ref;
  truth_options.need_lse = true;  // the LSE bounds the logits for the error floor
  const attn::reference::SdpaResultF64 t =
      attn::reference::scaled_dot_product_attention_f64(p.q, p.k, p.v, truth_options);
  std::string fail, detail;
  char buf[256];

  const double inv_keep = p.options.dropout_p < 1.0f ? 1.0 / (1.0 - p.options.dropout_p) : 1.0;
  const double logit_rounding = 0x1p-23 * max_abs_finite(t.lse) * inv_keep;
  double vmax = 1.0;
  for (float x : p.v.to_vector()) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  const double floor = 1e-6 + logit_rounding * vmax;
  const double ref_err = max_err(values(r.output), t.output);
  const double fused_err = max_err(values(f.output), t.output);
  const double allowed = 2.0 * ref_err + floor;
  if (!std::isfinite(ref_err)) {
    fail += " reference output has NaN/inf where the float64 truth does not (or the reverse);";
    hard = true;
  }
  if (!std::isfinite(fused_err)) {
    fail += " fused output has NaN/inf where the float64 truth does not (or the reverse);";
    hard = true;
  } else if (!(fused_err <= allowed)) {
    std::snprintf(buf, sizeof buf, " output: fused err %.3g > 2 * ref err %.3g + floor %.3g;", fused_err,
                  ref_err, floor);
    fail += buf;
  }
  if (std::isfinite(fused_err)) {
    const double budget = fused_err / allowed;
    if (budget > st.max_budget) {
      st.max_budget = budget;
      st.worst = "seed " + std::to_string(p.seed) + ": " + p.text;
    }
    if (ref_err > 0.0) st.max_ratio = std::max(st.max_ratio, fused_err / ref_err);
  }
  if (p.options.need_weights) {
    const double rw = max_err(values(r.attn_weights), t.attn_weights);
    const double fw = max_err(values(f.attn_weights), t.attn_weights);
    hard = hard || !std::isfinite(fw) || !std::isfinite(rw);
    std::snprintf(buf, sizeof buf, ", weights ref err %.3g fused err %.3g", rw, fw);
    detail += buf;
    if (!(fw <= 2.0 * rw + 1e-6 + logit_rounding)) {
      std::snprintf(buf, sizeof buf, " weights: fused err %.3g > 2 * ref err %.3g + floor %.3g;", fw, rw,
                    1e-6 + logit_rounding);
      fail += buf;
    }
  }
  if (p.options.need_lse) {
    const double rl = max_err(values(r.lse), t.lse);
    const double fl = max_err(values(f.lse), t.lse);
    const double tol = 2.0 * rl + 1e-5 * std::max(1.0, max_abs_finite(t.lse));
    hard = hard || !std::isfinite(fl) || !std::isfinite(rl);
    std::snprintf(buf, sizeof buf, ", lse ref err %.3g fused err %.3g", rl, fl);
    detail += buf;
    if (!(fl <= tol)) {
      std::snprintf(buf, sizeof buf, " lse: fused err %.3g > %.3g (ref err %.3g);", fl, tol, rl);
      fail += buf;
    }
  }
  // The same bits for another thread count.
  fused.num_threads = p.threads_b;
  const SdpaResult f2 = attn::scaled_dot_product_attention(p.q, p.k, p.v, fused);
  const std::vector<float> a = values(f.output), b = values(f2.output);
  if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) {
    fail += " output differs between thread counts;";
    hard = true;
  }

  ++st.iterations;
  st.cost += p.cost;
  st.with_mask += p.options.attn_mask.has_value();
  st.causal += p.options.is_causal;
  st.dropout += p.options.dropout_p > 0.0f;
  st.gqa += p.options.enable_gqa;
  st.weights += p.options.need_weights;
  st.lse += p.options.need_lse;
  st.strided += p.text.find("q:contig") == std::string::npos || p.text.find("k:contig") == std::string::npos ||
                p.text.find("v:contig") == std::string::npos;
  if (verbose) {
    std::printf("  %s: output ref err %.3g fused err %.3g%s%s\n", p.text.c_str(), ref_err, fused_err, detail.c_str(),
                fail.empty() ? "" : " FAIL");
  }
  return fail;
}

int usage() {
  std::fprintf(stderr, "usage: attn_soak SECONDS [--seed N] [--replay SEED] [--verbose] [--accuracy-warn-only]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = -1.0;
  uint64_t base_seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  bool replay = false, verbose = false, accuracy_warn_only = false;
  uint64_t replay_seed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    char* end = nullptr;
    if (a == "--seed" && i + 1 < argc) {
      base_seed = std::strtoull(argv[++i], &end, 0);
    } else if (a == "--replay" && i + 1 < argc) {
      replay = true;
      replay_seed = std::strtoull(argv[++i], &end, 0);
    } else if (a == "--verbose") {
      verbose = true;
    } else if (a == "--accuracy-warn-only") {
      accuracy_warn_only = true;
    } else if (seconds < 0 && !a.empty() && a[0] != '-') {
      seconds = std::strtod(a.c_str(), &end);
      if (end == a.c_str() || *end != '\0' || !(seconds >= 0)) return usage();
    } else {
      return usage();
    }
  }
  if (!replay && seconds < 0) return usage();

  Stats st;
  try {
    if (replay) {
      const Problem p = draw(replay_seed);
      bool hard = false;
      const std::string fail = check(p, st, true, hard);
      std::printf("replay seed %llu: %s\n", static_cast<unsigned long long>(replay_seed), fail.empty() ? "ok" : fail.c_str());
      return fail.empty() ? 0 : 1;
    }
    std::printf("attn_soak: %.0f s, base seed %llu (iteration i uses seed base + i; --replay SEED reruns one)\n",
                seconds, static_cast<unsigned long long>(base_seed));
    std::fflush(stdout);
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    auto next_report = start + std::chrono::seconds(30);
    for (uint64_t it = 0;; ++it) {
      const auto now = Clock::now();
      if (std::chrono::duration<double>(now - start).count() >= seconds) break;
      if (now >= next_report) {
        std::printf("  ... %ld iterations, %ld failures, max ratio %.3f\n", st.iterations, st.failures, st.max_ratio);
        std::fflush(stdout);
        next_report += std::chrono::seconds(30);
      }
      const uint64_t seed = base_seed + it;
      const Problem p = draw(seed);
      std::string fail;
      bool hard = false;
      try {
        fail = check(p, st, verbose, hard);
      } catch (const std::exception& e) {
        ++st.iterations;
        fail = std::string(" threw: ") + e.what();
        hard = true;
      }
      if (!fail.empty()) {
        ++st.failures;
        st.hard_failures += hard;
        if (st.failures <= 20 || hard) {
          std::printf("FAIL%s seed %llu: %s:%s\n", hard ? " (hard)" : "", static_cast<unsigned long long>(seed),
                      p.text.c_str(), fail.c_str());
          std::fflush(stdout);
        }
      }
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf(
        "attn_soak: %ld iterations in %.1f s, %ld failures (%ld hard); max error ratio fused/reference %.3f, "
        "max share of the allowed error (2*ref+floor) %.3f\n"
        "  problems: %ld with attn_mask, %ld causal, %ld dropout, %ld GQA, %ld strided inputs, %ld weights, "
        "%ld lse; %.2g multiply-adds per iteration on average\n"
        "  closest to the limit: %s\n",
        st.iterations, elapsed, st.failures, st.hard_failures, st.max_ratio, st.max_budget, st.with_mask, st.causal, st.dropout,
        st.gqa, st.strided, st.weights, st.lse, st.iterations > 0 ? st.cost / static_cast<double>(st.iterations) : 0.0,
        st.worst.empty() ? "-" : st.worst.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attn_soak: error: %s\n", e.what());
    return 1;
  }
  const long counted = accuracy_warn_only ? st.hard_failures : st.failures;
  return counted == 0 && st.iterations > 0 ? 0 : 1;
}

// `attn bench` (see bench.hpp).
#include "bench.hpp"

#include <fmt/format.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ostream>

#include "attn/random.hpp"
#include "peak.hpp"

// OpenBLAS's extensions, declared weak rather than taken from <cblas.h>: Debian's cblas.h is an
// alternatives link that may name another CBLAS, and with a BLAS other than OpenBLAS these stay
// null and the tool reports "unknown" instead of failing to link or load.
extern "C" {
__attribute__((weak)) char* openblas_get_corename(void);
__attribute__((weak)) char* openblas_get_config(void);
__attribute__((weak)) void openblas_set_num_threads(int num_threads);
}

namespace attn::bench {
namespace {

std::string trim(std::string s) {
  const auto first = s.find_first_not_of(" \t\n");
  if (first == std::string::npos) return {};
  const auto last = s.find_last_not_of(" \t\n");
  return s.substr(first, last - first + 1);
}

std::string json_string(const std::string& s) {
  std::string r = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      r += '\\';
      r += ch;
    } else if (c < 0x20) {
      r += fmt::format("\\u{:04x}", c);
    } else {
      r += ch;
    }
  }
  return r + "\"";
}

// A JSON number with `decimals` digits after the point; JSON has no inf or nan, so those are null.
std::string json_number(double x, int decimals) {
  if (!std::isfinite(x)) return "null";
  return fmt::format("{:.{}f}", x, decimals);
}

double max_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux reports KiB
}

std::string shape_text(const BenchConfig& c) {
  return fmt::format("B={} H={} Hkv={} L={} S={} E={}", c.batch, c.heads, c.kv_heads_or_default(),
                     c.seq, c.seq_kv_or_default(), c.dim);
}

std::string blas_text(const BenchResult& r) {
  std::string s = r.blas_core;
  if (!r.blas_config.empty()) s += fmt::format(" ({})", r.blas_config);
  if (!r.openblas_coretype.empty()) s += fmt::format(", OPENBLAS_CORETYPE={}", r.openblas_coretype);
  return s;
}

}  // namespace

int BenchConfig::threads_or_default() const { return threads.value_or(omp_get_num_procs()); }

std::optional<std::string> validate(const BenchConfig& c) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"--batch", c.batch}, {"--heads", c.heads},         {"--kv-heads", c.kv_heads_or_default()},
      {"--seq", c.seq},     {"--seq-kv", c.seq_kv_or_default()}, {"--dim", c.dim},
  };
  for (const auto& [flag, value] : sizes) {
    if (value <= 0) return fmt::format("{} must be a positive integer (got {})", flag, value);
  }
  if (c.heads % c.kv_heads_or_default() != 0) {
    return fmt::format("--heads ({}) must be a multiple of --kv-heads ({})", c.heads,
                       c.kv_heads_or_default());
  }
  if (c.threads && *c.threads <= 0) {
    return fmt::format("--threads must be a positive integer (got {})", *c.threads);
  }
  if (c.repeats <= 0) return fmt::format("--repeats must be a positive integer (got {})", c.repeats);
  if (c.warmup < 0) return fmt::format("--warmup must be zero or more (got {})", c.warmup);
  if (c.impl != "fused" && c.impl != "reference" && c.impl != "auto") {
    return fmt::format("--impl must be fused, reference or auto (got '{}')", c.impl);
  }
  if (c.dtype != "f32" && c.dtype != "bf16" && c.dtype != "f16" && c.dtype != "f64") {
    return fmt::format("--dtype must be f32, bf16, f16 or f64 (got '{}')", c.dtype);
  }
  if (!c.kernel.empty()) {
    std::string names;
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      if (k.name == c.kernel) return std::nullopt;
      names += (names.empty() ? "" : ", ") + k.name;
    }
    return fmt::format("--kernel must be one of {} (got '{}')", names, c.kernel);
  }
  return std::nullopt;
}

SdpaBackend backend_of(const std::string& impl) {
  if (impl == "fused") return SdpaBackend::kFused;
  if (impl == "reference") return SdpaBackend::kReference;
  return SdpaBackend::kAuto;
}

DType dtype_of(const std::string& dtype) {
  if (dtype == "bf16") return DType::kBFloat16;
  if (dtype == "f16") return DType::kFloat16;
  if (dtype == "f64") return DType::kFloat64;
  return DType::kFloat32;
}

double attention_flops(const BenchConfig& c) {
  const double L = static_cast<double>(c.seq), S = static_cast<double>(c.seq_kv_or_default());
  double pairs = L * S;
  if (c.causal) {
    if (c.seq == c.seq_kv_or_default()) {
      pairs = L * S / 2.0;  // FlashAttention's convention
    } else {
      // Top-left alignment: query i sees keys 0..min(i, S-1), i.e. min(i + 1, S) of them.
      const double full = std::max(0.0, L - S);  // queries i >= S see every key
      const double partial = L - full;           // queries i < S see i + 1 keys
      pairs = full * S + partial * (partial + 1.0) / 2.0;
    }
  }
  const double forward = 4.0 * static_cast<double>(c.batch) * static_cast<double>(c.heads) *
                         pairs * static_cast<double>(c.dim);
  return c.backward ? 2.5 * forward : forward;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

BenchResult run_bench(const BenchConfig& c) {
  using Clock = std::chrono::steady_clock;
  const int threads = c.threads_or_default();
  omp_set_num_threads(threads);
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(threads);

  BenchResult r;
  r.blas_core = openblas_get_corename != nullptr ? trim(openblas_get_corename()) : "unknown";
  r.blas_config = openblas_get_config != nullptr ? trim(openblas_get_config()) : "";
  if (const char* coretype = std::getenv("OPENBLAS_CORETYPE")) r.openblas_coretype = coretype;

  Generator gen(0);  // the same inputs on every run
  const int64_t kv_heads = c.kv_heads_or_default(), seq_kv = c.seq_kv_or_default();
  const DType dtype = dtype_of(c.dtype);
  const Tensor q = randn({c.batch, c.heads, c.seq, c.dim}, gen).to(dtype);
  const Tensor k = randn({c.batch, kv_heads, seq_kv, c.dim}, gen).to(dtype);
  const Tensor v = randn({c.batch, kv_heads, seq_kv, c.dim}, gen).to(dtype);

  SdpaOptions options;
  options.is_causal = c.causal;
  options.enable_gqa = kv_heads != c.heads;
  options.backend = backend_of(c.impl);
  options.kernel = c.kernel;
  options.num_threads = threads;
  // Which kernel the timed calls run; throws (before any timing) as the call would.
  r.kernel = sdpa_kernel_name(q, k, v, options);
  r.cpu = cpu_description();
  // The roof is the peak of the unit the kernel's products run on, measured now, on as many
  // threads: the BF16 dot unit for the native bf16 kernel, the FMA unit for every float32
  // kernel (also when it takes 16-bit inputs widened). A backward runs the float32 kernels.
  std::optional<PeakResult> peak;
  if (r.kernel == "cpu.flash.avx512_bf16" && !c.backward) peak = measure_bf16_dot_peak(threads);
  r.unit = peak ? "bf16-dot" : "fma";
  if (!peak) peak = measure_fma_peak(threads);
  r.peak_gflops = peak->gflops;
  r.simd = peak->isa;

  SdpaResult saved;
  Tensor dout;
  if (c.backward) {
    options.need_lse = true;
    saved = scaled_dot_product_attention(q, k, v, options);
    dout = randn(saved.output.shape(), gen).to(dtype);
  }
  const auto call = [&] {
    if (c.backward) return scaled_dot_product_attention_backward(dout, q, k, v, saved, options).grad_query;
    return scaled_dot_product_attention(q, k, v, options).output;
  };
  for (int i = 0; i < c.warmup; ++i) call();
  r.times_ms.reserve(static_cast<size_t>(c.repeats));
  for (int i = 0; i < c.repeats; ++i) {
    const auto start = Clock::now();
    const Tensor out = call();
    const auto stop = Clock::now();  // `out` is freed after the clock stops
    r.times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  r.median_ms = median(r.times_ms);
  r.min_ms = *std::min_element(r.times_ms.begin(), r.times_ms.end());
  r.gflops = attention_flops(c) / (r.median_ms * 1e-3) * 1e-9;
  r.peak_ratio = r.peak_gflops > 0.0 ? r.gflops / r.peak_gflops : 0.0;
  r.max_rss_mib = max_rss_mib();
  return r;
}

std::string format_json(const BenchConfig& c, const BenchResult& r) {
  std::string times;
  for (const double t : r.times_ms) times += (times.empty() ? "" : ", ") + json_number(t, 4);
  return fmt::format(
      "{{\"impl\": {}, \"kernel\": {}, \"dtype\": {}, \"unit\": {}, \"pass\": {}, \"batch\": {}, \"heads\": {}, \"kv_heads\": {}, \"seq\": {}, "
      "\"seq_kv\": {}, \"dim\": {}, \"causal\": {}, \"threads\": {}, \"repeats\": {}, "
      "\"warmup\": {}, \"median_ms\": {}, \"min_ms\": {}, \"gflops\": {}, \"peak_gflops\": {}, "
      "\"peak_ratio\": {}, \"max_rss_mib\": {}, \"blas_core\": {}, \"blas_config\": {}, "
      "\"openblas_coretype\": {}, \"simd\": {}, \"cpu\": {}, \"times_ms\": [{}]}}\n",
      json_string(c.impl), json_string(r.kernel), json_string(c.dtype), json_string(r.unit), json_string(c.backward ? "backward" : "forward"), c.batch, c.heads, c.kv_heads_or_default(), c.seq,
      c.seq_kv_or_default(), c.dim, c.causal, c.threads_or_default(), c.repeats, c.warmup,
      json_number(r.median_ms, 4), json_number(r.min_ms, 4), json_number(r.gflops, 3),
      json_number(r.peak_gflops, 3), json_number(r.peak_ratio, 5), json_number(r.max_rss_mib, 1),
      json_string(r.blas_core), json_string(r.blas_config),
      r.openblas_coretype.empty() ? "null" : json_string(r.openblas_coretype), json_string(r.simd),
      json_string(r.cpu), times);
}

std::string format_table(const BenchConfig& c, const BenchResult& r) {
  std::string s;
  const auto row = [&s](const char* key, const std::string& value) {
    s += fmt::format("{:<12} {}\n", key, value);
  };
  row("impl", c.impl);
  row("kernel", r.kernel);
  row("dtype", c.dtype);
  row("pass", c.backward ? "backward (FLOPs: 2.5x the forward's)" : "forward");
  row("shape", shape_text(c) + (c.causal ? ", causal" : ", not causal"));
  row("threads", fmt::format("{}", c.threads_or_default()));
  row("repeats", fmt::format("{} (after {} warmup)", c.repeats, c.warmup));
  row("median", fmt::format("{:.3f} ms", r.median_ms));
  row("min", fmt::format("{:.3f} ms", r.min_ms));
  row("throughput", fmt::format("{:.2f} GFLOP/s", r.gflops));
  row(r.unit == "fma" ? "FMA peak" : "BF16 peak", fmt::format("{:.2f} GFLOP/s ({})", r.peak_gflops, r.simd));
  row("of peak", fmt::format("{:.1f} %", 100.0 * r.peak_ratio));
  row("peak RSS", fmt::format("{:.1f} MiB", r.max_rss_mib));
  row("BLAS core", blas_text(r));
  row("CPU", r.cpu);
  return s;
}

std::string format_kernels() {
  std::string s = fmt::format("CPU: {}\n", cpu_description());
  for (const SdpaKernelInfo& k : sdpa_kernels()) {
    std::string dtypes;
    for (DType d : k.dtypes) dtypes += fmt::format("{}{}", dtypes.empty() ? "" : ",", dtype_name(d));
    s += fmt::format("{:<22} {:<9} {:<33} {}\n", k.name,
                     k.family == SdpaBackend::kReference ? "reference" : "fused", dtypes,
                     !k.runs_on_this_cpu        ? "not here: " + k.reason_if_not
                     : k.auto_declines.empty() ? std::string("runs here")
                                               : "runs here; " + k.auto_declines);
  }
  return s;
}

int run_bench_command(const BenchConfig& c, std::ostream& out, std::ostream& err) {
  if (const auto problem = validate(c)) {
    err << "attn bench: " << *problem << "\n";
    return 2;
  }
  if (c.peak_only) {
    const int threads = c.threads_or_default();
    omp_set_num_threads(threads);
    const PeakResult p = measure_fma_peak(threads);
    const std::optional<PeakResult> bf16 = measure_bf16_dot_peak(threads);
    if (c.json) {
      out << fmt::format("{{\"threads\": {}, \"peak_gflops\": {}, \"simd\": {}, \"lanes\": {}, "
                         "\"bf16_dot_peak_gflops\": {}}}\n",
                         p.threads, json_number(p.gflops, 3), json_string(p.isa), p.lanes,
                         bf16 ? json_number(bf16->gflops, 3) : "null");
    } else {
      out << fmt::format("{:<12} {:.2f} GFLOP/s\n{:<12} {} ({} float lanes)\n{:<12} {}\n",
                         "FMA peak", p.gflops, "ISA", p.isa, p.lanes, "threads", p.threads);
      out << fmt::format("{:<12} {}\n", "BF16 peak",
                         bf16 ? fmt::format("{:.2f} GFLOP/s (vdpbf16ps)", bf16->gflops)
                              : std::string("none (no AVX512-BF16)"));
    }
    return 0;
  }
  const BenchResult r = run_bench(c);
  out << (c.json ? format_json(c, r) : format_table(c, r));
  return 0;
}

}  // namespace attn::bench

// `attn bench` (see bench.hpp).
#include "bench.hpp"

#include "attn/kv_cache.hpp"

#include <fmt/format.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ostream>

#include "attn/error.hpp"
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

// ", not causal", ", causal" (top-left: the text before --causal-align existed) or
// ", causal (bottom-right)".
std::string causal_text(const BenchConfig& c) {
  std::string s = !c.causal ? ", not causal"
                  : c.causal_align == "bottom-right" ? ", causal (bottom-right)" : ", causal";
  if (c.window_left >= 0 || c.window_right >= 0) s += fmt::format(", window ({}, {})", c.window_left, c.window_right);
  if (c.softcap) s += fmt::format(", softcap {}", *c.softcap);
  if (c.alibi) s += ", alibi";
  if (c.sinks) s += ", sinks";
  return s;
}

std::string mib_text(int64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / double(1 << 20));
}

// A copy of `t` with its bytes rotated by `shift` elements: the same values in another order,
// so that no two copies of K/V share a page's contents (a hypervisor merging identical pages
// would otherwise map the copies onto the same memory, and the same cache lines).
Tensor rotated_copy(const Tensor& t, int64_t shift) {
  Tensor r = Tensor::empty(t.shape(), t.dtype());
  const size_t bytes = static_cast<size_t>(t.numel() * t.element_size());
  const size_t cut = static_cast<size_t>((shift % t.numel()) * t.element_size());
  const auto* from = static_cast<const char*>(t.raw_data());
  auto* to = static_cast<char*>(r.raw_data());
  std::memcpy(to, from + cut, bytes - cut);
  std::memcpy(to + (bytes - cut), from, cut);
  return r;
}

std::string one_line(std::string s) {
  for (char& ch : s) {
    if (ch == '\n' || ch == '\r') ch = ' ';
  }
  return s;
}

std::string json_times(const std::vector<double>& times_ms) {
  std::string s;
  for (const double t : times_ms) s += (s.empty() ? "" : ", ") + json_number(t, 4);
  return s;
}

// The read probe's JSON fields (no braces), shared by --peak-only and decode mode.
std::string bandwidth_json(const BandwidthResult& b) {
  return fmt::format("\"bandwidth_gbps\": {}, \"bandwidth_best_gbps\": {}, \"bandwidth_threads\": {}, "
                     "\"bandwidth_bytes\": {}, \"bandwidth_passes\": {}, \"bandwidth_isa\": {}, "
                     "\"llc_bytes\": {}",
                     json_number(b.gbps, 3), json_number(b.best_gbps, 3), b.threads, b.bytes,
                     b.passes, json_string(b.isa), b.llc_bytes);
}

std::string bandwidth_text(const BandwidthResult& b) {
  const std::string llc = b.llc_bytes > 0 ? "LLC " + mib_text(b.llc_bytes) : "LLC unknown";
  return fmt::format("{:.2f} GB/s (read probe, {}: {} threads, {} array, {}; median of {} "
                     "passes, best {:.2f})",
                     b.gbps, b.isa, b.threads, mib_text(b.bytes), llc, b.passes, b.best_gbps);
}

std::string dtype_text(const BenchConfig& c) {
  const std::string kv = c.kv_dtype_or_default();
  if (c.precision != "highest") return fmt::format("{} (float32_matmul_precision {})", c.dtype, c.precision);
  return kv == c.dtype ? c.dtype : fmt::format("{} (q), {} (k, v)", c.dtype, kv);
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
  if (c.precision != "highest" && c.precision != "high" && c.precision != "medium") {
    return fmt::format("--precision must be highest, high or medium (got '{}')", c.precision);
  }
  if (c.precision != "highest" && c.dtype != "f32") {
    return fmt::format("--precision {} applies to --dtype f32 only (got --dtype {})", c.precision, c.dtype);
  }
  if (const std::string kv = c.kv_dtype_or_default();
      c.kv_dtype && kv != "f32" && kv != "bf16" && kv != "f16" && !(kv == "int8" && c.page_size > 0)) {
    return fmt::format("--kv-dtype must be f32, bf16 or f16, or int8 with --page-size (got '{}')", kv);
  }
  if (c.page_size < 0) return fmt::format("--page-size must be positive (got {})", c.page_size);
  if (c.page_size > 0 && (!c.decode() || c.dtype == "f64")) {
    return fmt::format("--page-size decodes: it needs --seq at most {}, no --backward, and --dtype "
                       "f32, bf16 or f16", kDecodeMaxSeq);
  }
  if (c.page_size > 0 && c.causal && c.causal_align != "bottom-right") {
    return "--page-size with --causal needs --causal-align bottom-right (paged_attention's)";
  }
  if (c.causal_align != "top-left" && c.causal_align != "bottom-right") {
    return fmt::format("--causal-align must be top-left or bottom-right (got '{}')", c.causal_align);
  }
  const bool windowed = c.window_left >= 0 || c.window_right >= 0;
  if (c.causal_align == "bottom-right" && !c.causal && !windowed && !c.alibi) {
    return "--causal-align bottom-right needs --causal, a window or --alibi (it places their diagonal)";
  }
  if (c.window_left < -1 || c.window_right < -1) {
    return fmt::format("--window-left and --window-right must be -1 (unbounded) or more (got {}, {})",
                       c.window_left, c.window_right);
  }
  if (c.softcap && !(*c.softcap > 0.0)) return fmt::format("--softcap must be > 0 (got {})", *c.softcap);
  if (c.varlen < 0) return fmt::format("--varlen must be a positive number of sequences (got {})", c.varlen);
  if (c.varlen > 0 && (c.varlen_min < 1 || c.varlen_max < c.varlen_min)) {
    return fmt::format("--varlen-min and --varlen-max must satisfy 1 <= min <= max (got {}, {})",
                       c.varlen_min, c.varlen_max);
  }
  if (c.varlen > 0 && (c.dtype != "f32" || c.page_size > 0 || c.alibi || c.sinks || c.impl != "auto" ||
                       !c.kernel.empty() || c.causal_align != "top-left")) {
    return "--varlen takes --dtype f32, top-left --causal, the window and --softcap, and the default kernel choice";
  }
  if (c.page_size > 0 && (windowed || c.softcap || c.alibi || c.sinks)) {
    return "--page-size does not take the variant flags yet (--window-*, --softcap, --alibi, --sinks)";
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

CausalAlignment alignment_of(const std::string& causal_align) {
  return causal_align == "bottom-right" ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
}

// (query, key) pairs inside a sliding window (and the causal diagonal), counted row by row.
double band_pairs(const BenchConfig& c) {
  const int64_t L = c.seq, S = c.seq_kv_or_default();
  const int64_t off = alignment_of(c.causal_align) == CausalAlignment::kBottomRight ? S - L : 0;
  // A side of L + S or more hides nothing more (and i' - left cannot overflow then).
  const int64_t left = std::min(c.window_left, L + S), right = std::min(c.window_right, L + S);
  double pairs = 0;
  for (int64_t i = 0; i < L; ++i) {
    int64_t lo = 0, hi = S - 1;
    if (left >= 0) lo = std::max<int64_t>(lo, i + off - left);
    if (right >= 0) hi = std::min<int64_t>(hi, i + off + right);
    if (c.causal) hi = std::min<int64_t>(hi, i + off);
    if (hi >= lo) pairs += static_cast<double>(hi - lo + 1);
  }
  return pairs;
}

double attention_flops(const BenchConfig& c) {
  const double L = static_cast<double>(c.seq), S = static_cast<double>(c.seq_kv_or_default());
  double pairs = L * S;
  if (c.window_left >= 0 || c.window_right >= 0) {
    pairs = band_pairs(c);
  } else if (c.causal) {
    if (c.seq == c.seq_kv_or_default()) {
      pairs = L * S / 2.0;  // FlashAttention's convention
    } else if (alignment_of(c.causal_align) == CausalAlignment::kTopLeft) {
      // Top-left alignment: query i sees keys 0..min(i, S-1), i.e. min(i + 1, S) of them.
      const double full = std::max(0.0, L - S);  // queries i >= S see every key
      const double partial = L - full;           // queries i < S see i + 1 keys
      pairs = full * S + partial * (partial + 1.0) / 2.0;
    } else {
      // Bottom-right: query i sees keys j <= i + S - L, i.e. clamp(i + 1 + S - L, 0, S) of them:
      // the last min(L, S) queries see 1 + max(S - L, 0) ... S keys, the others none.
      const double seeing = std::min(L, S);
      pairs = seeing * (S - seeing) + seeing * (seeing + 1.0) / 2.0;
    }
  }
  const double forward = 4.0 * static_cast<double>(c.batch) * static_cast<double>(c.heads) *
                         pairs * static_cast<double>(c.dim);
  return c.backward ? 2.5 * forward : forward;
}

int64_t kv_bytes(const BenchConfig& c) {
  const int64_t rows = c.batch * c.kv_heads_or_default() * c.seq_kv_or_default();
  if (c.kv_dtype_or_default() == "int8") return rows * (c.dim + c.dim + 2 * 4);  // + the scales
  return rows * (c.dim + c.dim) * dtype_size(dtype_of(c.kv_dtype_or_default()));
}

// K and V (B, H_kv, S, E) in a paged cache: sequence b's tokens appended a page at a time, the
// sequences in turn, so that their pages interleave in the pool as an engine's would.
PagedKvCache paged_copy(const Tensor& k, const Tensor& v, int64_t page_size, DType dtype) {
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), E = k.size(3);
  PagedKvCacheOptions o;
  o.page_size = page_size;
  o.num_pages = B * ((S + page_size - 1) / page_size);
  o.heads_kv = H;
  o.head_dim = E;
  o.dtype = dtype;
  PagedKvCache cache(o);
  for (int64_t b = 0; b < B; ++b) cache.add_sequence();
  for (int64_t t0 = 0; t0 < S; t0 += page_size) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t1 = std::min(S, t0 + page_size);
      cache.append(b, k.select(0, b).slice(1, t0, t1).transpose(0, 1),
                   v.select(0, b).slice(1, t0, t1).transpose(0, 1));
    }
  }
  return cache;
}

KvCopies kv_copies(int64_t copy_bytes, int64_t llc_bytes, int64_t available_bytes) {
  const int64_t llc = llc_bytes > 0 ? llc_bytes : int64_t{512} << 20;
  copy_bytes = std::max<int64_t>(copy_bytes, 1);
  KvCopies k;
  // Not 2x: a last-level cache with adaptive replacement keeps a share of a cyclic working set
  // larger than itself (measured on AMD Zen 5, LLC 32 MiB: one 64 MiB float32 copy read 1.16-1.23
  // ms per call, three copies 1.45-1.66 ms).
  if (copy_bytes >= kRotationLlcs * llc) return k;
  k.wanted = std::max<int64_t>((kRotationLlcs * llc + copy_bytes - 1) / copy_bytes + 1, 2);
  k.count = k.wanted;
  if (available_bytes > 0) k.count = std::clamp<int64_t>(available_bytes / 2 / copy_bytes, 1, k.wanted);
  return k;
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
  const bool paged = c.page_size > 0;
  const DType dtype = dtype_of(c.dtype);
  const DType kv_dtype = c.kv_dtype_or_default() == "int8" ? DType::kFloat32 : dtype_of(c.kv_dtype_or_default());
  const DType cache_dtype = c.kv_dtype_or_default() == "int8" ? DType::kInt8 : kv_dtype;
  const Tensor q = randn({c.batch, c.heads, c.seq, c.dim}, gen).to(dtype);
  // Decode mode reads K/V from copies[i % copies.size()] on call i (see the top of bench.hpp).
  std::vector<Tensor> ks, vs;
  ks.push_back(randn({c.batch, kv_heads, seq_kv, c.dim}, gen).to(kv_dtype));
  vs.push_back(randn({c.batch, kv_heads, seq_kv, c.dim}, gen).to(kv_dtype));

  SdpaOptions options;
  options.is_causal = c.causal;
  options.causal_alignment = alignment_of(c.causal_align);
  options.enable_gqa = kv_heads != c.heads;
  options.backend = backend_of(c.impl);
  options.kernel = c.kernel;
  options.allow_fp16_bf16_reduction = c.reduction;
  options.num_threads = threads;
  options.float32_matmul_precision = c.precision == "high"     ? Float32MatmulPrecision::kHigh
                                     : c.precision == "medium" ? Float32MatmulPrecision::kMedium
                                                               : Float32MatmulPrecision::kHighest;
  options.window_size = {c.window_left, c.window_right};
  options.softcap = c.softcap;
  Tensor slopes, sinks;
  if (c.alibi) {
    slopes = Tensor::empty({c.heads});
    for (int64_t h = 0; h < c.heads; ++h) {
      slopes.data()[h] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.heads));
    }
    options.alibi_slopes = slopes;
  }
  if (c.sinks) {
    sinks = randn({c.heads}, gen);
    options.sinks = sinks;
  }
  // Which kernel the timed calls run; throws (before any timing) as the call would. K/V in another
  // dtype than q is the flags' choice: the library refusing it is a usage error.
  try {
    if (paged) {  // paged_attention runs the best decode build
      for (const SdpaKernelInfo& k : sdpa_kernels()) {
        if (r.kernel.empty() && k.name.starts_with("cpu.decode.") && k.runs_on_this_cpu) r.kernel = k.name;
      }
      r.kernel = "paged_attention, " + r.kernel;
    } else {
      r.kernel = sdpa_kernel_name(q, ks.front(), vs.front(), options);
    }
  } catch (const Error& e) {
    if (kv_dtype == dtype) throw;
    throw UsageError(fmt::format("--kv-dtype {} with --dtype {}: {}", c.kv_dtype_or_default(),
                                 c.dtype, one_line(e.what())));
  }
  r.cpu = cpu_description();
  // The roof is the peak of the unit the kernel's products run on, measured now, on as many
  // threads: the AMX tiles or the BF16 dot unit for the native bf16 kernels, the FMA unit for
  // every float32 kernel (also when it takes 16-bit inputs widened). A bf16 backward runs on the
  // BF16 dot unit where the registry runs it natively: cpu.flash.avx512_bf16 forced by name, or
  // where vdpbf16ps does at least 1.5x the FMA rate (registry.cpp; not on the Intel Xeons seen,
  // 0.50x), else widened on the FMA kernel.
  std::optional<PeakResult> peak;
  if (r.kernel == "cpu.flash.amx_bf16" && !c.backward) peak = measure_amx_bf16_peak(threads);
  if (r.kernel == "cpu.flash.avx512_bf16" && !c.backward) peak = measure_bf16_dot_peak(threads);
  const bool native16 = r.kernel == "cpu.flash.amx_bf16" || r.kernel == "cpu.flash.avx512_bf16";
  if (native16 && c.backward && dtype == DType::kBFloat16) {
    const std::optional<PeakResult> dot = measure_bf16_dot_peak(threads);
    if (dot && c.kernel == "cpu.flash.avx512_bf16") {
      peak = dot;
    } else if (dot && dot->gflops >= 1.5 * measure_fma_peak(threads).gflops) {
      peak = dot;
    }
  }
  r.unit = !peak ? "fma" : r.kernel == "cpu.flash.amx_bf16" && !c.backward ? "amx-bf16" : "bf16-dot";
  if (!peak) peak = measure_fma_peak(threads);
  r.peak_gflops = peak->gflops;
  r.simd = peak->isa;
  std::vector<PagedKvCache> caches;  // --page-size: the copies, as paged caches
  std::vector<int64_t> seq_ids(static_cast<size_t>(c.batch));
  for (int64_t b = 0; b < c.batch; ++b) seq_ids[static_cast<size_t>(b)] = b;
  Tensor q_paged;  // (B, L, H, E), paged_attention's layout
  PagedAttentionOptions paged_options;
  if (paged) {
    caches.push_back(paged_copy(ks.front(), vs.front(), c.page_size, cache_dtype));
    q_paged = q.transpose(1, 2).contiguous();
    paged_options.is_causal = c.causal;
    paged_options.num_threads = threads;
  }
  // Paged decode over a float cache also times the same copies as dense tensors (an int8 cache
  // has none: its dense K/V are float32).
  const bool with_dense = paged && c.decode() && cache_dtype != DType::kInt8;
  if (c.decode()) {
    // The probe's array is freed before the copies are made: the two never add up.
    DecodeResult d;
    d.bandwidth = measure_read_bandwidth(threads);
    if (paged) {  // one sequence per stream: a pool page holds its kv heads, which the kernel reads together
      d.paged_block_bytes = c.page_size * c.dim * dtype_size(cache_dtype) * c.kv_heads_or_default();
      d.paged_streams = c.batch;
      d.paged_bandwidth = measure_paged_read_bandwidth(threads, d.paged_block_bytes, d.paged_streams);
    }
    d.kv_bytes = kv_bytes(c);
    // with_dense: each copy also stays dense (twice the bytes).
    d.copies = kv_copies(d.kv_bytes, last_level_cache_bytes(), available_memory_bytes() / (with_dense ? 2 : 1));
    for (int64_t i = 1; i < d.copies.count; ++i) {
      const int64_t shift = i * 4099;  // elements; a prime, so no copy repeats another's pages
      if (paged && !with_dense) {  // one dense copy at a time: only the caches stay
        caches.push_back(paged_copy(rotated_copy(ks.front(), shift), rotated_copy(vs.front(), shift),
                                    c.page_size, cache_dtype));
        continue;
      }
      ks.push_back(rotated_copy(ks.front(), shift));
      vs.push_back(rotated_copy(vs.front(), shift));
      if (paged) caches.push_back(paged_copy(ks.back(), vs.back(), c.page_size, cache_dtype));
    }
    r.decode = d;
  }

  SdpaResult saved;
  Tensor dout;
  if (c.backward) {
    options.need_lse = true;
    options.need_output_residual = !c.no_residual;
    saved = scaled_dot_product_attention(q, ks.front(), vs.front(), options);
    dout = randn(saved.output.shape(), gen).to(dtype);
  }
  // Call i reads copy i % copies (always copy 0 outside decode mode).
  const auto call = [&](size_t i) {
    if (c.backward) return scaled_dot_product_attention_backward(dout, q, ks.front(), vs.front(), saved, options)
          .grad_query;
    if (paged) return paged_attention(q_paged, caches[i % caches.size()], seq_ids, paged_options).output;
    return scaled_dot_product_attention(q, ks[i % ks.size()], vs[i % vs.size()], options).output;
  };
  // with_dense: the same copies as dense tensors of the cache's dtype.
  const auto contiguous_call = [&](size_t i) {
    return scaled_dot_product_attention(q, ks[i % ks.size()], vs[i % vs.size()], options).output;
  };
  const auto timed = [&](auto&& fn, size_t i) {
    const auto start = Clock::now();
    const Tensor out = fn(i);
    const auto stop = Clock::now();  // `out` is freed after the clock stops
    return std::chrono::duration<double, std::milli>(stop - start).count();
  };
  size_t calls = 0;
  for (int i = 0; i < c.warmup; ++i) {
    if (with_dense) contiguous_call(calls + 1);
    call(calls++);
  }
  r.times_ms.reserve(static_cast<size_t>(c.repeats));
  for (int i = 0; i < c.repeats; ++i) {
    r.times_ms.push_back(timed(call, calls));
    // Another copy than the paged call's: a dense call never finds the paged one's bytes cached.
    if (with_dense) r.decode->contiguous_times_ms.push_back(timed(contiguous_call, calls + 1));
    ++calls;
  }
  if (r.decode) {
    DecodeResult& d = *r.decode;
    call(0);  // copy 0 into the cache, then every call reads it
    for (int i = 0; i < c.repeats; ++i) d.warm_times_ms.push_back(timed(call, 0));
    if (!d.contiguous_times_ms.empty()) {
      d.contiguous_median_ms = median(d.contiguous_times_ms);
      d.paged_over_contiguous = median(r.times_ms) / d.contiguous_median_ms;
    }
    d.warm_median_ms = median(d.warm_times_ms);
    const double bytes = static_cast<double>(d.kv_bytes);
    d.kv_gbps = bytes / (median(r.times_ms) * 1e-3) * 1e-9;
    d.warm_kv_gbps = bytes / (d.warm_median_ms * 1e-3) * 1e-9;
    d.bandwidth_ratio = d.bandwidth.gbps > 0.0 ? d.kv_gbps / d.bandwidth.gbps : 0.0;
    // Only copy 0 stays, so the second probe's array is sized as the first one's was.
    ks.erase(ks.begin() + 1, ks.end());
    vs.erase(vs.begin() + 1, vs.end());
    if (caches.size() > 1) caches.erase(caches.begin() + 1, caches.end());
    d.bandwidth_after = measure_read_bandwidth(threads);
    d.bandwidth_moved = bandwidth_moved(d.bandwidth.gbps, d.bandwidth_after.gbps);
    if (d.paged_bandwidth && d.paged_bandwidth->gbps > 0.0) d.paged_bandwidth_ratio = d.kv_gbps / d.paged_bandwidth->gbps;
  }
  r.median_ms = median(r.times_ms);
  r.min_ms = *std::min_element(r.times_ms.begin(), r.times_ms.end());
  r.gflops = attention_flops(c) / (r.median_ms * 1e-3) * 1e-9;
  r.peak_ratio = r.peak_gflops > 0.0 ? r.gflops / r.peak_gflops : 0.0;
  r.max_rss_mib = max_rss_mib();
  return r;
}

bool bandwidth_moved(double before_gbps, double after_gbps) {
  const double lo = std::min(before_gbps, after_gbps), hi = std::max(before_gbps, after_gbps);
  return lo > 0.0 && hi > lo * (1.0 + kBandwidthMoved);
}

std::string format_json(const BenchConfig& c, const BenchResult& r) {
  std::string decode;
  if (r.decode) {
    const DecodeResult& d = *r.decode;
    decode = fmt::format(
        ", \"decode\": {{\"kv_bytes\": {}, \"kv_copies\": {}, \"kv_copies_wanted\": {}, "
        "\"from_memory\": {}, \"kv_gbps\": {}, \"bandwidth_ratio\": {}, {}, "
        "\"bandwidth_after_gbps\": {}, \"bandwidth_moved\": {}, "
        "\"paged_bandwidth_gbps\": {}, \"paged_bandwidth_ratio\": {}, "
        "\"contiguous_median_ms\": {}, \"paged_over_contiguous\": {}, "
        "\"warm_median_ms\": {}, \"warm_kv_gbps\": {}, \"warm_times_ms\": [{}]}}",
        d.kv_bytes, d.copies.count, d.copies.wanted, d.copies.from_memory(),
        json_number(d.kv_gbps, 3), json_number(d.bandwidth_ratio, 5), bandwidth_json(d.bandwidth),
        json_number(d.bandwidth_after.gbps, 3), d.bandwidth_moved,
        d.paged_bandwidth ? json_number(d.paged_bandwidth->gbps, 3) : "null",
        d.paged_bandwidth ? json_number(d.paged_bandwidth_ratio, 5) : "null",
        d.contiguous_times_ms.empty() ? "null" : json_number(d.contiguous_median_ms, 4),
        d.contiguous_times_ms.empty() ? "null" : json_number(d.paged_over_contiguous, 4),
        json_number(d.warm_median_ms, 4), json_number(d.warm_kv_gbps, 3), json_times(d.warm_times_ms));
  }
  return fmt::format(
      "{{\"impl\": {}, \"kernel\": {}, \"dtype\": {}, \"precision\": {}, \"allow_fp16_bf16_reduction\": {}, \"unit\": {}, \"pass\": {}, \"batch\": {}, \"heads\": {}, \"kv_heads\": {}, \"seq\": {}, "
      "\"seq_kv\": {}, \"dim\": {}, \"causal\": {}, \"threads\": {}, \"repeats\": {}, "
      "\"warmup\": {}, \"median_ms\": {}, \"min_ms\": {}, \"gflops\": {}, \"peak_gflops\": {}, "
      "\"peak_ratio\": {}, \"max_rss_mib\": {}, \"blas_core\": {}, \"blas_config\": {}, "
      "\"openblas_coretype\": {}, \"simd\": {}, \"cpu\": {}, \"times_ms\": [{}], "
      "\"kv_dtype\": {}, \"causal_align\": {}, \"page_size\": {}, \"window_left\": {}, "
      "\"window_right\": {}, \"softcap\": {}, \"alibi\": {}, \"sinks\": {}{}}}\n",
      json_string(c.impl), json_string(r.kernel), json_string(c.dtype), json_string(c.precision), c.reduction ? "true" : "false", json_string(r.unit), json_string(c.backward ? "backward" : "forward"), c.batch, c.heads, c.kv_heads_or_default(), c.seq,
      c.seq_kv_or_default(), c.dim, c.causal, c.threads_or_default(), c.repeats, c.warmup,
      json_number(r.median_ms, 4), json_number(r.min_ms, 4), json_number(r.gflops, 3),
      json_number(r.peak_gflops, 3), json_number(r.peak_ratio, 5), json_number(r.max_rss_mib, 1),
      json_string(r.blas_core), json_string(r.blas_config),
      r.openblas_coretype.empty() ? "null" : json_string(r.openblas_coretype), json_string(r.simd),
      json_string(r.cpu), json_times(r.times_ms), json_string(c.kv_dtype_or_default()),
      json_string(c.causal_align), c.page_size, c.window_left, c.window_right,
      c.softcap ? json_number(*c.softcap, 6) : "null", c.alibi, c.sinks, decode);
}

std::string format_table(const BenchConfig& c, const BenchResult& r) {
  std::string s;
  const auto row = [&s](const char* key, const std::string& value) {
    s += fmt::format("{:<12} {}\n", key, value);
  };
  row("impl", c.impl);
  row("kernel", r.kernel);
  row("dtype", dtype_text(c));
  row("pass", c.backward  ? "backward (FLOPs: 2.5x the forward's)"
              : r.decode ? fmt::format("forward, decode (L <= {}: bound by memory bandwidth)", kDecodeMaxSeq)
                         : std::string("forward"));
  row("shape", shape_text(c) + causal_text(c));
  row("threads", fmt::format("{}", c.threads_or_default()));
  row("repeats", fmt::format("{} (after {} warmup)", c.repeats, c.warmup));
  if (r.decode) {
    const DecodeResult& d = *r.decode;
    row("K/V read", c.kv_dtype_or_default() == "int8"
                        ? fmt::format("{} per call (B*Hkv*S*(E+Ev) int8 bytes + 2 float32 scales a row)",
                                      mib_text(d.kv_bytes))
                        : fmt::format("{} per call (B*Hkv*S*(E+Ev)*{} bytes)", mib_text(d.kv_bytes),
                                      dtype_size(dtype_of(c.kv_dtype_or_default()))));
    if (c.page_size > 0) {
      row("layout", fmt::format("paged: pages of {} tokens, the {} sequences' pages interleaved",
                                c.page_size, c.batch));
    }
    row("K/V copies", fmt::format("{}, {} in all{}, rotated call by call{}", d.copies.count,
                                  mib_text(d.copies.count * d.kv_bytes),
                                  d.contiguous_times_ms.empty() ? "" : " (and as many dense, for the contiguous row)",
                                  d.copies.from_memory()
                                      ? " (K/V come from memory)"
                                      : fmt::format(" (WARNING: {} wanted to flush the LLC, capped "
                                                    "by free memory: partly from the cache)",
                                                    d.copies.wanted)));
  }
  row("median", fmt::format("{:.3f} ms", r.median_ms));
  row("min", fmt::format("{:.3f} ms", r.min_ms));
  if (r.decode) {
    const DecodeResult& d = *r.decode;
    row("K/V GB/s", fmt::format("{:.2f} GB/s (K/V bytes / median time)", d.kv_gbps));
    row("bandwidth", bandwidth_text(d.bandwidth));
    row("of bandwidth", fmt::format("{:.1f} %", 100.0 * d.bandwidth_ratio));
    row("probe after", fmt::format("{:.2f} GB/s (the same read probe, after the timed runs){}", d.bandwidth_after.gbps,
                             d.bandwidth_moved ? " WARNING: the machine's memory bandwidth changed during the "
                                                 "run, so the ratio above is unreliable"
                                               : ""));
    if (!d.contiguous_times_ms.empty()) {
      row("contiguous", fmt::format("{:.3f} ms median (the same K/V as dense tensors, each call right after a paged "
                                    "one); paged / contiguous: {:.3f}",
                                    d.contiguous_median_ms, d.paged_over_contiguous));
    }
    if (d.paged_bandwidth) {
      row("paged read", fmt::format("{:.2f} GB/s (the read probe in the pool's pattern: blocks of {} bytes at a "
                                    "stride of {}, median of {} passes); K/V GB/s / it: {:.1f} %",
                                    d.paged_bandwidth->gbps, d.paged_block_bytes,
                                    d.paged_block_bytes * d.paged_streams, d.paged_bandwidth->passes,
                                    100.0 * d.paged_bandwidth_ratio));
    }
    row("warm", fmt::format("{:.3f} ms median, {:.2f} GB/s (copy 0 on every call: K/V partly "
                            "from the cache)", d.warm_median_ms, d.warm_kv_gbps));
  }
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
    if (k.reduced_float32) dtypes += ",float32(high|medium)";
    s += fmt::format("{:<22} {:<9} {:<38} {}\n", k.name,
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
    std::optional<PeakResult> amx;  // the tiles, where the AMX kernel runs (present and permitted)
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      if (k.name == "cpu.flash.amx_bf16" && k.runs_on_this_cpu) amx = measure_amx_bf16_peak(threads);
    }
    const BandwidthResult b = measure_read_bandwidth(threads);
    if (c.json) {
      out << fmt::format("{{\"threads\": {}, \"peak_gflops\": {}, \"simd\": {}, \"lanes\": {}, "
                         "\"bf16_dot_peak_gflops\": {}, \"amx_bf16_peak_gflops\": {}, {}}}\n",
                         p.threads, json_number(p.gflops, 3), json_string(p.isa), p.lanes,
                         bf16 ? json_number(bf16->gflops, 3) : "null",
                         amx ? json_number(amx->gflops, 3) : "null", bandwidth_json(b));
    } else {
      out << fmt::format("{:<12} {:.2f} GFLOP/s\n{:<12} {} ({} float lanes)\n{:<12} {}\n",
                         "FMA peak", p.gflops, "ISA", p.isa, p.lanes, "threads", p.threads);
      out << fmt::format("{:<12} {}\n", "BF16 peak",
                         bf16 ? fmt::format("{:.2f} GFLOP/s (vdpbf16ps)", bf16->gflops)
                              : std::string("none (no AVX512-BF16)"));
      out << fmt::format("{:<12} {}\n", "AMX peak",
                         amx ? fmt::format("{:.2f} GFLOP/s (tdpbf16ps)", amx->gflops)
                             : std::string("none (no AMX-BF16 tiles granted)"));
      out << fmt::format("{:<12} {}\n", "bandwidth", bandwidth_text(b));
    }
    return 0;
  }
  if (c.varlen > 0) {
    out << format_varlen(c, run_varlen_bench(c));
    return 0;
  }
  try {
    const BenchResult r = run_bench(c);
    out << (c.json ? format_json(c, r) : format_table(c, r));
  } catch (const UsageError& e) {
    err << "attn bench: " << e.what() << "\n";
    return 2;
  }
  return 0;
}

}  // namespace attn::bench

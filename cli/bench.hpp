// `attn bench`: times attn::scaled_dot_product_attention on random inputs and sets the result
// against the machine's FMA peak (peak.hpp), measured in the same run on the same thread count.
//
// FLOPs are counted as FlashAttention's benchmarks count them: 4 * B * H * L * S * E (two
// matmuls, 2 flops per multiply-add), halved when causal. With L != S the causal count is the
// exact number of (query, key) pairs the top-left mask keeps, which is L * S / 2 for L == S.
// With a sliding window the count is the exact number of pairs inside the band.
// With --backward the timed call is scaled_dot_product_attention_backward (after one untimed
// forward that saves the output and LSE) and the count is 2.5x the forward's (five matmuls).
//
// Decode mode (a forward with L <= kDecodeMaxSeq, one to a few new tokens against S cached keys):
// the call is bound by memory bandwidth, not by the FMA units, so the report is the K/V bytes read
// per second, B * Hkv * S * (E + Ev) * sizeof(kv dtype) per call (every distinct kv head counted
// once, also under GQA), against the read bandwidth measured in the same run (bandwidth.hpp). The
// timed calls rotate among enough copies of K and V that each call reads them from memory, not
// from the last-level cache (kv_copies()); a "warm" figure, the same copy on every call, is
// measured beside it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"
#include "bandwidth.hpp"

namespace attn::bench {

// Query lengths up to this are timed as decoding (see the top of this file).
constexpr int64_t kDecodeMaxSeq = 16;

struct BenchConfig {
  int64_t batch = 1;
  int64_t heads = 12;
  std::optional<int64_t> kv_heads;  // default: heads
  int64_t seq = 1024;
  std::optional<int64_t> seq_kv;    // default: seq
  int64_t dim = 64;
  bool causal = false;
  std::string causal_align = "top-left";  // top-left | bottom-right (CausalAlignment)
  std::optional<int> threads;       // default: every core OpenMP sees
  int repeats = 10;
  int warmup = 2;
  std::string impl = "auto";        // fused | reference | auto: the kernel family
  std::string kernel;               // a registered kernel forced by name ("" = the family's best)
  std::string dtype = "f32";        // f32 | bf16 | f16 | f64: the dtype of q (and k, v)
  std::optional<std::string> kv_dtype;  // f32 | bf16 | f16 (| int8 with page_size): k, v (default: dtype)
  std::string precision = "highest";  // f32 only: SdpaOptions::float32_matmul_precision (highest | high | medium)
  int64_t page_size = 0;  // > 0: K/V in an attn::PagedKvCache of such pages, read by paged_attention
  bool backward = false;            // time the backward pass
  bool no_residual = false;         // backward of 16-bit inputs without SdpaResult::output_residual
  bool reduction = false;           // SdpaOptions::allow_fp16_bf16_reduction
  // The variants (SdpaOptions): a sliding window (-1 = unbounded side), softcapping, ALiBi
  // slopes 2^(-8 (h + 1) / H) (BLOOM's), learnable sinks (random logits).
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  bool alibi = false;
  bool sinks = false;
  // > 0: `--varlen N` packed sequences against the same padded (bench_varlen.cpp).
  int64_t varlen = 0;
  int64_t varlen_min = 64, varlen_max = 4096;
  bool json = false;
  bool peak_only = false;

  int64_t kv_heads_or_default() const { return kv_heads.value_or(heads); }
  int64_t seq_kv_or_default() const { return seq_kv.value_or(seq); }
  std::string kv_dtype_or_default() const { return kv_dtype.value_or(dtype); }
  int threads_or_default() const;
  bool decode() const { return seq <= kDecodeMaxSeq && !backward; }
};

// A problem the library found with the flags (e.g. a --kv-dtype no kernel takes yet): reported
// like an invalid flag, one line and exit code 2, by run_bench_command.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The first problem with the flags as one line (without a prefix), or nothing if they are valid.
std::optional<std::string> validate(const BenchConfig& config);

SdpaBackend backend_of(const std::string& impl);  // impl must be valid
DType dtype_of(const std::string& dtype);         // dtype must be valid
CausalAlignment alignment_of(const std::string& causal_align);  // must be valid

// Floating-point operations of one timed call (see the top of this file).
double attention_flops(const BenchConfig& config);

// K/V bytes one call reads: B * Hkv * S * (E + Ev) * sizeof(kv dtype).
int64_t kv_bytes(const BenchConfig& config);

// How many copies of K/V the decode timing rotates among, for copies of `copy_bytes` each, a
// last-level cache of `llc_bytes` (0: unknown, taken as 512 MiB) and `available_bytes` of free
// memory (0: unknown). Wanted: one copy if it alone is >= kRotationLlcs x the LLC, else
// ceil(kRotationLlcs * LLC / copy) + 1 (at least 2), so that a copy is evicted before it is read
// again and what an adaptive LLC keeps of the rotation is a small share of it. The copies may use
// at most half the available memory: `count` is then smaller than `wanted`.
constexpr int64_t kRotationLlcs = 8;
struct KvCopies {
  int64_t count = 1;
  int64_t wanted = 1;
  bool from_memory() const { return count >= wanted; }
};
KvCopies kv_copies(int64_t copy_bytes, int64_t llc_bytes, int64_t available_bytes);

// A change of the read probe between before and after the timed runs larger than this fraction
// of the lower one marks a decode run's bandwidth ratio unreliable (run-to-run spread within one
// state of the host: about 5 %).
constexpr double kBandwidthMoved = 0.15;
bool bandwidth_moved(double before_gbps, double after_gbps);

// What decode mode measures besides the common fields.
struct DecodeResult {
  int64_t kv_bytes = 0;          // per call (kv_bytes())
  KvCopies copies;
  double kv_gbps = 0.0;          // kv_bytes / median time of the rotating runs, 1e9 bytes/s
  double bandwidth_ratio = 0.0;  // kv_gbps / bandwidth.gbps
  BandwidthResult bandwidth;     // the read probe, same run, same threads, before the timed runs
  // The same probe after them (and after the warm runs), and whether the two medians differ by
  // more than kBandwidthMoved: the host's memory bandwidth can change from one second to the
  // next (seen on a KVM guest: 35 and 60 GB/s in alternate runs), and then bandwidth_ratio
  // compares the kernel with a probe taken in another state (it read up to 115 %).
  BandwidthResult bandwidth_after;
  bool bandwidth_moved = false;
  // --page-size: the probe in the paged pool's pattern (measure_paged_read_bandwidth), and
  // kv_gbps / its median
  std::optional<BandwidthResult> paged_bandwidth;
  double paged_bandwidth_ratio = 0.0;
  int64_t paged_block_bytes = 0, paged_streams = 0;  // its pattern
  // --page-size: the same K/V as dense tensors through scaled_dot_product_attention, each call
  // right after a paged one (the two alternate, so both see the same state of the host's memory,
  // which can change between runs); paged_over_contiguous = median / contiguous_median_ms.
  std::vector<double> contiguous_times_ms;
  double contiguous_median_ms = 0.0;
  double paged_over_contiguous = 0.0;
  std::vector<double> warm_times_ms;  // the same copy on every call
  double warm_median_ms = 0.0;
  double warm_kv_gbps = 0.0;
};

struct BenchResult {
  std::vector<double> times_ms;  // every timed run, in order
  double median_ms = 0.0;
  double min_ms = 0.0;
  double gflops = 0.0;           // at the median time
  double peak_gflops = 0.0;
  double peak_ratio = 0.0;       // gflops / peak_gflops
  double max_rss_mib = 0.0;      // getrusage(RUSAGE_SELF).ru_maxrss at the end of the run
  std::string blas_core;         // openblas_get_corename(), or "unknown"
  std::string blas_config;       // openblas_get_config(), or ""
  std::string openblas_coretype; // $OPENBLAS_CORETYPE, or "" if unset
  std::string simd;              // ISA of the peak probe
  std::string unit;              // the unit whose peak is the roof: "fma" or "bf16-dot"
  std::string kernel;            // the SDPA kernel that ran (attn::sdpa_kernel_name)
  std::string cpu;               // attn::cpu_description(): model and detected features
  std::optional<DecodeResult> decode;  // config.decode() only
};

// Sets the OpenMP and OpenBLAS thread counts, measures the peak, then times the call: `warmup`
// untimed runs followed by `repeats` timed ones (decode mode: rotating among the K/V copies, then
// `repeats` warm ones after one untimed). attn::Error propagates, except that the library
// rejecting a --kv-dtype different from --dtype throws UsageError.
BenchResult run_bench(const BenchConfig& config);

std::string format_json(const BenchConfig& config, const BenchResult& result);
std::string format_table(const BenchConfig& config, const BenchResult& result);

// The whole subcommand for parsed flags: 0 on success, 2 (one line on `err`) for invalid flags
// and UsageError.
// attn::Error from the library propagates to the caller.
int run_bench_command(const BenchConfig& config, std::ostream& out, std::ostream& err);

double median(std::vector<double> values);

// `--varlen`: the drawn lengths, and the alternating timings of varlen_attn and of the padded call.
struct VarlenResult {
  std::vector<int64_t> lengths;
  int64_t tokens = 0, padded_tokens = 0;
  std::vector<double> varlen_ms, padded_ms;
};
VarlenResult run_varlen_bench(const BenchConfig& config);
std::string format_varlen(const BenchConfig& config, const VarlenResult& result);

// `attn kernels`: every registered SDPA kernel, its dtypes, and whether it runs on this CPU (with
// the reason if not), under the CPU's description.
std::string format_kernels();

}  // namespace attn::bench

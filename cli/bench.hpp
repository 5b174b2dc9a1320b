// `attn bench`: times attn::scaled_dot_product_attention on random inputs and sets the result
// against the machine's FMA peak (peak.hpp), measured in the same run on the same thread count.
//
// FLOPs are counted as FlashAttention's benchmarks count them: 4 * B * H * L * S * E (two
// matmuls, 2 flops per multiply-add), halved when causal. With L != S the causal count is the
// exact number of (query, key) pairs the top-left mask keeps, which is L * S / 2 for L == S.
// With --backward the timed call is scaled_dot_product_attention_backward (after one untimed
// forward that saves the output and LSE) and the count is 2.5x the forward's (five matmuls).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"

namespace attn::bench {

struct BenchConfig {
  int64_t batch = 1;
  int64_t heads = 12;
  std::optional<int64_t> kv_heads;  // default: heads
  int64_t seq = 1024;
  std::optional<int64_t> seq_kv;    // default: seq
  int64_t dim = 64;
  bool causal = false;
  std::optional<int> threads;       // default: every core OpenMP sees
  int repeats = 10;
  int warmup = 2;
  std::string impl = "auto";        // fused | reference | auto: the kernel family
  std::string kernel;               // a registered kernel forced by name ("" = the family's best)
  std::string dtype = "f32";        // f32 | bf16 | f16 | f64: the dtype of q, k, v
  bool backward = false;            // time the backward pass
  bool json = false;
  bool peak_only = false;

  int64_t kv_heads_or_default() const { return kv_heads.value_or(heads); }
  int64_t seq_kv_or_default() const { return seq_kv.value_or(seq); }
  int threads_or_default() const;
};

// The first problem with the flags as one line (without a prefix), or nothing if they are valid.
std::optional<std::string> validate(const BenchConfig& config);

SdpaBackend backend_of(const std::string& impl);  // impl must be valid
DType dtype_of(const std::string& dtype);         // dtype must be valid

// Floating-point operations of one timed call (see the top of this file).
double attention_flops(const BenchConfig& config);

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
};

// Sets the OpenMP and OpenBLAS thread counts, measures the peak, then times the call: `warmup`
// untimed runs followed by `repeats` timed ones. attn::Error propagates.
BenchResult run_bench(const BenchConfig& config);

std::string format_json(const BenchConfig& config, const BenchResult& result);
std::string format_table(const BenchConfig& config, const BenchResult& result);

// The whole subcommand for parsed flags: 0 on success, 2 (one line on `err`) for invalid flags.
// attn::Error from the library propagates to the caller.
int run_bench_command(const BenchConfig& config, std::ostream& out, std::ostream& err);

double median(std::vector<double> values);

// `attn kernels`: every registered SDPA kernel, its dtypes, and whether it runs on this CPU (with
// the reason if not), under the CPU's description.
std::string format_kernels();

}  // namespace attn::bench

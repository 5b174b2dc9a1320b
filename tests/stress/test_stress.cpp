// Re-entrancy: several std::threads call scaled_dot_product_attention at once, each on its own
// rotation through a set of problems (causal both alignments, boolean and additive masks, GQA,
// attention weights, LSE, Philox dropout, strided and unbatched inputs, 1 to 4 OpenMP threads
// per call), on input tensors that all threads share read-only. Every result must equal, bit for
// bit, the one computed beforehand by a single caller: the kernels keep no shared mutable state,
// and a call's OpenMP team is its own.
//
// Under ThreadSanitizer (scripts/sanitize.sh) this is also the race detector's workload: many
// OpenMP teams started from different threads at the same time.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <latch>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "attn/attn.hpp"

namespace attn {
namespace {

struct Job {
  std::string name;
  Tensor q, k, v, mask;        // the storage every thread reads
  TensorView qv, kv, vv;       // the views passed in (strided for some jobs)
  SdpaOptions options;
};

struct Outcome {
  std::vector<float> output, lse, weights;
};

std::vector<float> values_of(const Tensor& t) { return t.defined() ? t.to_vector() : std::vector<float>{}; }

Outcome run(const Job& job, int num_threads) {
  SdpaOptions o = job.options;
  o.num_threads = num_threads;
  const SdpaResult r = scaled_dot_product_attention(job.qv, job.kv, job.vv, o);
  return {values_of(r.output), values_of(r.lse), values_of(r.attn_weights)};
}

// Bit-for-bit equality (NaN == NaN, and -0 differs from +0).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::string compare(const Outcome& got, const Outcome& want) {
  std::string what;
  if (!same_bits(got.output, want.output)) what += " output";
  if (!same_bits(got.lse, want.lse)) what += " lse";
  if (!same_bits(got.weights, want.weights)) what += " weights";
  return what;
}

Tensor bool_mask(Shape shape, float keep_fraction) {
  Tensor m = rand(shape);
  for (int64_t i = 0; i < m.numel(); ++i) m.data()[i] = m.data()[i] < keep_fraction ? 1.0f : 0.0f;
  return m;
}

std::vector<Job> make_jobs(SdpaBackend backend) {
  manual_seed(2024);  // all inputs drawn here, on the main thread
  std::vector<Job> jobs;
  auto add = [&](std::string name, Tensor q, Tensor k, Tensor v, SdpaOptions o) -> Job& {
    Job& j = jobs.emplace_back();
    j.name = std::move(name);
    j.q = std::move(q), j.k = std::move(k), j.v = std::move(v);
    j.qv = j.q, j.kv = j.k, j.vv = j.v;
    j.options = o;
    j.options.backend = backend;
    return j;
  };
  {
    add("plain", randn({2, 4, 77, 64}), randn({2, 4, 91, 64}), randn({2, 4, 91, 64}), {});
  }
  {
    SdpaOptions o;
    o.is_causal = true;
    o.need_lse = true;
    add("causal-top-left+lse", randn({1, 3, 130, 32}), randn({1, 3, 130, 32}), randn({1, 3, 130, 48}), o);
  }
  {
    SdpaOptions o;
    o.is_causal = true;
    o.causal_alignment = CausalAlignment::kBottomRight;  // L > S: the first 40 rows see nothing
    o.need_lse = o.need_weights = true;
    add("causal-bottom-right+weights", randn({2, 2, 100, 16}), randn({2, 2, 60, 16}), randn({2, 2, 60, 16}), o);
  }
  {
    Job& j = add("bool-mask-per-head+weights", randn({2, 2, 45, 24}), randn({2, 2, 70, 24}),
                 randn({2, 2, 70, 8}), {});
    j.mask = bool_mask({2, 2, 45, 70}, 0.7f);
    for (int64_t s = 0; s < 70; ++s) j.mask.at({1, 0, 44, s}) = 0.0f;  // one fully masked row
    j.options.attn_mask = AttnMask::boolean(j.mask);
    j.options.need_weights = true;
  }
  {
    Job& j = add("additive-broadcast-mask", randn({1, 4, 50, 80}), randn({1, 4, 66, 80}), randn({1, 4, 66, 80}), {});
    j.mask = randn({50, 66});
    for (int64_t i = 0; i < 50; i += 7) j.mask.at({i, i % 66}) = -std::numeric_limits<float>::infinity();
    j.options.attn_mask = AttnMask::additive(j.mask);
    j.options.need_lse = true;
  }
  {
    SdpaOptions o;
    o.enable_gqa = true;
    o.dropout_p = 0.2f;
    o.dropout_rng = DropoutRng::kPhilox;
    o.dropout_seed = 0x5eed;
    o.dropout_offset = 3;
    o.need_weights = o.need_lse = true;
    add("gqa-4:1+philox-dropout+weights", randn({1, 8, 64, 64}), randn({1, 2, 96, 64}), randn({1, 2, 96, 32}), o);
  }
  {
    // (B, L, H, E) tensors as a Linear leaves them, viewed as (B, H, L, E); the value's last dim
    // is strided too, so the kernel's row copy runs concurrently as well.
    Job& j = add("strided-views+causal", randn({2, 33, 3, 40}), randn({2, 47, 3, 40}), randn({2, 3, 20, 47}), {});
    j.qv = j.q.transpose(1, 2);
    j.kv = j.k.transpose(1, 2);
    j.vv = j.v.transpose(2, 3);  // (2, 3, 47, 20) with stride 47 along Ev
    j.options.is_causal = true;
    j.options.need_lse = true;
  }
  {
    SdpaOptions o;
    o.scale = 0.3;
    o.is_causal = true;
    o.causal_alignment = CausalAlignment::kBottomRight;
    add("unbatched+scale", randn({29, 12}), randn({41, 12}), randn({41, 7}), o);
  }
  return jobs;
}

struct ThreadReport {
  int calls = 0;
  std::vector<std::string> failures;
};

// kThreads callers, each running kRounds calls; caller t in round r takes job (3t + r) mod n with
// (r + t) mod 4 + 1 OpenMP threads, so different and identical jobs overlap in time.
void hammer(const std::vector<Job>& jobs, const std::vector<Outcome>& expected, int rounds) {
  constexpr int kThreads = 6;
  std::vector<ThreadReport> reports(kThreads);  // slot t is written by caller t only
  std::latch start(kThreads);
  std::vector<std::thread> callers;
  for (int t = 0; t < kThreads; ++t) {
    callers.emplace_back([&, t] {
      ThreadReport& me = reports[static_cast<size_t>(t)];
      start.arrive_and_wait();
      for (int r = 0; r < rounds; ++r) {
        const size_t n = static_cast<size_t>(3 * t + r) % jobs.size();
        const int omp_threads = (r + t) % 4 + 1;
        try {
          const std::string diff = compare(run(jobs[n], omp_threads), expected[n]);
          if (!diff.empty()) {
            me.failures.push_back("caller " + std::to_string(t) + " round " + std::to_string(r) + " job '" +
                                  jobs[n].name + "' (" + std::to_string(omp_threads) + " OpenMP threads): differs in" + diff);
          }
        } catch (const std::exception& e) {
          me.failures.push_back("caller " + std::to_string(t) + " job '" + jobs[n].name + "' threw: " + e.what());
        }
        ++me.calls;
      }
    });
  }
  for (std::thread& c : callers) c.join();
  int calls = 0;
  for (const ThreadReport& r : reports) {
    calls += r.calls;
    for (const std::string& f : r.failures) ADD_FAILURE() << f;
  }
  EXPECT_EQ(calls, kThreads * rounds);
}

TEST(Stress, ConcurrentFusedCallersMatchSingleThreadedResultsBitForBit) {
  const std::vector<Job> jobs = make_jobs(SdpaBackend::kFused);
  std::vector<Outcome> expected;
  for (const Job& j : jobs) {
    expected.push_back(run(j, 1));
    // Sanity: each job produces what it asked for, and fully masked rows stay finite.
    ASSERT_FALSE(expected.back().output.empty()) << j.name;
    ASSERT_EQ(expected.back().lse.empty(), !j.options.need_lse) << j.name;
    ASSERT_EQ(expected.back().weights.empty(), !j.options.need_weights) << j.name;
    for (float x : expected.back().output) ASSERT_TRUE(std::isfinite(x)) << j.name;
  }
  hammer(jobs, expected, 48);
}

TEST(Stress, ConcurrentReferenceCallersMatchSingleThreadedResultsBitForBit) {
  // The reference path (OpenBLAS, OpenMP rows, Philox dropout) is re-entrant as well.
  const std::vector<Job> jobs = make_jobs(SdpaBackend::kReference);
  std::vector<Outcome> expected;
  for (const Job& j : jobs) expected.push_back(run(j, 1));
  hammer(jobs, expected, 12);
}

}  // namespace
}  // namespace attn

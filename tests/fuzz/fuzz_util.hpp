// Shared helpers for the libFuzzer targets in tests/fuzz/ (built by ATTN_BUILD_FUZZERS,
// run by scripts/fuzz.sh).
//
// Every target is one file defining LLVMFuzzerTestOneInput. A violated property calls
// fuzz_fail(), which prints what was violated and aborts, so libFuzzer records the input as a
// crash artifact (as it does for ASan/UBSan reports, uncaught exceptions and timeouts).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "attn/error.hpp"

namespace attn::fuzz {

[[noreturn]] inline void fuzz_fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fuzz_fail(const char* fmt, ...) {
  std::fprintf(stderr, "\n==== fuzz property violated: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

#define ATTN_FUZZ_CHECK(cond)                                                         \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      ::attn::fuzz::fuzz_fail("%s:%d: check '%s' failed", __FILE__, __LINE__, #cond); \
    }                                                                                 \
  } while (0)

#define ATTN_FUZZ_CHECKF(cond, fmt, ...)                                                    \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ::attn::fuzz::fuzz_fail("%s:%d: check '%s' failed: " fmt, __FILE__, __LINE__, #cond, \
                              __VA_ARGS__);                                                 \
    }                                                                                       \
  } while (0)

// Reads the fuzzer's bytes front to back; past the end every read returns 0, so every input
// decodes to something.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return static_cast<uint32_t>(u16()) | (static_cast<uint32_t>(u16()) << 16); }
  uint64_t u64() { return static_cast<uint64_t>(u32()) | (static_cast<uint64_t>(u32()) << 32); }
  bool flag() { return (u8() & 1) != 0; }
  // One of n choices (n >= 1).
  int pick(int n) { return static_cast<int>(u8() % static_cast<unsigned>(n)); }
  template <typename T, size_t N>
  const T& pick_from(const T (&table)[N]) {
    return table[u8() % N];
  }
  size_t remaining() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// splitmix64: fills tensors deterministically from a seed taken from the input.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  // A rough standard normal (sum of four uniforms, rescaled): cheap and bounded by +-3.5.
  float normal() {
    return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f;
  }

 private:
  uint64_t s_;
};

// Runs f(); an attn::Error is the expected way to reject bad input and is returned as true.
// Any other exception is a finding.
template <typename F>
bool throws_attn_error(const char* what, F&& f) {
  try {
    f();
  } catch (const attn::Error&) {
    return true;
  } catch (const std::exception& e) {
    fuzz_fail("%s: threw a non-attn exception: %s", what, e.what());
  } catch (...) {
    fuzz_fail("%s: threw a non-std exception", what);
  }
  return false;
}

}  // namespace attn::fuzz

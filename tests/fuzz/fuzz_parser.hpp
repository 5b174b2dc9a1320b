// The harness every file-parser target shares: feed the raw bytes to the parser; rejecting
// them with attn::FormatError is fine, anything else (another exception, a crash, an
// ASan/UBSan report, a hang) is a finding. A new parser (checkpoints, safetensors, ...) gets its
// own small target file:
//
//   #include "fuzz_parser.hpp"
//   ATTN_FUZZ_PARSER_TARGET(parse_bytes)   // void parse_bytes(std::string_view bytes)
//
// plus its name in ATTN_FUZZ_TARGETS (CMakeLists.txt) and a seed corpus in
// tests/fuzz/corpus/<target>/. The parse function may add its own property checks (e.g. that
// what it parsed survives a round trip) with ATTN_FUZZ_CHECK.
#pragma once

#include <string_view>

#include "fuzz_util.hpp"

namespace attn::fuzz {

template <typename Parse>
int run_parser_target(const uint8_t* data, size_t size, Parse&& parse) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    parse(bytes);
  } catch (const attn::FormatError&) {
    // malformed input, rejected as documented
  } catch (const std::exception& e) {
    fuzz_fail("parser threw something other than attn::FormatError: %s", e.what());
  } catch (...) {
    fuzz_fail("parser threw a non-std exception");
  }
  return 0;
}

}  // namespace attn::fuzz

#define ATTN_FUZZ_PARSER_TARGET(parse_fn)                                     \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {   \
    return ::attn::fuzz::run_parser_target(data, size, parse_fn);             \
  }

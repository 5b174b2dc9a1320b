// Fuzz target: the safetensors reader (src/io/safetensors.cpp, src/io/json.cpp).
//
// Arbitrary bytes go to attn::parse_safetensors; attn::FormatError is the only allowed rejection.
// Whatever it accepts must survive a round trip: written back with serialize_safetensors (each
// tensor in its dtype, same names, order and metadata) and parsed again, it gives the same
// tensors, dtype and bits.
// Seeds (tests/fuzz/corpus/fuzz_safetensors/) are small valid files of each dtype, metadata,
// escapes and empty tensors, plus a few near-misses; written by tests/fuzz/seeds_safetensors.py.
#include <cstring>
#include <string>
#include <string_view>

#include "attn/safetensors.hpp"
#include "fuzz_parser.hpp"

namespace {

void parse_bytes(std::string_view bytes) {
  const attn::Safetensors a = attn::parse_safetensors(bytes, "fuzz-input");
  attn::NamedViews views;
  for (const auto& [name, t] : a.tensors) views.emplace_back(name, t);
  const std::string again = attn::serialize_safetensors(views, a.metadata);
  const attn::Safetensors b = attn::parse_safetensors(again, "round-trip");
  ATTN_FUZZ_CHECK(b.metadata == a.metadata);
  ATTN_FUZZ_CHECK(b.tensors.size() == a.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const attn::Tensor& x = a.tensors[i].second;
    const attn::Tensor& y = b.tensors[i].second;
    ATTN_FUZZ_CHECK(a.tensors[i].first == b.tensors[i].first);
    ATTN_FUZZ_CHECK(x.shape() == y.shape());
    ATTN_FUZZ_CHECK(x.dtype() == y.dtype());
    const auto bytes = static_cast<size_t>(x.numel() * x.element_size());
    ATTN_FUZZ_CHECK(bytes == 0 || std::memcmp(x.raw_data(), y.raw_data(), bytes) == 0);
  }
}

}  // namespace

ATTN_FUZZ_PARSER_TARGET(parse_bytes)

// Fuzz target: the fixture-file parser (tests/fixture.cpp), the only file parser today.
//
// Arbitrary bytes go to attn::test::parse_fixtures; attn::FormatError is the only allowed
// rejection. Whatever it accepts must survive a round trip: written back in the canonical
// format (shapes "d0,d1", values "%.17g", text records between "@text name" and "@end") and
// parsed again, it gives the same header, records, shapes, values (bit for bit; NaN as NaN)
// and texts.
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>

#include "fixture.hpp"
#include "fuzz_parser.hpp"

namespace {

using attn::test::FixtureFile;

std::string serialize(const FixtureFile& f) {
  std::string out = f.header + "\n";
  char buf[64];
  for (const auto& [name, t] : f.tensors) {
    out += name;
    out += '\t';
    for (int i = 0; i < t.shape.ndim(); ++i) {
      if (i > 0) out += ',';
      out += std::to_string(t.shape[i]);
    }
    out += '\t';
    for (size_t i = 0; i < t.values.size(); ++i) {
      if (i > 0) out += ' ';
      std::snprintf(buf, sizeof buf, "%.17g", t.values[i]);
      out += buf;
    }
    out += '\n';
  }
  for (const auto& [name, body] : f.texts) out += "@text " + name + "\n" + body + "\n@end\n";
  return out;
}

bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

void parse_bytes(std::string_view bytes) {
  const FixtureFile f = attn::test::parse_fixtures(std::string(bytes), "fuzz-input");
  ATTN_FUZZ_CHECK(f.header.rfind("# attn-fixtures v1", 0) == 0);
  for (const auto& [name, t] : f.tensors) {
    ATTN_FUZZ_CHECK(!name.empty());
    ATTN_FUZZ_CHECK(static_cast<int64_t>(t.values.size()) == t.shape.numel());
  }
  FixtureFile g;
  try {
    g = attn::test::parse_fixtures(serialize(f), "round-trip");
  } catch (const attn::FormatError& e) {
    attn::fuzz::fuzz_fail("accepted input does not survive a round trip: %s", e.what());
  }
  ATTN_FUZZ_CHECK(g.header == f.header);
  ATTN_FUZZ_CHECK(g.texts == f.texts);
  ATTN_FUZZ_CHECK(g.tensors.size() == f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    const auto it = g.tensors.find(name);
    ATTN_FUZZ_CHECK(it != g.tensors.end());
    ATTN_FUZZ_CHECK(it->second.shape == t.shape);
    ATTN_FUZZ_CHECK(it->second.values.size() == t.values.size());
    for (size_t i = 0; i < t.values.size(); ++i) ATTN_FUZZ_CHECK(same_value(it->second.values[i], t.values[i]));
  }
}

}  // namespace

ATTN_FUZZ_PARSER_TARGET(parse_bytes)

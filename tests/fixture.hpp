// Reader for the golden-data files under tests/fixtures/.
//
// Format (written by the committed PyTorch scripts beside the fixtures, e.g. gen_random.py):
//   line 1:  "# attn-fixtures v1 <free text: generator script, torch version>"
//   then one record per tensor:  "name<TAB>d0,d1,...<TAB>v0 v1 v2 ..."
//   (an empty shape field means a 0-D scalar; at most 4 non-negative extents). Values are
//   Python's repr() of each float32 converted to float64, which reads back to the exact float32
//   bit pattern. Empty lines and lines starting with '#' are skipped.
// Text records (expected printed output) use:  "@text name" followed by the lines of the text
// and a line "@end".
// A record name may appear once per file.
#pragma once

#include <cstdint>
#include <istream>
#include <map>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::test {

struct FixtureTensor {
  Shape shape;
  std::vector<double> values;  // exact float32 values, or float64 truth
  Tensor tensor() const;       // as float32
};

struct FixtureFile {
  std::string header;
  std::map<std::string, FixtureTensor> tensors;
  std::map<std::string, std::string> texts;

  const FixtureTensor& at(const std::string& name) const;
  const std::string& text(const std::string& name) const;
};

// Parses fixture records from a stream or a string. `source` names the input in error
// messages. Malformed input throws attn::FormatError "<source>:<line>: <what>" (FormatError
// is an std::runtime_error); nothing else is thrown for any input (fuzzed by
// tests/fuzz/fuzz_fixture_parser.cpp).
FixtureFile parse_fixtures(std::istream& in, const std::string& source);
FixtureFile parse_fixtures(const std::string& text, const std::string& source = "<string>");

// Loads ATTN_FIXTURE_DIR/<file>; throws std::runtime_error if missing, attn::FormatError if
// malformed.
FixtureFile load_fixtures(const std::string& file);

}  // namespace attn::test

// The small JSON reader safetensors headers need: RFC 8259 values, strings with every escape
// (\uXXXX and surrogate pairs to UTF-8), numbers kept as their text, nesting capped so that
// hostile input cannot exhaust the stack. Errors are thrown as FormatError by the caller's
// `fail` function, which adds the file name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace attn::io {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  std::string text;  // kString: the decoded string; kNumber: the number as written
  std::vector<JsonValue> items;  // kArray: the elements; kObject: the values of `keys`
  std::vector<std::string> keys;  // kObject, in file order (duplicates kept, for the caller)

  // kNumber holding a non-negative integer that fits in uint64 (no sign, fraction or exponent).
  bool as_uint64(uint64_t& out) const;
  static const char* kind_name(Kind k);
};

// Parses exactly one JSON value spanning `text` (surrounding whitespace allowed). On error
// returns false and sets `error` to "<problem> at byte <offset>".
bool parse_json(std::string_view text, JsonValue& out, std::string& error);

}  // namespace attn::io

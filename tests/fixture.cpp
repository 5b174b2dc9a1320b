#include "fixture.hpp"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "attn/error.hpp"

namespace attn::test {

Tensor FixtureTensor::tensor() const {
  std::vector<float> f(values.begin(), values.end());
  return Tensor(shape, f);
}

const FixtureTensor& FixtureFile::at(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) throw std::runtime_error("fixture tensor not found: " + name);
  return it->second;
}

const std::string& FixtureFile::text(const std::string& name) const {
  auto it = texts.find(name);
  if (it == texts.end()) throw std::runtime_error("fixture text not found: " + name);
  return it->second;
}

namespace {

// Error messages quote at most this much of the offending input.
std::string excerpt(std::string_view s) {
  constexpr size_t kMax = 60;
  std::string out(s.substr(0, kMax));
  for (char& c : out) {
    if (!std::isprint(static_cast<unsigned char>(c))) c = '?';
  }
  if (s.size() > kMax) out += "...";
  return out;
}

class Parser {
 public:
  Parser(std::istream& in, const std::string& source) : in_(in), source_(source) {}

  FixtureFile run() {
    FixtureFile out;
    if (!next(out.header) || out.header.rfind("# attn-fixtures v1", 0) != 0) {
      fail("expected header '# attn-fixtures v1', got '" + excerpt(out.header) + "'");
    }
    std::string line;
    while (next(line)) {
      if (line.empty() || line[0] == '#') continue;
      if (line.rfind("@text ", 0) == 0) {
        text_record(line.substr(6), out);
      } else {
        tensor_record(line, out);
      }
    }
    return out;
  }

 private:
  bool next(std::string& line) {
    if (!std::getline(in_, line)) return false;
    ++line_no_;
    return true;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(source_ + ":" + std::to_string(line_no_) + ": " + what);
  }

  void text_record(const std::string& name, FixtureFile& out) {
    if (name.empty()) fail("text record without a name");
    if (out.texts.count(name) != 0) fail("duplicate text record '" + excerpt(name) + "'");
    const int64_t first = line_no_;
    std::string body, l;
    bool closed = false;
    while (next(l)) {
      if (l == "@end") {
        closed = true;
        break;
      }
      body += l;
      body += '\n';
    }
    if (!closed) {
      fail("text record '" + excerpt(name) + "' (line " + std::to_string(first) + ") has no @end");
    }
    if (!body.empty()) body.pop_back();
    out.texts[name] = std::move(body);
  }

  // "d0,d1,...": up to kMaxDims non-negative decimal extents; empty for 0-D.
  Shape parse_shape(std::string_view field, std::string_view name) const {
    Shape shape;
    if (field.empty()) return shape;
    size_t pos = 0;
    while (true) {
      const size_t comma = field.find(',', pos);
      const std::string_view tok = field.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
      int64_t v = 0;
      const auto [ptr, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
      if (tok.empty() || ec != std::errc() || ptr != tok.data() + tok.size() || v < 0) {
        fail("record '" + excerpt(name) + "': bad extent '" + excerpt(tok) + "' in shape '" +
             excerpt(field) + "'");
      }
      if (shape.ndim() == kMaxDims) {
        fail("record '" + excerpt(name) + "': shape '" + excerpt(field) + "' has more than " +
             std::to_string(kMaxDims) + " dims");
      }
      shape.push_back(v);
      if (comma == std::string_view::npos) break;
      pos = comma + 1;
    }
    return shape;
  }

  void tensor_record(const std::string& line, FixtureFile& out) {
    const size_t t1 = line.find('\t');
    const size_t t2 = t1 == std::string::npos ? std::string::npos : line.find('\t', t1 + 1);
    if (t1 == std::string::npos || t2 == std::string::npos) {
      fail("malformed record (expected name<TAB>shape<TAB>values): " + excerpt(line));
    }
    const std::string name = line.substr(0, t1);
    if (name.empty()) fail("record without a name");
    if (out.tensors.count(name) != 0) fail("duplicate record '" + excerpt(name) + "'");
    FixtureTensor ft;
    ft.shape = parse_shape(std::string_view(line).substr(t1 + 1, t2 - t1 - 1), name);
    int64_t numel = 1;
    for (int64_t d : ft.shape) {
      if (__builtin_mul_overflow(numel, d, &numel)) {
        fail("record '" + excerpt(name) + "': shape " + ft.shape.str() + " has too many elements");
      }
    }
    // Values: whitespace-separated numbers as strtod reads them, nothing else.
    const char* p = line.c_str() + t2 + 1;
    const char* const end_of_line = line.c_str() + line.size();
    while (true) {
      while (p < end_of_line && std::isspace(static_cast<unsigned char>(*p))) ++p;
      if (p >= end_of_line) break;
      char* end = nullptr;
      const double v = std::strtod(p, &end);
      if (end == p || end > end_of_line ||
          (end < end_of_line && !std::isspace(static_cast<unsigned char>(*end)))) {
        fail("record '" + excerpt(name) + "': bad value '" +
             excerpt(std::string_view(p, static_cast<size_t>(end_of_line - p))) + "'");
      }
      if (static_cast<int64_t>(ft.values.size()) == numel) {
        fail("record '" + excerpt(name) + "' has more than " + std::to_string(numel) +
             " values for shape " + ft.shape.str());
      }
      ft.values.push_back(v);
      p = end;
    }
    if (static_cast<int64_t>(ft.values.size()) != numel) {
      fail("record '" + excerpt(name) + "' has " + std::to_string(ft.values.size()) +
           " values for shape " + ft.shape.str());
    }
    out.tensors[name] = std::move(ft);
  }

  std::istream& in_;
  const std::string& source_;
  int64_t line_no_ = 0;
};

}  // namespace

FixtureFile parse_fixtures(std::istream& in, const std::string& source) {
  return Parser(in, source).run();
}

FixtureFile parse_fixtures(const std::string& text, const std::string& source) {
  std::istringstream in(text);
  return parse_fixtures(in, source);
}

FixtureFile load_fixtures(const std::string& file) {
  const std::string path = std::string(ATTN_FIXTURE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open fixture file " + path);
  return parse_fixtures(in, path);
}

}  // namespace attn::test

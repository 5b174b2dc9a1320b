#include "fixture.hpp"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

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

FixtureFile load_fixtures(const std::string& file) {
  const std::string path = std::string(ATTN_FIXTURE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open fixture file " + path);
  FixtureFile out;
  std::getline(in, out.header);
  if (out.header.rfind("# attn-fixtures v1", 0) != 0) {
    throw std::runtime_error(path + ": expected header '# attn-fixtures v1', got '" + out.header + "'");
  }
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("@text ", 0) == 0) {
      const std::string name = line.substr(6);
      std::string body, l;
      bool closed = false;
      while (std::getline(in, l)) {
        if (l == "@end") {
          closed = true;
          break;
        }
        body += l + "\n";
      }
      if (!closed) throw std::runtime_error(path + ": text record '" + name + "' has no @end");
      if (!body.empty()) body.pop_back();
      out.texts[name] = body;
      continue;
    }
    const size_t t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
    if (t1 == std::string::npos || t2 == std::string::npos) {
      throw std::runtime_error(path + ": malformed record: " + line.substr(0, 60));
    }
    FixtureTensor ft;
    std::stringstream dims(line.substr(t1 + 1, t2 - t1 - 1));
    std::string d;
    while (std::getline(dims, d, ',')) ft.shape.push_back(std::stoll(d));
    const char* p = line.c_str() + t2 + 1;
    char* end = nullptr;
    for (double v = std::strtod(p, &end); end != p; v = std::strtod(p, &end)) {
      ft.values.push_back(v);
      p = end;
    }
    if (static_cast<int64_t>(ft.values.size()) != ft.shape.numel()) {
      throw std::runtime_error(path + ": record '" + line.substr(0, t1) + "' has " +
                               std::to_string(ft.values.size()) + " values for shape " + ft.shape.str());
    }
    out.tensors[line.substr(0, t1)] = std::move(ft);
  }
  return out;
}

}  // namespace attn::test

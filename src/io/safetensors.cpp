// safetensors reader and writer (format: include/attn/safetensors.hpp). The reader trusts
// nothing in the file: every length, offset and extent is checked against the bytes actually
// present before anything is allocated or read, and all arithmetic on them is overflow-checked.
#include "attn/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "attn/modules.hpp"
#include "io/json.hpp"

namespace attn {

namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping here");

// The reference implementation's limit: a larger header is an attack, not a model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw FormatError(source + ": " + what);
}

// The safetensors names of the dtypes attn tensors carry.
struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {{"F32", DType::kFloat32}, {"BF16", DType::kBFloat16},
                                 {"F16", DType::kFloat16}, {"F64", DType::kFloat64},
                                 {"I8", DType::kInt8},     {"I32", DType::kInt32}};

bool parse_dtype(const std::string& s, DType& out, uint64_t& item_size) {
  for (const DTypeName& d : kDTypes) {
    if (s == d.name) {
      out = d.dtype;
      item_size = static_cast<uint64_t>(dtype_size(d.dtype));
      return true;
    }
  }
  return false;
}

const char* dtype_file_name(DType t) {
  for (const DTypeName& d : kDTypes) {
    if (d.dtype == t) return d.name;
  }
  return "?";
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

const io::JsonValue* member(const io::JsonValue& obj, std::string_view key) {
  for (size_t i = 0; i < obj.keys.size(); ++i) {
    if (obj.keys[i] == key) return &obj.items[i];
  }
  return nullptr;
}

Entry parse_entry(const std::string& source, const std::string& name, const io::JsonValue& v) {
  using Kind = io::JsonValue::Kind;
  const std::string what = "tensor '" + name + "'";
  if (v.kind != Kind::kObject) {
    fail(source, what + ": expected an object, got " + io::JsonValue::kind_name(v.kind));
  }
  const io::JsonValue* dtype = member(v, "dtype");
  const io::JsonValue* shape = member(v, "shape");
  const io::JsonValue* offsets = member(v, "data_offsets");
  if (!dtype || !shape || !offsets) {
    fail(source, what + ": missing \"" +
                     std::string(!dtype ? "dtype" : !shape ? "shape" : "data_offsets") + "\"");
  }
  Entry e{name, DType::kFloat32, {}, 0, 0};
  uint64_t item_size = 0;
  if (dtype->kind != Kind::kString) fail(source, what + ": \"dtype\" must be a string");
  if (!parse_dtype(dtype->text, e.dtype, item_size)) {
    fail(source, what + " has dtype \"" + dtype->text +
                     "\"; attn reads F32, BF16, F16, F64, I8 and I32");
  }
  if (shape->kind != Kind::kArray) fail(source, what + ": \"shape\" must be an array");
  if (shape->items.size() > static_cast<size_t>(kMaxDims)) {
    fail(source, what + " has " + std::to_string(shape->items.size()) +
                     " dimensions; attn tensors have at most " + std::to_string(kMaxDims));
  }
  // numel * item_size must fit the file, so bounding it by int64 here is no restriction.
  uint64_t bytes = item_size;
  for (const io::JsonValue& d : shape->items) {
    uint64_t extent = 0;
    if (!d.as_uint64(extent) || extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(source, what + ": shape entries must be non-negative integers, got " +
                       (d.kind == Kind::kNumber ? d.text : io::JsonValue::kind_name(d.kind)));
    }
    e.shape.push_back(static_cast<int64_t>(extent));
    if (extent != 0 && bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / extent) {
      fail(source, what + ": shape " + e.shape.str() + " is too large");
    }
    bytes *= extent;
  }
  if (offsets->kind != Kind::kArray || offsets->items.size() != 2 ||
      !offsets->items[0].as_uint64(e.begin) || !offsets->items[1].as_uint64(e.end)) {
    fail(source, what + ": \"data_offsets\" must be [begin, end] with non-negative integers");
  }
  if (e.end < e.begin) {
    fail(source, what + ": data_offsets [" + std::to_string(e.begin) + ", " +
                     std::to_string(e.end) + "] end before they begin");
  }
  if (e.end - e.begin != bytes) {
    fail(source, what + ": data_offsets span " + std::to_string(e.end - e.begin) +
                     " bytes, but dtype " + dtype->text + " and shape " + e.shape.str() +
                     " need " + std::to_string(bytes));
  }
  return e;
}

Tensor decode(const Entry& e, const char* data) {
  Tensor t = Tensor::empty(e.shape, e.dtype);
  const int64_t bytes = t.numel() * t.element_size();
  if (bytes > 0) std::memcpy(t.raw_data(), data, static_cast<size_t>(bytes));
  return t;
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

std::string os_error(const std::string& what, const std::string& path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

}  // namespace

const Tensor* Safetensors::find(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

Safetensors parse_safetensors(std::string_view bytes, const std::string& source) {
  if (bytes.size() < 8) {
    fail(source, "file is " + std::to_string(bytes.size()) +
                     " bytes, too short for the 8-byte header length");
  }
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxHeaderBytes) {
    fail(source, "header length " + std::to_string(n) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (n > bytes.size() - 8) {
    fail(source, "header length " + std::to_string(n) + " exceeds the " +
                     std::to_string(bytes.size() - 8) + " bytes after it");
  }
  const std::string_view header = bytes.substr(8, n);
  const std::string_view data = bytes.substr(8 + n);
  if (header.empty() || header[0] != '{') fail(source, "header does not start with '{'");

  io::JsonValue root;
  std::string error;
  if (!io::parse_json(header, root, error)) fail(source, "header is not valid JSON: " + error);
  if (root.kind != io::JsonValue::Kind::kObject) fail(source, "header is not a JSON object");

  Safetensors out;
  std::vector<Entry> entries;
  std::set<std::string_view> seen;
  for (size_t m = 0; m < root.keys.size(); ++m) {
    const std::string& name = root.keys[m];
    const io::JsonValue& value = root.items[m];
    if (!seen.insert(name).second) fail(source, "header has the key '" + name + "' twice");
    if (name == "__metadata__") {
      if (value.kind != io::JsonValue::Kind::kObject) fail(source, "\"__metadata__\" must be an object");
      for (size_t i = 0; i < value.keys.size(); ++i) {
        const std::string& k = value.keys[i];
        const io::JsonValue& v = value.items[i];
        if (v.kind != io::JsonValue::Kind::kString) {
          fail(source, "\"__metadata__\" value of '" + k + "' must be a string, got " +
                           io::JsonValue::kind_name(v.kind));
        }
        if (!out.metadata.emplace(k, v.text).second) {
          fail(source, "\"__metadata__\" has the key '" + k + "' twice");
        }
      }
      continue;
    }
    entries.push_back(parse_entry(source, name, value));
  }

  // The tensors must tile the data exactly, as the reference implementation requires: a gap or
  // an overlap means a corrupt or truncated file.
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const Entry* e : order) {
    if (e->begin != expected) {
      fail(source, "tensor '" + e->name + "' data_offsets begin at " + std::to_string(e->begin) +
                       ", expected " + std::to_string(expected) +
                       (e->begin < expected ? " (overlaps the previous tensor)" : " (gap in the data)"));
    }
    expected = e->end;
  }
  if (expected != data.size()) {
    fail(source, "tensors cover " + std::to_string(expected) + " bytes of data, but the file has " +
                     std::to_string(data.size()) + " after the header");
  }
  for (const Entry* e : order) out.tensors.emplace_back(e->name, decode(*e, data.data() + e->begin));
  return out;
}

Safetensors load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(os_error("cannot open", path));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError(os_error("cannot read", path));
  return parse_safetensors(bytes, path);
}

std::string serialize_safetensors(const NamedViews& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  std::set<std::string_view> names;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw ValueError("tensors: the name \"__metadata__\" is reserved");
    if (!names.insert(name).second) throw ValueError("tensors: the name '" + name + "' appears twice");
    if (!t.defined() && t.numel() != 0) throw ValueError("tensors: '" + name + "' is undefined");
  }
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) header += ',';
      first = false;
      json_string(header, k);
      header += ':';
      json_string(header, v);
    }
    header += '}';
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (header.size() > 1) header += ',';
    json_string(header, name);
    header += ":{\"dtype\":\"";
    header += dtype_file_name(t.dtype());
    header += "\",\"shape\":[";
    for (int i = 0; i < t.dim(); ++i) {
      if (i > 0) header += ',';
      header += std::to_string(t.size(i));
    }
    const uint64_t bytes = static_cast<uint64_t>(t.numel() * t.element_size());
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += '}';
  // Pad with spaces (allowed by the format) so the data starts 8-byte aligned, as the
  // reference writer does.
  header.append((8 - header.size() % 8) % 8, ' ');

  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out += header;
  out.reserve(out.size() + offset);
  for (const auto& [name, t] : tensors) {
    if (t.numel() == 0) continue;
    const size_t bytes = static_cast<size_t>(t.numel() * t.element_size());
    if (t.is_contiguous()) {
      out.append(static_cast<const char*>(t.raw_data()), bytes);
    } else {
      const Tensor c = t.contiguous();
      out.append(static_cast<const char*>(c.raw_data()), bytes);
    }
  }
  return out;
}

void save_safetensors(const std::string& path, const NamedViews& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string bytes = serialize_safetensors(tensors, metadata);
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(os_error("cannot create", tmp));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string msg = os_error("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(msg);
    }
    done += static_cast<size_t>(w);
  }
  // fsync before rename: otherwise a crash can leave the new name pointing at empty data.
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string msg = os_error("cannot flush", tmp);
    ::unlink(tmp.c_str());
    throw IoError(msg);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string msg = os_error("cannot rename '" + tmp + "' to", path);
    ::unlink(tmp.c_str());
    throw IoError(msg);
  }
}

namespace nn {

void load_state_dict(Module& module, const std::vector<std::pair<std::string, Tensor>>& tensors,
                     bool strict) {
  NamedTensors dst = module.state_dict();
  std::vector<std::pair<Tensor*, const Tensor*>> copies;
  std::vector<std::string> missing, unexpected;
  std::set<std::string_view> known;
  for (auto& [name, t] : dst) {
    known.insert(name);
    const Tensor* src = nullptr;
    for (const auto& [n, s] : tensors) {
      if (n == name) src = &s;
    }
    if (!src) {
      missing.push_back(name);
      continue;
    }
    if (!(src->shape() == t->shape())) {
      throw ShapeError("state_dict['" + name + "']: expected shape " + t->shape().str() +
                       " (the module's), got " + src->shape().str());
    }
    copies.emplace_back(t, src);
  }
  for (const auto& [n, s] : tensors) {
    if (!known.count(n)) unexpected.push_back(n);
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (const std::string& n : v) s += (s.empty() ? "'" : ", '") + n + "'";
      return s.empty() ? std::string("none") : s;
    };
    throw ValueError("state_dict: missing keys " + list(missing) + "; unexpected keys " +
                     list(unexpected));
  }
  for (auto [d, s] : copies) {
    if (d->numel() == 0) continue;
    const std::vector<float> v = s->to_vector();
    if (d->is_contiguous()) {
      std::memcpy(d->data(), v.data(), v.size() * sizeof(float));
    } else {
      *d = Tensor(s->shape(), v);
    }
  }
}

void save_safetensors(Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  NamedViews views;
  for (auto& [name, t] : module.state_dict()) views.emplace_back(name, *t);
  attn::save_safetensors(path, views, metadata);
}

void load_safetensors(Module& module, const std::string& path, bool strict) {
  load_state_dict(module, attn::load_safetensors(path).tensors, strict);
}

}  // namespace nn

}  // namespace attn

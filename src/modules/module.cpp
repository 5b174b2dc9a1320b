#include "attn/modules.hpp"

namespace attn::nn {

NamedTensors Module::state_dict() {
  NamedTensors all = named_parameters();
  NamedTensors buffers = named_buffers();
  all.insert(all.end(), buffers.begin(), buffers.end());
  return all;
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t->numel();
  return n;
}

void append_prefixed(NamedTensors& out, const std::string& prefix, NamedTensors items) {
  for (auto& [name, t] : items) out.emplace_back(prefix + "." + name, t);
}

}  // namespace attn::nn

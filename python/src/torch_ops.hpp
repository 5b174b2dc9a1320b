// attn.torch's bindings (torch_ops.cpp), added to the extension module by bindings.cpp.
#pragma once

#include <nanobind/nanobind.h>

namespace attn::py {

void bind_torch_ops(nanobind::module_& m);

}  // namespace attn::py

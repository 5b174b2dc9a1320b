// The process-wide float32 matmul precision (attn/dtype.hpp): one atomic, read once per call
// where a call's options leave it at kDefault (check_sdpa), never inside a kernel.
#include <atomic>

#include <fmt/format.h>

#include "attn/dtype.hpp"
#include "attn/error.hpp"

namespace attn {
namespace {
std::atomic<Float32MatmulPrecision> g_precision{Float32MatmulPrecision::kHighest};
}  // namespace

void set_float32_matmul_precision(Float32MatmulPrecision precision) {
  g_precision.store(precision == Float32MatmulPrecision::kDefault ? Float32MatmulPrecision::kHighest : precision);
}

void set_float32_matmul_precision(std::string_view precision) {
  for (auto p : {Float32MatmulPrecision::kHighest, Float32MatmulPrecision::kHigh, Float32MatmulPrecision::kMedium}) {
    if (precision == float32_matmul_precision_name(p)) return set_float32_matmul_precision(p);
  }
  throw ValueError(fmt::format("set_float32_matmul_precision: precision must be 'highest', 'high' or 'medium', "
                               "got '{}'", precision));
}

Float32MatmulPrecision get_float32_matmul_precision() { return g_precision.load(); }

std::string_view float32_matmul_precision_name(Float32MatmulPrecision precision) {
  switch (precision) {
    case Float32MatmulPrecision::kHighest: return "highest";
    case Float32MatmulPrecision::kHigh: return "high";
    case Float32MatmulPrecision::kMedium: return "medium";
    case Float32MatmulPrecision::kDefault: break;
  }
  return "default";
}

}  // namespace attn

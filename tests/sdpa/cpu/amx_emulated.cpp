// The AMX-BF16 forward kernel (src/sdpa/cpu/flash_amx_kernel.hpp) over an emulation of the tile
// registers, so that its packing, tiling, tails and masks are tested on CPUs without AMX. Built
// with the AVX512-BF16 kernel's flags: the kernel's softmax and conversions are AVX-512 code.
//
// The emulation follows the ISA reference's TDPBF16PS: for each row m of A and column n of B,
// C[m][n] += A[m][2k] * B[k][2n] + A[m][2k+1] * B[k][2n+1] over k, bf16 inputs with subnormals
// read as zero, products exact in float32, each added in turn (round to nearest even).
#include <cstdint>
#include <cstring>

#include "sdpa/cpu/amx_emulated.hpp"
#include "sdpa/cpu/flash_amx_kernel.hpp"

namespace attn::cpu {
namespace {

float bf16_in(uint16_t h) {
  if ((h & 0x7f80u) == 0) h &= 0x8000u;  // subnormal -> signed zero
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct EmulatedTiles {
  alignas(64) unsigned char reg[8][16 * 64];
  bool configured = false;

  void configure() {
    std::memset(reg, 0, sizeof reg);
    configured = true;
  }
  void release() { configured = false; }
  void require() const {
    if (!configured) __builtin_trap();  // a tile instruction before ldtilecfg faults on hardware
  }
  template <int T> void zero() {
    require();
    std::memset(reg[T], 0, sizeof reg[T]);
  }
  template <int T> void load(const void* p, int64_t stride) {
    require();
    for (int r = 0; r < 16; ++r) std::memcpy(reg[T] + r * 64, static_cast<const unsigned char*>(p) + r * stride, 64);
  }
  template <int T> void store(void* p, int64_t stride) {
    require();
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<unsigned char*>(p) + r * stride, reg[T] + r * 64, 64);
  }
  template <int C, int A, int B> void dp() {
    require();
    static_assert(C != A && C != B && A != B, "tdpbf16ps needs three distinct tiles");
    float c[16][16];
    uint16_t a[16][32], b[16][32];
    std::memcpy(c, reg[C], sizeof c);
    std::memcpy(a, reg[A], sizeof a);
    std::memcpy(b, reg[B], sizeof b);
    for (int m = 0; m < 16; ++m) {
      for (int k = 0; k < 16; ++k) {
        const float a0 = bf16_in(a[m][2 * k]), a1 = bf16_in(a[m][2 * k + 1]);
        for (int n = 0; n < 16; ++n) {
          c[m][n] += a0 * bf16_in(b[k][2 * n]);
          c[m][n] += a1 * bf16_in(b[k][2 * n + 1]);
        }
      }
    }
    std::memcpy(reg[C], c, sizeof c);
  }
};

}  // namespace

const Bf16ForwardKernel& amx_kernel_emulated(DType dtype, Float32MatmulPrecision precision, bool p_two_terms) {
  using amx_kernel::Src;
  if (dtype == DType::kFloat16) return amx_kernel::kernel_table<EmulatedTiles, Src::kFp16, 2>();
  if (dtype == DType::kBFloat16) {
    return p_two_terms ? amx_kernel::kernel_table<EmulatedTiles, Src::kBf16, 1, 2>()
                    : amx_kernel::kernel_table<EmulatedTiles, Src::kBf16, 1>();
  }
  return precision == Float32MatmulPrecision::kMedium ? amx_kernel::kernel_table<EmulatedTiles, Src::kFp32, 1>()
                                                      : amx_kernel::kernel_table<EmulatedTiles, Src::kFp32, 3>();
}

}  // namespace attn::cpu

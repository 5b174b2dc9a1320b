// The AMX-BF16 build of the bfloat16, float16 and float32 ("high", "medium") fused forward (flash_amx_kernel.hpp): the kernel's tile
// operations on the hardware's eight tile registers. Compiled with -mamx-tile -mamx-bf16 on top
// of the AVX512-BF16 flags; the registry runs it only on a CPU with all of them and with Linux's
// permission to use the tile state (cpu_features.cpp asks for it once per process).
//
// The tile configuration (palette 1, eight tiles of 16 rows x 64 bytes) is loaded at the start
// of every query block and released at its end: a thread of the OpenMP pool holds tile state
// only while it runs this kernel, so other code and context switches do not pay for 8 KiB of it.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "sdpa/cpu/flash_amx_kernel.hpp"

namespace attn::cpu {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tiles 0-15
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

// GCC's tile intrinsics are macros that paste their register number into the instruction text,
// so they cannot take a template parameter; these are the same instructions with the number as
// an immediate operand (%c: printed bare), and a memory clobber on loads and stores (the
// compiler must finish writing a packed block before a tile reads it).
struct AmxTiles {
  void configure() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
  }
  void release() { _tile_release(); }
  template <int T> void zero() { __asm__ volatile("tilezero %%tmm%c0" ::"i"(T)); }
  template <int T> void load(const void* p, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T> void store(void* p, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  // C += A . B (AT&T operand order: B, A, C).
  template <int C, int A, int B> void dp() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

}  // namespace

using amx_kernel::Src;
const Bf16ForwardKernel& bf16_kernel_amx() { return amx_kernel::kernel_table<AmxTiles, Src::kBf16, 1>(); }
const Bf16ForwardKernel& bf16_two_term_kernel_amx() { return amx_kernel::kernel_table<AmxTiles, Src::kBf16, 1, 2>(); }
const Bf16ForwardKernel& fp16_kernel_amx() { return amx_kernel::kernel_table<AmxTiles, Src::kFp16, 2>(); }
const Bf16ForwardKernel& fp32_high_kernel_amx() { return amx_kernel::kernel_table<AmxTiles, Src::kFp32, 3>(); }
const Bf16ForwardKernel& fp32_medium_kernel_amx() { return amx_kernel::kernel_table<AmxTiles, Src::kFp32, 1>(); }

}  // namespace attn::cpu

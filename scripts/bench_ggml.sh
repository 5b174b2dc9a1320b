#!/usr/bin/env bash
# ggml's CPU flash attention on the decode shapes of issue 14, as a peer for `attn bench` (L <= 16)
# and scripts/bench_suite.py --decode. ggml is built outside the project and never committed:
#
#   git clone https://github.com/ggml-org/ggml /work/peers/ggml   # or a snapshot of it
#   cmake -S /work/peers/ggml -B /work/peers/ggml/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
#         -DGGML_NATIVE=ON -DGGML_BUILD_TESTS=ON -DGGML_BUILD_EXAMPLES=OFF
#   cmake --build /work/peers/ggml/build --target test-backend-ops -j2
#   scripts/bench_ggml.sh [/work/peers/ggml/build]
#
# Part 1: ggml's own harness, `test-backend-ops perf -b CPU -o FLASH_ATTN_EXT`, on its decode
# cases nearest ours: nh=8 kv heads, nr23=[4,1] (32 query heads, GQA), kv=8192, nb=1 query,
# hs 64 and 128, f16 K/V. It cannot express the rest of our grid (H_kv=32 with 32 query heads,
# f32 K/V, S 1024/32768, B=8 are not in its perf list), it uses one thread per core of the
# machine (std::thread::hardware_concurrency(), no flag: 2 only on a 2-core machine), and it
# repeats the op on the same K/V, so a cache that fits the last-level cache is read warm. It
# prints us/run and GFLOPS (its FLOP count, 2*nh*nr*nb*(hsk+hsv)*kv), not GB/s: this script adds
# the K/V GB/s, nh*kv*(hsk+hsv)*sizeof(K/V) bytes (each kv head once) / (us/run).
#
# Part 2: a small C program, written by this script into $WORK (default /work/peers/ggml-fa-decode)
# and built against the ggml build's headers and libraries, that times ggml_flash_attn_ext on our
# exact shapes as `attn bench` times attn: q f32 (B, H_q, L, E), K/V (B, H_kv, S, E) in f32 or
# f16, GQA by broadcast, no mask for L=1 (bottom-right causal mask for L > 1), THREADS threads,
# calls rotating among enough K/V copies (ceil(8*LLC/copy)+1, at least 2, or one copy >= 8*LLC,
# at most half the free memory) that K/V come from memory, median of REPEATS calls after WARMUP,
# plus the warm figure (copy 0 on every call). One line per shape, with GB/s of K/V read.
#
# Part 3, with an attn build (ATTN_BUILD, default build/ of this checkout, holding libattn.a): a
# C++ program that alternates ggml_flash_attn_ext and attn::scaled_dot_product_attention call by
# call in one process, on the same K/V memory (ggml's tensors, read by attn as views), rotating
# among copies that fill 8x the LLC (at most half the free memory). The host's memory bandwidth
# moves by 2x between seconds here, so two programs run one after the other can each meet a
# different state; alternate calls meet the same one. It checks that both outputs agree and
# prints both medians and the median over rounds of ggml's time / attn's (above 1: attn faster),
# with its quartiles: the figure to quote against ggml. L = 1 shapes only (ROUNDS rounds, 60).
#
# Environment: THREADS (2), REPEATS (20), WARMUP (3), WORK, ROUNDS (60), ATTN_BUILD, and SHAPES:
# lines "B H_q H_kv E S L kv_type" (kv_type f32 or f16); the default is the grid the issue
# compares with ggml.
set -euo pipefail

build="${1:-/work/peers/ggml/build}"
threads="${THREADS:-2}"
repeats="${REPEATS:-20}"
warmup="${WARMUP:-3}"
work="${WORK:-/work/peers/ggml-fa-decode}"
rounds="${ROUNDS:-60}"
attn_build="${ATTN_BUILD:-$(cd "$(dirname "$0")/.." && pwd)/build}"
shapes="${SHAPES:-"1 32 8 128 8192 1 f32
1 32 8 128 8192 1 f16
1 32 8 64 8192 1 f32
1 32 8 64 8192 1 f16
1 32 32 128 8192 1 f32
1 32 32 128 8192 1 f16
1 32 32 64 8192 1 f32
1 32 32 64 8192 1 f16"}"

if [[ ! -f "$build/CMakeCache.txt" ]]; then
  echo "bench_ggml.sh: $build is not a ggml CMake build (see the top of this script)" >&2
  exit 2
fi
src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")"
if [[ ! -f "$src/include/ggml.h" ]]; then
  echo "bench_ggml.sh: no ggml.h under '$src/include' (the build's source directory)" >&2
  exit 2
fi
echo "ggml: $src ($(cat "$src/COMMIT" 2>/dev/null || git -C "$src" rev-parse HEAD 2>/dev/null || echo "commit unknown"))"
echo "machine: $(nproc) CPUs; THREADS=$threads"

# ---- part 1: test-backend-ops ---------------------------------------------------------------------
tbo="$build/bin/test-backend-ops"
echo
echo "== test-backend-ops perf -b CPU -o FLASH_ATTN_EXT (decode cases: nb=1, kv=8192, nh=8 x nr 4)"
if [[ ! -x "$tbo" ]]; then
  echo "(no $tbo: cmake --build $build --target test-backend-ops)"
else
  if [[ "$(nproc)" != "$threads" ]]; then
    echo "(note: test-backend-ops runs $(nproc) threads here, one per CPU, not THREADS=$threads)"
  fi
  "$tbo" perf -b CPU -o FLASH_ATTN_EXT \
      -p 'hsk=(64|128),hsv=(64|128),nh=8,nr23=\[4,1\],kv=8192,nb=1,.*type_K=f16,type_V=f16' 2>&1 |
    sed 's/\x1b\[[0-9;]*m//g' |
    awk '/FLASH_ATTN_EXT\(/ {
      print
      match($0, /hsk=[0-9]+/);     hsk = substr($0, RSTART + 4, RLENGTH - 4)
      match($0, /hsv=[0-9]+/);     hsv = substr($0, RSTART + 4, RLENGTH - 4)
      match($0, /nh=[0-9]+/);      nh = substr($0, RSTART + 3, RLENGTH - 3)
      match($0, /nr23=\[[0-9]+,[0-9]+\]/); split(substr($0, RSTART + 6, RLENGTH - 7), nr, ",")
      match($0, /kv=[0-9]+/);      kv = substr($0, RSTART + 3, RLENGTH - 3)
      match($0, /type_K=[a-z0-9_]+/); tk = substr($0, RSTART + 7, RLENGTH - 7)
      match($0, /[0-9.]+ us\/run/); us = substr($0, RSTART, RLENGTH - 7)
      size = (tk == "f32") ? 4 : 2
      bytes = nh * nr[2] * kv * (hsk + hsv) * size
      printf "    -> H_q=%d H_kv=%d E=%d S=%d K/V %s: %.3f ms, K/V %.1f MiB, %.2f GB/s (same K/V every run: warm)\n",
             nh * nr[1], nh, hsk, kv, tk, us / 1000, bytes / 1048576, bytes / (us * 1e3)
    }'
fi

# ---- part 2: our shapes, K/V from memory ----------------------------------------------------------
mkdir -p "$work"
cat > "$work/ggml_fa_decode.c" <<'EOF'
// Times ggml_flash_attn_ext on one decode shape (written by attn's scripts/bench_ggml.sh).
// usage: ggml_fa_decode B H_q H_kv E S L f32|f16 threads repeats warmup
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* v, int n) {
  qsort(v, n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The largest cache sysfs reports for cpu0, bytes (0: none).
static int64_t llc_bytes(void) {
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    FILE* f = fopen(path, "r");
    if (!f) continue;
    long long n = 0;
    char unit = 0;
    if (fscanf(f, "%lld%c", &n, &unit) >= 1) {
      const int64_t b = unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : unit == 'G' ? n << 30 : n;
      if (b > best) best = b;
    }
    fclose(f);
  }
  return best;
}

static int64_t available_bytes(void) {
  FILE* f = fopen("/proc/meminfo", "r");
  char key[64];
  long long kib = 0;
  int64_t r = 0;
  if (!f) return 0;
  while (fscanf(f, "%63s %lld kB", key, &kib) == 2) {
    if (strcmp(key, "MemAvailable:") == 0) r = (int64_t)kib * 1024;
  }
  fclose(f);
  return r;
}

static uint64_t rng = 88172645463325252ull;
static float next_uniform(void) {  // xorshift64, in [-1, 1)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static void fill(struct ggml_tensor* t) {
  const int64_t n = ggml_nelements(t);
  if (t->type == GGML_TYPE_F32) {
    float* p = (float*)t->data;
    for (int64_t i = 0; i < n; ++i) p[i] = next_uniform();
  } else {
    ggml_fp16_t* p = (ggml_fp16_t*)t->data;
    for (int64_t i = 0; i < n; ++i) p[i] = ggml_fp32_to_fp16(next_uniform());
  }
}

int main(int argc, char** argv) {
  if (argc != 11) {
    fprintf(stderr, "usage: %s B H_q H_kv E S L f32|f16 threads repeats warmup\n", argv[0]);
    return 2;
  }
  const int64_t B = atoll(argv[1]), Hq = atoll(argv[2]), Hkv = atoll(argv[3]), E = atoll(argv[4]);
  const int64_t S = atoll(argv[5]), L = atoll(argv[6]);
  const enum ggml_type kv_type = strcmp(argv[7], "f32") == 0 ? GGML_TYPE_F32 : GGML_TYPE_F16;
  const int threads = atoi(argv[8]), repeats = atoi(argv[9]), warmup = atoi(argv[10]);
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || E <= 0 || S <= 0 || L <= 0 || threads <= 0 ||
      repeats <= 0 || warmup < 0 || (strcmp(argv[7], "f32") && strcmp(argv[7], "f16"))) {
    fprintf(stderr, "ggml_fa_decode: bad arguments\n");
    return 2;
  }
  ggml_cpu_init();

  // K/V copies, as attn bench chooses them (cli/bench.hpp, kv_copies).
  const int64_t kv_bytes = B * Hkv * S * 2 * E * (int64_t)ggml_type_size(kv_type);
  const int64_t llc = llc_bytes() > 0 ? llc_bytes() : (int64_t)512 << 20;
  int64_t copies = 1, wanted = 1;
  if (kv_bytes < 8 * llc) {
    wanted = (8 * llc + kv_bytes - 1) / kv_bytes + 1;
    if (wanted < 2) wanted = 2;
    copies = wanted;
    const int64_t avail = available_bytes();
    if (avail > 0 && avail / 2 / kv_bytes < copies) copies = avail / 2 / kv_bytes > 0 ? avail / 2 / kv_bytes : 1;
  }

  const size_t mem = (size_t)(copies * kv_bytes) + (size_t)(B * Hq * L * E * 4) + (size_t)(S * L * 2) +
                     (size_t)copies * (ggml_graph_overhead() + 8 * ggml_tensor_overhead()) + (16u << 20);
  struct ggml_init_params params = {mem, NULL, false};
  struct ggml_context* ctx = ggml_init(params);
  if (!ctx) {
    fprintf(stderr, "ggml_fa_decode: ggml_init of %zu bytes failed\n", mem);
    return 1;
  }
  struct ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, E, L, Hq, B);
  fill(q);
  struct ggml_tensor* mask = NULL;
  if (L > 1) {  // causal, bottom-right: query i sees keys j <= i + S - L
    mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, S, L, 1, 1);
    ggml_fp16_t* m = (ggml_fp16_t*)mask->data;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) m[i * S + j] = ggml_fp32_to_fp16(j <= i + S - L ? 0.0f : -INFINITY);
  }
  struct ggml_cgraph** graphs = calloc((size_t)copies, sizeof *graphs);
  struct ggml_cplan* plans = calloc((size_t)copies, sizeof *plans);
  for (int64_t c = 0; c < copies; ++c) {
    struct ggml_tensor* k = ggml_new_tensor_4d(ctx, kv_type, E, S, Hkv, B);
    struct ggml_tensor* v = ggml_new_tensor_4d(ctx, kv_type, E, S, Hkv, B);
    fill(k);
    fill(v);
    struct ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / sqrtf((float)E), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    graphs[c] = ggml_new_graph(ctx);
    ggml_build_forward_expand(graphs[c], out);
    plans[c] = ggml_graph_plan(graphs[c], threads, NULL);
    plans[c].work_data = plans[c].work_size ? malloc(plans[c].work_size) : NULL;
  }

  double* cold = malloc(sizeof(double) * (size_t)repeats);
  double* warm = malloc(sizeof(double) * (size_t)repeats);
  int64_t call = 0;
  for (int i = 0; i < warmup; ++i, ++call) ggml_graph_compute(graphs[call % copies], &plans[call % copies]);
  for (int i = 0; i < repeats; ++i, ++call) {
    const double t0 = now_ms();
    ggml_graph_compute(graphs[call % copies], &plans[call % copies]);
    cold[i] = now_ms() - t0;
  }
  ggml_graph_compute(graphs[0], &plans[0]);
  for (int i = 0; i < repeats; ++i) {
    const double t0 = now_ms();
    ggml_graph_compute(graphs[0], &plans[0]);
    warm[i] = now_ms() - t0;
  }
  const double ms = median(cold, repeats), warm_ms = median(warm, repeats);
  printf("ggml_flash_attn_ext B=%lld H_q=%lld H_kv=%lld E=%lld S=%lld L=%lld K/V %s threads=%d: "
         "%.3f ms, K/V %.1f MiB, %.2f GB/s (%lld copies rotated%s); warm %.3f ms, %.2f GB/s\n",
         (long long)B, (long long)Hq, (long long)Hkv, (long long)E, (long long)S, (long long)L, argv[7],
         threads, ms, kv_bytes / 1048576.0, kv_bytes / (ms * 1e6), (long long)copies,
         copies < wanted ? ", fewer than wanted: partly cached" : "", warm_ms, kv_bytes / (warm_ms * 1e6));
  return 0;
}
EOF
libs=()
for lib in ggml ggml-base ggml-cpu; do
  found="$(find "$build" -name "lib$lib.so" -o -name "lib$lib.a" | head -n 1)"
  [[ -n "$found" ]] && libs+=("$found")
done
cc -O2 -std=c11 -I"$src/include" "$work/ggml_fa_decode.c" -o "$work/ggml_fa_decode" \
   "${libs[@]}" -Wl,-rpath,"$build/src:$build/bin" -fopenmp -lm -lstdc++

echo
echo "== ggml_flash_attn_ext, our shapes, K/V rotating among copies ($work/ggml_fa_decode)"
while read -r b hq hkv e s l kv; do
  [[ -z "${b:-}" ]] && continue
  "$work/ggml_fa_decode" "$b" "$hq" "$hkv" "$e" "$s" "$l" "$kv" "$threads" "$repeats" "$warmup"
done <<< "$shapes"

# ---- part 3: ggml and attn alternating in one process ---------------------------------------------
echo
if [[ ! -f "$attn_build/libattn.a" ]]; then
  echo "== (no part 3: no libattn.a in '$attn_build'; scripts/build.sh, or set ATTN_BUILD)"
  exit 0
fi
attn_src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$attn_build/CMakeCache.txt")"
cat > "$work/ggml_attn_ab.cpp" <<'EOF'
// ggml_flash_attn_ext and attn::scaled_dot_product_attention alternating call by call on the same
// K/V (ggml's tensors, (B, H_kv, S, E) row-major, viewed by attn), rotating among copies that
// fill 8x the last-level cache (written by attn's scripts/bench_ggml.sh, part 3).
// usage: ggml_attn_ab B H_q H_kv E S f32|f16 threads rounds
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {
uint64_t rng = 88172645463325252ull;
float next_uniform() {  // xorshift64, in [-1, 1)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return static_cast<float>((rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}
void fill(ggml_tensor* t) {
  const int64_t n = ggml_nelements(t);
  for (int64_t i = 0; i < n; ++i) {
    if (t->type == GGML_TYPE_F32) static_cast<float*>(t->data)[i] = next_uniform();
    else static_cast<ggml_fp16_t*>(t->data)[i] = ggml_fp32_to_fp16(next_uniform());
  }
}
// The largest cache sysfs reports for cpu0, in bytes (0: none), as part 2's program reads it.
int64_t llc_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    char path[96];
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;
    long long n = 0;
    char unit = 0;
    if (std::fscanf(f, "%lld%c", &n, &unit) >= 1) {
      const int64_t b = unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : unit == 'G' ? n << 30 : n;
      best = std::max(best, b);
    }
    std::fclose(f);
  }
  return best;
}
int64_t available_bytes() {  // MemAvailable (0: unknown)
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char key[64];
  long long kib = 0;
  int64_t r = 0;
  while (std::fscanf(f, "%63s %lld kB", key, &kib) == 2) {
    if (std::strcmp(key, "MemAvailable:") == 0) r = static_cast<int64_t>(kib) * 1024;
  }
  std::fclose(f);
  return r;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s B H_q H_kv E S f32|f16 threads rounds\n", argv[0]);
    return 2;
  }
  const int64_t B = atoll(argv[1]), Hq = atoll(argv[2]), Hkv = atoll(argv[3]), E = atoll(argv[4]), S = atoll(argv[5]);
  const bool f16 = std::strcmp(argv[6], "f16") == 0;
  const int threads = atoi(argv[7]), rounds = atoi(argv[8]);
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || E <= 0 || S <= 0 || threads <= 0 || rounds <= 0 ||
      (!f16 && std::strcmp(argv[6], "f32") != 0)) {
    std::fprintf(stderr, "ggml_attn_ab: bad arguments\n");
    return 2;
  }
  ggml_cpu_init();
  const ggml_type kv_type = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
  const int64_t kv_bytes = B * Hkv * S * 2 * E * static_cast<int64_t>(ggml_type_size(kv_type));
  // Copies filling 8x the LLC (as attn bench and part 2 rotate them), at least 2: K/V from memory.
  const int64_t llc = llc_bytes() > 0 ? llc_bytes() : int64_t{512} << 20;
  int64_t copies = std::max<int64_t>(2, 8 * llc / kv_bytes + 1);
  if (const int64_t avail = available_bytes(); avail > 0) {  // at most half the free memory
    copies = std::max<int64_t>(1, std::min(copies, avail / 2 / kv_bytes));
  }
  const size_t mem = static_cast<size_t>(copies * kv_bytes + B * Hq * E * 4) +
                     static_cast<size_t>(copies) * (ggml_graph_overhead() + 8 * ggml_tensor_overhead()) + (16u << 20);
  ggml_init_params init = {mem, nullptr, false};
  ggml_context* ctx = ggml_init(init);
  if (ctx == nullptr) {
    std::fprintf(stderr, "ggml_attn_ab: ggml_init of %zu bytes failed\n", mem);
    return 1;
  }
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, E, 1, Hq, B);
  fill(q);
  std::vector<ggml_cgraph*> graphs;
  std::vector<ggml_cplan> plans;
  std::vector<ggml_tensor*> ks, vs;
  for (int64_t c = 0; c < copies; ++c) {
    ks.push_back(ggml_new_tensor_4d(ctx, kv_type, E, S, Hkv, B));
    vs.push_back(ggml_new_tensor_4d(ctx, kv_type, E, S, Hkv, B));
    fill(ks.back());
    fill(vs.back());
    ggml_tensor* out = ggml_flash_attn_ext(ctx, q, ks.back(), vs.back(), nullptr,
                                           1.0f / std::sqrt(static_cast<float>(E)), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    graphs.push_back(ggml_new_graph(ctx));
    ggml_build_forward_expand(graphs.back(), out);
    plans.push_back(ggml_graph_plan(graphs.back(), threads, nullptr));
    plans.back().work_data =
        plans.back().work_size ? static_cast<uint8_t*>(std::malloc(plans.back().work_size)) : nullptr;
  }
  const attn::DType dtype = f16 ? attn::DType::kFloat16 : attn::DType::kFloat32;
  const attn::TensorView qa(static_cast<float*>(q->data), attn::Shape{B, Hq, 1, E});
  attn::SdpaOptions options;
  options.num_threads = threads;
  options.enable_gqa = Hq != Hkv;
  std::vector<double> ggml_s, attn_s, ratio;
  constexpr int kWarmup = 3;
  for (int r = 0; r < rounds + kWarmup; ++r) {
    const int64_t c = (2 * r) % copies, d = (2 * r + 1) % copies;  // each call a copy of its own
    auto t0 = std::chrono::steady_clock::now();
    ggml_graph_compute(graphs[c], &plans[c]);
    const double g = seconds_since(t0);
    const attn::TensorView ka(ks[d]->data, dtype, attn::Shape{B, Hkv, S, E});
    const attn::TensorView va(vs[d]->data, dtype, attn::Shape{B, Hkv, S, E});
    t0 = std::chrono::steady_clock::now();
    const attn::SdpaResult out = attn::scaled_dot_product_attention(qa, ka, va, options);
    const double a = seconds_since(t0);
    if (r < kWarmup) continue;
    ggml_s.push_back(g), attn_s.push_back(a), ratio.push_back(g / a);
  }
  // Both compute the same thing: ggml's output (E, H_q, 1, B) is attn's (B, H_q, 1, E) in memory.
  ggml_graph_compute(graphs[0], &plans[0]);
  const float* go = static_cast<const float*>(ggml_graph_node(graphs[0], -1)->data);
  const attn::SdpaResult check = attn::scaled_dot_product_attention(
      qa, attn::TensorView(ks[0]->data, dtype, attn::Shape{B, Hkv, S, E}),
      attn::TensorView(vs[0]->data, dtype, attn::Shape{B, Hkv, S, E}), options);
  const float* ao = check.output.data();
  double diff = 0.0;
  for (int64_t i = 0; i < B * Hq * E; ++i) diff = std::max(diff, std::fabs(static_cast<double>(go[i]) - ao[i]));
  if (!(diff <= 1e-3)) {  // outputs are ~1e-2 here; a wrong head or layout differs by as much
    std::fprintf(stderr, "ggml_attn_ab: outputs differ by %g: not the same computation\n", diff);
    return 1;
  }
  for (auto* v : {&ggml_s, &attn_s, &ratio}) std::sort(v->begin(), v->end());
  const size_t m = ratio.size() / 2;
  std::printf("B=%lld H_q=%lld H_kv=%lld E=%lld S=%lld L=1 K/V %s threads=%d, %d rounds (%lld copies): "
              "ggml %.3f ms (%.1f GB/s), attn %.3f ms (%.1f GB/s); ggml / attn %.2fx (quartiles %.2f-%.2f); outputs within %.1e\n",
              static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Hkv),
              static_cast<long long>(E), static_cast<long long>(S), argv[6], threads, rounds,
              static_cast<long long>(copies), ggml_s[m] * 1e3, kv_bytes / ggml_s[m] * 1e-9, attn_s[m] * 1e3,
              kv_bytes / attn_s[m] * 1e-9, ratio[m], ratio[ratio.size() / 4], ratio[ratio.size() * 3 / 4], diff);
  return 0;
}
EOF
c++ -O2 -std=c++20 -I"$src/include" -I"$attn_src/include" "$work/ggml_attn_ab.cpp" -o "$work/ggml_attn_ab" \
    "$attn_build/libattn.a" "${libs[@]}" -Wl,-rpath,"$build/src:$build/bin" -fopenmp -lfmt -lopenblas -lm
echo "== ggml and attn alternating call by call in one process, same K/V ($work/ggml_attn_ab; attn: $attn_build)"
while read -r b hq hkv e s l kv; do
  [[ -z "${b:-}" || "$l" != 1 ]] && continue
  "$work/ggml_attn_ab" "$b" "$hq" "$hkv" "$e" "$s" "$kv" "$threads" "$rounds"
done <<< "$shapes"

#!/usr/bin/env bash
# Compares the float32 CPU kernels of two source trees in one process (scripts/ab_kernels.cpp):
# each call of one build is paired with a call of the other on the same inputs, so the ratio of
# their times is not moved by the host's drifts between runs, which on the project's shared VMs
# are larger than most kernel changes (scripts/ab_bench.sh compares whole binaries run by run).
#
#   scripts/ab_kernels.sh [-i avx2|avx512|avx512_bf16|generic] REV_A REV_B -- MODE ARGS...
#
# REV is a git revision (its src/ is exported), `worktree` (the working tree's src/) or a
# directory holding a src/ (an experiment's copy). MODE and ARGS are ab_kernels.cpp's:
# `fwd|bwd H L E CAUSAL PAIRS [THREADS]` or `decode H_KV ROWS S E COPIES PAIRS [THREADS [KV [PAGE]]]`, KV f32,
# bf16 or bf16q (bf16 queries too: the bf16 dot unit's path, -i avx512_bf16), PAGE a paged pool
# of PAGE-token pages (0: dense), PAGE_A:PAGE_B a layout per build (16:0 with HEAD HEAD: paged
# over dense in one process); with -i avx512_bf16
# also `fwd16|bwd16 H L E CAUSAL PAIRS [THREADS]`, the AVX512-BF16 forward and backward on bf16
# inputs (the trees' flash_avx512_bf16.cpp and flash_bwd_avx512_bf16.cpp, their accessors
# renamed). e.g., a change to flash_kernel.hpp against HEAD:
#   scripts/ab_kernels.sh HEAD worktree -- fwd 1 1024 64 0 201
# The kernels are compiled as the library compiles its flash_<isa>.cpp (-O3, the ISA's flags);
# the harness links the library for what the kernels call (Philox dropout): build it first
# (scripts/build.sh; ATTN_BUILD_DIR, default build/). Nothing else may run on the machine meanwhile.
set -euo pipefail

isa=avx2
if [[ "${1:-}" == "-i" ]]; then
  isa="$2"
  shift 2
fi
if [[ $# -lt 4 || "$3" != "--" ]]; then
  echo "usage: $0 [-i avx2|avx512|avx512_bf16|generic] REV_A REV_B -- fwd|bwd|decode ARGS..." >&2
  exit 2
fi
rev_a="$1" rev_b="$2"
shift 3
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${ATTN_BUILD_DIR:-$root/build}"
[[ -f "$build/libattn.a" ]] || { echo "ab_kernels.sh: no $build/libattn.a; run scripts/build.sh first" >&2; exit 2; }

case "$isa" in
  avx2) flags=(-mavx2 -mfma -mf16c) width=8 need=(avx2 fma f16c) ;;
  avx512) flags=(-mavx512f -mavx512vl -mavx512dq -mfma) width=16 need=(avx512f avx512vl avx512dq fma) ;;
  avx512_bf16) flags=(-mavx512f -mavx512vl -mavx512dq -mavx512bw -mavx512bf16 -mfma) width=16
    need=(avx512f avx512vl avx512dq avx512bw avx512_bf16 fma) ;;
  generic) flags=() width=4 need=() ;;
  *) echo "ab_kernels.sh: unknown ISA $isa (avx2, avx512, avx512_bf16 or generic)" >&2; exit 2 ;;
esac
for f in "${need[@]}"; do
  grep -qw "$f" /proc/cpuinfo || { echo "ab_kernels.sh: this CPU lacks $f, which the $isa build assumes" >&2; exit 2; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tree() {  # tree REV DIR: the revision's src/ under DIR
  mkdir -p "$2"
  if [[ "$1" == worktree ]]; then
    cp -r "$root/src" "$2/"
  elif [[ -d "$1/src" ]]; then
    cp -r "$1/src" "$2/"
  else
    git -C "$root" archive "$1" src | tar -x -C "$2"
  fi
}
tree "$rev_a" "$work/a"
tree "$rev_b" "$work/b"
common=(-O3 -DNDEBUG -std=c++20 -fopenmp -ffp-contract=fast -I"$root/include" "-DATTN_SIMD_WIDTH=$width" "${flags[@]}")
g++ "${common[@]}" -I"$work/a/src" -DATTN_SIMD_NS=ab_a -DAB_KERNEL=kernel_a -DAB_DECODE=decode_a \
  -c "$root/scripts/ab_tu.cpp" -o "$work/a.o" &
g++ "${common[@]}" -I"$work/b/src" -DATTN_SIMD_NS=ab_b -DAB_KERNEL=kernel_b -DAB_DECODE=decode_b \
  -c "$root/scripts/ab_tu.cpp" -o "$work/b.o"
wait $!
bf16_objs=()
if [[ "$isa" == avx512_bf16 ]]; then  # the bf16 kernels are .cpp files: each tree's, renamed
  for t in a b; do
    g++ "${common[@]}" -I"$work/$t/src" -Dbf16_kernel_avx512=bf16_kernel_$t \
      -c "$work/$t/src/sdpa/cpu/flash_avx512_bf16.cpp" -o "$work/fwd16_$t.o"
    g++ "${common[@]}" -I"$work/$t/src" -Dbf16_backward_avx512=bf16_backward_$t \
      -c "$work/$t/src/sdpa/cpu/flash_bwd_avx512_bf16.cpp" -o "$work/bwd16_$t.o"
    bf16_objs+=("$work/fwd16_$t.o" "$work/bwd16_$t.o")
  done
fi
# Linked four ways: A's kernels first or B's, each behind 16 or 48 bytes of padding. Where a
# build's code lands moves its speed (the same source in both namespaces measured A/B 0.89-0.98
# linked one way and 1.11 the other, on Zen 3), so the layouts' medians are combined (their
# geometric mean) and shown one by one. The spread is widest when a neighbour slows the host
# (low absolute rates on every line): trust a difference that the layouts agree on when it is quiet.
# The library's own dependencies (scripts/install-deps.sh installs them).
g++ -O2 -std=c++20 -fopenmp -I"$root/src" -I"$root/include" -c "$root/scripts/ab_kernels.cpp" -o "$work/main.o"
for pad in 16 48; do
  printf '__attribute__((used, noinline)) void ab_pad() { __asm__ volatile(".skip %d"); }\n' "$pad" > "$work/pad$pad.c"
  gcc -O0 -fno-asynchronous-unwind-tables -c "$work/pad$pad.c" -o "$work/pad$pad.o"
done
echo "A = $rev_a, B = $rev_b, $isa build ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
medians=()
for layout in ab16 ba16 ab48 ba48; do
  objs=("$work/a.o" "$work/b.o")
  [[ "$layout" == ba* ]] && objs=("$work/b.o" "$work/a.o")
  g++ -fopenmp "$work/main.o" "$work/pad${layout:2}.o" "${objs[@]}" ${bf16_objs[@]+"${bf16_objs[@]}"} "$build/libattn.a" \
    -lfmt -lopenblas -o "$work/ab_kernels"
  printf '%s first, +%s bytes: ' "$([[ "$layout" == ab* ]] && echo A || echo B)" "${layout:2}"
  line="$("$work/ab_kernels" "$@")"
  echo "$line"
  medians+=("$(sed -n 's/.*A\/B median \([0-9.]*\).*/\1/p' <<<"$line")")
done
awk -v m="${medians[*]}" 'BEGIN { n = split(m, x, " "); p = 1; for (i = 1; i <= n; ++i) p *= x[i];
  printf "A/B over the %d layouts (geometric mean of the medians): %.3f\n", n, p ^ (1 / n) }'

#!/usr/bin/env bash
# Times two `attn` binaries against each other, alternating run by run, so that both see the same
# states of a noisy host (its memory bandwidth moves by 2x between minutes on the project's VMs):
# the way this project's notes compare a kernel change with the unchanged build.
#
#   cp build/attn /tmp/attn_old            # before the change
#   ... change, rebuild ...
#   scripts/ab_bench.sh [-n ROUNDS] /tmp/attn_old build/attn -- ATTN_BENCH_ARGS...
#
# e.g. scripts/ab_bench.sh -n 8 /tmp/attn_old build/attn -- --heads 12 --seq 1024 --dim 64 \
#        --causal --threads 2 --repeats 30
#
# Each round runs `A bench ARGS` then `B bench ARGS` (ROUNDS rounds, default 6) and prints both
# medians; for decode shapes (L <= 16) also the run's "% of bandwidth" (the kernel's K/V rate over
# the read probe of the same run) and the probe. The summary gives, per binary, the median, min
# and max of the rounds' medians, and the median "% of bandwidth" where there is one. Nothing else
# may run on the machine meanwhile.
set -euo pipefail

rounds=6
if [[ "${1:-}" == "-n" ]]; then
  rounds="$2"
  shift 2
fi
if [[ $# -lt 3 || "$3" != "--" ]]; then
  echo "usage: $0 [-n ROUNDS] BINARY_A BINARY_B -- ATTN_BENCH_ARGS..." >&2
  exit 2
fi
a="$1" b="$2"
shift 3
[[ "$a" != "$b" ]] || { echo "ab_bench.sh: A and B are the same path ($a); copy one of them" >&2; exit 2; }
for bin in "$a" "$b"; do
  [[ -x "$bin" ]] || { echo "ab_bench.sh: $bin is not an executable" >&2; exit 2; }
done

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for ((i = 1; i <= rounds; ++i)); do
  for bin in "$a" "$b"; do
    # median ms, % of bandwidth (or -), probe GB/s (or -)
    line="$("$bin" bench "$@" 2>&1 | awk '/^median/ {m=$2} /^of bandwidth/ {o=$3} /^bandwidth/ {p=$2}
             END {if (m == "") exit 1; print m, (o == "" ? "-" : o), (p == "" ? "-" : p)}')" || {
      echo "ab_bench.sh: '$bin bench $*' printed no median" >&2
      exit 1
    }
    echo "$bin $line" | tee -a "$out"
  done
done

median() { sort -n | awk '{v[NR] = $1} END {if (NR > 0) print v[int((NR + 1) / 2)]}'; }
for bin in "$a" "$b"; do
  ms="$(awk -v b="$bin" '$1 == b {print $2}' "$out" | sort -n)"
  summary="$(printf '%s\n' "$ms" | awk -v b="$bin" '{v[NR] = $1}
    END {printf "%s: median %.3f ms (min %.3f, max %.3f, %d rounds)", b, v[int((NR + 1) / 2)], v[1], v[NR], NR}')"
  bw="$(awk -v b="$bin" '$1 == b && $3 != "-" {print $3}' "$out" | median)"
  [[ -n "$bw" ]] && summary="$summary; median $bw % of bandwidth"
  echo "$summary"
done

#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang, ASan and UBSan into ./build-fuzz and
# runs each for a while on a working copy of its seed corpus.
#
#   scripts/fuzz.sh [--time SECONDS] [--jobs N] [--keep-corpus] [TARGET...]
#                                     (default: 60 s, one target at a time, every target)
#
# Targets: fuzz_fixture_parser fuzz_sdpa fuzz_tensor_views fuzz_safetensors. Each runs as one libFuzzer process
# (one worker, one job) with -max_total_time=SECONDS -rss_limit_mb=2048 -timeout=10, on
# build-fuzz/corpus-work/<target>/: a fresh copy of the committed seeds in
# tests/fuzz/corpus/<target>/ (the repository is never written), or with --keep-corpus the
# previous run's working corpus plus the seeds. Crash, timeout and OOM inputs go to
# build-fuzz/artifacts/, logs to build-fuzz/logs/<target>.log; each target's summary line (executions, corpus, coverage,
# finding) and libFuzzer's final stats go to build-fuzz/logs/<target>.summary and are appended
# to build-fuzz/fuzz-summary.txt (so two instances on different targets can run side by side,
# one core each; --jobs N runs N targets at a time, as CI does on its 2 cores). Exits 1 if any
# target found something.
# Reproduce a finding:  build-fuzz/<target> build-fuzz/artifacts/<target>-crash-<hash>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
all_targets=(fuzz_fixture_parser fuzz_sdpa fuzz_tensor_views fuzz_safetensors fuzz_paged_attention)

time_s=60
jobs=1
keep_corpus=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) time_s="${2:?--time needs a number of seconds}"; shift 2 ;;
    --time=*) time_s="${1#--time=}"; shift ;;
    --jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
    --keep-corpus) keep_corpus=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target $t (have: ${all_targets[*]})" >&2; exit 2; }
done
[[ "$time_s" =~ ^[0-9]+$ ]] || { echo "fuzz.sh: --time takes whole seconds, got '$time_s'" >&2; exit 2; }
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --jobs takes a positive whole number, got '$jobs'" >&2; exit 2; }

"$root/scripts/install-deps.sh" clang libclang-rt-14-dev libomp-dev

build="$root/build-fuzz"
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DATTN_BUILD_FUZZERS=ON -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_CLI=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

mkdir -p "$build/artifacts" "$build/logs" "$build/corpus-work"
# One core per target: no BLAS or OpenMP thread pools beyond what a fuzz input asks for.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

summary="$build/fuzz-summary.txt"
# One target: runs it, prints its summary line; exit status 1 if it found something.
fuzz_one() {
  local t="$1" work log before after rc execs last cov ft corp finding line
  work="$build/corpus-work/$t"
  [ "$keep_corpus" -eq 1 ] || rm -rf "$work"
  mkdir -p "$work"
  cp "$root/tests/fuzz/corpus/$t/"* "$work/"
  log="$build/logs/$t.log"
  before=$(ls "$build/artifacts" | grep -c "^$t-" || true)
  echo "fuzz.sh: $t for ${time_s}s (log: $log)"
  rc=0
  "$build/$t" "$work" -max_total_time="$time_s" -rss_limit_mb=2048 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" >"$log" 2>&1 || rc=$?
  after=$(ls "$build/artifacts" | grep -c "^$t-" || true)
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
  last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9a-zA-Z]*\).*/\1/p' <<<"$last")
  finding="none"
  if [ "$rc" -ne 0 ] || [ "$after" -gt "$before" ]; then
    finding="FOUND (exit $rc): $(ls -t "$build/artifacts" | grep "^$t-" | head -1 | sed "s|^|build-fuzz/artifacts/|")"
  fi
  line="$t: ${time_s}s, executions ${execs:-?}, corpus ${corp:-?} (files in corpus-work: $(ls "$work" | wc -l)), cov ${cov:-?}, ft ${ft:-?}, finding: $finding"
  echo "$line"
  {
    echo "$(date -u +%FT%TZ) $line"
    echo "  last status line: $last"
    grep '^stat::' "$log" | sed "s/^/  /" || true
  } > "$build/logs/$t.summary"
  if [ "$finding" != "none" ]; then
    grep -E 'ERROR|fuzz property violated|runtime error|deadly signal|Timeout|out-of-memory' "$log" | head -5 | sed 's/^/    /'
    return 1
  fi
}

# Up to $jobs targets at a time; the summary file is appended in target order once all are done.
failed=0
pids=()
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$t" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for t in "${targets[@]}"; do cat "$build/logs/$t.summary" >> "$summary" 2>/dev/null || failed=1; done
echo "fuzz.sh: summary in $summary"
exit $failed

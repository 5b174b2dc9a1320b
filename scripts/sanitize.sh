#!/usr/bin/env bash
# Sanitizer run, for CI: every check must end with zero reports.
#
#   scripts/sanitize.sh [asan] [tsan]      (default: both)
#
# asan  g++, -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer,
#       RelWithDebInfo, in build-asan/: the CTest suite (unit tests, stress test, CLI exit-code
#       tests, example) but for the labels "slow" (two full training runs) and "heavy" (the
#       sweeps' largest cases, tests/label_heavy.cmake), which test.sh runs in the optimised
#       build; then a short soak (random shapes, strided inputs, masks, dropout) under the same
#       sanitizers.
# tsan  clang++-14 with LLVM's libomp and its Archer tool (OMP_TOOL_LIBRARIES=libarcher.so),
#       which tells ThreadSanitizer about OpenMP's barriers, tasks and locks; GCC's libgomp is not
#       instrumented and would give false reports. In build-tsan/: first a canary
#       (tests/stress/tsan_canary.cpp) proves the setup: Archer loads, a correct OpenMP program
#       gives no report with it (without it, OMP_TOOL=disabled, TSan reports a false race there:
#       shown as a note), and a deliberate race is reported.
#       Then the threaded tests (the fused kernel's FlashForward*, the fused backward's two-thread
#       sweep and FlashBackward* cases, every Sdpa* test, the variants' two-thread sweep
#       (Sweep/Variants.SameBitsForOneAndTwoThreads/*), flex_attention's thread-count test,
#       Stress.*, NumericsPolicy.*; not the label-heavy cases) and a short soak run with
#       TSAN_OPTIONS=halt_on_error=1.
#
# Every test's output is kept (<build>/ctest-output.txt, ctest -V) and searched for sanitizer
# reports, so a report in a test that is expected to fail, or in a child process, still counts.
# Prints one summary line at the end and exits non-zero if a build failed, a test failed or any
# report was found.
# Took 26 min on 2 cores of an AMD Zen 3 (ASan+UBSan 21 min with its build, TSan 6), 54 before
# the label "heavy" and the sanitized builds' -g1 and -O1 (CMakeLists.txt). Knobs: SOAK_SECONDS
# (per sanitizer, default 25; 0 skips the soak), SOAK_SEED (default: the time), JOBS (default:
# nproc).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
started=$SECONDS
jobs="${JOBS:-$(nproc)}"
soak_seconds="${SOAK_SECONDS:-25}"
soak_seed="${SOAK_SEED:-$(date +%s)}"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(asan tsan)

llvm=/usr/lib/llvm-14
archer="$llvm/lib/libarcher.so"
extra_pkgs=()
for s in "${stages[@]}"; do
  case "$s" in
    asan) ;;
    tsan) extra_pkgs+=(clang-14 libclang-rt-14-dev libomp-14-dev) ;;
    *) echo "sanitize.sh: unknown stage '$s' (asan, tsan)" >&2; exit 2 ;;
  esac
done
"$root/scripts/install-deps.sh" ninja-build "${extra_pkgs[@]}"

summary=()
failed=0
log() { printf '\n== sanitize: %s\n' "$*"; }
fail() { echo "sanitize: FAIL: $*" >&2; failed=1; }

# Sanitizer reports in the output files given; each is printed (to stderr) with some context,
# and the count is echoed.
report_pattern='ERROR: (Address|Leak)Sanitizer|runtime error:|WARNING: ThreadSanitizer'
count_reports() {
  local n=0 f c
  for f in "$@"; do
    [ -f "$f" ] || continue
    c=$(grep -cE "$report_pattern" "$f" || true)
    if [ "$c" -gt 0 ]; then
      echo "---- $c sanitizer report(s) in $f:" >&2
      grep -E -A 25 "$report_pattern" "$f" | head -200 >&2
    fi
    n=$((n + c))
  done
  echo "$n"
}

# Runs ctest verbosely (every test's output is kept, so a report in a test expected to fail, or
# in a child process, is seen) in a build dir with extra arguments; sets ran/failed_tests.
run_ctest() {
  local dir="$1"
  shift
  local out rc=0
  out="$dir/ctest-output.txt"
  (cd "$dir" && ctest -V --timeout 900 -j "$jobs" "$@") >"$out" 2>&1 || rc=$?
  grep -E '% tests passed|tests failed out of|The following tests FAILED|^[[:space:]]+[0-9]+ - ' "$out" || true
  ran=$(grep -oE 'out of [0-9]+' "$out" | tail -1 | grep -oE '[0-9]+' || echo 0)
  failed_tests=$(grep -oE '[0-9]+ tests failed' "$out" | tail -1 | grep -oE '^[0-9]+' || echo 0)
  if [ "$rc" -ne 0 ]; then
    echo "(full ctest output: $out)"
    [ "$failed_tests" -eq 0 ] && failed_tests=1
  fi
}

# ---- AddressSanitizer + UndefinedBehaviorSanitizer (g++, libgomp) ----------------------------------
stage_asan() {
  log "ASan+UBSan: configure and build build-asan (g++, RelWithDebInfo)"
  t0=$SECONDS
  cmake -S "$root" -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DATTN_SANITIZE=address,undefined -DATTN_WITH_MPI=OFF >/dev/null || { fail "ASan configure"; return 1; }
  cmake --build build-asan -j "$jobs" >build-asan/build.log 2>&1 ||
    { tail -30 build-asan/build.log; fail "ASan build (build-asan/build.log)"; return 1; }
  rm -f build-asan/ctest-output.txt build-asan/soak.txt
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  log "ASan+UBSan: the CTest suite but the label-slow training runs and the label-heavy sweep cases"
  # Both run in test.sh's optimised build: the two full default training runs, and the sweeps'
  # "_large" cases (tests/label_heavy.cmake), whose smaller cases take the same code paths here.
  run_ctest build-asan -LE 'slow|heavy'
  asan_ran=$ran
  [ "$failed_tests" -ne 0 ] && fail "$failed_tests of $ran tests failed under ASan+UBSan"
  asan_soak="skipped"
  if [ "$soak_seconds" -gt 0 ]; then
    log "ASan+UBSan: soak, $soak_seconds s, seed $soak_seed"
    if build-asan/attn_soak "$soak_seconds" --seed "$soak_seed" --accuracy-warn-only >build-asan/soak.txt 2>&1; then
      asan_soak="$(grep -oE '^attn_soak: [0-9]+ iterations' build-asan/soak.txt | grep -oE '[0-9]+') iterations"
    else
      asan_soak="FAILED"
      fail "soak under ASan+UBSan (seed $soak_seed)"
    fi
    grep -E '^attn_soak: [0-9]+ iterations|FAIL \(hard\)' build-asan/soak.txt || tail -20 build-asan/soak.txt
  fi
  asan_reports=$(count_reports build-asan/ctest-output.txt build-asan/soak.txt)
  [ "$asan_reports" -ne 0 ] && fail "$asan_reports ASan/UBSan reports (build-asan/ctest-output.txt, soak.txt)"
  unset ASAN_OPTIONS UBSAN_OPTIONS
  summary+=("ASan+UBSan: $asan_ran tests, soak $asan_soak, $asan_reports reports ($((SECONDS - t0)) s)")
}

# ---- ThreadSanitizer (clang++-14, LLVM libomp + Archer) --------------------------------------------
stage_tsan() {
  log "TSan: configure and build build-tsan (clang++-14, libomp, RelWithDebInfo)"
  t0=$SECONDS
  [ -f "$archer" ] || { fail "$archer not found (libomp-14-dev)"; return 1; }
  CXX=clang++-14 cmake -S "$root" -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DATTN_SANITIZE=thread -DATTN_WITH_MPI=OFF >/dev/null || { fail "TSan configure"; return 1; }
  grep -q 'CMAKE_CXX_COMPILER:.*clang' build-tsan/CMakeCache.txt ||
    { fail "build-tsan is configured with another compiler; remove build-tsan/"; return 1; }
  cmake --build build-tsan -j "$jobs" --target attn_tests attn_soak >build-tsan/build.log 2>&1 ||
    { tail -30 build-tsan/build.log; fail "TSan build (build-tsan/build.log)"; return 1; }
  # grep reads to the end (no -q): under pipefail, grep -q leaving at the first match can end
  # ldd by SIGPIPE while it still writes, and the pipeline fails (a CI run failed so, 2026-12-01).
  ldd build-tsan/attn_tests | grep 'libomp' >/dev/null || { fail "attn_tests is not linked with LLVM's libomp"; return 1; }

  rm -f build-tsan/ctest-output.txt build-tsan/soak.txt
  tsan_base="halt_on_error=1 ignore_noninstrumented_modules=1 second_deadlock_stack=1"

  log "TSan: canary (tests/stress/tsan_canary.cpp)"
  canary_ok=1
  clang++-14 -std=c++20 -O1 -g -fsanitize=thread -fopenmp tests/stress/tsan_canary.cpp \
    -o build-tsan/tsan_canary || { canary_ok=0; fail "canary build"; }
  # 1. correct code, Archer: no report, and Archer announces itself.
  if [ "$canary_ok" -eq 0 ]; then
    :
  elif ! out=$(TSAN_OPTIONS="$tsan_base" OMP_TOOL_LIBRARIES="$archer" ARCHER_OPTIONS=verbose=1 \
             build-tsan/tsan_canary clean 2>&1) || [[ "$out" == *ThreadSanitizer* ]] ||
     [[ "$out" != *"Archer detected"* ]]; then
    echo "$out"; canary_ok=0; fail "canary: clean OpenMP code is reported, or Archer did not load"
  fi
  # 2. correct code without Archer: TSan cannot see libomp's barriers (false report expected).
  out=$(TSAN_OPTIONS="$tsan_base" OMP_TOOL=disabled build-tsan/tsan_canary clean 2>&1) || true
  if [[ "$out" != *"WARNING: ThreadSanitizer"* ]]; then
    echo "note: without Archer the canary gave no report either (libomp may be annotated)"
  fi
  # 3. a real race, with Archer: must be reported.
  out=$(TSAN_OPTIONS="$tsan_base" OMP_TOOL_LIBRARIES="$archer" build-tsan/tsan_canary race 2>&1) || true
  if [[ "$out" != *"WARNING: ThreadSanitizer: data race"* ]]; then
    echo "$out"; canary_ok=0; fail "canary: TSan did not report the deliberate race"
  fi
  [ "$canary_ok" -eq 1 ] && echo "canary: clean code 0 reports with Archer, deliberate race reported"

  export TSAN_OPTIONS="$tsan_base"
  export OMP_TOOL_LIBRARIES="$archer"
  log "TSan: threaded tests (FlashForward*, FlashBackward two-thread sweep, Sdpa*, the 16-bit kernels' two-thread sweep (the AMX kernel's on emulated tiles too), the decode kernels' thread-count sweep, the variants' two-thread sweep, flex_attention's thread counts, Stress.*, NumericsPolicy.*)"
  run_ctest build-tsan -R 'FlashForward|FlashBackward\.SameBits|FlashBackward[A-Z]|Sdpa|LowPrecision\.SameBits|AmxEmulated\.SameBits|Decode\.SameBits|/Variants\.SameBitsForOneAndTwoThreads/|^FlexAttention\.SameBitsForOneTwoAndThreeThreads$|^Stress\.|^NumericsPolicy\.' -LE heavy
  tsan_ran=$ran
  [ "$failed_tests" -ne 0 ] && fail "$failed_tests of $ran tests failed under TSan"
  tsan_soak="skipped"
  if [ "$soak_seconds" -gt 0 ]; then
    log "TSan: soak, $soak_seconds s, seed $soak_seed"
    if build-tsan/attn_soak "$soak_seconds" --seed "$soak_seed" --accuracy-warn-only >build-tsan/soak.txt 2>&1; then
      tsan_soak="$(grep -oE '^attn_soak: [0-9]+ iterations' build-tsan/soak.txt | grep -oE '[0-9]+') iterations"
    else
      tsan_soak="FAILED"
      fail "soak under TSan (seed $soak_seed)"
    fi
    grep -E '^attn_soak: [0-9]+ iterations|FAIL \(hard\)' build-tsan/soak.txt || tail -20 build-tsan/soak.txt
  fi
  tsan_reports=$(count_reports build-tsan/ctest-output.txt build-tsan/soak.txt)
  [ "$tsan_reports" -ne 0 ] && fail "$tsan_reports TSan reports (build-tsan/ctest-output.txt, soak.txt)"
  unset TSAN_OPTIONS OMP_TOOL_LIBRARIES
  canary_text=$([ "$canary_ok" -eq 1 ] && echo "canary ok" || echo "canary FAILED")
  summary+=("TSan+Archer: $tsan_ran tests, soak $tsan_soak, $tsan_reports reports, $canary_text ($((SECONDS - t0)) s)")
}

for s in "${stages[@]}"; do
  case "$s" in
    asan) stage_asan || summary+=("ASan+UBSan: build FAILED") ;;
    tsan) stage_tsan || summary+=("TSan+Archer: build FAILED") ;;
  esac
done

elapsed=$((SECONDS - started))
status=$([ "$failed" -eq 0 ] && echo PASS || echo FAIL)
line="sanitize: $status"
for s in "${summary[@]}"; do line+=" | $s"; done
line+=" | total $((elapsed / 60))m$((elapsed % 60))s"
echo
echo "$line"
exit "$failed"

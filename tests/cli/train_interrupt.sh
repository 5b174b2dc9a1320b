#!/usr/bin/env bash
# Interrupting `attn train` leaves the last good checkpoint intact.
#   usage: train_interrupt.sh <attn binary> <scratch directory>
#
# 1. Ctrl-C (SIGINT): exit code 130, the message names the checkpoint, the file loads
#    (`attn generate` reads it) and `--resume` continues from it.
# 2. A hard kill (SIGKILL, no chance to clean up) at random moments while checkpoints are written
#    every few milliseconds: after each kill the checkpoint still loads, because it is written to
#    a temporary file that is renamed over the old one only when complete.
set -euo pipefail
attn=$1
dir=$2
mkdir -p "$dir"
ck="$dir/interrupt.safetensors"
rm -f "$ck" "$ck".tmp-*

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# A small model that checkpoints every 2 steps (a few milliseconds apart).
train=(train --steps 1000000 --eval-every 2 --eval-batches 1 --batch 4 --d-model 16 --heads 2
       --layers 1 --threads 1 --checkpoint "$ck")
wait_for_checkpoint() {
  for _ in $(seq 1 600); do
    [ -s "$ck" ] && return 0
    sleep 0.05
  done
  fail "no checkpoint after 30 s"
}
loads() {
  "$attn" generate --checkpoint "$ck" --prompt "abcdefghijklmnop|A" --max-new-tokens 1 >/dev/null 2>"$dir/gen.err" ||
    fail "$1: the checkpoint does not load: $(cat "$dir/gen.err")"
}

# ---- 1. Ctrl-C ----
"$attn" "${train[@]}" 2>"$dir/int.err" &
pid=$!
wait_for_checkpoint
sleep 0.3
kill -INT "$pid"
rc=0
wait "$pid" || rc=$?
[ "$rc" -eq 130 ] || fail "exit code $rc after SIGINT, expected 130: $(tail -3 "$dir/int.err")"
grep -q "interrupted at step [0-9]*; the last checkpoint ($ck) is intact" "$dir/int.err" ||
  fail "no interruption message: $(tail -3 "$dir/int.err")"
loads "after SIGINT"
ls "$ck".tmp-* >/dev/null 2>&1 && fail "a temporary file was left after SIGINT: $(ls "$ck".tmp-*)"
step=$(sed -n 's/^eval  step *\([0-9]*\).*/\1/p' "$dir/int.err" | tail -1)
[ -n "$step" ] || fail "no evaluation before the interrupt"
"$attn" train --resume "$ck" --steps $((step + 4)) >"$dir/resume.out" 2>"$dir/resume.err" ||
  fail "resume failed: $(cat "$dir/resume.err")"
grep -q "resumed from $ck at step $step" "$dir/resume.err" || fail "resume did not start at step $step"
grep -q "trained 4 steps" "$dir/resume.out" || fail "resume did not train 4 steps: $(cat "$dir/resume.out")"
echo "SIGINT: exit 130 at step ${step}+, checkpoint loads, resumed to step $((step + 4))"

# ---- 2. SIGKILL at random moments ----
kills=12
for i in $(seq 1 "$kills"); do
  rm -f "$ck"
  "$attn" "${train[@]}" 2>/dev/null &
  pid=$!
  wait_for_checkpoint
  sleep "0.$((RANDOM % 300 + 10))"
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null || true
  loads "after SIGKILL $i"
done
rm -f "$ck" "$ck".tmp-*
echo "SIGKILL: the checkpoint loaded after each of $kills kills"

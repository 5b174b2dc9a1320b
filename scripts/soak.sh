#!/usr/bin/env bash
# Soak test: builds attn_soak (Release, in build-soak/) and runs it for SECONDS (default 180):
# random shapes and options, the fused kernel against the float32 reference and the float64
# truth (tests/stress/soak.cpp). Further arguments go to attn_soak, e.g.
#   scripts/soak.sh 600 --seed 42          # a reproducible 10-minute run
#   scripts/soak.sh 0 --replay 1234567     # rerun the one problem a failure printed
# Exit code: attn_soak's (0 = no failure).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-180}"
[ $# -gt 0 ] && shift
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build-soak" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build-soak" --target attn_soak -j "$(nproc)" >/dev/null
if [[ "${1:-}" == "--replay" ]]; then
  exec "$root/build-soak/attn_soak" "$@"
fi
exec "$root/build-soak/attn_soak" "$seconds" "$@"

#!/usr/bin/env bash
# Quick start 2: install what is missing, build, and run the whole test suite with CTest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/build.sh" -DATTN_WITH_MPI=ON  # attn::dist and its MPI tests are part of the suite
cd "$root/build"
ctest --output-on-failure -j "$(nproc)"

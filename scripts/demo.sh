#!/usr/bin/env bash
# Quick start 1: install what is missing, build, and run `attn demo` (arguments are passed on,
# e.g. `scripts/demo.sh --step causal-attention`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/build.sh" >/dev/null
exec "$root/build/attn" demo "$@"

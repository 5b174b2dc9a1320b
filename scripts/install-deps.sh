#!/usr/bin/env bash
# Installs what attn needs to build and test, from Debian's packages, if it is missing.
# Idempotent and quiet when everything is present (no apt-get update then). Extra package
# names given as arguments are installed too (e.g. the sanitizer and fuzzing toolchain).
set -euo pipefail

packages=(cmake g++ make pkg-config libopenblas-dev libfmt-dev libcli11-dev libgtest-dev libpng-dev
          openmpi-bin libopenmpi-dev iproute2 "$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
# CI (.ci/run sets ATTN_APT_CLEAN=1) drops the downloaded .deb files once installed: about 1.4 GB
# on a clean machine, which the later stages' disk needs more.
if [ "${ATTN_APT_CLEAN:-0}" = 1 ]; then "${sudo_cmd[@]}" apt-get clean; fi

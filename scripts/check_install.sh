#!/usr/bin/env bash
# The C++ package, as a user gets it: configures and builds attn (library only) in
# ./build-install, installs it (`cmake --install`) into a temporary prefix, then builds and runs
# examples/consumer against the installed files only, twice: with CMake (find_package(attn) ->
# attn::attn) and with pkg-config (attn.pc). Exits non-zero if any step fails.
#
#   scripts/check_install.sh [--build-dir DIR]
#
# --build-dir: install from DIR, an existing Release build of this tree (CI passes scripts/build.sh's
# ./build, which test.sh then reuses), instead of building the library in ./build-install.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-install"
own_build=1
case "${1:-}" in
  --build-dir) build="$(cd "${2:?--build-dir needs a directory}" && pwd)"; own_build=0 ;;
  "") ;;
  *) echo "check_install.sh: unknown argument '$1' (--build-dir DIR)" >&2; exit 2 ;;
esac
"$root/scripts/install-deps.sh"
prefix="$(mktemp -d)"
trap 'rm -rf "$prefix"' EXIT

if [ "$own_build" -eq 1 ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_CLI=OFF >/dev/null
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$build/CMakeCache.txt" ||
  { echo "check_install.sh: $build is not a Release build of attn" >&2; exit 2; }
cmake --build "$build" -j "$(nproc)" --target attn
cmake --install "$build" --prefix "$prefix/usr" --component dev >/dev/null
echo "check_install: installed into $prefix/usr:"
(cd "$prefix/usr" && find . -type f | grep -v '/include/attn/' | sort | sed 's/^/  /')

# 1. CMake: a separate project that only knows the prefix.
cmake -S "$root/examples/consumer" -B "$prefix/consumer-cmake" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix/usr" >/dev/null
cmake --build "$prefix/consumer-cmake" -j "$(nproc)" >/dev/null
mkdir -p "$prefix/run-cmake"
(cd "$prefix/run-cmake" && "$prefix/consumer-cmake/consumer")

# 2. pkg-config.
pcdir="$(dirname "$(find "$prefix/usr" -name attn.pc | head -1)")"
flags="$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs attn)"
echo "check_install: pkg-config --cflags --libs attn: $flags"
# shellcheck disable=SC2086  # the flags are a word list
g++ -std=c++20 -O1 "$root/examples/consumer/main.cpp" -o "$prefix/consumer-pc" $flags
mkdir -p "$prefix/run-pc"
(cd "$prefix/run-pc" && "$prefix/consumer-pc")
echo "check_install: OK (find_package(attn) and pkg-config consumers built and ran)"

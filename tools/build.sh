#!/usr/bin/env bash
# Installs what is missing (Debian packages) and builds everything into
# build/ (or $CIUIC_BUILD_DIR). Safe to run again: it only rebuilds what
# changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/install-deps.sh"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE=/usr/bin/python3
fi
cmake --build "$build" -j "${CIUIC_JOBS:-2}" "$@"

#!/usr/bin/env bash
# Installs, builds and runs every test: unit tests, integration tests with
# real daemons and trainer processes, the Python SDK tests and the
# benchmark smoke test. Exits non-zero if anything fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/build.sh"
cd "$build"
ctest --output-on-failure --timeout 900 "$@"

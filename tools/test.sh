#!/usr/bin/env bash
# Installs, builds and runs every test: unit tests, integration tests with
# real daemons and trainer processes, the Python SDK tests and the
# benchmark smoke test. Then the fuzz targets under libFuzzer, briefly
# (tools/fuzz.sh). Then, where the CUDA toolkit's headers are, the
# device (CUDA) buffer tests against the CUDA emulation
# (tests/cuda_emulation) in a second build, build-emu/ (or
# $CIUIC_EMU_BUILD_DIR). Arguments go to the first ctest, and then only it
# runs. Exits non-zero if anything fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/build.sh"
cd "$build"
ctest --output-on-failure --timeout 900 "$@"
[ $# -eq 0 ] || exit 0

# The fuzz targets (tests/fuzz) under libFuzzer and the sanitizers, 20 s
# each with a fixed seed: a second build, build-fuzz/ (clang).
bash "$root/tools/fuzz.sh" --seconds "${CIUIC_FUZZ_SECONDS:-20}" --seed 1

headers=${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h
if [ ! -f "$headers" ]; then
  echo "test.sh: no $headers: the device tests against the CUDA emulation are skipped"
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "test.sh: the CUDA emulation's SIMT executor is x86-64 code; on $(uname -m) the device tests against it are skipped"
  exit 0
fi
emu=${CIUIC_EMU_BUILD_DIR:-$root/build-emu}
if [ ! -f "$emu/build.ninja" ]; then
  cmake -S "$root" -B "$emu" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE=/usr/bin/python3 -DCIUIC_CUDA=EMULATED -DCIUIC_WITH_MPI_BASELINE=OFF
fi
# Only what the device tests run.
cmake --build "$emu" -j "${CIUIC_JOBS:-2}" --target integration_device_test cuda_kernels_test cuda_runtime_test cuda_emulation_simt_test ciuic-bench ciuicd ciuicctl ciuic_python
cd "$emu"
ctest --output-on-failure --timeout 900 -j "${CIUIC_JOBS:-2}" -L gpu

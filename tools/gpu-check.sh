#!/usr/bin/env bash
# The GPU checks of issue 7 in one run, for a machine with an NVIDIA GPU
# (sized for about 8 minutes on one H200; the figures the issue asks for
# come first, so that a step that hangs cannot cost them):
#   1. build, Release, CIUIC_CUDA=ON, only the targets needed, all cores (or
#      the bundle, checked against the sources here);
#   2. the CPU references on this CPU (reduce_test, codec_test: every kernel
#      build it runs, AVX-512 included, which the development machines lack),
#      so that a CPU fault is not taken for a GPU one;
#   3. the kernel benchmark: sum-reduce, int8/fp16 encode and int8 decode at
#      256 MiB beside a device-to-device copy of the same size, measured in
#      the same run (median of 15), with the targets (>= 80% of the copy);
#   4. the allreduce benchmark, two trainer processes on one GPU through the
#      daemon with device buffers (ciuic-bench --device cuda, float32, 8 B to
#      1 GiB, checked; target: algbw at 1 GiB >= 50% of the copy's bandwidth);
#   5. the GPU tests (every kernel against its CPU reference, device buffers
#      through the daemon on one and two nodes), the CPU-side CUDA tests, and
#      the Python CUDA-tensor tests where torch has CUDA (with the bundle, the
#      extension is compiled there for its python3);
#   6. compute-sanitizer's memcheck over the kernel tests (racecheck and
#      synccheck over the top-k and int8 ones), and Nsight
#      Compute's time and memory throughput of each benchmarked kernel;
#   7. for information: multi-node allreduce (device vs host, uncompressed
#      and int8), alltoall and alltoallv (device vs host) through two daemons.
# Every step after the build runs under a timeout within one deadline for
# the whole run (CIUIC_GPU_DEADLINE_S, default 510 s): a step that would
# start too late is skipped, saying so. (With the bundle there is no build.)
#
# Usage:
#   tools/gpu-check.sh           run the checks (builds first, see below)
#   tools/gpu-check.sh bundle    on a machine that has the build dependencies
#                                (Debian 12: tools/install-deps.sh) but maybe
#                                no GPU: build the binaries and the shared
#                                libraries they need into .gpu-bundle/, to be
#                                carried to a GPU machine that lacks them
#
# Build dependencies on the GPU machine: the checks need gRPC, Protobuf, UCX,
# Abseil, spdlog, yaml-cpp and GoogleTest development files besides CUDA and
# CMake. If a configure there fails (the lent H200 image has CUDA, CMake and
# ninja but, as far as is known, none of the Debian -dev packages, and no
# network to fetch them), the script uses .gpu-bundle/ built beforehand with
# `tools/gpu-check.sh bundle` on a Debian 12 machine (this project's CI and
# development machines), carried along: binaries built there run on the newer
# glibc/libstdc++ of the GPU image, with their other libraries from the
# bundle (LD_LIBRARY_PATH) and UCX's transport modules from it too. The
# bundle, built here on 2026-12-02: 55 MiB (the checkout with it: about 58 of
# the device tool's 64 MiB), 5 minutes on 2 cores.
#
# Output: everything is printed and, when $OUT is set, also written to
# $OUT/gpu-check.log.
#
# Environment: CIUIC_GPU_BUILD_DIR (default build-gpu), CIUIC_GPU_BUILD_TYPE
# (default Release), CIUIC_CUDA_ARCHITECTURES (default "80;90"),
# CIUIC_GPU_USE_BUNDLE=1 (skip the build and use .gpu-bundle/),
# CIUIC_GPU_PREBUILT=DIR (skip the build and use the build in DIR as it is:
# for a dry run of this script on a machine without a GPU against the CUDA
# emulation's build, build-emu/, whose figures mean nothing).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$root/.gpu-bundle
build=${CIUIC_GPU_BUILD_DIR:-$root/build-gpu}
jobs=$(nproc)
targets=(cuda_kernels_test cuda_launch_test gpu_info_test cuda_runtime_test cuda_kernels_bench ciuicd ciuicctl ciuic-bench
         integration_device_test reduce_test codec_test)
deadline=${CIUIC_GPU_DEADLINE_S:-510}

tee_pid=""
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu-check.log") 2>&1
  tee_pid=$!
fi
tmp=""
daemon_pid=""
summary=$(mktemp)
# At the end: no daemon left, no temporary files, and the log complete.
finish() {
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null
  [ -n "$tmp" ] && rm -rf "$tmp"
  rm -f "$summary"
  if [ -n "$tee_pid" ]; then
    exec >&- 2>&-
    wait "$tee_pid" 2>/dev/null
  fi
}
trap finish EXIT

say() { printf '\n=== %s (%s, %d s in)\n' "$*" "$(date -u +%H:%M:%S)" "$SECONDS"; }

# step CAP CMD...: CMD under a timeout of CAP seconds, or of what is left
# before the deadline if that is less (killed 10 s after its TERM); a step
# that would get under 15 s is not started. Output line-buffered where
# stdbuf exists, so that a killed step's last lines are in the log.
# Each step's outcome goes to the summary printed at the end, under
# $STEP (set for the call) or the command's name.
step() {
  local cap=$1 left name rc
  shift
  name=${STEP:-$(basename "$1")}
  left=$((deadline - SECONDS))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ -z "$1" ]; then
    echo "NOT BUILT: $name (no such binary in $bin)"
    echo "$name: FAILED (not built)" >>"$summary"
    return 1
  fi
  if [ "$cap" -lt 15 ]; then
    echo "SKIPPED (out of time, $SECONDS s in): $*"
    echo "$name: SKIPPED (out of time)" >>"$summary"
    return 1
  fi
  if command -v stdbuf >/dev/null; then
    timeout -k 10 "$cap" stdbuf -oL -eL "$@"
  else
    timeout -k 10 "$cap" "$@"
  fi
  rc=$?
  case $rc in
    0) echo "$name: ok" >>"$summary" ;;
    124|137) echo "$name: TIMED OUT after $cap s" >>"$summary" ;;
    *) echo "$name: FAILED (exit $rc)" >>"$summary" ;;
  esac
  return $rc
}
# The sources a bundle is built from, and their fingerprint.
bundle_sources() {
  (cd "$root" && find CMakeLists.txt cmake daemon proto sdk tools tests -type f \
     \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.proto' \
        -o -name 'CMakeLists.txt' -o -name '*.cmake' \) 2>/dev/null | LC_ALL=C sort)
}
fingerprint() { (cd "$root" && xargs -d '\n' sha1sum | sha1sum | cut -c1-16); }

configure_and_build() {
  local cuda_arch=${CIUIC_CUDA_ARCHITECTURES:-80;90}
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${CIUIC_GPU_BUILD_TYPE:-Release}" -DCIUIC_CUDA=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=$cuda_arch" -DCIUIC_WITH_MPI_BASELINE=OFF \
    -DPython_EXECUTABLE="$(command -v python3)" >"$build/ciuic-configure.log" 2>&1 || return 1
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
}

if [ "${1:-}" = "bundle" ]; then
  say "building the bundle in $build"
  mkdir -p "$build"
  if ! configure_and_build; then
    cat "$build/ciuic-configure.log"
    exit 1
  fi
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib"
  for t in "${targets[@]}"; do
    f=$(find "$build" -name "$t" -type f -perm -u+x | head -n 1)
    [ -n "$f" ] || { echo "gpu-check: $t not built" >&2; exit 1; }
    cp "$f" "$bundle/bin/" && strip --strip-debug "$bundle/bin/$t"
  done
  # Shared libraries, except the C/C++ runtime, which the GPU image has
  # (newer) itself.
  for t in "${targets[@]}"; do ldd "$bundle/bin/$t"; done | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' |
    while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
  # UCX loads its transports (tcp, shared memory, cma) as modules from a
  # directory compiled into it; the run points UCX_MODULE_DIR here instead.
  libucp=$(ldd "$bundle/bin/ciuicd" | awk '/libucp/{print $3}')
  ucx_modules=$(dirname "$(readlink -f "$libucp")")/ucx
  if [ -d "$ucx_modules" ]; then
    mkdir -p "$bundle/lib/ucx"
    cp -L "$ucx_modules"/*.so* "$bundle/lib/ucx/"
  else
    echo "gpu-check: UCX modules not found next to $libucp" >&2
  fi
  strip --strip-debug "$bundle"/lib/*.so* "$bundle"/lib/ucx/*.so* 2>/dev/null
  # pybind11's headers, for the Python extension compiled on the GPU machine
  # where its python3 has none.
  [ -d /usr/include/pybind11 ] && mkdir -p "$bundle/include" &&
    cp -r /usr/include/pybind11 "$bundle/include/"
  bundle_sources >"$bundle/SOURCES"
  fingerprint <"$bundle/SOURCES" >"$bundle/FINGERPRINT"
  (cd "$root" && git rev-parse --short HEAD 2>/dev/null; git -C "$root" status --porcelain \
     --untracked-files=no 2>/dev/null | grep -q . && echo "(with uncommitted changes)") \
    >"$bundle/VERSION" || true
  du -sh "$bundle"
  echo "bundle ready: carry .gpu-bundle (and run tools/gpu-check.sh there)"
  exit 0
fi

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
  echo "gpu-check: driver $driver is older than CUDA 13 needs (580 or newer): the GPU tests will"
  echo "fail with cudaErrorInsufficientDriver unless the cuda-compat libraries are in use"
fi
command -v nvcc >/dev/null && nvcc --version | tail -n 2
uname -srm; ldd --version 2>&1 | head -n 1

status=0
dry_run=0
bin=""
ctest_dir=""
say "build (Release, CIUIC_CUDA=ON, -j$jobs)"
start=$SECONDS
if [ -n "${CIUIC_GPU_PREBUILT:-}" ]; then
  build=$(cd "$CIUIC_GPU_PREBUILT" && pwd) || exit 1
  bin=$build
  ctest_dir=$build
  echo "using the build in $build as it is (CIUIC_GPU_PREBUILT)"
  if grep -q 'CIUIC_CUDA:STRING=EMULATED' "$build/CMakeCache.txt" 2>/dev/null; then
    echo "gpu-check: a DRY RUN against the CUDA emulation, at small sizes: no figure below means anything"
    dry_run=1
  fi
elif [ "${CIUIC_GPU_USE_BUNDLE:-0}" != 1 ] && configure_and_build; then
  bin=$build
  ctest_dir=$build
  echo "built in $((SECONDS - start)) s"
elif [ -x "$bundle/bin/ciuicd" ]; then
  if [ "${CIUIC_GPU_USE_BUNDLE:-0}" != 1 ]; then
    echo "configure here failed (missing build dependencies; see $build/ciuic-configure.log):"
    grep -m 3 -iE 'could not find|error' "$build/ciuic-configure.log" || true
  fi
  echo "using the prebuilt bundle in $bundle, built from $(tr '\n' ' ' <"$bundle/VERSION" 2>/dev/null)"
  if [ -f "$bundle/SOURCES" ] &&
     [ "$(fingerprint <"$bundle/SOURCES")" = "$(cat "$bundle/FINGERPRINT" 2>/dev/null)" ] &&
     [ "$(bundle_sources)" = "$(cat "$bundle/SOURCES")" ]; then
    echo "the bundle was built from the sources here"
  else
    echo "gpu-check: WARNING: STALE BUNDLE: it was built from other sources than these"
    echo "(rebuild it with tools/gpu-check.sh bundle right before carrying it); going on"
    status=1
  fi
  bin=$bundle/bin
  export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [ -d "$bundle/lib/ucx" ] && export UCX_MODULE_DIR=$bundle/lib/ucx
  missing=$(for t in "${targets[@]}"; do ldd "$bin/$t"; done | grep 'not found' | sort -u)
  if [ -n "$missing" ]; then
    echo "gpu-check: libraries missing for the bundle:"; echo "$missing"; exit 1
  fi
else
  echo "gpu-check: no build: configure failed and there is no .gpu-bundle"
  tail -n 20 "$build/ciuic-configure.log"
  exit 1
fi
find_bin() { find "$bin" -name "$1" -type f -perm -u+x | head -n 1; }
tmp=$(mktemp -d)
# The sizes: the issue's, or a dry run's (the emulation runs every GPU
# thread on the CPU).
kernel_args=(--bytes 256M --reps 15 --inner 10)
ar_sizes=8,1K,64K,1M,16M,64M,256M,1G
ar_big=1073741824
ar_big_name="1 GiB"
multi_sizes=1M,16M,256M
a2a_sizes=64K,16M,256M
if [ "$dry_run" = 1 ]; then
  kernel_args=(--bytes 4M --reps 3 --inner 1)
  ar_sizes=8,1K,64K,1M,4M
  ar_big=4194304
  ar_big_name="4 MiB"
  multi_sizes=1M,4M
  a2a_sizes=64K,1M
fi

say "CPU references on this CPU (every reduction build it runs; the codecs)"
grep -o -m 1 -E 'avx512[a-z]*' /proc/cpuinfo | head -n 1 | sed 's/^/has /' || true
STEP="CPU reductions (reduce_test)" step 120 "$(find_bin reduce_test)" --gtest_brief=1 || status=1
STEP="CPU codecs (codec_test)" step 60 "$(find_bin codec_test)" --gtest_brief=1 || status=1

say "kernel benchmark (256 MiB, median of 15, interleaved with the copy)"
STEP="kernel benchmark" step 120 "$(find_bin cuda_kernels_bench)" "${kernel_args[@]}" --json |
  tee "$tmp/kernels.txt" || status=1
# The copy's bandwidth as the kernel benchmark counts it (bytes read + written).
copy_gbps=$(grep -o '"copy_gbps": [0-9.]*' "$tmp/kernels.txt" | awk '{print $2}')

say "allreduce benchmark: two trainer processes on one GPU through the daemon"
bench=$(find_bin ciuic-bench)
STEP="allreduce benchmark, 2 ranks on one GPU" step 150 "$bench" --op allreduce --nodes 1 --ranks-per-node 2 --device cuda \
  --sizes "$ar_sizes" --dtype float32 --iters 10 --warmup 3 --check \
  --ciuicd "$(find_bin ciuicd)" | tee "$tmp/allreduce.txt" || status=1
algbw=$(awk -v big="$ar_big" '$1 == big {print $7}' "$tmp/allreduce.txt")
if [ -n "$algbw" ] && [ -n "$copy_gbps" ]; then
  # Two definitions of the copy's bandwidth, both printed: bytes read +
  # written (the kernel benchmark's, and bandwidthTest's), and bytes copied
  # per second (half that). A two-rank allreduce of S bytes reads 2 S and
  # writes 2 S at least, so its algbw can reach half the bytes-copied rate:
  # the 50% target, taken against the bytes-copied rate, means running at
  # the copy's memory bandwidth (against read + written it could not exceed 25%).
  awk -v a="$algbw" -v c="$copy_gbps" -v size="$ar_big_name" 'BEGIN {
    printf "%s allreduce algbw %.1f GB/s\n", size, a
    printf "d2d copy: %.1f GB/s read + written = %.1f GB/s copied\n", c, c / 2
    printf "algbw / copy (copied): %.0f%%; algbw / copy (read + written): %.0f%%\n", 200 * a / c, 100 * a / c
    printf "target: %s allreduce algbw >= 50%% of the d2d copy (bytes copied per second): %s\n", size,
           (200 * a / c >= 50 ? "MET" : "NOT MET")  # in parentheses: a bare > is a redirection
  }' | tee "$tmp/allreduce-target.txt"
else
  echo "no $ar_big_name allreduce figure (or no copy figure): see the output above"
  status=1
fi

say "GPU tests (every kernel against its CPU reference; device buffers through the daemon)"
# A GPU test without a usable GPU fails here instead of skipping (a skip
# would count as a pass while testing nothing: an old driver, say).
export CIUIC_REQUIRE_GPU=1
if [ -n "$ctest_dir" ]; then
  (cd "$ctest_dir" && step 240 ctest -L gpu --output-on-failure --timeout 150) || status=1
  (cd "$ctest_dir" && step 60 ctest -L unit -R 'GridFor|ItemsFor|CudaStatus|ArgumentTest|NoDevice|GpuInfo' \
     --output-on-failure --timeout 60) || status=1
else
  # The no-CUDA error test skips where there is a GPU: leave it out.
  STEP="GPU kernel tests" step 150 "$(find_bin cuda_kernels_test)" --gtest_brief=1 || status=1
  CIUICD_FOR_TESTS="$(find_bin ciuicd)" CIUICCTL_FOR_TESTS="$(find_bin ciuicctl)" STEP="device buffers through the daemon (integration_device_test)" step 150 "$(find_bin integration_device_test)" \
    --gtest_brief=1 --gtest_filter=-DeviceBuffersTest.ClearErrorWithoutCuda || status=1
  STEP=cuda_launch_test step 30 "$(find_bin cuda_launch_test)" --gtest_brief=1 || status=1
  STEP=cuda_runtime_test step 30 "$(find_bin cuda_runtime_test)" --gtest_brief=1 || status=1
  STEP=gpu_info_test step 30 "$(find_bin gpu_info_test)" --gtest_brief=1 || status=1
fi
unset CIUIC_REQUIRE_GPU

say "Python: torch CUDA tensors through the daemon (sdk/python/tests/test_cuda.py)"
# Needs the extension built for this machine's python3 and a torch with CUDA.
# With the bundle (built for Debian's Python), the extension is compiled here
# from its one source over the bundle's libciuic: pybind11's headers from
# pip (python3 -m pybind11), else the bundle's copy of Debian's; Python's
# own headers; the first C++ compiler found.
python_from_bundle() {
  local dir=$1 includes suffix cxx
  includes=$(python3 -m pybind11 --includes 2>/dev/null) ||
    includes="-I$bundle/include -I$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" ||
    { echo "no pybind11 or Python headers for $(command -v python3)"; return 1; }
  suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') || return 1
  for cxx in ${CXX:-} g++ c++ clang++; do command -v "$cxx" >/dev/null && break; cxx=""; done
  [ -n "$cxx" ] || { echo "no C++ compiler (g++, c++, clang++) here"; return 1; }
  mkdir -p "$dir/ciuic"
  ln -sf "$root"/sdk/python/ciuic/*.py "$dir/ciuic/"
  # shellcheck disable=SC2086  # the includes are several flags
  STEP="Python extension build" step 150 "$cxx" -O2 -std=c++20 -shared -fPIC -fvisibility=hidden $includes -I"$root/sdk/include" \
    "$root/sdk/python/src/module.cc" "$bundle/lib/libciuic.so.0" -o "$dir/ciuic/_ciuic$suffix"
}
# pytest's own per-test limit where the plugin is there.
pytest_args=(-q -rs -p no:cacheprovider)
python3 -c 'import pytest_timeout' 2>/dev/null && pytest_args+=(--timeout=100)
export PYTHONUNBUFFERED=1
if ! timeout -k 10 60 python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "NOT RUN: $(command -v python3) has no torch that sees a GPU"
  echo "Python CUDA tests: NOT RUN (no torch that sees a GPU)" >>"$summary"
elif [ -n "$ctest_dir" ]; then
  if STEP="Python extension build" step 200 cmake --build "$build" -j "$jobs" --target _ciuic ciuic_python >"$build/python-build.log" 2>&1; then
    PYTHONPATH="$build/python" CIUICD="$(find_bin ciuicd)" STEP="Python test_cuda.py" step 150 \
      python3 -m pytest "${pytest_args[@]}" "$root/sdk/python/tests/test_cuda.py" \
      "$root/sdk/python/tests/test_cuda_array_interface.py" || status=1
  else
    echo "NOT RUN: the Python extension did not build here:"; tail -n 5 "$build/python-build.log"
    status=1
  fi
elif python_from_bundle "$bundle/python" >"$bundle/python-build.log" 2>&1; then
  PYTHONPATH="$bundle/python" CIUICD="$(find_bin ciuicd)" STEP="Python test_cuda.py" step 150 \
    python3 -m pytest "${pytest_args[@]}" "$root/sdk/python/tests/test_cuda.py" \
      "$root/sdk/python/tests/test_cuda_array_interface.py" || status=1
else
  echo "NOT RUN: the Python extension did not build here over the bundle's libciuic:"
  tail -n 5 "$bundle/python-build.log"
  status=1
fi

say "compute-sanitizer memcheck over the kernel tests (out-of-bounds and misaligned accesses)"
# The large-count tests are left out: they take minutes under the sanitizer.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -n "$sanitizer" ]; then
  STEP="compute-sanitizer memcheck" step 90 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
    "$(find_bin cuda_kernels_test)" --gtest_brief=1 '--gtest_filter=-*LargeCounts*' || status=1
else
  echo "NOT RUN: no compute-sanitizer here"
fi

say "Nsight Compute: the benchmark's kernels, one launch each at 256 MiB (time, memory throughput)"
# For the next step if a target is missed: which kernel, and how far from
# the memory's speed it runs (cudaMemcpy, the copy, is no kernel: not shown).
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -n "$ncu_bin" ]; then
  STEP="Nsight Compute" step 90 "$ncu_bin" --clock-control none --section SpeedOfLight --launch-count 40 \
    --kernel-name 'regex:Reduce|Int8|Cast|Scan' \
    "$(find_bin cuda_kernels_bench)" "${kernel_args[0]}" "${kernel_args[1]}" --reps 1 --inner 1 2>&1 |
    grep -E '^  [A-Za-z].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|==ERR|==WARNING' ||
    echo "(no ncu figures)"
else
  echo "NOT RUN: no ncu here"
fi

# What the CUDA emulation cannot show (its fibers run until they wait):
# shared-memory races and barrier misuse, in the kernels that use them
# (top-k's histogram, int8's warp shuffles).
if [ -n "$sanitizer" ]; then
  for tool in racecheck synccheck; do
    STEP="compute-sanitizer $tool" step 60 "$sanitizer" --tool "$tool" --error-exitcode 3 --print-limit 20 \
      "$(find_bin cuda_kernels_test)" --gtest_brief=1 '--gtest_filter=*TopKMatches*:*Int8Matches*' || status=1
  done
fi

say "daemon status on this machine"
"$(find_bin ciuicd)" --socket "$tmp/ciuicd.sock" --node-name gpu-check --log-level info \
  >"$tmp/ciuicd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 50); do [ -S "$tmp/ciuicd.sock" ] && break; sleep 0.1; done
STEP="ciuicctl status" step 20 "$(find_bin ciuicctl)" --socket "$tmp/ciuicd.sock" status | sed -n '1,12p' || status=1
kill "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; daemon_pid=""

# The rest is for information, as time allows.
export UCX_TLS=tcp
say "multi-node allreduce: 2 daemons x 1 rank on this GPU (UCX tcp on loopback), device vs host"
# Device buffers: reduced on the GPU and staged through pinned host memory in
# staging_segment_bytes pieces, overlapped with the network; the host-buffer
# run beside it is the same inter-node path without the GPU.
# With int8 the device buffers are encoded by the GPU's kernels (--check
# then prints the largest relative error, int8's bound being ~4e-3 of the
# block maximum, beside the host buffers' run).
for run in "cuda none" "cpu none" "cuda int8" "cpu int8"; do
  set -- $run
  echo "--device $1 --compression $2"
  STEP="multi-node allreduce --device $1 --compression $2" step 60 "$bench" --op allreduce --nodes 2 --ranks-per-node 1 --device "$1" \
    --compression "$2" --sizes "$multi_sizes" --dtype float32 --iters 5 --warmup 2 --check \
    --ciuicd "$(find_bin ciuicd)" || status=1
done

say "multi-node alltoall(v): 2 daemons x 2 ranks on this GPU, device (staged in segments) vs host"
# alltoallv: uneven pairs (rank i sends rank j the share 1 + ((j-i) mod n)).
for op in alltoall alltoallv; do
  for device in cuda cpu; do
    echo "--op $op --device $device"
    STEP="multi-node $op --device $device" step 60 "$bench" --op "$op" --nodes 2 --ranks-per-node 2 --device "$device" \
      --sizes "$a2a_sizes" --dtype float32 --iters 5 --warmup 2 --check \
      --ciuicd "$(find_bin ciuicd)" || status=1
  done
done

say "summary"
grep -h '^target' "$tmp/kernels.txt" "$tmp/allreduce-target.txt" 2>/dev/null ||
  echo "targets: no figures (see the benchmarks above)"
cat "$summary"
say "done (status $status)"
exit $status

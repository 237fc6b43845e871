#!/usr/bin/env bash
# The Debian packages on a fresh Debian 12 (issue 34): builds them from
# BUILD_DIR (tools/package.sh), makes a minimal bookworm root with
# mmdebstrap (cached as a tarball in $CIUIC_TEST_CACHE, default
# /var/cache/ciuic-test, so that later runs only unpack it), installs them
# there with `apt-get install ./*.deb` (dependencies from Debian's archive),
# and inside the root (chroot, its own network namespace):
#   - starts ciuicd from the packaged configuration, as the unit would;
#   - runs `ciuicctl status`;
#   - builds a C++ program against libciuic-dev twice, through
#     find_package(ciuic) and through pkg-config, and runs 2 ranks of a
#     float32 allreduce with each, checked against a plain loop;
#   - runs 2 Python ranks (`import ciuic`) of an allreduce checked against numpy;
#   - stops ciuicd, purges the packages, and checks that no process is left
#     in the root and that none of the packages' files is.
# Exits non-zero on the first failure, naming it.
#
#   tests/deploy/package_test.sh BUILD_DIR
set -euo pipefail
root_dir=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: package_test.sh BUILD_DIR}" && pwd)
cache=${CIUIC_TEST_CACHE:-/var/cache/ciuic-test}
mirror=${CIUIC_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${CIUIC_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
# What the root needs besides the packages' own dependencies: a compiler,
# CMake and pkg-config for the C++ program.
extra=g++,make,cmake,pkg-config,ca-certificates

step() { echo "package_test: $*"; }
fail() { echo "package_test: FAILED: $*" >&2; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
  echo "package_test: skipped: needs root (chroot, mounts, a network namespace)"
  exit 77
fi
for tool in mmdebstrap dpkg-shlibdeps unshare; do
  command -v "$tool" >/dev/null || fail "$tool is missing (tools/install-deps.sh installs it)"
done

step "building the packages (tools/package.sh)"
CIUIC_BUILD_DIR=$build bash "$root_dir/tools/package.sh" >/dev/null
debs=("$build"/packages/*.deb)
[ ${#debs[@]} -eq 5 ] || fail "expected 5 packages in $build/packages, got ${#debs[@]}"

mkdir -p "$cache"
tarball=$cache/bookworm-$(echo "$extra" | md5sum | cut -c1-8).tar
if [ ! -s "$tarball" ]; then
  step "making a minimal Debian 12 root with mmdebstrap (once; cached in $tarball)"
  timeout 900 mmdebstrap --variant=apt --format=tar --include="$extra" --quiet bookworm "$tarball.part" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb $security bookworm-security main" || fail "mmdebstrap"
  mv "$tarball.part" "$tarball"
fi

work=$(mktemp -d /tmp/ciuic-pkgtest.XXXXXX)
root=$work/root
mounted=()
cleanup() {
  set +e
  # Anything still running in the root, then the mounts, then the files.
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$root"
step "unpacking the root into $root"
tar -C "$root" -xf "$tarball"
for m in proc sys dev; do
  mkdir -p "$root/$m"
  mount --rbind "/$m" "$root/$m"
  mounted+=("$root/$m")
done
cp /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/tmp/debs"
cp "${debs[@]}" "$root/tmp/debs/"

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

step "apt-get install ./*.deb in the root"
# Bounded: a mirror that stalls fails the step instead of hanging the test.
in_root timeout 600 sh -c 'apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q /tmp/debs/*.deb' \
  > "$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; fail "apt-get install of the packages"; }
for pkg in ciuicd libciuic0 libciuic-dev python3-ciuic ciuic-bench; do
  in_root dpkg-query -W -f='${Status}\n' "$pkg" | grep -q "install ok installed" ||
    fail "$pkg is not installed"
done
[ -f "$root/etc/ciuic/ciuicd.yaml" ] || fail "no /etc/ciuic/ciuicd.yaml"
in_root dpkg-query --control-show ciuicd conffiles | grep -q /etc/ciuic/ciuicd.yaml ||
  fail "/etc/ciuic/ciuicd.yaml is not a conffile"

# The test programs.
mkdir -p "$root/tmp/app"
cat > "$root/tmp/app/allreduce.cc" <<'EOF'
// Rank R of 2: a float32 sum allreduce through the node's ciuicd, checked
// against the plain loop.
#include <ciuic/ciuic.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

int main(int argc, char** argv) {
  ciuic::JobOptions opts;
  opts.job_id = argv[1];
  opts.rank = std::atoi(argv[2]);
  opts.world_size = 2;
  opts.arena_bytes = 8 << 20;
  std::unique_ptr<ciuic::Communicator> comm;
  ciuic::Status s = ciuic::Communicator::Create(opts, &comm);
  if (!s.ok()) { std::fprintf(stderr, "join: %s\n", s.ToString().c_str()); return 1; }
  const size_t n = 100003;
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + opts.rank * 3) % 11);
  s = comm->Allreduce(v.data(), v.data(), n, ciuic::DataType::kFloat32, ciuic::ReduceOp::kSum).Wait();
  if (!s.ok()) { std::fprintf(stderr, "allreduce: %s\n", s.ToString().c_str()); return 1; }
  for (size_t i = 0; i < n; ++i) {
    const float want = static_cast<float>((i * 7) % 11) + static_cast<float>((i * 7 + 3) % 11);
    if (v[i] != want) { std::fprintf(stderr, "element %zu: %g, want %g\n", i, v[i], want); return 1; }
  }
  return 0;
}
EOF
cat > "$root/tmp/app/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(ciuic_package_test CXX)
find_package(ciuic 0.1 REQUIRED)
add_executable(allreduce allreduce.cc)
target_link_libraries(allreduce PRIVATE ciuic::ciuic)
EOF
cat > "$root/tmp/app/allreduce.py" <<'EOF'
# Rank R of 2: float64 and int32 sum allreduces, checked against numpy.
import sys

import numpy as np

import ciuic

job, rank = sys.argv[1], int(sys.argv[2])
comm = ciuic.init(rank=rank, world_size=2, job=job, arena_bytes=8 << 20)
for dtype, n in ((np.float64, 4099), (np.int32, 1)):
    mine = (np.arange(n) * 5 + rank).astype(dtype)
    want = sum((np.arange(n) * 5 + r).astype(dtype) for r in range(2))
    comm.allreduce(mine)
    assert np.array_equal(mine, want), (dtype, mine[:5], want[:5])
print("python rank", rank, "ok")
EOF

step "building the C++ program: find_package(ciuic) and pkg-config"
in_root sh -c 'cd /tmp/app && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build >/dev/null' \
  > "$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log" >&2; fail "find_package(ciuic) build"; }
in_root sh -c 'cd /tmp/app && g++ -std=c++17 -O2 allreduce.cc -o allreduce-pc $(pkg-config --cflags --libs ciuic)' \
  > "$work/pc.log" 2>&1 || { cat "$work/pc.log" >&2; fail "pkg-config build"; }

# The rest runs in the root's own network namespace (loopback up): the
# daemon's default peer port (127.0.0.1:7361) is then its own.
cat > "$root/tmp/app/run.sh" <<'EOF'
#!/bin/sh
# Inside the root: the daemon as its unit starts it, its status, the
# programs' ranks, then SIGTERM.
set -eu
mkdir -p /run/ciuic
/usr/bin/ciuicd --config /etc/ciuic/ciuicd.yaml > /tmp/ciuicd.log 2>&1 &
daemon=$!
i=0
until [ -S /run/ciuic/ciuicd.sock ]; do
  i=$((i + 1))
  if [ $i -gt 300 ] || ! kill -0 $daemon 2>/dev/null; then
    echo "ciuicd did not start:"; cat /tmp/ciuicd.log; exit 1
  fi
  sleep 0.1
done
ciuicctl status
status=0
for prog in /tmp/app/build/allreduce /tmp/app/allreduce-pc; do
  job=cxx-$(basename $prog)
  $prog $job 0 & r0=$!
  $prog $job 1 & r1=$!
  wait $r0 || { echo "$prog rank 0 failed"; status=1; }
  wait $r1 || { echo "$prog rank 1 failed"; status=1; }
done
python3 /tmp/app/allreduce.py py 0 & r0=$!
python3 /tmp/app/allreduce.py py 1 & r1=$!
wait $r0 || { echo "python rank 0 failed"; status=1; }
wait $r1 || { echo "python rank 1 failed"; status=1; }
kill -TERM $daemon
i=0
while kill -0 $daemon 2>/dev/null; do
  i=$((i + 1))
  [ $i -le 300 ] || { echo "ciuicd did not stop on SIGTERM"; exit 1; }
  sleep 0.1
done
wait $daemon || { echo "ciuicd exited non-zero:"; tail -n 20 /tmp/ciuicd.log; exit 1; }
exit $status
EOF
chmod +x "$root/tmp/app/run.sh"
step "starting ciuicd in the root; ciuicctl status; 2 C++ ranks twice; 2 Python ranks"
timeout 300 unshare --net sh -c "ip link set lo up && chroot '$root' /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /tmp/app/run.sh" \
  > "$work/run.log" 2>&1 || { cat "$work/run.log" >&2; fail "running the installed packages"; }
grep -q "python rank 1 ok" "$work/run.log" || { cat "$work/run.log" >&2; fail "the Python ranks"; }
grep -qi "ciuicd" "$work/run.log" || { cat "$work/run.log" >&2; fail "ciuicctl status printed nothing about the daemon"; }

step "apt-get purge of the packages"
in_root timeout 600 sh -c 'DEBIAN_FRONTEND=noninteractive apt-get purge -y -q ciuicd libciuic0 libciuic-dev python3-ciuic ciuic-bench' \
  > "$work/purge.log" 2>&1 || { tail -n 30 "$work/purge.log" >&2; fail "apt-get purge"; }
for p in /proc/[0-9]*; do
  if [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ]; then
    fail "process ${p#/proc/} ($(cat "$p/comm" 2>/dev/null)) still runs in the root"
  fi
done
for f in /usr/bin/ciuicd /usr/bin/ciuicctl /usr/bin/ciuic-bench /usr/lib/libciuic.so.0 \
  /usr/include/ciuic /usr/lib/cmake/ciuic /usr/lib/pkgconfig/ciuic.pc \
  /usr/lib/python3/dist-packages/ciuic /usr/lib/systemd/system/ciuicd.service /etc/ciuic; do
  [ ! -e "$root$f" ] || fail "$f is left after the purge"
done
step "ok: installed, ran (daemon, ciuicctl, C++ through CMake and pkg-config, Python), purged"

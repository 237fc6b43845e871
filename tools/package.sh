#!/usr/bin/env bash
# Builds the Debian packages (cmake/packaging.cmake) into build/packages/
# (or $CIUIC_BUILD_DIR/packages): ciuicd, libciuic0, libciuic-dev,
# python3-ciuic, ciuic-bench, all of the version in CMakeLists.txt. Builds
# what they hold first (tools/build.sh). Prints the files made.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/build.sh" --target ciuicd ciuicctl ciuic ciuic_python ciuic-bench
command -v dpkg-shlibdeps >/dev/null || {
  echo "package.sh: dpkg-shlibdeps (dpkg-dev) is needed: tools/install-deps.sh installs it" >&2
  exit 1
}
out=$build/packages
rm -rf "$out"
mkdir -p "$out"
(cd "$build" && cpack --config CPackConfig.cmake -B "$out" >"$out/cpack.log" 2>&1) || {
  echo "package.sh: cpack failed; its log:" >&2
  tail -n 40 "$out/cpack.log" >&2
  exit 1
}
ls -1 "$out"/*.deb

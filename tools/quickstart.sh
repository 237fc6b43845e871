#!/usr/bin/env bash
# The main job: build if needed, then run a checked, benchmarked allreduce.
# With a ciuicd running at $CIUIC_SOCKET (or /run/ciuic/ciuicd.sock): 2 ranks
# on that node. Otherwise a local cluster: ciuic-bench starts 2 daemons on
# this host (each its own socket, ports and node name; they register with
# each other and move the data over UCX), 2 ranks on each, and stops them
# afterwards.
#
#   bash tools/quickstart.sh [extra ciuic-bench flags, e.g. --json]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/build.sh" --target ciuicd ciuicctl ciuic-bench >&2

socket=${CIUIC_SOCKET:-/run/ciuic/ciuicd.sock}
args=(--op allreduce --ranks-per-node 2 --sizes 8,64K,16M,256M
      --dtype float32 --iters 20 --warmup 5 --check)
if [ -S "$socket" ] && "$build/tools/ctl/ciuicctl" --socket "$socket" status >/dev/null 2>&1; then
  echo "quickstart: using the running ciuicd at $socket (1 node x 2 ranks)" >&2
  args+=(--nodes 1 --socket "$socket")
else
  echo "quickstart: no ciuicd at $socket; ciuic-bench starts a local cluster of 2 daemons x 2 ranks" >&2
  args+=(--nodes 2 --ciuicd "$build/daemon/ciuicd")
fi
exec "$build/tools/bench/ciuic-bench" "${args[@]}" "$@"

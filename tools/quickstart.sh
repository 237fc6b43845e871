#!/usr/bin/env bash
# The main job: build if needed, then run a checked, benchmarked allreduce on
# 2 local ranks through ciuicd. Uses the daemon at $CIUIC_SOCKET (or
# /run/ciuic/ciuicd.sock) when one is running there; otherwise ciuic-bench
# starts a daemon of its own and stops it afterwards.
#
#   bash tools/quickstart.sh [extra ciuic-bench flags, e.g. --json]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
bash "$root/tools/build.sh" --target ciuicd ciuicctl ciuic-bench >&2

socket=${CIUIC_SOCKET:-/run/ciuic/ciuicd.sock}
args=(--op allreduce --nodes 1 --ranks-per-node 2 --sizes 8,64K,16M,256M
      --dtype float32 --iters 20 --warmup 5 --check)
if [ -S "$socket" ] && "$build/tools/ctl/ciuicctl" --socket "$socket" status >/dev/null 2>&1; then
  echo "quickstart: using the running ciuicd at $socket" >&2
  args+=(--socket "$socket")
else
  echo "quickstart: no ciuicd at $socket; ciuic-bench starts its own" >&2
  args+=(--ciuicd "$build/daemon/ciuicd")
fi
exec "$build/tools/bench/ciuic-bench" "${args[@]}" "$@"

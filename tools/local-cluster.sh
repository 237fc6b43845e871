#!/usr/bin/env bash
# Starts, shows and stops a "cluster" of ciuicd daemons on this host, one per
# pretend node, each with its own socket, peer port and node name, so that
# multi-node jobs can be tried without several machines.
#
#   tools/local-cluster.sh start [N]    # N daemons (default 2), UCX over TCP
#   tools/local-cluster.sh status       # ciuicctl status/peers of each
#   tools/local-cluster.sh stop
#
# Node k: socket $DIR/node$k.sock, peer service 127.0.0.1:$((BASE_PORT + k)),
# log $DIR/node$k.log. Rank r of a job with R ranks per node joins node
# r / R with CIUIC_SOCKET=$DIR/node$k.sock, LOCAL_RANK, LOCAL_WORLD_SIZE and
# CIUIC_COORDINATOR=127.0.0.1:$BASE_PORT.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_BUILD_DIR:-$root/build}
dir=${CIUIC_CLUSTER_DIR:-/tmp/ciuic-cluster}
base_port=${CIUIC_CLUSTER_BASE_PORT:-17361}
ciuicd=${CIUICD:-$build/daemon/ciuicd}
ciuicctl=$build/tools/ctl/ciuicctl

start() {
  local n=${1:-2}
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 64 ]] || { echo "N must be 1..64" >&2; exit 64; }
  [ -x "$ciuicd" ] || bash "$root/tools/build.sh" --target ciuicd ciuicctl >&2
  mkdir -p "$dir"
  for ((k = 0; k < n; k++)); do
    if [ -f "$dir/node$k.pid" ] && kill -0 "$(cat "$dir/node$k.pid")" 2>/dev/null; then
      echo "node$k already running (pid $(cat "$dir/node$k.pid"))"
      continue
    fi
    UCX_TLS=${UCX_TLS:-tcp} setsid "$ciuicd" --socket "$dir/node$k.sock" \
      --listen "127.0.0.1:$((base_port + k))" --node-name "node$k" \
      >"$dir/node$k.log" 2>&1 < /dev/null &
    echo $! > "$dir/node$k.pid"
  done
  for ((k = 0; k < n; k++)); do
    # Up to 30 s (a loaded machine starts slowly); a daemon that exited
    # (a port in use, a bad config) is reported at once, with its log.
    local pid=$(cat "$dir/node$k.pid")
    for _ in $(seq 600); do
      [ -S "$dir/node$k.sock" ] && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    if [ ! -S "$dir/node$k.sock" ]; then
      echo "node$k did not start; its log ($dir/node$k.log):" >&2
      tail -n 20 "$dir/node$k.log" >&2 || true
      exit 1
    fi
    echo "node$k: socket $dir/node$k.sock, peer 127.0.0.1:$((base_port + k)), pid $(cat "$dir/node$k.pid")"
  done
  echo "coordinator for jobs: CIUIC_COORDINATOR=127.0.0.1:$base_port"
}

status() {
  shopt -s nullglob
  local any=0
  for pidfile in "$dir"/node*.pid; do
    any=1
    local name=$(basename "$pidfile" .pid)
    echo "== $name"
    "$ciuicctl" --socket "$dir/$name.sock" status || true
    "$ciuicctl" --socket "$dir/$name.sock" peers || true
  done
  [ $any = 1 ] || echo "no local cluster in $dir"
}

stop() {
  shopt -s nullglob
  for pidfile in "$dir"/node*.pid; do
    local pid=$(cat "$pidfile")
    if kill -TERM "$pid" 2>/dev/null; then
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
      echo "stopped $(basename "$pidfile" .pid) (pid $pid)"
    fi
    rm -f "$pidfile"
  done
}

case "${1:-}" in
  start) start "${2:-2}" ;;
  status) status ;;
  stop) stop ;;
  *) sed -n '2,13p' "$0"; exit 64 ;;
esac

#!/usr/bin/env bash
# The start/status/stop cycle of tools/local-cluster.sh.
#   local_cluster_test.sh BUILD_DIR
set -euo pipefail
build=$1
root=$(cd "$(dirname "$0")/.." && pwd)
export CIUIC_BUILD_DIR=$build
export CIUIC_CLUSTER_DIR=$(mktemp -d)
# Below Linux's ephemeral range (32768-60999), where other tests' outgoing
# connections take their ports.
export CIUIC_CLUSTER_BASE_PORT=$((20000 + RANDOM % 12000))
trap 'bash "$root/tools/local-cluster.sh" stop >/dev/null; rm -rf "$CIUIC_CLUSTER_DIR"' EXIT

bash "$root/tools/local-cluster.sh" start 2
out=$(bash "$root/tools/local-cluster.sh" status)
grep -q "on node node0" <<<"$out"
grep -q "on node node1" <<<"$out"
grep -q "peer service    127.0.0.1:$CIUIC_CLUSTER_BASE_PORT" <<<"$out"
bash "$root/tools/local-cluster.sh" stop
[ -z "$(ls "$CIUIC_CLUSTER_DIR"/*.pid 2>/dev/null)" ]
echo "local_cluster_test: start/status/stop ok"

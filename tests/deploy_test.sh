#!/usr/bin/env bash
# The systemd unit is valid for systemd-analyze (with ExecStart pointed at the
# built ciuicd), and the daemon starts with the shipped config file, one
# reduction worker per CPU it may run on.
#   deploy_test.sh CIUICD
set -euo pipefail
ciuicd=$1
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
pid=

if command -v systemd-analyze >/dev/null; then
  sed "s|^ExecStart=/usr/local/bin/ciuicd|ExecStart=$ciuicd|" "$root/deploy/ciuicd.service" \
    > "$tmp/ciuicd.service"
  systemd-analyze verify "$tmp/ciuicd.service"
  echo "deploy_test: systemd-analyze verify: ok"
else
  echo "deploy_test: SKIPPED unit check: systemd-analyze is not installed"
fi

# The shipped config, with the socket moved into the temporary directory and
# the peer service on a free loopback port (`listen: auto` means
# 127.0.0.1:7361, which another test's daemon may hold while ctest runs tests
# side by side).
sed -e "s|^socket: .*|socket: $tmp/ciuicd.sock|" -e "s|^listen: auto$|listen: \"127.0.0.1:0\"|" \
  "$root/deploy/ciuicd.yaml" > "$tmp/ciuicd.yaml"
grep -q '^listen: "127.0.0.1:0"$' "$tmp/ciuicd.yaml" ||
  { echo "deploy_test: deploy/ciuicd.yaml has no 'listen: auto' line"; exit 1; }
# On one CPU (taskset, as systemd's CPUAffinity= would): the config's
# worker_threads 0 means one worker per CPU the daemon may run on.
cpu=$(/usr/bin/python3 -c 'import os; print(min(os.sched_getaffinity(0)))')
taskset -c "$cpu" "$ciuicd" --config "$tmp/ciuicd.yaml" --log-level info > "$tmp/log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  [ -S "$tmp/ciuicd.sock" ] && break
  sleep 0.05
done
[ -S "$tmp/ciuicd.sock" ] || { echo "deploy_test: ciuicd did not start with deploy/ciuicd.yaml"; exit 1; }
for _ in $(seq 100); do
  grep -q "ready on" "$tmp/log" && break
  sleep 0.05
done
grep -q "ready on $tmp/ciuicd.sock (node .*, 1 worker threads)" "$tmp/log" ||
  { echo "deploy_test: pinned to CPU $cpu, ciuicd did not start one worker:"; cat "$tmp/log"; exit 1; }
kill -TERM $pid
wait $pid
echo "deploy_test: ciuicd ran with deploy/ciuicd.yaml and drained on SIGTERM: ok"

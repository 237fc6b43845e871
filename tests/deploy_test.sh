#!/usr/bin/env bash
# The systemd unit is valid for systemd-analyze (with ExecStart pointed at the
# built ciuicd), and the daemon starts with the shipped config file.
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

# The shipped config, with the socket moved into the temporary directory.
sed "s|^socket: .*|socket: $tmp/ciuicd.sock|" "$root/deploy/ciuicd.yaml" > "$tmp/ciuicd.yaml"
"$ciuicd" --config "$tmp/ciuicd.yaml" --log-level warn &
pid=$!
for _ in $(seq 100); do
  [ -S "$tmp/ciuicd.sock" ] && break
  sleep 0.05
done
[ -S "$tmp/ciuicd.sock" ] || { echo "deploy_test: ciuicd did not start with deploy/ciuicd.yaml"; exit 1; }
kill -TERM $pid
wait $pid
echo "deploy_test: ciuicd ran with deploy/ciuicd.yaml and drained on SIGTERM: ok"

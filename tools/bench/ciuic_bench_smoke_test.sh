#!/bin/bash
# Smoke test of ciuic-bench --json: one node of 2 ranks (it starts its own
# ciuicd) and two 2-node jobs of 1 rank (their daemons pinned, one per
# CPU: --bind-daemons core), sizes 8 and 4K, checked; then
# alltoall and alltoallv on 2 nodes x 2 ranks (busbw = 3/4 algbw), checked. Passes when
# every row has 0 wrong elements and a busbw that agrees with its own time
# (for 2 ranks busbw = algbw = bytes / time): an 8-byte row's busbw is about
# 1e-4 GB/s, so it must keep its significant digits, not 4 decimals.
# Usage: ciuic_bench_smoke_test.sh PATH/TO/ciuic-bench
set -euo pipefail
bench="${1:?usage: $0 PATH/TO/ciuic-bench}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n
"$bench" --op allreduce --sizes 8,4K --iters 20 --warmup 2 --check --json \
    --ranks-per-node 2 >"$tmp/local.json" 2>"$tmp/local.err" ||
  { echo "FAIL: ciuic-bench (1 node x 2) exited $?" >&2; cat "$tmp/local.err" >&2; exit 1; }
"$bench" --op allreduce --sizes 8,4K --iters 20 --warmup 2 --check --json \
    --nodes 2 --ranks-per-node 1 --bind-daemons core >"$tmp/nodes.json" 2>"$tmp/nodes.err" ||
  { echo "FAIL: ciuic-bench (2 nodes x 1) exited $?" >&2; cat "$tmp/nodes.err" >&2; exit 1; }
# --bind-daemons pins only daemons it starts: with --socket it is refused.
if "$bench" --socket "$tmp/none.sock" --bind-daemons core --sizes 8 2>"$tmp/bind.err"; then
  echo "FAIL: --bind-daemons with --socket was not refused" >&2; exit 1
fi
grep -q -- "--bind-daemons pins the daemons ciuic-bench starts" "$tmp/bind.err" ||
  { echo "FAIL: --bind-daemons with --socket: unclear refusal" >&2; cat "$tmp/bind.err" >&2; exit 1; }
# --bind-daemons core: node n's daemon on the n-th CPU this shell may use.
cpus=($(/usr/bin/python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))'))
for n in 0 1; do
  want=${cpus[$((n % ${#cpus[@]}))]}
  grep -q "started .*bench-.*, CPU $want)" "$tmp/nodes.err" ||
    { echo "FAIL: node $n's daemon not on CPU $want" >&2; cat "$tmp/nodes.err" >&2; exit 1; }
done
for op in alltoall alltoallv; do
"$bench" --op "$op" --sizes 64,64K --iters 10 --warmup 2 --check --json \
    --nodes 2 --ranks-per-node 2 >"$tmp/$op.json" 2>"$tmp/$op.err" ||
  { echo "FAIL: ciuic-bench $op (2 nodes x 2) exited $?" >&2; cat "$tmp/$op.err" >&2; exit 1; }
/usr/bin/python3 - "$tmp/$op.json" "$op" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ok = sorted(r["bytes"] for r in rows) == [64, 65536]
for r in rows:
    want = 0.75 * r["bytes"] / (r["time_us"] * 1e3)
    ok = ok and r["errors"] == 0 and r["ranks"] == 4 and r["op"] == sys.argv[2] and \
        abs(r["busbw_gbps"] - want) <= 0.01 * want
if not ok:
    print("FAIL: %s rows %s" % (sys.argv[2], rows))
sys.exit(0 if ok else 1)
PY
done
/usr/bin/python3 - "$tmp/local.json" "$tmp/nodes.json" <<'PY'
import json, sys
ok = True
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    if sorted(r["bytes"] for r in rows) != [8, 4096]:
        print("FAIL: %s: rows for %s" % (path, [r["bytes"] for r in rows])); ok = False
    for r in rows:
        want = r["bytes"] / (r["time_us"] * 1e3)  # GB/s; busbw factor 1 for 2 ranks
        if r["errors"] != 0 or r["ranks"] != 2 or not r["p99_us"] >= r["time_us"] > 0:
            print("FAIL: %s: %s" % (path, r)); ok = False
        elif not abs(r["busbw_gbps"] - want) <= 0.01 * want:
            print("FAIL: %s: busbw %s, time says %.6g: %s" % (path, r["busbw_gbps"], want, r))
            ok = False
sys.exit(0 if ok else 1)
PY
echo PASS

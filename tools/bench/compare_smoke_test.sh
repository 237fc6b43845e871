#!/bin/bash
# Smoke test of compare.py: OpenMPI and gloo, 2 ranks, two tiny sizes, one rep,
# allreduce, alltoall and alltoallv.
# Usage: compare_smoke_test.sh PATH/TO/ciuic-mpi-bench
# Passes when compare.py exits 0 and its JSON has rows with errors == 0 for
# both systems. Runs as root too (compare.py adds --allow-run-as-root) and on
# few cores (--oversubscribe).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mpi_bench="${1:?usage: $0 PATH/TO/ciuic-mpi-bench}"
python=/usr/bin/python3

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Belt and braces for mpirun as root, should a caller drop the flag.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

for op in allreduce alltoall alltoallv; do
rc=0
"$python" "$here/compare.py" --op "$op" --systems mpi,gloo --ranks 2 --sizes 8,4K \
    --reps 1 --iters 2 --warmup 1 --mpi-bench "$mpi_bench" --timeout 120 \
    --json-out "$tmp/$op.json" >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
if [[ $rc -ne 0 ]]; then
  echo "FAIL: compare.py exited with $rc" >&2
  cat "$tmp/stdout" "$tmp/stderr" >&2
  exit 1
fi

"$python" - "$tmp/$op.json" "$op" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
rows = doc["rows"]
ok = True
for system in ("mpi", "gloo"):
    mine = [r for r in rows if r["system"] == system]
    sizes = sorted(r["bytes"] for r in mine)
    if sizes != [8, 4096]:
        print("FAIL: %s rows for sizes %s, want [8, 4096]" % (system, sizes))
        ok = False
    for r in mine:
        if r.get("errors") != 0 or not r["time_us"] > 0:
            print("FAIL: bad %s row %s" % (system, r))
            ok = False
        if not r.get("p99_us", -1) >= r["time_us"]:
            print("FAIL: %s row's p99 below its median: %s" % (system, r))
            ok = False
        for key in ("op", "dtype", "bytes", "ranks", "time_us", "algbw_gbps",
                    "busbw_gbps", "errors", "p99_us"):
            if key not in r:
                print("FAIL: %s row lacks %s: %s" % (system, key, r))
                ok = False
        if r.get("ranks") != 2 or r.get("op") != sys.argv[2]:
            print("FAIL: %s row with %s ranks for %s" % (system, r.get("ranks"), r.get("op")))
            ok = False
sys.exit(0 if ok else 1)
PY
done
cp "$tmp/allreduce.json" "$tmp/out.json"
# md_table.py turns the file into a table with both systems' rows, and
# refuses what is not such a file by name.
table="$("$python" "$here/md_table.py" "$tmp/out.json")"
for want in "| 8 |" "| 4K |" "OpenMPI µs" "gloo µs"; do
  if [[ "$table" != *"$want"* ]]; then
    echo "FAIL: md_table.py output lacks '$want':" >&2
    echo "$table" >&2
    exit 1
  fi
done
echo '[1]' >"$tmp/bad.json"
if err="$("$python" "$here/md_table.py" "$tmp/bad.json" 2>&1)" ||
   [[ "$err" != *"not a compare.py --json-out file"* ]]; then
  echo "FAIL: md_table.py on a non-compare file: '$err'" >&2
  exit 1
fi
# A --scenario train file (no "rows": per-run "results" and a "summary").
cat >"$tmp/train.json" <<'JSON'
{"scenario": "train", "link_rate": "1gbit",
 "config": {"steps": 2, "reps": 1, "hidden": 8, "layers": 2, "train_threads": 1},
 "results": [{"row": "ciuic", "final_loss": 0.5, "link_tx_bytes": [2000000, 1000000]}],
 "summary": [{"row": "ciuic", "median_step_s": 0.25, "status": "ok"}]}
JSON
train_table="$("$python" "$here/md_table.py" "$tmp/train.json")"
if [[ "$train_table" != *"| ciuic | 0.250 | 0.500000 | ok | 2/1 |"* ]]; then
  echo "FAIL: md_table.py on a train file:" >&2
  echo "$train_table" >&2
  exit 1
fi
cat "$tmp/stdout"
echo "$table"
echo "PASS"

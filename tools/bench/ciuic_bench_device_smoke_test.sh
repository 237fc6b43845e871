#!/bin/bash
# Smoke test of ciuic-bench --device cuda (CUDA device buffers through the
# daemon): every collective on one node of 2 ranks and on 2 nodes of 2 ranks
# (staged through pinned host memory), an allreduce of float16 and one with
# int8 compression, sizes 0 or 8 B, 64 KiB and 3 MiB + 4 (several staging
# segments of 1 MiB, the last one short), checked. Passes when every row has
# 0 wrong elements (int8: a max_rel_error within int8's bound). Run by the
# CUDA emulation's build (tests/cuda_emulation); on a GPU, tools/gpu-check.sh
# runs the benchmark itself.
# Usage: ciuic_bench_device_smoke_test.sh PATH/TO/ciuic-bench PATH/TO/ciuicd
set -euo pipefail
bench="${1:?usage: $0 PATH/TO/ciuic-bench PATH/TO/ciuicd}"
ciuicd="${2:?usage: $0 PATH/TO/ciuic-bench PATH/TO/ciuicd}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n
printf 'tuning:\n  staging_segment_bytes: 1M\n' >"$tmp/segments.yaml"
# 3 MiB + 4 bytes: 786433 float32 elements, not a multiple of anything.
sizes=8,64K,3145732
run() {  # name, then ciuic-bench's arguments
  local name=$1
  shift
  "$bench" --device cuda --sizes "$sizes" --iters 3 --warmup 1 --check --json \
      --ciuicd "$ciuicd" "$@" >"$tmp/$name.json" 2>"$tmp/$name.err" ||
    { echo "FAIL: ciuic-bench $* exited $?" >&2; cat "$tmp/$name.err" >&2; exit 1; }
}
for op in allreduce reduce_scatter allgather broadcast alltoall alltoallv; do
  run "local-$op" --op "$op" --nodes 1 --ranks-per-node 2
  run "nodes-$op" --op "$op" --nodes 2 --ranks-per-node 2 --daemon-config "$tmp/segments.yaml"
done
run nodes-fp16 --op allreduce --dtype float16 --nodes 2 --ranks-per-node 2
run nodes-int8 --op allreduce --compression int8 --nodes 2 --ranks-per-node 2
/usr/bin/python3 - "$tmp" <<'PY'
import glob, json, os, sys
ok = True
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))
for path in files:
    name = os.path.basename(path)[:-5]
    rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    if len(rows) != 3:
        print("FAIL: %s: %d rows" % (name, len(rows))); ok = False
    for r in rows:
        # int8: blocks of 256 with a scale each, error <= half a step of
        # max|block| / 127 per node, summed over 2 nodes; 1e-2 of the max.
        good = r.get("max_rel_error", 1) <= 1e-2 if name.endswith("int8") else r["errors"] == 0
        if not good or r["ranks"] != (4 if name.startswith("nodes") else 2):
            print("FAIL: %s: %s" % (name, r)); ok = False
print("%d runs, %s" % (len(files), "PASS" if ok else "FAIL"))
sys.exit(0 if ok and len(files) == 14 else 1)
PY

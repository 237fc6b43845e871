#!/usr/bin/env bash
# Runs the fuzz targets of tests/fuzz under libFuzzer, with AddressSanitizer
# and UndefinedBehaviorSanitizer, each for a bounded time, and prints a
# table (or JSON with --json) of what each did. Builds them first, with
# clang, into build-fuzz/ (or $CIUIC_FUZZ_BUILD_DIR), instrumented for
# coverage; installs what is missing (tools/install-deps.sh).
#
#   tools/fuzz.sh [--seconds N] [--seed S] [--json] [TARGET...]
#
# --seconds: per target (default 60, or $CIUIC_FUZZ_SECONDS). --seed:
# libFuzzer's seed (default: a random one, printed). Targets: codec_fuzz,
# config_fuzz, submission_fuzz, fragment_reducer_fuzz, membership_fuzz,
# coordinator_fuzz, ordering_frame_fuzz, message_fuzz (default: all).
# Each target's corpus grows in build-fuzz/corpus/TARGET across runs,
# seeded from tests/fuzz/corpus/TARGET. An input that breaks a property or
# that a sanitizer objects to is saved in build-fuzz/crashes/ and the script
# exits non-zero; replay it with build/tests/fuzz/TARGET_replay FILE, and
# once it is fixed, commit it to tests/fuzz/corpus/TARGET/ so ctest keeps
# replaying it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CIUIC_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${CIUIC_FUZZ_SECONDS:-60}
seed=""
json=0
targets=()
all_targets=(codec_fuzz config_fuzz submission_fuzz fragment_reducer_fuzz membership_fuzz
  coordinator_fuzz ordering_frame_fuzz message_fuzz)
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --json) json=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *)
      if [[ ! " ${all_targets[*]} " == *" $1 "* ]]; then
        echo "fuzz.sh: unknown target '$1' (targets: ${all_targets[*]})" >&2
        exit 2
      fi
      targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: --seconds wants a positive number of seconds, not '$seconds'" >&2
  exit 2
fi
[ -n "$seed" ] || seed=$(( (RANDOM << 15 | RANDOM) + 1 ))
if ! [[ "$seed" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: --seed wants a positive integer, not '$seed'" >&2
  exit 2
fi
say() { [ $json -eq 1 ] && echo "$@" >&2 || echo "$@"; }

bash "$root/tools/install-deps.sh" >&2
if [ ! -f "$build/build.ninja" ]; then
  say "fuzz.sh: configuring $build (clang, libFuzzer, ASan, UBSan)"
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCIUIC_CUDA=OFF -DCIUIC_FUZZ=ON -DCIUIC_WITH_MPI_BASELINE=OFF \
    -DPython_EXECUTABLE=/usr/bin/python3 > "$build.configure.log" 2>&1 ||
    { cat "$build.configure.log" >&2; exit 1; }
fi
say "fuzz.sh: building ${targets[*]}"
cmake --build "$build" -j "${CIUIC_JOBS:-2}" --target "${targets[@]}" > "$build/fuzz-build.log" 2>&1 ||
  { tail -40 "$build/fuzz-build.log" >&2; exit 1; }

mkdir -p "$build/corpus" "$build/crashes" "$build/logs"
say "fuzz.sh: ${#targets[@]} target(s), ${seconds} s each, seed $seed"
failed=0
rows=()
for t in "${targets[@]}"; do
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  cp -n "$root/tests/fuzz/corpus/$t/"* "$corpus/" 2>/dev/null || true
  [ "$t" != config_fuzz ] || cp -n "$root/deploy/ciuicd.yaml" "$corpus/" 2>/dev/null || true
  log=$build/logs/$t.log
  say "fuzz.sh: $t ..."
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb bounds memory.
  set +e
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    timeout $((seconds + 120)) "$build/tests/fuzz/$t" "$corpus" \
    -max_total_time="$seconds" -seed="$seed" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$build/crashes/$t-" > "$log" 2>&1
  rc=$?
  set -e
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | sed 's/cov: //')
  corp=$(ls "$corpus" | wc -l)
  if [ $rc -eq 0 ]; then
    result=ok
  else
    failed=1
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
    result="FAILED (exit $rc)${artifact:+: $artifact}"
    grep -E 'property broken|ERROR: (AddressSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error' \
      "$log" | head -5 >&2 || true
    echo "fuzz.sh: $t's log: $log" >&2
  fi
  rows+=("$t|$seconds|${runs:-0}|${cov:-0}|$corp|$result")
done

if [ $json -eq 1 ]; then
  printf '{"seed": %s, "targets": [' "$seed"
  sep=""
  for r in "${rows[@]}"; do
    IFS='|' read -r t s n c k res <<< "$r"
    res=${res//\\/\\\\}
    printf '%s{"target": "%s", "seconds": %s, "runs": %s, "coverage": %s, "corpus": %s, "result": "%s"}' \
      "$sep" "$t" "$s" "$n" "$c" "$k" "${res//\"/\\\"}"
    sep=", "
  done
  printf ']}\n'
else
  printf '\n%-24s %8s %12s %9s %7s  %s\n' target seconds runs coverage corpus result
  for r in "${rows[@]}"; do
    IFS='|' read -r t s n c k res <<< "$r"
    printf '%-24s %8s %12s %9s %7s  %s\n' "$t" "$s" "$n" "$c" "$k" "$res"
  done
fi
exit $failed

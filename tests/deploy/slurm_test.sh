#!/usr/bin/env bash
# tests/deploy/slurm_test.sh BUILD_DIR: the Slurm integration of deploy/slurm/,
# tested on a real one-host Slurm cluster that this script builds in a temp
# dir and tears down on exit, whatever happens.
#
# Debian packages it needs, installed here with apt-get when missing (root):
#   slurmctld slurmd slurm-client munge
# plus what the build already needs: python3-numpy and Debian's python3
# (the interpreter $CIUIC_TEST_PYTHON, default /usr/bin/python3, must import
# numpy and BUILD_DIR/python's ciuic).
#
# What it does, each wait bounded (about 13 s in all on 2 busy cores, plus
# about 12 s to install the packages if missing; after the install the run is
# stopped after $CIUIC_SLURM_TEST_LIMIT seconds, default 240, whatever it is
# waiting for):
#   1. a munged with its own key and socket in the temp dir (a system munged,
#      if any, is left alone), a slurm.conf for this host only (root, no
#      systemd, no cgroups: proctrack/linuxproc, task/none; free ports; all
#      state, spool, logs and pid files in the temp dir), slurmctld and
#      slurmd, and a ciuicd from BUILD_DIR on its own socket (--listen off);
#   2. Prolog, TaskProlog and Epilog are deploy/slurm's scripts, given the
#      test's socket through a defaults file (CIUIC_SLURM_DEFAULTS), as a site
#      would with /etc/default/ciuic-slurm;
#   3. `srun -n 2 allreduce.py --hold-until FILE`: while the job runs,
#      `ciuicctl jobs` must show ciuic job slurm-<jobid>.0 with an operation
#      waiting for rank 1, and the Epilog run by hand for that job id must log
#      it as left over; then FILE is made and both ranks must report results
#      equal to numpy's; the Prolog and the Slurm-run Epilog must have logged
#      their checks of that job. The tasks get a wrong CIUIC_SOCKET from srun,
#      so they reach the daemon only through the TaskProlog's; two more
#      sruns check what the TaskProlog exports (and that a user's CIUIC_JOB
#      is kept);
#   4. `sbatch deploy/slurm/allreduce.sbatch` must complete the same way;
#   5. ciuicd stopped, `srun -n 2` must fail in the Prolog without running
#      its command, slurmd's log must hold the Prolog's message, and the node
#      must be drained.
# Exit 0 only if every check passed. Set CIUIC_SLURM_TEST_KEEP=1 to keep the
# temp dir (logs) after the run.
set -euo pipefail

if [ $# -ne 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 BUILD_DIR   (the build with daemon/ciuicd, tools/ctl/ciuicctl, python/)" >&2
  exit 64
fi
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/deploy/slurm
python=${CIUIC_TEST_PYTHON:-/usr/bin/python3}
limit=${CIUIC_SLURM_TEST_LIMIT:-240}
ciuicd=$build/daemon/ciuicd
ciuicctl=$build/tools/ctl/ciuicctl

t0=$SECONDS
say() { printf '[slurm-test %3ds] %s\n' $((SECONDS - t0)) "$*"; }
fail() {
  say "FAIL: $*" >&2
  exit 1
}
# wait_for SECONDS COMMAND...: runs COMMAND every 0.2 s until it succeeds;
# returns 1 if it has not within SECONDS.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.2
  done
}

# --- packages ---------------------------------------------------------------
packages=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || fail "needs root to install ${missing[*]} (or install them first)"
  say "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # Without package lists (a fresh container), or with stale ones, the first
  # try fails: update once and try again. Each apt-get is bounded.
  if ! timeout 120 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    timeout 120 apt-get update -q >/dev/null || fail "apt-get update failed"
    timeout 120 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
      fail "apt-get install ${missing[*]} failed"
  fi
fi
for c in slurmctld slurmd srun sbatch squeue sinfo scontrol scancel munged; do
  command -v "$c" >/dev/null || fail "$c not found after installing ${packages[*]}"
done
[ "$(id -u)" -eq 0 ] || fail "must run as root (slurmd runs jobs and prologs as root here)"
for f in "$ciuicd" "$ciuicctl"; do [ -x "$f" ] || fail "$f missing: build it first"; done
for f in prolog.sh task-prolog.sh epilog.sh; do
  [ -x "$here/$f" ] || fail "$here/$f is not executable (git update-index --chmod=+x)"
done
PYTHONPATH=$build/python "$python" -c 'import numpy, ciuic' ||
  fail "$python cannot import numpy and ciuic from $build/python"

# --- temp dir, and cleanup whatever happens -----------------------------------
# 0755: munged wants every directory above its socket searchable by all;
# ciuicd wants its socket's directory owned by its uid and writable by no one
# else.
tmp=$(mktemp -d /tmp/ciuic-slurm-test.XXXXXX)
chmod 755 "$tmp"
mkdir -m 755 "$tmp/munge" "$tmp/ciuic" "$tmp/slurm" "$tmp/bin"
mkdir -m 700 "$tmp/slurm/state" "$tmp/slurm/spool"
# Every process this test starts (and what they start: slurmstepd, the
# tasks) inherits this variable; the cleanup ends whatever still has it.
export CIUIC_SLURM_TEST_TAG=$tmp
sock=$tmp/ciuic/ciuicd.sock
log=$tmp/ciuic-slurm.log # what the prolog and epilog log
: >"$log"
pids=()    # daemons started here, in start order
watchdog=""

# No job left in this test's Slurm.
no_jobs() { [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ]; }

# Sends SIGTERM, waits up to 10 s, then SIGKILL.
stop_pid() {
  kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$1" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  [ -n "$watchdog" ] && kill "$watchdog" 2>/dev/null
  if [ "$rc" -ne 0 ]; then
    # The logs, the most telling last.
    for f in "$tmp"/munge/munged.log "$tmp"/slurm/slurmctld.log "$tmp"/slurm/slurmd.log \
      "$tmp"/ciuicd.log "$log" "$tmp"/*.out; do
      [ -s "$f" ] && { echo "----- ${f#"$tmp"/} (last 15 lines)"; tail -n 15 "$f"; }
    done >&2
  fi
  # Jobs first, so that their steps and epilogs end under a live slurmd.
  if [ -n "${SLURM_CONF:-}" ] && timeout 5 squeue -h -o %i >"$tmp/left-jobs" 2>/dev/null &&
    [ -s "$tmp/left-jobs" ]; then
    xargs timeout 10 scancel <"$tmp/left-jobs"
    wait_for 15 no_jobs
  fi
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop_pid "${pids[i]}"; done
  # Anything else of ours (a slurmstepd or task Slurm did not end).
  local p left=()
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    grep -qzx "CIUIC_SLURM_TEST_TAG=$tmp" "$p/environ" 2>/dev/null && left+=("${p#/proc/}")
  done
  for p in "${left[@]}"; do kill -KILL "$p" 2>/dev/null; done
  if [ "${CIUIC_SLURM_TEST_KEEP:-0}" = 1 ]; then
    say "kept $tmp"
  else
    rm -rf "$tmp"
  fi
  if [ "$rc" -eq 0 ]; then say "PASS: Slurm integration (deploy/slurm)"; else say "FAILED (exit $rc)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# The overall bound: every wait below has its own, this catches the sum.
(
  sleep "$limit"
  echo "[slurm-test] overall limit of ${limit}s reached" >&2
  kill -TERM $$
) &
watchdog=$!

# --- munge --------------------------------------------------------------------
say "temp dir $tmp; starting munged"
head -c 1024 /dev/urandom >"$tmp/munge/munge.key"
chmod 600 "$tmp/munge/munge.key"
munged -F --socket="$tmp/munge/munge.sock" --key-file="$tmp/munge/munge.key" \
  --pid-file="$tmp/munge/munged.pid" --log-file="$tmp/munge/munged.log" \
  --seed-file="$tmp/munge/munged.seed" >"$tmp/munge/stdout" 2>&1 &
pids+=($!)
wait_for 20 test -S "$tmp/munge/munge.sock" || fail "munged did not start"

# --- ciuicd -------------------------------------------------------------------
say "starting ciuicd on $sock"
"$ciuicd" --socket "$sock" --listen off --worker-threads 1 --node-name slurm-test \
  >"$tmp/ciuicd.log" 2>&1 </dev/null &
ciuicd_pid=$!
pids+=("$ciuicd_pid")
wait_for 30 "$ciuicctl" --socket "$sock" status >/dev/null 2>&1 || fail "ciuicd did not start"

# --- Slurm --------------------------------------------------------------------
host=$(hostname -s)
# srun and slurmd find each other through this host's name; say so if it
# does not resolve (a container without its name in /etc/hosts).
getent hosts "$host" >/dev/null || say "warning: host name $host does not resolve; add it to /etc/hosts if srun fails"
# Two free TCP ports for slurmctld and slurmd (srun picks its own).
read -r ctld_port slurmd_port < <("$python" -c '
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')

# The site's settings of the ciuic scripts, as /etc/default/ciuic-slurm would
# hold them; slurmd gives prologs no environment of its own, so the wrappers
# that Slurm runs only say where this file is.
cat >"$tmp/ciuic-slurm.defaults" <<EOF
CIUIC_SLURM_SOCKET=$sock
CIUIC_SLURM_CTL=$ciuicctl
CIUIC_SLURM_LOG=$log
CIUIC_SLURM_TIMEOUT=10
CIUIC_SLURM_ATTEMPTS=2
EOF
for s in prolog task-prolog epilog; do
  printf '#!/bin/sh\nCIUIC_SLURM_DEFAULTS=%s exec %s "$@"\n' \
    "$tmp/ciuic-slurm.defaults" "$here/$s.sh" >"$tmp/bin/$s"
  chmod 755 "$tmp/bin/$s"
done

# Nothing of an outer Slurm (CI run inside a Slurm job, a user's defaults)
# may reach this test's srun and sbatch.
for v in $(compgen -e); do
  case $v in SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | SQUEUE_* | SINFO_*) unset "$v" ;; esac
done
export SLURM_CONF=$tmp/slurm/slurm.conf
cat >"$SLURM_CONF" <<EOF
# One host, everything as root, no systemd and no cgroups.
ClusterName=ciuictest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge/munge.sock
StateSaveLocation=$tmp/slurm/state
SlurmdSpoolDir=$tmp/slurm/spool
SlurmctldPidFile=$tmp/slurm/slurmctld.pid
SlurmdPidFile=$tmp/slurm/slurmd.pid
SlurmctldLogFile=$tmp/slurm/slurmctld.log
SlurmdLogFile=$tmp/slurm/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# CPUs=4 whatever this host has, so that 2 tasks fit on any CI machine.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
PrologEpilogTimeout=60
Prolog=$tmp/bin/prolog
TaskProlog=$tmp/bin/task-prolog
Epilog=$tmp/bin/epilog
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=ciuic Nodes=$host Default=YES MaxTime=10 State=UP
EOF

say "starting slurmctld (port $ctld_port) and slurmd (port $slurmd_port) for node $host"
(cd "$tmp/slurm" && exec slurmctld -D -f "$SLURM_CONF" >"$tmp/slurm/slurmctld.stdout" 2>&1) &
pids+=($!)
(cd "$tmp/slurm" && exec slurmd -D -f "$SLURM_CONF" >"$tmp/slurm/slurmd.stdout" 2>&1) &
pids+=($!)
node_idle() { [ "$(sinfo -h -n "$host" -o %T 2>/dev/null)" = idle ]; }
wait_for 60 node_idle || fail "node $host not idle after 60 s: $(sinfo -h -n "$host" -o '%T %E' 2>&1)"
say "node $host idle"

# What the tasks get from srun: a socket that does not exist (the TaskProlog
# must replace it) and no job id (the TaskProlog's must be used).
export PYTHONPATH=$build/python CIUIC_PYTHON=$python CIUIC_ARENA_BYTES=64M
export CIUIC_SOCKET=$tmp/not-the-daemon.sock
unset CIUIC_JOB CIUIC_COORDINATOR MASTER_ADDR RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE \
  TORCHELASTIC_RUN_ID || true

# check_ranks FILE JOBID: both ranks of ciuic job slurm-JOBID.0 reported a
# match with numpy through the test's daemon.
check_ranks() {
  local n
  n=$(grep -c "of ciuic job slurm-$2\.0 via $sock: allreduces .* match numpy" "$1" || true)
  [ "$n" -eq 2 ] || fail "expected 2 ranks of slurm-$2.0 matching numpy in $1, got $n: $(cat "$1")"
}
# logged PATTERN: the prolog/epilog log has a line matching PATTERN.
logged() { grep -q -- "$1" "$log"; }

# --- 3. srun, held while `ciuicctl jobs` is looked at ---------------------------
say "srun -n 2 allreduce.py --hold-until: 2 ranks through ciuicd, held after the checks"
(cd "$tmp" && exec timeout 120 srun -J ciuic-hold -n 2 --kill-on-bad-exit=1 --time=3 \
  "$python" "$here/allreduce.py" --count 262144 --hold-until "$tmp/go" --hold-timeout 60) \
  >"$tmp/hold.out" 2>&1 &
srun_pid=$!
# srun ending early (a rank that failed, a prolog that failed) ends the waits
# below at once, with its output.
srun_ended() { ! kill -0 "$srun_pid" 2>/dev/null; }
srun_ended_early() {
  local rc=0
  wait "$srun_pid" || rc=$?
  fail "srun ended early (exit $rc) before $1: $(cat "$tmp/hold.out")"
}
job_started() { srun_ended || [ -n "$(squeue -h -n ciuic-hold -t R -o %i 2>/dev/null)" ]; }
wait_for 60 job_started || fail "job ciuic-hold did not start: $(squeue 2>&1; cat "$tmp/hold.out")"
srun_ended && srun_ended_early "the job was seen running"
jid=$(squeue -h -n ciuic-hold -o %i)
say "Slurm job $jid running; waiting for its ciuic job in \`ciuicctl jobs\`"

# The daemon's view, checked exactly: ciuic job slurm-<jid>.0 of 2 ranks has
# completed the 3 checks and has 'hold' pending, submitted by rank 0 and
# waiting for rank 1.
cat >"$tmp/check_jobs.py" <<'EOF'
import json, sys
want, seen = f"slurm-{sys.argv[1]}.0", json.load(sys.stdin)
for job in seen.get("jobs", []):
    if job["jobId"] != want:
        continue
    held = [p for p in job.get("pending", []) if p["name"] == "hold"]
    if (job["worldSize"] == 2 and int(job["opsCompleted"]) >= 3 and held
            and held[0]["submittedRanks"] == [0] and held[0]["waitingForRanks"] == [1]):
        sys.exit(0)
print(f"{want} not (yet) holding 'hold' for rank 1: jobs = {seen.get('jobs')}", file=sys.stderr)
sys.exit(1)
EOF
held_in_daemon() {
  "$ciuicctl" --socket "$sock" --json jobs >"$tmp/jobs.json" 2>&1 &&
    "$python" "$tmp/check_jobs.py" "$jid" <"$tmp/jobs.json" 2>"$tmp/jobs.why"
}
held_or_ended() { srun_ended || held_in_daemon; }
wait_for 60 held_or_ended ||
  fail "ciuicctl jobs never showed slurm-$jid.0 holding 'hold': $(cat "$tmp/jobs.why")"
srun_ended && srun_ended_early "ciuicctl jobs showed slurm-$jid.0 holding 'hold'"
"$ciuicctl" --socket "$sock" jobs | sed 's/^/    /'
say "ok: ciuicctl jobs shows ciuic job slurm-$jid.0 of Slurm job $jid, 'hold' waiting for rank 1"

# The epilog's detection, run by hand for the live job (as slurmd would).
SLURM_JOB_ID=$jid SLURMD_NODENAME=$host CIUIC_SLURM_EPILOG_GRACE=1 \
  CIUIC_SLURM_DEFAULTS=$tmp/ciuic-slurm.defaults timeout 30 "$here/epilog.sh" ||
  fail "epilog.sh exited $? for a job with leftovers (it must only log)"
logged "ciuic epilog: job $jid on $host: ciuic jobs still in ciuicd .*slurm-$jid\.0" ||
  fail "epilog.sh did not log slurm-$jid.0 as left over: $(cat "$log")"
say "ok: epilog.sh logs the live job's ciuic job as left over (and exits 0)"

touch "$tmp/go"
wait "$srun_pid" || fail "srun exited $?: $(cat "$tmp/hold.out")"
check_ranks "$tmp/hold.out" "$jid"
say "ok: both ranks' allreduces match numpy (job slurm-$jid.0, socket from the TaskProlog)"
logged "ciuic prolog: job $jid on $host: ciuicd healthy at $sock" ||
  fail "the Prolog did not log its check of job $jid: $(cat "$log")"
wait_for 30 logged "ciuic epilog: job $jid on $host: no ciuic job of it left" ||
  fail "the Epilog did not log a clean check of job $jid: $(cat "$log")"
say "ok: Prolog found ciuicd healthy, Epilog found nothing left of job $jid"

# What the TaskProlog exported, as the task sees it: the node's socket over
# srun's, the step's job id, and a job id of the user's own kept.
got=$(cd "$tmp" && timeout 60 srun -J ciuic-env -n 1 printenv CIUIC_SOCKET CIUIC_JOB | tr '\n' ' ') ||
  fail "srun printing the TaskProlog's exports failed"
jid_env=$(squeue -h -t all -n ciuic-env -o %i | head -n 1)
[ "$got" = "$sock slurm-$jid_env.0 " ] ||
  fail "task saw CIUIC_SOCKET CIUIC_JOB = '$got', expected '$sock slurm-$jid_env.0'"
got=$(cd "$tmp" && CIUIC_JOB=mine timeout 60 srun -n 1 printenv CIUIC_JOB) ||
  fail "srun with the user's CIUIC_JOB failed"
[ "$got" = mine ] || fail "the TaskProlog replaced the user's CIUIC_JOB=mine by '$got'"
say "ok: tasks get CIUIC_SOCKET=$sock and CIUIC_JOB=slurm-$jid_env.0 (a user's CIUIC_JOB kept)"

# --- 4. the sbatch example ------------------------------------------------------
say "sbatch deploy/slurm/allreduce.sbatch"
# (sbatch --wait would do, but polls only every few seconds.)
jid2=$(cd "$root" && timeout 30 sbatch --parsable -o "$tmp/sbatch-%j.out" \
  deploy/slurm/allreduce.sbatch --count 262144) || fail "sbatch exited $?"
jid2=${jid2%%;*}
# Finished jobs stay in slurmctld's memory (MinJobAge, 300 s) with their state.
job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
job_done() { case $(job_state "$jid2") in PENDING | CONFIGURING | RUNNING | COMPLETING) return 1 ;; esac; }
wait_for 90 job_done || fail "batch job $jid2 not done after 90 s: $(job_state "$jid2")"
state=$(job_state "$jid2")
[ "$state" = COMPLETED ] ||
  fail "batch job $jid2 ended $state: $(cat "$tmp/sbatch-$jid2.out" 2>/dev/null)"
check_ranks "$tmp/sbatch-$jid2.out" "$jid2"
wait_for 30 logged "ciuic epilog: job $jid2 on $host: no ciuic job of it left" ||
  fail "the Epilog did not log a clean check of job $jid2: $(cat "$log")"
say "ok: sbatch example job $jid2 passed"

# --- 5. no daemon: the Prolog fails the job and Slurm drains the node ------------
say "stopping ciuicd; srun must now fail in the Prolog"
stop_pid "$ciuicd_pid"
set +e
(cd "$tmp" && timeout 60 srun -J ciuic-nodaemon -n 2 touch "$tmp/ran") >"$tmp/nodaemon.out" 2>&1
rc=$?
set -e
[ "$rc" -ne 0 ] || fail "srun succeeded without a ciuicd"
[ "$rc" -ne 124 ] || fail "srun hung without a ciuicd: $(cat "$tmp/nodaemon.out")"
[ ! -e "$tmp/ran" ] || fail "the job's command ran although the Prolog failed"
grep -q "prolog failed" "$tmp/nodaemon.out" ||
  fail "srun did not report the prolog failure: $(cat "$tmp/nodaemon.out")"
msg="ciuic prolog: job [0-9]* on $host: ciuicd is not reachable (tries: 2): \`$ciuicctl --socket $sock status\` exited 2: cannot reach ciuicd at $sock"
grep -q "prolog failed: rc:1 output:$msg" "$tmp/slurm/slurmd.log" ||
  fail "slurmd's log lacks the Prolog's message: $(grep -i prolog "$tmp/slurm/slurmd.log")"
logged "$msg" || fail "the Prolog did not log its failure: $(cat "$log")"
drained() { sinfo -h -n "$host" -o %T | grep -q drain; }
wait_for 15 drained || fail "node $host not drained: $(sinfo -h -n "$host" -o '%T %E')"
say "ok: without ciuicd srun fails (exit $rc) in the Prolog, slurmd logged:"
grep -o "prolog failed: rc:1 output:.*" "$tmp/slurm/slurmd.log" | tail -n 1 | sed 's/^/    /'
say "ok: node $host drained ($(sinfo -h -n "$host" -o '%T: %E'))"

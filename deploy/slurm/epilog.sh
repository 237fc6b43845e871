#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/ciuic-epilog.sh). slurmd runs
# it as root on the node after a job ends there. It checks that the node's
# ciuicd holds no ciuic job of that Slurm job any more: the ids
# slurm-$SLURM_JOB_ID.<step> that the TaskProlog and the SDK give each srun
# step (and torch's sub-groups, slurm-J.S.g<n>). A job still there means
# trainers of the ended job are still alive (outside Slurm's process
# tracking) or the daemon has not noticed them leave. Either way the epilog
# only logs it, to syslog and $CIUIC_SLURM_LOG, with the job's rows of
# `ciuicctl jobs`; it never fails: the daemon ends such a job itself once its
# trainers are gone, and draining the node for it would be worse. A daemon
# that cannot be asked is logged too; the next job's Prolog deals with it.
#
# Trainers that Slurm has just killed take the daemon a moment to notice, so
# the check is repeated for up to $CIUIC_SLURM_EPILOG_GRACE seconds (5)
# before anything is logged.
#
# Settings as in prolog.sh (environment, else $CIUIC_SLURM_DEFAULTS, default
# /etc/default/ciuic-slurm, else the default): CIUIC_SLURM_SOCKET,
# CIUIC_SLURM_CTL, CIUIC_SLURM_TIMEOUT, CIUIC_SLURM_LOG, and
# CIUIC_SLURM_EPILOG_GRACE.
set -u
PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}

env_socket=${CIUIC_SLURM_SOCKET-} env_ctl=${CIUIC_SLURM_CTL-}
env_timeout=${CIUIC_SLURM_TIMEOUT-} env_log=${CIUIC_SLURM_LOG-}
env_grace=${CIUIC_SLURM_EPILOG_GRACE-}
defaults=${CIUIC_SLURM_DEFAULTS:-/etc/default/ciuic-slurm}
# shellcheck disable=SC1090
[ -r "$defaults" ] && . "$defaults"
socket=${env_socket:-${CIUIC_SLURM_SOCKET:-/run/ciuic/ciuicd.sock}}
ctl=${env_ctl:-${CIUIC_SLURM_CTL:-ciuicctl}}
timeout_s=${env_timeout:-${CIUIC_SLURM_TIMEOUT:-5}}
logfile=${env_log:-${CIUIC_SLURM_LOG:-}}
grace=${env_grace:-${CIUIC_SLURM_EPILOG_GRACE:-5}}
node=${SLURMD_NODENAME:-$(hostname)}
job=${SLURM_JOB_ID:-}

log() {  # PRIORITY MESSAGE, as in prolog.sh
  if [ "$1" != info ]; then
    logger -t ciuic-slurm -p "user.$1" -- "$2" 2>/dev/null || true
  fi
  if [ -n "$logfile" ]; then
    printf '%s %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "$2" >>"$logfile" 2>/dev/null || true
  fi
}

case $job in
  '' | *[!0-9]*)
    log warning "ciuic epilog on $node: no numeric SLURM_JOB_ID ('$job'); nothing checked"
    exit 0
    ;;
esac

# Prints the distinct ciuic job ids of this Slurm job that the daemon still
# has, as jobs or as sessions, one per line; exits with ciuicctl's status.
# The JSON is matched with grep, not parsed, so that the epilog needs nothing
# beyond coreutils; the pattern allows blanks around the colon.
left_jobs() {
  json=$(timeout "$timeout_s" "$ctl" --socket "$socket" --json jobs 2>&1) || {
    rc=$?
    printf '%s' "$json" | tr '\n' ' ' | cut -c1-300
    return "$rc"
  }
  printf '%s' "$json" |
    grep -o "\"jobId\"[[:space:]]*:[[:space:]]*\"slurm-$job\.[^\"]*\"" |
    sed 's/.*"\(slurm-[^"]*\)"$/\1/' | sort -u
}

# Half-second polls up to the grace period.
polls=$((grace * 2))
i=0
while :; do
  left=$(left_jobs)
  rc=$?
  if [ "$rc" -ne 0 ]; then
    log warning "ciuic epilog: job $job on $node: could not ask ciuicd at $socket (\`$ctl --json jobs\` exited $rc: $left); leftover ciuic jobs not checked"
    exit 0
  fi
  [ -z "$left" ] && break
  i=$((i + 1))
  [ "$i" -gt "$polls" ] && break
  sleep 0.5
done

if [ -z "$left" ]; then
  log info "ciuic epilog: job $job on $node: no ciuic job of it left in ciuicd"
  exit 0
fi
ids=$(printf '%s' "$left" | tr '\n' ' ')
# The human-readable rows (job table and pending operations) of those jobs.
rows=$(timeout "$timeout_s" "$ctl" --socket "$socket" jobs 2>/dev/null |
  grep "^slurm-$job\." | tr -s ' ' | tr '\n' '|')
log warning "ciuic epilog: job $job on $node: ciuic jobs still in ciuicd ${grace}s after the Slurm job ended: ${ids}(trainers still alive?) ciuicctl jobs: ${rows:-none shown}"
exit 0

#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ciuic-prolog.sh) for nodes that
# run ciuicd. slurmd runs it as root on the node before a job's first step
# there. It asks the node's ciuicd for its status; if the daemon does not
# answer, the prolog exits 1 with one line saying why. Slurm then drains the
# node ("Prolog error" in `sinfo -R`), requeues or fails the job, and writes
# that line into slurmd's log ("prolog failed: rc:1 output:ciuic prolog: ...");
# it also goes to syslog and to $CIUIC_SLURM_LOG. The prolog does not start
# the daemon: that is systemd's job (deploy/ciuicd.service, Restart=on-failure),
# and a node whose daemon keeps failing should stay out of the pool.
#
# Settings, each from the environment, else from the file
# $CIUIC_SLURM_DEFAULTS (default /etc/default/ciuic-slurm, shell assignments,
# read if present), else the default shown:
#   CIUIC_SLURM_SOCKET   control socket of the node's ciuicd (/run/ciuic/ciuicd.sock)
#   CIUIC_SLURM_CTL      the ciuicctl to run (ciuicctl, looked up on PATH)
#   CIUIC_SLURM_TIMEOUT  seconds ciuicctl may take before the daemon counts as hung (5)
#   CIUIC_SLURM_ATTEMPTS times to ask a daemon that is not reachable, 2 s apart (3)
#   CIUIC_SLURM_LOG      a file to append one line per check to (none)
# slurmd gives prologs no PATH and none of its own environment, so the
# defaults file (or a wrapper that sets these and execs this script) is where
# a site puts a socket other than the default.
set -u
PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}

# The environment wins over the defaults file: remember it, read the file,
# then put the environment's values back over the file's.
env_socket=${CIUIC_SLURM_SOCKET-} env_ctl=${CIUIC_SLURM_CTL-}
env_timeout=${CIUIC_SLURM_TIMEOUT-} env_log=${CIUIC_SLURM_LOG-}
env_attempts=${CIUIC_SLURM_ATTEMPTS-}
defaults=${CIUIC_SLURM_DEFAULTS:-/etc/default/ciuic-slurm}
# shellcheck disable=SC1090
[ -r "$defaults" ] && . "$defaults"
socket=${env_socket:-${CIUIC_SLURM_SOCKET:-/run/ciuic/ciuicd.sock}}
ctl=${env_ctl:-${CIUIC_SLURM_CTL:-ciuicctl}}
timeout_s=${env_timeout:-${CIUIC_SLURM_TIMEOUT:-5}}
attempts=${env_attempts:-${CIUIC_SLURM_ATTEMPTS:-3}}
logfile=${env_log:-${CIUIC_SLURM_LOG:-}}
node=${SLURMD_NODENAME:-$(hostname)}

# log PRIORITY MESSAGE: to syslog (problems only; a node without a syslog
# daemon just loses it) and, if set, to $CIUIC_SLURM_LOG.
log() {
  if [ "$1" != info ]; then
    logger -t ciuic-slurm -p "user.$1" -- "$2" 2>/dev/null || true
  fi
  if [ -n "$logfile" ]; then
    printf '%s %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "$2" >>"$logfile" 2>/dev/null || true
  fi
}

# Only ciuicctl's stderr is kept: on failure it names the reason
# ("cannot reach ciuicd at PATH: No such file or directory"). A daemon that
# is not reachable is asked again, up to $attempts times 2 s apart, so that
# systemd restarting it (RestartSec=2s) does not drain the node; one that
# does not answer in time has had its chance. Either way the prolog ends
# within about 5 s by default, as Slurm wants (under its MessageTimeout, 10 s).
attempt=1
while :; do
  err=$( { timeout "$timeout_s" "$ctl" --socket "$socket" status >/dev/null; } 2>&1 )
  rc=$?
  if [ "$rc" -ne 2 ] || [ "$attempt" -ge "$attempts" ]; then
    break
  fi
  attempt=$((attempt + 1))
  sleep 2
done
if [ "$rc" -eq 0 ]; then
  log info "ciuic prolog: job ${SLURM_JOB_ID:-?} on $node: ciuicd healthy at $socket"
  exit 0
fi

case $rc in
  2) why="ciuicd is not reachable (tries: $attempt)" ;;
  1) why="ciuicd answered with an error" ;;
  124) why="ciuicd did not answer within ${timeout_s}s (hung?)" ;;
  126 | 127) why="cannot run '$ctl' (not installed? set CIUIC_SLURM_CTL)" ;;
  *) why="'$ctl' failed unexpectedly" ;;
esac
# One line, so that slurmd's log and syslog keep it whole.
detail=$(printf '%s' "$err" | tr '\n' ' ' | cut -c1-300)
msg="ciuic prolog: job ${SLURM_JOB_ID:-?} on $node: $why: \`$ctl --socket $socket status\` exited $rc${detail:+: $detail}; failing the prolog so Slurm drains $node. Fix the daemon (systemctl status ciuicd), then: scontrol update NodeName=$node State=RESUME"
log err "$msg"
echo "$msg"
exit 1

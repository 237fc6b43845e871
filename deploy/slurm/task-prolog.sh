#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/ciuic-task-prolog.sh).
# slurmstepd runs it as the job's user before each task, with the task's
# environment; each "export NAME=value" line it prints is set in the task's
# environment. It prints only what the ciuic SDK cannot find out by itself:
#
#   CIUIC_SOCKET     the node's ciuicd control socket, always: the task must
#                    use the daemon this node's Prolog checked, not a path
#                    that sbatch/srun carried over from the submitting host.
#   CIUIC_JOB        slurm-$SLURM_JOB_ID.$SLURM_STEP_ID, for each srun step,
#                    unless the task already has a CIUIC_JOB of its own. The
#                    Python SDK derives this very id under srun by itself;
#                    exporting it also covers trainers that see torchrun's
#                    variables (torchrun started by srun, whose
#                    TORCHELASTIC_RUN_ID would win otherwise) and C++
#                    trainers (the C++ SDK takes JobOptions::job_id as
#                    given), so that `ciuicctl jobs` always shows Slurm's
#                    job id. One ciuic job per step, not per Slurm job: two
#                    steps of one job running at once are two ciuic jobs and
#                    never meet. The batch script itself (no SLURM_STEP_ID)
#                    gets none, so that its own sruns get theirs.
#   CIUIC_PEER_PORT  only if CIUIC_SLURM_PEER_PORT is set: the daemons' peer
#                    port, when not the default 7361. The SDK takes the
#                    coordinator of a job over several nodes as the first
#                    host of $SLURM_STEP_NODELIST at that port, which is
#                    rank 0's node under Slurm's default block distribution,
#                    so no CIUIC_COORDINATOR is exported (it would override a
#                    MASTER_ADDR that the user set).
#
# Settings, each from the environment, else from $CIUIC_SLURM_DEFAULTS
# (default /etc/default/ciuic-slurm, read if present), else the default:
#   CIUIC_SLURM_SOCKET     (/run/ciuic/ciuicd.sock)
#   CIUIC_SLURM_PEER_PORT  (unset: the SDK's default, 7361)
# It runs once per task, so it runs no other program.
set -u

env_socket=${CIUIC_SLURM_SOCKET-} env_port=${CIUIC_SLURM_PEER_PORT-}
defaults=${CIUIC_SLURM_DEFAULTS:-/etc/default/ciuic-slurm}
# shellcheck disable=SC1090
[ -r "$defaults" ] && . "$defaults"
socket=${env_socket:-${CIUIC_SLURM_SOCKET:-/run/ciuic/ciuicd.sock}}
peer_port=${env_port:-${CIUIC_SLURM_PEER_PORT:-}}

echo "export CIUIC_SOCKET=$socket"
if [ -n "$peer_port" ]; then
  echo "export CIUIC_PEER_PORT=$peer_port"
fi

# Steps of srun have a number; the batch script has none here, and the
# extern, batch and interactive steps use Slurm's reserved ids from
# 4294967290 (0xfffffffa) up.
case ${SLURM_STEP_ID:-} in
  '' | *[!0-9]*) ;;
  *)
    if [ "$SLURM_STEP_ID" -lt 4294967290 ] && [ -z "${CIUIC_JOB:-}" ] &&
      [ -n "${SLURM_JOB_ID:-}" ]; then
      echo "export CIUIC_JOB=slurm-$SLURM_JOB_ID.$SLURM_STEP_ID"
    fi
    ;;
esac
exit 0

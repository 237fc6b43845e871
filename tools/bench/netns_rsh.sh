#!/bin/sh
# netns_rsh.sh: OpenMPI's "ssh" into a network namespace (compare.py --scenario netns).
#
# mpirun runs in node 0's namespace with --mca plm_rsh_agent pointing here and
# --host <node addresses>; for every other node it calls
#     netns_rsh.sh [ssh options] HOST COMMAND...
# and this runs COMMAND (OpenMPI's orted) in the namespace that owns HOST, as
# given by $CIUIC_NETNS_MAP ("10.88.0.2=nsA,10.88.0.3=nsB"), with a UTS
# namespace of its own whose hostname is the namespace's name (otherwise all
# "hosts" report the same hostname). orted then connects back to mpirun over
# the namespaces' network, and the ranks of each node talk to their own orted
# over that namespace's loopback, which is what PMIx needs: ranks started by a
# single mpirun through 'ip netns exec' fail in MPI_Init, because PMIx reaches
# mpirun over TCP on the loopback, which a namespace does not share.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
ns=""
for kv in $(echo "$CIUIC_NETNS_MAP" | tr ',' ' '); do
  [ "${kv%%=*}" = "$host" ] && ns=${kv#*=}
done
if [ -z "$ns" ]; then
  echo "netns_rsh.sh: no namespace for host $host in CIUIC_NETNS_MAP=$CIUIC_NETNS_MAP" >&2
  exit 1
fi
exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*"

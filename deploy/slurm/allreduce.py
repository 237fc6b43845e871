#!/usr/bin/env python3
"""Allreduces through the node's ciuicd under Slurm, checked against numpy.

    srun -n 2 python3 deploy/slurm/allreduce.py        # or: sbatch deploy/slurm/allreduce.sbatch

Every task calls ``ciuic.init()`` with no arguments: the SDK takes the rank,
world size and node-local layout from Slurm's environment (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, this node's count in SLURM_TASKS_PER_NODE),
the job id from $CIUIC_JOB (the TaskProlog's slurm-<job>.<step>, which the
SDK would derive itself under srun) and the socket from $CIUIC_SOCKET (the
TaskProlog's; else /run/ciuic/ciuicd.sock). Each rank then reduces arrays
whose every element is a small integer, so that every partial sum is exact
and the daemon's result must equal numpy's bit for bit whatever order it
adds in, and one float64 average against numpy within rounding. Each rank
prints one line and exits 0 if everything matched, 1 otherwise.

``--hold-until FILE`` (used by tests/deploy/slurm_test.sh) keeps one operation,
named "hold", pending in the daemon afterwards: rank 0 submits it at once,
the other ranks only once FILE exists (at most --hold-timeout seconds), so
that `ciuicctl jobs` can be seen listing the job and the operation waiting
for them while the Slurm job runs.
"""
import argparse
import os
import sys
import time

import numpy as np

import ciuic


def rank_data(rank, count, dtype):
    """Rank ``rank``'s input: integers 0..1000, different on every rank."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13) % 1001).astype(dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=1 << 20,
                   help="elements of the large allreduce (default 1M float32 = 4 MiB)")
    p.add_argument("--hold-until", metavar="FILE",
                   help="then keep operation 'hold' pending until FILE exists")
    p.add_argument("--hold-timeout", type=float, default=60.0,
                   help="seconds to wait for --hold-until's FILE (default 60)")
    args = p.parse_args()

    try:
        comm = ciuic.init()
    except ciuic.Error as e:  # no daemon on the socket, a bad environment, ...
        print(f"ciuic.init() failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    where = (f"rank {comm.rank}/{comm.world_size} (local {comm.local_rank}/{comm.local_size}) "
             f"of ciuic job {comm.job_id} via "
             f"{os.environ.get('CIUIC_SOCKET') or '/run/ciuic/ciuicd.sock'}")
    errors = []
    try:
        check(comm, args, errors)
    except ciuic.Error as e:  # the daemon's or the SDK's error, e.g. a rank that left
        errors.append(f"{type(e).__name__}: {e}")
    comm.close()
    if errors:
        for e in errors:
            print(f"{where}: MISMATCH or ERROR: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"{where}: allreduces of 100 and {args.count} float32 (sum) and 4096 float64 (avg) "
          f"match numpy", flush=True)
    return 0


def check(comm, args, errors):
    """Runs the allreduces; appends what went wrong to ``errors``."""
    rank, world = comm.rank, comm.world_size

    # Exact sums: 100 elements (a few hundred bytes: the daemon's fast path
    # among the ranks' shared memory) and --count (through the daemon).
    for count in (100, args.count):
        x = rank_data(rank, count, np.float32)
        comm.allreduce(x, op="sum", name=f"check.sum.{count}")
        expected = np.sum([rank_data(r, count, np.float32) for r in range(world)], axis=0)
        if not np.array_equal(x, expected):
            bad = np.flatnonzero(x != expected)
            errors.append(f"sum of {count} float32: {bad.size} elements differ from numpy, "
                          f"first at [{bad[0]}]: {x[bad[0]]} != {expected[bad[0]]}")

    # An average of random float64: equal to numpy's within rounding.
    y = np.random.default_rng(rank).standard_normal(4096)
    comm.allreduce(y, op="avg", name="check.avg")
    mean = np.mean([np.random.default_rng(r).standard_normal(4096) for r in range(world)], axis=0)
    if not np.allclose(y, mean, rtol=1e-12, atol=1e-12):
        errors.append(f"avg of 4096 float64: max difference from numpy {np.max(np.abs(y - mean))}")

    if args.hold_until and not errors:
        h = np.full(4, rank + 1, dtype=np.float32)
        # The daemon's own limit for the operation outlasts our wait for FILE.
        op_timeout = args.hold_timeout + 30
        if rank == 0:
            print(f"rank 0: operation 'hold' submitted, pending until {args.hold_until} exists",
                  flush=True)
            work = comm.allreduce_async(h, op="sum", name="hold", timeout=op_timeout)
            if not work.wait(timeout=op_timeout + 10):
                errors.append("operation 'hold' did not complete")
        else:
            deadline = time.monotonic() + args.hold_timeout
            while not os.path.exists(args.hold_until) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not os.path.exists(args.hold_until):
                # Leaving makes the daemon fail 'hold' on rank 0 at once (ABORTED).
                errors.append(f"{args.hold_until} did not appear within {args.hold_timeout}s")
            else:
                comm.allreduce(h, op="sum", name="hold", timeout=op_timeout)
        if not errors and not np.array_equal(h, np.full(4, world * (world + 1) / 2, np.float32)):
            errors.append(f"'hold' gave {h}, not {world * (world + 1) // 2} everywhere")


if __name__ == "__main__":
    sys.exit(main())

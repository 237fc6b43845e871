#!/usr/bin/python3
"""ciuic_py_bench.py: ciuic-bench's measurement through the Python SDK, joining
daemons that are already running (one per node, e.g. one per network namespace).

    PYTHONPATH=build/python /usr/bin/python3 tools/bench/ciuic_py_bench.py \\
        --op allreduce --nodes 2 --ranks-per-node 1 --sizes 1M,16M \\
        --sockets /tmp/x/n0.sock,/tmp/x/n1.sock --coordinator 10.88.0.1:7361 --check --json

ciuic-bench starts its own daemons and --socket names only one; this program
is for the case where the caller has started one ciuicd per node itself
(compare.py --scenario netns). It starts --nodes x --ranks-per-node rank
processes on this machine; rank r joins the daemon of node r // R through
--sockets (comma separated, one per node). With more than one node,
$CIUIC_COORDINATOR is set to --coordinator (the peer address of the daemon of
node 0) for the C++ SDK, which reads it when local_size < world_size.
The ranks themselves may run anywhere that reaches the daemon's unix socket;
the bytes between nodes go daemon to daemon.

Same flags and JSON keys as ciuic-bench, ciuic-mpi-bench and gloo_bench.py;
same method as gloo_bench.py:
  - buffers come from comm.empty() (the daemon's shared memory: zero copy),
    allocated once per size and written before timing;
  - one cold op timed alone (cold_us), --warmup untimed ops, a barrier, then
    --iters ops each timed with time.perf_counter(), no barrier between;
  - time_us = median over iterations of the max over ranks (the per-op times
    are reduced with a ciuic allreduce op="max" after the timing);
  - --check refills (rank r's element i is ((3*i + 5*r) mod 17) - 8), runs one
    more op and counts mismatching output elements over all ranks; with a
    lossy --compression it reports max_rel_error = max |result - exact| /
    max |exact| (max over ranks) instead, as ciuic-bench does.
--compression CODEC (none, fp16, bf16, int8, topk:RATIO) is passed to every
allreduce / reduce_scatter as the per-operation codec (the daemon's
min_compress_bytes still applies).
allreduce and broadcast are in place (the SDK's form).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import benchlib
from benchlib import BUS_FACTOR, ELEMENT_SIZE, parse_size, shape_for

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "alltoallv", "broadcast",
       "barrier")
DTYPES = ("float32", "float64", "int32")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True, choices=OPS)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sizes", default="8,64K,16M,256M")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sockets", required=True,
                   help="control sockets of the running daemons, one per node, comma separated")
    p.add_argument("--coordinator", default="",
                   help="host:port of node 0's daemon peer service (needed for --nodes > 1)")
    p.add_argument("--job", default="", help="job id (default: a fresh one)")
    p.add_argument("--compression", default="",
                   help="per-operation codec: none, fp16, bf16, int8, topk:RATIO "
                        "(default: the daemon's)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds before the ranks are killed (default 600)")
    args = p.parse_args(argv)
    args.socket_list = [s for s in args.sockets.split(",") if s]
    if len(args.socket_list) != args.nodes:
        p.error("--sockets names %d daemons for --nodes %d" % (len(args.socket_list), args.nodes))
    if args.nodes > 1 and not args.coordinator:
        p.error("--nodes > 1 needs --coordinator host:port")
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error("bad --sizes %s" % args.sizes)
    if args.compression and not benchlib.valid_codec(args.compression):
        p.error("unknown compression codec '%s' (none, fp16, bf16, int8, topk:RATIO with "
                "0 < RATIO <= 1)" % args.compression)
    if args.compression and args.op not in ("allreduce", "reduce_scatter"):
        p.error("--compression applies to allreduce and reduce_scatter, not %s" % args.op)
    if args.iters < 1 or args.warmup < 0 or args.nodes < 1 or args.ranks_per_node < 1:
        p.error("--iters, --nodes, --ranks-per-node must be >= 1, --warmup >= 0")
    return args


def lossy(args):
    return bool(args.compression) and args.compression.strip().lower() != "none"


# ---------------------------------------------------------------- launcher

def launch(args, argv):
    world = args.nodes * args.ranks_per_node
    job = args.job or "pybench-%d-%d" % (os.getpid(), int(time.time() * 1000) % 10 ** 9)
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({"CIUIC_PYBENCH_RANK": str(rank), "CIUIC_PYBENCH_WORLD": str(world),
                    "CIUIC_PYBENCH_JOB": job})
        if args.nodes > 1:
            env["CIUIC_COORDINATOR"] = args.coordinator
        out = None if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                                      env=env, stdout=out))
    return benchlib.supervise(procs, args.timeout, "ciuic_py_bench")


# ------------------------------------------------------------------ worker



class SizeRun:
    def __init__(self, np, comm, args, rank, world, nbytes):
        self.np, self.comm, self.args = np, comm, args
        self.rank, self.world = rank, world
        self.dtype = getattr(np, args.dtype)
        self.send_count, self.recv_count, self.bytes = shape_for(args.op, args.dtype,
                                                                 nbytes, world)
        op = args.op
        self.buf = self.out = None
        self.checking = False  # the --check op runs under its own name (no residual)
        if op != "barrier":
            self.buf = comm.empty(self.send_count, self.dtype)
        if op in ("reduce_scatter", "allgather", "alltoall", "alltoallv"):
            self.out = comm.empty(self.recv_count, self.dtype)
        if op == "alltoallv":  # element counts to / from each rank (rows of one element)
            total = self.send_count
            self.send_splits = [benchlib.uneven_count(world, total, rank, j) for j in range(world)]
            self.recv_splits = [benchlib.uneven_count(world, total, j, rank) for j in range(world)]
        self.fill()

    def fill(self):
        op = self.args.op
        if op == "barrier":
            return
        if op == "broadcast" and self.rank != 0:
            self.buf[:] = -1000
        else:
            self.buf[:] = benchlib.fill_value(self.np, 0 if op == "broadcast" else self.rank, 0,
                                              self.send_count)
        if self.out is not None:
            self.out[:] = -1000

    def run(self):
        c, op = self.comm, self.args.op
        codec = self.args.compression or None
        # A stable name, as a training loop's gradient buckets have: error
        # feedback keeps one residual per name (an unnamed op gets a fresh
        # "#N" name each time, hence a fresh residual allocation per op).
        name = "bench.%s.%d%s" % (op, self.bytes, ".check" if self.checking else "")
        if op == "allreduce":
            c.allreduce(self.buf, name=name, compression=codec)
        elif op == "reduce_scatter":
            c.reduce_scatter_async(self.out, self.buf, name=name, compression=codec).wait()
        elif op == "allgather":
            c.allgather(self.out, self.buf)
        elif op == "alltoall":
            c.alltoall(self.out, self.buf, name=name)
        elif op == "alltoallv":
            c.alltoall(self.out, self.buf, output_split_sizes=self.recv_splits,
                       input_split_sizes=self.send_splits, name=name)
        elif op == "broadcast":
            c.broadcast(self.buf, root=0)
        else:
            c.barrier()

    def count_errors(self):
        """Mismatching elements; with a lossy codec max |got - want| / max |want|."""
        np, op = self.np, self.args.op
        if op == "barrier":
            return 0
        if op == "allreduce":
            want = sum(benchlib.fill_value(np, r, 0, self.recv_count) for r in range(self.world))
            got = self.buf
        elif op == "reduce_scatter":
            base = self.rank * self.recv_count
            want = sum(benchlib.fill_value(np, r, base, self.recv_count) for r in range(self.world))
            got = self.out
        elif op == "broadcast":
            want = benchlib.fill_value(np, 0, 0, self.recv_count)
            got = self.buf
        elif op == "alltoall":
            want = benchlib.alltoall_expected(np, self.rank, self.send_count // self.world, 0,
                                              self.recv_count)
            got = self.out
        elif op == "alltoallv":
            want = np.concatenate([np.zeros(0, np.int64)] + [
                benchlib.fill_value(np, src, at, n)
                for src, at, n in benchlib.alltoallv_pieces(self.world, self.send_count,
                                                            self.rank)])
            got = self.out
        else:
            idx = np.arange(self.recv_count, dtype=np.int64)
            src = idx // self.send_count
            want = ((idx % self.send_count) * 3 + src * 5) % 17 - 8
            got = self.out
        if lossy(self.args):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            scale = float(np.abs(want).max()) if want.size else 0.0
            worst = float(diff.max()) if diff.size else 0.0
            return worst / scale if scale > 0 else worst
        return int((got != want.astype(self.dtype)).sum())


def worker(args):
    import numpy as np
    import ciuic

    rank = int(os.environ["CIUIC_PYBENCH_RANK"])
    world = int(os.environ["CIUIC_PYBENCH_WORLD"])
    rpn = args.ranks_per_node
    es = ELEMENT_SIZE[args.dtype]
    biggest = max(args.size_list) if args.op != "barrier" else 0
    arena = 2 * (biggest // es + world) * es + (16 << 20)
    comm = ciuic.init(rank=rank, world_size=world, local_rank=rank % rpn, local_size=rpn,
                      job=os.environ["CIUIC_PYBENCH_JOB"],
                      socket=args.socket_list[rank // rpn], arena_bytes=arena)
    times = comm.empty(args.iters + 1, np.float64)
    err = comm.empty(1, np.float64 if lossy(args) else np.int64)
    sizes = [0] if args.op == "barrier" else args.size_list
    for nbytes in sizes:
        s = SizeRun(np, comm, args, rank, world, nbytes)
        comm.barrier()
        t0 = time.perf_counter()
        s.run()
        cold = time.perf_counter() - t0
        for _ in range(args.warmup):
            s.run()
        comm.barrier()
        for i in range(args.iters):
            t0 = time.perf_counter()
            s.run()
            times[i] = time.perf_counter() - t0
        times[args.iters] = cold
        comm.allreduce(times, op="max")
        errors = None
        if args.check:
            s.fill()
            s.checking = True
            comm.barrier()
            s.run()
            err[0] = s.count_errors()
            if lossy(args):
                comm.allreduce(err, op="max")
                errors = float(err[0])
            else:
                comm.allreduce(err)
                errors = int(err[0])
        if rank == 0:
            med_us = statistics.median(times[:args.iters].tolist()) * 1e6
            print_row(args, world, s, med_us, float(times[args.iters]) * 1e6, errors)
        del s
    comm.close()


def print_row(args, world, s, time_us, cold_us, errors):
    algbw = s.bytes / (time_us * 1e3) if time_us > 0 else 0.0
    busbw = algbw * BUS_FACTOR[args.op](world)
    check = {"errors": errors}
    if lossy(args) and errors is not None:
        check = {"max_rel_error": float("%.3e" % errors)}
    if args.json:
        row = {"op": args.op, "dtype": args.dtype, "bytes": s.bytes,
               "ranks": world, "nodes": args.nodes, "time_us": round(time_us, 3),
               "algbw_gbps": float("%.6g" % algbw),
               "busbw_gbps": float("%.6g" % busbw), "cold_us": round(cold_us, 3),
               "compression": args.compression or "default"}
        row.update(check)
        print(json.dumps(row))
    else:
        print("  %10d %8s %10.2f %10.2f %8.3f %8.3f %7s"
              % (s.bytes, args.dtype, time_us, cold_us, algbw, busbw,
                 "N/A" if errors is None else
                 ("%.2e" % errors if lossy(args) else errors)))
    sys.stdout.flush()


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if "CIUIC_PYBENCH_RANK" in os.environ:
        worker(args)
        return 0
    if not args.json:
        print("# ciuic_py_bench: op %s, dtype %s, %d x %d ranks; columns: bytes dtype "
              "time_us cold_us algbw busbw #wrong" % (args.op, args.dtype, args.nodes,
                                                      args.ranks_per_node))
    return launch(args, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

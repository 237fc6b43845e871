#!/usr/bin/python3
"""gloo_bench.py: the torch.distributed/gloo baseline for ciuic-bench.

Same flags and JSON keys as ciuic-bench and ciuic-mpi-bench. Run it directly
(with Debian's /usr/bin/python3, which has torch 1.13): it starts its own
--nodes x --ranks-per-node rank processes on this machine, all meeting at
MASTER_ADDR=127.0.0.1 on a free port, and gloo carries every byte over TCP
on the loopback interface (gloo has no shared-memory transport).
With --netns ns0,ns1,... (one namespace per node, root only) rank r runs
under 'ip netns exec' in the namespace of node r // R, meeting at
--master-addr over --ifname (GLOO_SOCKET_IFNAME): compare.py --scenario netns.

Method, per size (the same as ciuic-mpi-bench):
  - tensors are allocated once per size and written before timing, so no
    timed op pays first-touch page faults;
  - one cold op timed alone (cold_us), --warmup untimed ops, one barrier,
    then --iters ops each timed with time.perf_counter(), no barrier between;
  - time_us = median over iterations of the max over ranks;
  - algbw = bytes / time; busbw = algbw * 2(n-1)/n (allreduce),
    (n-1)/n (reduce_scatter, allgather, alltoall), 1 (broadcast); GB/s = 1e9 B/s;
  - --check refills, runs one more op and counts output elements that differ
    from an expectation computed from the fill rule (errors, summed over
    ranks; null without --check).

torch 1.13's gloo has no reduce_scatter: it is emulated as an in-place
allreduce of the full buffer plus a copy of this rank's block, which is what
a gloo user has to do; those rows carry "impl": "allreduce+copy".
allreduce and broadcast are in place (gloo's only form); allgather gathers
into views of one preallocated buffer.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import benchlib
from benchlib import BUS_FACTOR, ELEMENT_SIZE, parse_size, shape_for

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "alltoallv", "broadcast",
       "barrier")
DTYPES = ("float32", "float64", "int32")
CHUNK = 1 << 22  # elements per step when filling/checking big buffers


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
    p.add_argument("--socket", help="ciuic-bench only; accepted and ignored")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds before the ranks are killed (default 600)")
    p.add_argument("--netns", default="",
                   help="network namespaces, one per node, comma separated: rank r runs "
                        "under 'ip netns exec' in the namespace of node r // R (root only)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="MASTER_ADDR: node 0's address (default 127.0.0.1)")
    p.add_argument("--ifname", default=None,
                   help="GLOO_SOCKET_IFNAME (default: $GLOO_SOCKET_IFNAME, else lo)")
    args = p.parse_args(argv)
    args.netns_list = [n for n in args.netns.split(",") if n]
    if args.netns_list and len(args.netns_list) != args.nodes:
        p.error("--netns names %d namespaces for --nodes %d" % (len(args.netns_list),
                                                                 args.nodes))
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error("bad --sizes %s" % args.sizes)
    if args.iters < 1 or args.warmup < 0 or args.nodes < 1 or args.ranks_per_node < 1:
        p.error("--iters, --nodes, --ranks-per-node must be >= 1, --warmup >= 0")
    return args


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- launcher

def launch(args, argv):
    """Starts the ranks, relays rank 0's stdout, returns the exit code."""
    world = args.nodes * args.ranks_per_node
    # With --netns node 0's namespace is fresh: any port is free there.
    port = 29500 + os.getpid() % 1000 if args.netns_list else free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({
            "GLOO_BENCH_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % args.ranks_per_node),
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": args.ifname or env.get("GLOO_SOCKET_IFNAME", "lo"),
            # One compute thread per rank: ranks already share few cores.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        })
        out = None if rank == 0 else subprocess.DEVNULL
        prefix = []
        if args.netns_list:
            prefix = ["ip", "netns", "exec", args.netns_list[rank // args.ranks_per_node]]
        procs.append(subprocess.Popen(prefix + [sys.executable, os.path.abspath(__file__)]
                                      + argv, env=env, stdout=out))
    return benchlib.supervise(procs, args.timeout, "gloo_bench")


# ------------------------------------------------------------------ worker


class SizeRun:
    """The buffers and the op of one size on one rank."""

    def __init__(self, torch, dist, args, rank, world, nbytes):
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = rank, world
        self.dtype = getattr(torch, args.dtype)
        self.send_count, self.recv_count, self.bytes = shape_for(args.op, args.dtype,
                                                                 nbytes, world)
        op = args.op
        # torch.empty + fill writes every page now, outside the timing.
        if op == "allreduce" or op == "broadcast":
            self.buf = torch.empty(self.send_count, dtype=self.dtype)
        elif op == "reduce_scatter":
            self.buf = torch.empty(self.send_count, dtype=self.dtype)
            self.out = torch.empty(self.recv_count, dtype=self.dtype)
        elif op == "allgather":
            self.buf = torch.empty(self.send_count, dtype=self.dtype)
            self.out = torch.empty(self.recv_count, dtype=self.dtype)
            self.out_views = list(self.out.split(self.send_count))
        elif op in ("alltoall", "alltoallv"):
            self.buf = torch.empty(self.send_count, dtype=self.dtype)
            self.out = torch.empty(self.recv_count, dtype=self.dtype)
        if op == "alltoallv":  # element counts to / from each rank
            total = self.send_count
            self.send_splits = [benchlib.uneven_count(world, total, rank, j) for j in range(world)]
            self.recv_splits = [benchlib.uneven_count(world, total, j, rank) for j in range(world)]
        self.fill()

    def fill(self):
        t = self.torch
        op = self.args.op
        if op == "barrier":
            return
        src_rank = 0 if op == "broadcast" else self.rank
        for start in range(0, self.send_count, CHUNK):
            n = min(CHUNK, self.send_count - start)
            if op == "broadcast" and self.rank != 0:
                self.buf[start:start + n].fill_(-1000)
            else:
                self.buf[start:start + n].copy_(benchlib.fill_value(t, src_rank, start, n))
        if op in ("reduce_scatter", "allgather", "alltoall", "alltoallv"):
            self.out.fill_(-1000)

    def run(self):
        d = self.dist
        op = self.args.op
        if op == "allreduce":
            d.all_reduce(self.buf)
        elif op == "reduce_scatter":
            d.all_reduce(self.buf)
            lo = self.rank * self.recv_count
            self.out.copy_(self.buf[lo:lo + self.recv_count])
        elif op == "allgather":
            d.all_gather(self.out_views, self.buf)
        elif op == "alltoall":
            d.all_to_all_single(self.out, self.buf)
        elif op == "alltoallv":
            d.all_to_all_single(self.out, self.buf, output_split_sizes=self.recv_splits,
                                input_split_sizes=self.send_splits)
        elif op == "broadcast":
            d.broadcast(self.buf, src=0)
        else:
            d.barrier()

    def count_errors(self):
        t = self.torch
        op = self.args.op
        if op == "barrier":
            return 0
        result = self.out if op in ("reduce_scatter", "allgather", "alltoall",
                                    "alltoallv") else self.buf
        base = self.rank * self.recv_count if op == "reduce_scatter" else 0
        errors = 0
        if op == "alltoallv":  # each sender's piece for this rank, in rank order
            into = 0
            for src, at, n in benchlib.alltoallv_pieces(self.world, self.send_count, self.rank):
                want = benchlib.fill_value(t, src, at, n)
                errors += int((result[into:into + n] != want.to(self.dtype)).sum())
                into += n
            return errors
        for start in range(0, self.recv_count, CHUNK):
            n = min(CHUNK, self.recv_count - start)
            if op in ("allreduce", "reduce_scatter"):
                want = sum(benchlib.fill_value(t, r, base + start, n) for r in range(self.world))
            elif op == "broadcast":
                want = benchlib.fill_value(t, 0, start, n)
            elif op == "alltoall":
                want = benchlib.alltoall_expected(t, self.rank, self.send_count // self.world,
                                                  start, n)
            else:  # allgather: element i came from rank i // block, index i % block
                idx = t.arange(start, start + n, dtype=t.int64)
                src = idx // self.send_count
                want = ((idx % self.send_count) * 3 + src * 5) % 17 - 8
            errors += int((result[start:start + n] != want.to(self.dtype)).sum())
        return errors


def worker(args):
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method="tcp://%s:%s" % (os.environ["MASTER_ADDR"],
                                                         os.environ["MASTER_PORT"]),
                            timeout=timedelta(seconds=args.timeout))
    if rank == 0:
        print_header(args, world)
    sizes = [0] if args.op == "barrier" else args.size_list
    for i, nbytes in enumerate(sizes):
        s = SizeRun(torch, dist, args, rank, world, nbytes)
        dist.barrier()
        t0 = time.perf_counter()
        s.run()
        cold = time.perf_counter() - t0
        for _ in range(args.warmup):
            s.run()
        dist.barrier()
        times = torch.empty(args.iters + 1, dtype=torch.float64)
        for i in range(args.iters):
            t0 = time.perf_counter()
            s.run()
            times[i] = time.perf_counter() - t0
        times[args.iters] = cold
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        errors = None
        if args.check:
            s.fill()
            dist.barrier()
            s.run()
            err = torch.tensor([s.count_errors()], dtype=torch.int64)
            dist.all_reduce(err)
            errors = int(err[0])
        if rank == 0:
            med_us = statistics.median(times[:args.iters].tolist()) * 1e6
            print_row(args, world, s, med_us, float(times[args.iters]) * 1e6, errors,
                      p99(times[:args.iters].tolist()) * 1e6)
        if i + 1 < len(sizes):
            del s, times  # the next size's buffers come after these are freed
    # torch 1.13's gloo group joins its worker threads in its destructor,
    # holding the GIL; a worker that then drops the last reference to a
    # tensor Python made waits for the GIL: a hang at exit. The last size's
    # tensors stay referenced until the group is gone.
    dist.destroy_process_group()


def print_header(args, world):
    if args.json:
        return
    print("# gloo_bench: op %s, dtype %s, %d ranks, iters %d, warmup %d, check %s"
          % (args.op, args.dtype, world, args.iters, args.warmup,
             "on" if args.check else "off"))
    print("# time: median over iters of the max over ranks; cold: first op of the size")
    print("#")
    print("# %10s %12s %8s %6s %5s %10s %10s %8s %8s %7s"
          % ("size", "count", "type", "redop", "root", "time", "cold", "algbw", "busbw",
             "#wrong"))
    print("# %10s %12s %8s %6s %5s %10s %10s %8s %8s %7s"
          % ("(B)", "(elements)", "", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", ""))
    sys.stdout.flush()


def p99(values):
    """The 99th percentile (nearest rank) of `values`."""
    v = sorted(values)
    return v[max(0, -(-99 * len(v) // 100) - 1)]


def print_row(args, world, s, time_us, cold_us, errors, p99_us=None):
    algbw = s.bytes / (time_us * 1e3) if time_us > 0 else 0.0
    busbw = algbw * BUS_FACTOR[args.op](world)
    if args.json:
        row = {"op": args.op, "dtype": args.dtype, "bytes": s.bytes, "ranks": world,
               "time_us": round(time_us, 3), "algbw_gbps": float("%.6g" % algbw),
               "busbw_gbps": float("%.6g" % busbw), "errors": errors,
               "cold_us": round(cold_us, 3)}
        if p99_us is not None:
            row["p99_us"] = round(p99_us, 3)
        if args.op == "reduce_scatter":
            row["impl"] = "allreduce+copy"
        print(json.dumps(row))
    else:
        count = s.recv_count if args.op == "allgather" else s.send_count
        redop = "sum" if args.op in ("allreduce", "reduce_scatter") else "none"
        root = 0 if args.op == "broadcast" else -1
        print("  %10d %12d %8s %6s %5d %10.2f %10.2f %8.3f %8.3f %7s"
              % (s.bytes, count, args.dtype, redop, root, time_us, cold_us, algbw, busbw,
                 "N/A" if errors is None else errors))
    sys.stdout.flush()


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if "GLOO_BENCH_RANK" in os.environ:
        worker(args)
        return 0
    if args.op == "reduce_scatter":
        print("gloo_bench: torch 1.13's gloo has no reduce_scatter; emulating it as "
              "allreduce + copy", file=sys.stderr)
    return launch(args, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

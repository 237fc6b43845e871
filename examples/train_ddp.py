#!/usr/bin/python3
"""Data-parallel training of an MLP with DDP, gradients over gloo or ciuicd.

    # its own launcher: processes on this machine (starts a ciuicd of its
    # own unless --socket or $CIUIC_SOCKET names one)
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nprocs 2 --backend ciuic
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nprocs 2 --backend gloo
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nprocs 2 --backend ciuic-pg

    # "nodes" on this machine: --nodes N starts N ciuicd (each its own socket
    # and peer port, UCX over TCP between them) and --nprocs ranks on each,
    # node-major; node 0's peer service is the coordinator
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nodes 2 --nprocs 1

    # the compute alone: one process, no DDP, same model, data and steps
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --compute-only

    # or torchrun (one process per rank; ciuicd must be running: --socket/$CIUIC_SOCKET)
    CIUIC_SOCKET=/tmp/x/ciuicd.sock PYTHONPATH=build/python \\
        torchrun --nproc_per_node 2 examples/train_ddp.py --backend ciuic

The task is synthetic and fixed by --seed: inputs x ~ N(0, 1) and targets
y = teacher(x), the teacher a random MLP. Each step every rank trains on its
own slice of the dataset. With the same seed, --backend gloo and --backend
ciuic print the same losses (within float tolerance: for 2 ranks the
averaged gradients are bit-identical).

With --backend gloo and --backend ciuic, gloo is the process group (DDP
needs one for its setup: the broadcast of the parameters); with --backend
ciuic the gradient allreduce goes through ciuic.torch.allreduce_hook
instead. With --backend ciuic-pg the process group is the torch.distributed
backend "ciuic" itself (ciuic/torch_backend.py): DDP's setup and its
gradient buckets both go through ciuicd, without a hook.

Prints rank 0's loss and the step time per step, then the median step time
(the first step, which includes DDP's bucket rebuild and first-touch costs,
is reported apart) and the final loss averaged over the ranks. The last line
on stdout is one JSON object for benchmark drivers:
{"backend": "gloo"|"ciuic"|"ciuic-pg"|"none", "nodes", "ranks", "median_step_s",
"final_loss", ...} (also "hook_mode", "params", "steps", "first_step_s",
"threads", "rank0_losses").
"""

import argparse
import json
import os
import pathlib
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


# name -> (hidden width, hidden layers); with --in-dim 256 and --out-dim 16:
# small 0.40M parameters, base 5.14M, large 25.7M (103 MB of float32
# gradients per step: communication-heavy).
MODEL_SIZES = {"small": (512, 2), "base": (1536, 3), "large": (2048, 7)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "ciuic", "ciuic-pg"), default="ciuic",
                   help="gloo: DDP over gloo; ciuic: DDP over gloo with the ciuic hook for "
                        "gradients; ciuic-pg: DDP over the torch.distributed backend "
                        "\"ciuic\" (no hook, no gloo)")
    p.add_argument("--compression", default=None,
                   help="ciuic backend: codec for gradients crossing the network between "
                        "nodes (fp16, bf16, int8, topk:RATIO, none), with error feedback")
    p.add_argument("--hook-mode", choices=("shm", "staging"), default="shm",
                   help="ciuic hook memory path (see ciuic/torch.py)")
    p.add_argument("--nodes", type=int, default=1,
                   help="own launcher: nodes simulated on this host (ciuic: one ciuicd each)")
    p.add_argument("--nprocs", "--nproc-per-node", type=int, default=2,
                   help="own launcher: ranks per node")
    p.add_argument("--compute-only", action="store_true",
                   help="one process, no DDP: the compute-alone baseline of a rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="base",
                   help="preset of --hidden/--layers: " + ", ".join(
                       f"{k} {h}x{n}" for k, (h, n) in sorted(MODEL_SIZES.items())))
    p.add_argument("--in-dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=None, help="width (default: --model-size)")
    p.add_argument("--layers", type=int, default=None,
                   help="hidden layers (default: --model-size)")
    p.add_argument("--out-dim", type=int, default=16)
    p.add_argument("--samples", type=int, default=1024, help="dataset size")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cores / ranks on this host; "
                        "--compute-only: as for one of --nodes x --nprocs ranks)")
    p.add_argument("--arena-mb", type=int, default=0,
                   help="ciuic shared memory per rank (0: 4x the gradients + 64 MiB)")
    p.add_argument("--socket", default=None, help="ciuicd control socket")
    p.add_argument("--ciuicd", default=None, help="ciuicd binary for the own launcher")
    p.add_argument("--ucx-tls", default=os.environ.get("UCX_TLS") or "tcp",
                   help="UCX_TLS of the launcher's daemons with --nodes > 1 (default: "
                        "$UCX_TLS, else tcp: the inter-node path over the network stack)")
    args = p.parse_args(argv)
    hidden, layers = MODEL_SIZES[args.model_size]
    args.hidden = hidden if args.hidden is None else args.hidden
    args.layers = layers if args.layers is None else args.layers
    if args.nodes < 1 or args.nprocs < 1:
        p.error("--nodes and --nprocs must be at least 1")
    if args.nodes > 1 and args.socket:
        p.error("--socket names one daemon; --nodes > 1 starts its own")
    return args


# ------------------------------------------------------------------ model

def mlp(in_dim, hidden, layers, out_dim):
    import torch.nn as nn
    mods, d = [], in_dim
    for _ in range(layers):
        mods += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    mods.append(nn.Linear(d, out_dim))
    return nn.Sequential(*mods)


def make_dataset(args):
    import torch
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.samples, args.in_dim, generator=g)
    torch.manual_seed(args.seed + 2)
    teacher = mlp(args.in_dim, 32, 1, args.out_dim)
    with torch.no_grad():
        y = teacher(x)
        y = (y - y.mean(0)) / (y.std(0) + 1e-6)
    return x, y


# ------------------------------------------------------------------ a rank

def run_steps(args, model, x, y, rank, world, log):
    """Trains `args.steps` steps on rank's batches of a `world`-rank job;
    returns (step times in s, losses)."""
    import torch
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    times, losses = [], []
    for step in range(args.steps):
        start = ((step * world + rank) * args.batch) % args.samples
        idx = torch.arange(start, start + args.batch) % args.samples
        xb, yb = x[idx], y[idx]
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss.item())
        if log:
            print(f"step {step:4d}  loss {losses[-1]:.6f}  time {dt * 1e3:8.1f} ms", flush=True)
    return times, losses


def summarize(args, backend, nodes, world, nparams, threads, times, losses, final):
    warm = times[1:] or times
    return {
        "backend": backend, "nodes": nodes, "ranks": world,
        "median_step_s": statistics.median(warm), "final_loss": final,
        "hook_mode": args.hook_mode if backend == "ciuic" else None,
        "compression": getattr(args, "compression", None) if backend == "ciuic" else None,
        "params": nparams, "steps": args.steps, "first_step_s": times[0], "threads": threads,
        "rank0_losses": losses,
    }


def report(summary):
    print(f"median step {summary['median_step_s'] * 1e3:.1f} ms "
          f"(first {summary['first_step_s'] * 1e3:.1f} ms); "
          f"final loss (mean over ranks) {summary['final_loss']:.6f}", flush=True)


def compute_only(args):
    """Rank 0's compute of a --nodes x --nprocs job, alone: no DDP, no
    communication (same model, data, batches and steps)."""
    import torch
    world = args.nodes * args.nprocs
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    x, y = make_dataset(args)
    torch.manual_seed(args.seed)
    net = mlp(args.in_dim, args.hidden, args.layers, args.out_dim)
    nparams = sum(p.numel() for p in net.parameters())
    print(f"train_ddp: compute only (rank 0 of {world}), {nparams / 1e6:.2f}M params, "
          f"batch {args.batch}, {threads} threads", flush=True)
    times, losses = run_steps(args, net, x, y, 0, world, True)
    summary = summarize(args, "none", 1, 1, nparams, threads, times, losses, losses[-1])
    report(summary)
    return summary


def train(args):
    """One rank of the job described by torchrun's environment."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local_world if world % local_world == 0 else None
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if args.backend == "ciuic-pg":
        import ciuic.torch  # noqa: F401  (registers the backend "ciuic")
        if args.socket:
            os.environ["CIUIC_SOCKET"] = args.socket
        if args.arena_mb:
            os.environ["CIUIC_ARENA_BYTES"] = str(args.arena_mb << 20)
        dist.init_process_group("ciuic", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    x, y = make_dataset(args)
    torch.manual_seed(args.seed)
    net = mlp(args.in_dim, args.hidden, args.layers, args.out_dim)
    nparams = sum(p.numel() for p in net.parameters())
    model = DDP(net, bucket_cap_mb=args.bucket_cap_mb)

    comm = None
    if args.backend == "ciuic":
        import ciuic
        import ciuic.torch
        arena = (args.arena_mb << 20) or (4 * 4 * nparams + (64 << 20))
        # rank, sizes, job, socket and (several nodes) the coordinator from the environment
        comm = ciuic.init(socket=args.socket, arena_bytes=arena)
        model.register_comm_hook(ciuic.torch.CiuicHookState(comm, mode=args.hook_mode,
                                                            compression=args.compression),
                                 ciuic.torch.allreduce_hook)

    if rank == 0:
        print(f"train_ddp: {world} ranks on {nodes or '?'} node(s), backend {args.backend}"
              f"{' (' + args.hook_mode + ')' if comm else ''}, {nparams / 1e6:.2f}M params, "
              f"batch {args.batch}/rank, {threads} threads/rank"
              f"{', coordinator ' + comm.coordinator if comm and comm.coordinator else ''}",
              flush=True)

    times, losses = run_steps(args, model, x, y, rank, world, rank == 0)

    last = torch.tensor([losses[-1]])
    dist.all_reduce(last)
    final = last.item() / world
    summary = summarize(args, args.backend, nodes, world, nparams, threads, times, losses, final)
    if rank == 0:
        report(summary)
    if comm is not None:
        comm.close()
    # torch 1.13's gloo group joins its worker threads in its destructor,
    # holding the GIL; a worker that drops the last reference to a tensor
    # Python made (it lets go of `last` a moment after the all_reduce
    # returns) waits for the GIL there: both wait forever, and the rank
    # hangs at exit (seen 2 runs in 30 on one busy core). So the group goes
    # (DDP's reducer holds it too) while every such tensor is still
    # referenced here.
    dist.destroy_process_group()
    del model, net
    del last
    return summary


# --------------------------------------------------------------- launcher

def free_ports(n):
    """n distinct free TCP ports: each socket stays bound until all are
    chosen, so that the kernel cannot hand out one port twice (a daemon's
    peer port equal to MASTER_PORT fails torch's store with EADDRINUSE)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_ciuicd(args):
    for c in (args.ciuicd, os.environ.get("CIUICD"), str(REPO / "build" / "daemon" / "ciuicd")):
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("train_ddp: no ciuicd binary (build it, or pass --ciuicd PATH or --socket PATH)")


def start_daemon(binary, node_name, listen=None, env=None):
    """A ciuicd in a temp dir: (process, socket path, dir, peer address or None)."""
    d = tempfile.mkdtemp(prefix="train-ddp-")
    sock = os.path.join(d, "ciuicd.sock")
    cmd = [binary, "--socket", sock, "--node-name", node_name, "--log-level", "warn"]
    if listen:
        cmd += ["--listen", listen]
    proc = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, **(env or {})))
    deadline = time.monotonic() + 20
    while not (os.path.exists(sock) and os.path.exists(sock + ".session")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"train_ddp: {binary} did not start")
        time.sleep(0.02)
    return proc, sock, d, listen


def stop_daemon(daemon):
    proc, sock, d, _ = daemon
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for f in (sock, sock + ".session"):
        if os.path.exists(f):
            os.unlink(f)
    os.rmdir(d)


def _rank_main(env, args, results, fn=None):
    os.environ.update(env)
    try:
        summary = (fn or train)(args)
        if int(env["RANK"]) == 0:
            results.put(summary)
            results.close()
            results.join_thread()
    except KeyboardInterrupt:
        sys.exit(130)


def supervise(procs, results, grace_s=20):
    """Waits for the ranks; returns (rank 0's summary or None, exit code).

    Rank 0's summary is read while waiting (a queue's writer only exits once
    its data is read). A rank that fails gets the others terminated (they
    would wait for it forever); ranks still alive `grace_s` after the summary
    or after another rank's clean exit (hung at exit) are terminated too.
    """
    summary, rc, done_at = None, 0, None
    while any(p.is_alive() for p in procs):
        try:
            summary = results.get(timeout=0.2)
            done_at = done_at or time.monotonic()
        except queue.Empty:
            pass
        if done_at is None and any(not p.is_alive() and p.exitcode == 0 for p in procs):
            done_at = time.monotonic()
        failed = [p for p in procs if not p.is_alive() and p.exitcode != 0]
        late = done_at is not None and time.monotonic() - done_at > grace_s
        if failed or late:
            if failed:
                rc = failed[0].exitcode if failed[0].exitcode > 0 else 1
                print(f"train_ddp: {failed[0].name} failed ({failed[0].exitcode}); "
                      "stopping the others", file=sys.stderr, flush=True)
            else:
                alive = ", ".join(p.name for p in procs if p.is_alive())
                print(f"train_ddp: {alive} still running {grace_s} s after the end; "
                      "stopping them", file=sys.stderr, flush=True)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            break
    for p in procs:
        p.join()
    if summary is None:
        try:
            summary = results.get(timeout=1)
        except queue.Empty:
            pass
    if rc == 0 and summary is None:
        rc = next((p.exitcode for p in procs if p.exitcode), 1)
    return summary, rc


def launch(args, fn=None):
    """Own launcher: --nodes x --nprocs ranks on this host, node-major (rank
    r on node r // nprocs). With ciuic, one daemon per node (unless one is
    named for a single node); gloo ranks simply all run on this host. Each
    rank runs fn(args) (default: train) with torchrun's environment set;
    rank 0's return value is printed as JSON."""
    import multiprocessing as mp
    world = args.nodes * args.nprocs
    if not args.threads:  # all ranks share this host's cores
        args.threads = max(1, (os.cpu_count() or 1) // world)
    ports = free_ports(1 + args.nodes)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])}
    daemons, sockets = [], [None] * args.nodes
    rc = 0
    try:
        if args.backend in ("ciuic", "ciuic-pg"):
            base["CIUIC_JOB"] = f"train-ddp-{os.getpid()}-{base['MASTER_PORT']}"
            if args.nodes > 1:
                binary = find_ciuicd(args)
                env = {"UCX_TLS": args.ucx_tls, "UCX_WARN_UNUSED_ENV_VARS": "n"}
                for k in range(args.nodes):
                    daemons.append(start_daemon(binary, f"train-ddp-node{k}",
                                                f"127.0.0.1:{ports[1 + k]}", env))
                sockets = [dm[1] for dm in daemons]
                base["CIUIC_COORDINATOR"] = daemons[0][3]
            elif args.socket is None and not os.environ.get("CIUIC_SOCKET"):
                daemons.append(start_daemon(find_ciuicd(args), "train-ddp"))
                sockets = [daemons[0][1]]
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = []
        for r in range(world):
            env = dict(base, RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(r % args.nprocs), LOCAL_WORLD_SIZE=str(args.nprocs))
            if sockets[r // args.nprocs]:
                env["CIUIC_SOCKET"] = sockets[r // args.nprocs]
            procs.append(ctx.Process(target=_rank_main, args=(env, args, results, fn),
                                     name=f"rank{r}"))
        summary = None
        try:
            for p in procs:
                p.start()
            summary, rc = supervise(procs, results)
        except KeyboardInterrupt:
            rc = 130
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
    finally:
        for dm in daemons:
            stop_daemon(dm)
    if summary is not None and rc == 0:
        print(json.dumps(summary), flush=True)  # the last line: for benchmark drivers
    return rc


def main():
    args = parse_args()
    if args.compute_only:
        print(json.dumps(compute_only(args)), flush=True)
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        summary = train(args)
        if summary and int(os.environ["RANK"]) == 0:
            print(json.dumps(summary), flush=True)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Data-parallel training of an MLP with DDP, gradients over gloo or ciuicd.

    # its own launcher: N processes on this machine (starts a ciuicd of its
    # own unless --socket or $CIUIC_SOCKET names one)
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nprocs 2 --backend ciuic
    PYTHONPATH=build/python /usr/bin/python3 examples/train_ddp.py --nprocs 2 --backend gloo

    # or torchrun (one process per rank; ciuicd must be running: --socket/$CIUIC_SOCKET)
    CIUIC_SOCKET=/tmp/x/ciuicd.sock PYTHONPATH=build/python \\
        torchrun --nproc_per_node 2 examples/train_ddp.py --backend ciuic

The task is synthetic and fixed by --seed: inputs x ~ N(0, 1) and targets
y = teacher(x), the teacher a random MLP. Each step every rank trains on its
own slice of the dataset. With the same seed, --backend gloo and --backend
ciuic print the same losses (within float tolerance: for 2 ranks the
averaged gradients are bit-identical).

gloo is the process group in both cases (DDP needs one for its setup: the
broadcast of the parameters); with --backend ciuic the gradient allreduce
goes through ciuic.torch.allreduce_hook instead.

Prints rank 0's loss and the step time per step, then the median step time
(the first step, which includes DDP's bucket rebuild and first-touch costs,
is reported apart) and the final loss averaged over the ranks.
"""

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "ciuic"), default="ciuic")
    p.add_argument("--hook-mode", choices=("shm", "staging"), default="shm",
                   help="ciuic hook memory path (see ciuic/torch.py)")
    p.add_argument("--nprocs", type=int, default=2, help="processes (own launcher)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--in-dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--out-dim", type=int, default=16)
    p.add_argument("--samples", type=int, default=1024, help="dataset size")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--arena-mb", type=int, default=0,
                   help="ciuic shared memory per rank (0: 4x the gradients + 64 MiB)")
    p.add_argument("--socket", default=None, help="ciuicd control socket")
    p.add_argument("--ciuicd", default=None, help="ciuicd binary for the own launcher")
    p.add_argument("--json", action="store_true", help="print a JSON summary line at the end")
    return p.parse_args(argv)


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

def train(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
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
        comm = ciuic.init(socket=args.socket, arena_bytes=arena)
        model.register_comm_hook(ciuic.torch.CiuicHookState(comm, mode=args.hook_mode),
                                 ciuic.torch.allreduce_hook)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"train_ddp: {world} ranks, backend {args.backend}"
              f"{' (' + args.hook_mode + ')' if comm else ''}, {nparams / 1e6:.2f}M params, "
              f"batch {args.batch}/rank, {torch.get_num_threads()} threads/rank", flush=True)

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
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.6f}  time {dt * 1e3:8.1f} ms", flush=True)

    final = torch.tensor([losses[-1]])
    dist.all_reduce(final)
    final = final.item() / world
    warm = times[1:] or times
    summary = {
        "backend": args.backend if comm is None else f"ciuic/{args.hook_mode}",
        "ranks": world, "params": nparams, "steps": args.steps,
        "median_step_ms": statistics.median(warm) * 1e3, "first_step_ms": times[0] * 1e3,
        "final_loss": final, "rank0_losses": losses,
    }
    if rank == 0:
        print(f"median step {summary['median_step_ms']:.1f} ms (first {times[0] * 1e3:.1f} ms); "
              f"final loss (mean over ranks) {final:.6f}", flush=True)
        if args.json:
            print("JSON " + json.dumps(summary), flush=True)
    if comm is not None:
        comm.close()
    dist.destroy_process_group()
    return summary


# --------------------------------------------------------------- launcher

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_ciuicd(args):
    for c in (args.ciuicd, os.environ.get("CIUICD"), str(REPO / "build" / "daemon" / "ciuicd")):
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("train_ddp: no ciuicd binary (build it, or pass --ciuicd PATH or --socket PATH)")


def start_daemon(binary):
    d = tempfile.mkdtemp(prefix="train-ddp-")
    sock = os.path.join(d, "ciuicd.sock")
    proc = subprocess.Popen([binary, "--socket", sock, "--node-name", "train-ddp",
                             "--log-level", "warn"], start_new_session=True)
    deadline = time.monotonic() + 20
    while not (os.path.exists(sock) and os.path.exists(sock + ".session")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"train_ddp: {binary} did not start")
        time.sleep(0.02)
    return proc, sock, d


def _rank_main(rank, world, env, args):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    try:
        train(args)
    except KeyboardInterrupt:
        sys.exit(130)


def launch(args):
    import multiprocessing as mp
    daemon = None
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if args.backend == "ciuic":
        env["CIUIC_JOB"] = f"train-ddp-{os.getpid()}-{env['MASTER_PORT']}"
        if args.socket is None and not os.environ.get("CIUIC_SOCKET"):
            daemon = start_daemon(find_ciuicd(args))
            args.socket = daemon[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, args.nprocs, env, args))
             for r in range(args.nprocs)]
    rc = 0
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            rc = rc or p.exitcode
    except KeyboardInterrupt:
        rc = 130
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    finally:
        if daemon is not None:
            proc, sock, d = daemon
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            for f in (sock, sock + ".session"):
                if os.path.exists(f):
                    os.unlink(f)
            os.rmdir(d)
    return rc


def main():
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        train(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""ZeRO-2-style data-parallel training on plain torch.distributed calls.

    # one node, 4 ranks started by the example itself (ciuicd running; its
    # socket in $CIUIC_SOCKET)
    PYTHONPATH=build/python /usr/bin/python3 examples/train_zero2.py --nprocs 4 --check

    # or torchrun (Debian's torchrun of torch 1.13 fails in its own launcher
    # on Python 3.11: AttributeError in elastic/multiprocessing/api.py to_map)
    PYTHONPATH=build/python torchrun --nproc_per_node 4 examples/train_zero2.py --check

    # Slurm: srun starts the ranks (see the README's srun example)
    srun --ntasks-per-node 4 python3 examples/train_zero2.py

Every rank holds the whole model (as in data parallelism) in one flat
parameter buffer, cut into world-size equal shards; rank r owns shard r.
Each step:
  1. forward and backward on the rank's own batch, gradients into one flat
     gradient buffer;
  2. ``reduce_scatter_tensor(op=AVG)``: each rank receives only the averaged
     gradient of its own shard (the ZeRO-2 part: no rank ever holds the
     whole averaged gradient);
  3. SGD with momentum and weight decay on the owned shard only, its
     momentum buffer a shard too (the optimizer state is sharded: ZeRO-1);
  4. ``all_gather_into_tensor``: every rank gets every updated shard back
     into its flat parameters.
(The gradient reduce-scatter runs once after backward over the whole flat
buffer; a production ZeRO-2 would reduce-scatter bucket by bucket during
backward to overlap it with compute and free each bucket after.)

torch 1.13's gloo backend has no reduce_scatter, so this runs on the "ciuic"
backend (``import ciuic.torch``) or NCCL; ``--backend`` picks it.

``--check`` (rank 0) also trains the same model in one process on the
concatenated batches of all ranks with torch.optim.SGD and prints the
largest relative difference of the parameters (AVG of equal per-rank batch
means is the mean over the concatenated batch). The last line on stdout is
a JSON object: {"backend", "ranks", "steps", "final_loss", "max_rel_diff",
"params", "first_step_s", "median_step_s"} (the median over the steps after
the first).
"""

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 24, 64, 6


def build_model(seed, hidden=HIDDEN):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, OUT))


def batch(seed, step, rank, size):
    """Rank `rank`'s batch of step `step`: the same on every run."""
    g = torch.Generator().manual_seed(seed * 100003 + step * 1009 + rank)
    x = torch.randn(size, IN, generator=g)
    y = torch.sin(x[:, :OUT] * 2.0) + 0.1 * torch.randn(size, OUT, generator=g)
    return x, y


def train(steps=10, seed=0, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3,
          group=None, hidden=HIDDEN):
    """ZeRO-2 training on `group` (None: the default group). Returns
    {"params": {name: tensor}, "losses": [mean loss over ranks per step],
    "step_s": [seconds per step]}."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = build_model(seed, hidden)
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    shard = math.ceil(numel / world)
    flat = torch.zeros(shard * world)       # all parameters, padded to world shards
    flat_grad = torch.zeros(shard * world)  # all gradients of this rank's batch
    at = 0
    for _, p in named:  # the parameters and their gradients become views of the flat buffers
        n = p.numel()
        flat[at:at + n].copy_(p.data.reshape(-1))
        p.data = flat[at:at + n].view_as(p)
        p.grad = flat_grad[at:at + n].view_as(p)
        at += n
    mine = slice(rank * shard, (rank + 1) * shard)
    grad_shard = torch.zeros(shard)
    momentum_shard = torch.zeros(shard)
    losses, step_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = batch(seed, step, rank, batch_size)
        loss = torch.nn.functional.mse_loss(model(x), y)
        flat_grad.zero_()
        loss.backward()
        dist.reduce_scatter_tensor(grad_shard, flat_grad, op=dist.ReduceOp.AVG, group=group)
        params = flat[mine]
        grad_shard.add_(params, alpha=weight_decay)
        if step == 0:
            momentum_shard.copy_(grad_shard)
        else:
            momentum_shard.mul_(momentum).add_(grad_shard)
        updated = params - lr * momentum_shard
        dist.all_gather_into_tensor(flat, updated, group=group)
        mean_loss = loss.detach().reshape(1)
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG, group=group)
        losses.append(float(mean_loss))
        step_s.append(time.perf_counter() - t0)
    return {"params": {name: p.detach().clone() for name, p in named}, "losses": losses,
            "step_s": step_s}


def train_single(world, steps=10, seed=0, batch_size=8, lr=0.1, momentum=0.9,
                 weight_decay=1e-3, hidden=HIDDEN):
    """The same training in one process on the concatenated batches of
    `world` ranks, with torch.optim.SGD."""
    model = build_model(seed, hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                          weight_decay=weight_decay)
    losses = []
    for step in range(steps):
        xs, ys = zip(*(batch(seed, step, r, batch_size) for r in range(world)))
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "losses": losses}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="ciuic")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="width of the hidden layers")
    p.add_argument("--check", action="store_true",
                   help="rank 0: compare with one process on the concatenated batches")
    p.add_argument("--nprocs", type=int, default=0,
                   help="start this many ranks on this machine (torchrun's variables set "
                        "for each); 0: this process is one rank of a launcher's job")
    args = p.parse_args(argv)
    if args.nprocs:
        return launch(args.nprocs, [a for a in (argv if argv is not None else sys.argv[1:])])
    if args.backend == "ciuic":
        import ciuic
        import ciuic.torch  # noqa: F401  (registers the backend)
        env = ciuic.launch_env()  # torchrun's variables, else Slurm's
        dist.init_process_group(
            "ciuic", rank=-1 if env["rank"] is None else env["rank"],
            world_size=-1 if env["world_size"] is None else env["world_size"])
    else:
        dist.init_process_group(args.backend)
    result = train(steps=args.steps, seed=args.seed, batch_size=args.batch, hidden=args.hidden)
    times = result["step_s"]
    out = {"backend": args.backend, "ranks": dist.get_world_size(), "steps": args.steps,
           "final_loss": result["losses"][-1], "max_rel_diff": None,
           "params": sum(p.numel() for p in result["params"].values()),
           "first_step_s": times[0] if times else None,
           # the first step pays the job's setup: the median is of the others
           "median_step_s": statistics.median(times[1:] if len(times) > 1 else times)
           if times else None}
    if dist.get_rank() == 0:
        for step, loss in enumerate(result["losses"]):
            print(f"step {step}: loss {loss:.6f}")
        if args.check:
            ref = train_single(dist.get_world_size(), steps=args.steps, seed=args.seed,
                               batch_size=args.batch, hidden=args.hidden)
            out["max_rel_diff"] = max(
                float((p - ref["params"][n]).abs().max() /
                      ref["params"][n].abs().max().clamp_min(1e-12))
                for n, p in result["params"].items())
        print(json.dumps(out))
    dist.destroy_process_group()


def launch(nprocs, argv):
    """Runs this script as `nprocs` ranks of one job on this machine, with
    torchrun's variables (a free MASTER_PORT); returns the worst exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rest = []
    skip = False
    for a in argv:  # drop --nprocs N / --nprocs=N
        if skip:
            skip = False
        elif a == "--nprocs":
            skip = True
        elif not a.startswith("--nprocs="):
            rest.append(a)
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + rest,
                                      env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())

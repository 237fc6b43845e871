#!/usr/bin/python3
"""DDP training that evens out a slow rank: each rank's share of the global
batch follows its measured speed (ciuic's Communicator.balance()), between
epochs.

    # 2 "nodes" on this host (one ciuicd each, UCX over TCP), rank 1 slow
    PYTHONPATH=build/python /usr/bin/python3 examples/train_balanced.py --nodes 2 --nprocs 1
    # the same run with equal batches
    PYTHONPATH=build/python /usr/bin/python3 examples/train_balanced.py --nodes 2 --nprocs 1 \\
        --no-balance
    # both, --reps times each, interleaved: medians and the ratio
    PYTHONPATH=build/python /usr/bin/python3 examples/train_balanced.py --compare --reps 3

    # or torchrun (ciuicd running: --socket/$CIUIC_SOCKET)
    torchrun --nproc_per_node 2 examples/train_balanced.py

Every step trains on the same global batch of --global-batch samples
whatever the split: the ranks take consecutive slices of it, and each rank's
loss is weighted by its slice's size, so that DDP's average of the ranks'
gradients is the gradient of the whole batch. The split changes who computes
what, not what is computed (the losses agree with an equal split up to the
order of float sums).

Rank --slow-rank is made slower per sample, as a slower or busier GPU would
be: after its forward pass it busy-loops --slow-ms-per-sample for each
sample of its slice. At the end of each epoch every rank calls
comm.balance(samples=...) (all ranks, also with --no-balance, so both runs
pay for it); with balancing the next epoch's split is its split(). Rank 0
prints each epoch's table (who waited, each rank's share of the step time,
speed) and the split.

The last line on stdout is one JSON object: {"balance", "samples_per_s" (the
whole job: samples over wall time from the first step to the last),
"samples_per_s_after_first" (epochs 2..), "epoch_s", "splits", "slowest"
(per epoch, as balance() named it), "final_loss", ...}.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_ddp  # noqa: E402  (the model, the data and the own launcher)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2,
                   help="own launcher: nodes simulated on this host (one ciuicd each)")
    p.add_argument("--nprocs", "--nproc-per-node", type=int, default=1,
                   help="own launcher: ranks per node")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=128, help="samples per step, all ranks")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms-per-sample", type=float, default=0.4,
                   help="extra compute of the slow rank per sample of its slice (busy loop)")
    p.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                   help="split each epoch's batches by balance() (--no-balance: equal)")
    p.add_argument("--compare", action="store_true",
                   help="run --no-balance and --balance --reps times each, interleaved, and "
                        "print the medians and their ratio")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--in-dim", type=int, default=256)
    p.add_argument("--out-dim", type=int, default=16)
    p.add_argument("--samples", type=int, default=4096, help="dataset size")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cores / ranks on this host)")
    p.add_argument("--socket", default=None, help="ciuicd control socket")
    p.add_argument("--ciuicd", default=None, help="ciuicd binary for the own launcher")
    p.add_argument("--ucx-tls", default=os.environ.get("UCX_TLS") or "tcp",
                   help="UCX_TLS of the launcher's daemons with --nodes > 1")
    args = p.parse_args(argv)
    world = args.nodes * args.nprocs
    if args.nodes < 1 or args.nprocs < 1:
        p.error("--nodes and --nprocs must be at least 1")
    if not 0 <= args.slow_rank < world:
        p.error(f"--slow-rank must be a rank of the {world}")
    if args.global_batch < world:
        p.error(f"--global-batch must give each of the {world} ranks a sample")
    if args.nodes > 1 and args.socket:
        p.error("--socket names one daemon; --nodes > 1 starts its own")
    args.backend = "ciuic"  # for train_ddp.launch: one ciuicd per node
    return args


def busy_loop(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def train(args):
    """One rank (torchrun's environment)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuic
    import ciuic.torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # DDP's setup only

    x, y = train_ddp.make_dataset(args)
    torch.manual_seed(args.seed)
    net = train_ddp.mlp(args.in_dim, args.hidden, args.layers, args.out_dim)
    nparams = sum(p.numel() for p in net.parameters())
    model = DDP(net)
    comm = ciuic.init(socket=args.socket, arena_bytes=4 * 4 * nparams + (64 << 20))
    model.register_comm_hook(ciuic.torch.CiuicHookState(comm), ciuic.torch.allreduce_hook)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    G = args.global_batch
    split = [G // world + (1 if r < G % world else 0) for r in range(world)]
    slow_s = args.slow_ms_per_sample / 1e3 if rank == args.slow_rank else 0.0
    if rank == 0:
        print(f"train_balanced: {world} ranks, {nparams / 1e6:.2f}M params, global batch {G}, "
              f"rank {args.slow_rank} slower by {args.slow_ms_per_sample} ms per sample, "
              f"balancing {'on' if args.balance else 'off'}", flush=True)
    comm.balance()  # the first window starts with the first step
    dist.barrier()
    t_start = time.perf_counter()
    epoch_s, splits, slowest, losses = [], [], [], []
    step = 0
    for epoch in range(args.epochs):
        t_epoch = time.perf_counter()
        splits.append(list(split))
        first = sum(split[:rank])
        for _ in range(args.steps_per_epoch):
            base = (step * G) % args.samples
            idx = (torch.arange(first, first + split[rank]) + base) % args.samples
            out = model(x[idx])
            busy_loop(slow_s * split[rank])
            # Weighted by the slice: DDP averages the ranks' gradients, which
            # then is the gradient of the mean loss over all G samples.
            loss = torch.nn.functional.mse_loss(out, y[idx]) * (split[rank] * world / G)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            losses.append(loss.item() * G / (split[rank] * world))
            step += 1
        b = comm.balance(samples=split[rank] * args.steps_per_epoch)
        epoch_s.append(time.perf_counter() - t_epoch)
        slowest.append(b.slowest)
        if rank == 0:
            print(f"epoch {epoch}: {epoch_s[-1]:.3f} s, split {split}, "
                  f"{G * args.steps_per_epoch / epoch_s[-1]:.0f} samples/s\n{b.table()}",
                  flush=True)
        if args.balance:
            split = b.split(G, minimum=1)
    wall = time.perf_counter() - t_start

    # The loss of the whole global batch, the mean over ranks weighted by slice.
    last = torch.tensor([losses[-1] * splits[-1][rank] / G])
    dist.all_reduce(last)
    total = G * args.steps_per_epoch * args.epochs
    after = G * args.steps_per_epoch * (args.epochs - 1)
    summary = {
        "balance": args.balance, "ranks": world, "slow_rank": args.slow_rank,
        "slow_ms_per_sample": args.slow_ms_per_sample, "global_batch": G,
        "epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch,
        "samples_per_s": total / wall,
        "samples_per_s_after_first": after / sum(epoch_s[1:]) if args.epochs > 1 else None,
        "epoch_s": epoch_s, "splits": splits, "slowest": slowest,
        "final_loss": last.item(), "params": nparams,
    }
    if rank == 0:
        print(f"{total} samples in {wall:.2f} s: {summary['samples_per_s']:.0f} samples/s; "
              f"final loss {summary['final_loss']:.6f}", flush=True)
    comm.close()
    dist.destroy_process_group()  # see train_ddp.train on why before the tensors go
    del model, net, last
    return summary


def compare(args):
    """--reps runs of each mode, interleaved; a table of medians and the ratio."""
    runs = {False: [], True: []}
    base = [sys.executable, os.path.abspath(__file__)] + [
        a for a in sys.argv[1:] if a not in ("--compare", "--balance", "--no-balance")]
    for rep in range(args.reps):
        for mode in (False, True):
            cmd = base + ["--balance" if mode else "--no-balance"]
            print(f"[{rep + 1}/{args.reps}] {'balanced' if mode else 'equal'} ...", flush=True,
                  file=sys.stderr)
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                sys.exit(f"train_balanced: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for mode in (False, True):
        rows.append({
            "mode": "balanced" if mode else "equal batches",
            "samples_per_s": statistics.median(r["samples_per_s"] for r in runs[mode]),
            "samples_per_s_after_first": statistics.median(
                r["samples_per_s_after_first"] for r in runs[mode]),
            "final_split": runs[mode][-1]["splits"][-1],
            "final_loss": statistics.median(r["final_loss"] for r in runs[mode]),
        })
    ratio = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    ratio_after = rows[1]["samples_per_s_after_first"] / rows[0]["samples_per_s_after_first"]
    print(f"{'mode':<14} {'samples/s':>10} {'after 1st':>10} {'final loss':>11}  last split")
    for r in rows:
        print(f"{r['mode']:<14} {r['samples_per_s']:>10.0f} {r['samples_per_s_after_first']:>10.0f}"
              f" {r['final_loss']:>11.6f}  {r['final_split']}")
    print(f"balanced / equal: {ratio:.2f}x over the job, {ratio_after:.2f}x after the first "
          f"epoch (medians of {args.reps})")
    print(json.dumps({"rows": rows, "ratio": ratio, "ratio_after_first": ratio_after,
                      "reps": args.reps, "runs": {"equal": runs[False],
                                                  "balanced": runs[True]}}), flush=True)
    return 0


def main():
    args = parse_args()
    if args.compare:
        return compare(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        summary = train(args)
        if int(os.environ["RANK"]) == 0:
            print(json.dumps(summary), flush=True)
        return 0
    return train_ddp.launch(args, train)


if __name__ == "__main__":
    sys.exit(main())

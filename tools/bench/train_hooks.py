#!/usr/bin/python3
"""train_hooks.py: one rank of examples/train_ddp.py with a torch DDP hook, or
without DDP at all; used by compare.py --scenario train (train_compare.py).

    train_hooks.py --mode MODE --script examples/train_ddp.py -- TRAIN_DDP_ARGS...

MODE
  plain     train_ddp.py as it is (plain DDP over gloo; or --backend ciuic)
  fp16      DDP + torch's fp16_compress_hook (default_hooks)
  powersgd  DDP + torch's powerSGD_hook (rank 1, start_powerSGD_iter 2)
  compute   no DDP: the model itself, so one process measures compute alone

train_ddp.py is loaded as a module and its main() runs with TRAIN_DDP_ARGS;
it takes its rank from torchrun's environment (RANK, WORLD_SIZE, ...), which
the caller sets. The hooks are attached by replacing
torch.nn.parallel.DistributedDataParallel, which train_ddp.py imports inside
train(), with a subclass that registers the hook in its constructor; so the
model, data and step loop are exactly train_ddp.py's in every mode.
"""

import argparse
import importlib.util
import os
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", required=True, choices=("plain", "fp16", "powersgd", "compute"))
    p.add_argument("--script", required=True, help="path of examples/train_ddp.py")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest

    import torch.nn.parallel as tnp
    base = tnp.DistributedDataParallel

    if args.mode == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        class Hooked(base):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.register_comm_hook(None, default_hooks.fp16_compress_hook)
        tnp.DistributedDataParallel = Hooked
    elif args.mode == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

        class Hooked(base):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                               start_powerSGD_iter=2)
                self.register_comm_hook(state, powerSGD.powerSGD_hook)
        tnp.DistributedDataParallel = Hooked
    elif args.mode == "compute":
        def no_ddp(module, *a, **kw):
            return module
        tnp.DistributedDataParallel = no_ddp

    spec = importlib.util.spec_from_file_location("train_ddp", args.script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.argv = [args.script] + rest
    sys.stdout.flush()
    return mod.main() or 0


if __name__ == "__main__":
    sys.exit(main())

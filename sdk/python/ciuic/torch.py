"""ciuic for torch: the torch.distributed backend "ciuic" and a DDP
communication hook.

Importing this module registers the backend (ciuic/torch_backend.py):

    import torch.distributed as dist, ciuic.torch
    dist.init_process_group("ciuic")         # every collective through ciuicd
    model = DDP(net)                         # no hook needed

The hook, for ``DistributedDataParallel.register_comm_hook``, sends DDP's
gradient buckets through a ciuic communicator under any process group:

    dist.init_process_group("gloo")          # DDP's setup traffic
    comm = ciuic.init()                      # or ciuic.torch.communicator() under "ciuic"
    model = DDP(net)
    model.register_comm_hook(ciuic.torch.CiuicHookState(comm), ciuic.torch.allreduce_hook)

The process group keeps DDP's own setup traffic (the broadcast of parameters
and buffers at construction); every gradient bucket goes through the daemon,
averaged (ReduceOp avg: for 2 ranks bit-identical to DDP's divide-then-sum).

Names and priority. Each bucket's operation is named
``<prefix>.b<bucket index>.<n>``, n counting that bucket's calls, so ranks
match operations by name whatever order their buckets become ready in. DDP
orders buckets in reverse parameter order: bucket 0 holds the last layers'
gradients and is ready first in backward, the highest index (``is_last()``)
last. The default priority is ``-index``: among operations ready in the
daemon at the same time, the earlier-ready bucket goes first, which
completes the whole backward soonest (DDP waits for all buckets before the
optimizer step, so finishing the first layers early gains nothing).
Pass ``priority=callable(bucket) -> int`` to change it.

Memory paths (``mode``), measured in sdk/python/README.md:
- "shm" (default): each bucket is copied into a per-bucket tensor in the
  daemon's shared memory (allocated once, cached by bucket index, size and
  dtype; no page faults after the first step), reduced there in place (zero
  copy for the daemon), and that tensor is the hook's result: DDP copies the
  result into the parameters' .grad itself, so nothing is copied back.
- "staging": hands ``bucket.buffer()`` itself to the SDK, which copies it
  into a staging region of its arena and back on completion (one more copy).
CUDA buckets (a model on a GPU) ignore ``mode``: the bucket is reduced in
place in device memory by the daemon (CUDA IPC; see the
README for what has run on a GPU).
"""

import itertools

import torch

import ciuic
from ciuic.torch_backend import (BACKEND, ProcessGroupCiuic, close_all,  # noqa: F401
                                 communicator, register)

__all__ = ["CiuicHookState", "allreduce_hook", "register", "communicator", "close_all",
           "ProcessGroupCiuic", "BACKEND"]

# `import ciuic.torch` makes dist.init_process_group("ciuic") work.
register()

_state_ids = itertools.count()


class CiuicHookState:
    """State of :func:`allreduce_hook`: the communicator and per-bucket data.

    comm: a ciuic.Communicator of the same ranks as the DDP process group.
    mode: "shm" (default) or "staging" (see the module doc).
    op: "avg" (default: DDP semantics) or "sum".
    prefix: operation name prefix; distinct per DDP model when several
        models share a communicator (default "ddp<k>", k counting the
        states made in this process, so identical on every rank if all
        ranks build their models in the same order).
    priority: None (-bucket index) or callable(bucket) -> int.
    timeout: seconds per operation (None: the daemon's default).
    compression: codec for what crosses the network between nodes ("fp16",
        "bf16", "int8", "topk:RATIO", "none"; None: the daemon's setting).
        With a codec, each bucket's operation keeps one name across steps
        ("<prefix>.b<index>") so that the daemon's error feedback carries
        what compression dropped in one step into the next.
    """

    def __init__(self, comm, mode="shm", op="avg", prefix=None, priority=None, timeout=None,
                 compression=None):
        if mode not in ("shm", "staging"):
            raise ValueError(f"mode must be 'shm' or 'staging', not {mode!r}")
        self.comm = comm
        self.mode = mode
        self.op = op
        self.prefix = prefix if prefix is not None else f"ddp{next(_state_ids)}"
        self.priority = priority
        self.timeout = timeout
        self.compression = compression
        self.calls = {}   # bucket index -> calls so far
        self.shm = {}     # bucket index -> shared-memory tensor (mode "shm")

    def __getstate__(self):  # DDP may pickle hook states; the comm cannot be
        raise TypeError("CiuicHookState holds a live communicator and cannot be pickled")

    def _shm_tensor(self, index, like):
        t = self.shm.get(index)
        if t is None or t.numel() != like.numel() or t.dtype != like.dtype:
            self.shm.pop(index, None)  # frees the old region first (buckets are rebuilt once)
            t = self.comm.empty((like.numel(),), like.dtype)
            self.shm[index] = t
        return t


def allreduce_hook(state, bucket):
    """DDP comm hook: averages ``bucket.buffer()`` over the ranks through ciuicd.

    Returns a torch.futures.Future completed (by the communicator's waiter
    thread) with the averaged gradients.
    """
    index = bucket.index()
    n = state.calls.get(index, 0)
    state.calls[index] = n + 1
    name = f"{state.prefix}.b{index}" if state.compression else f"{state.prefix}.b{index}.{n}"
    priority = -index if state.priority is None else int(state.priority(bucket))
    grads = bucket.buffer()
    if grads.is_cuda:
        # CUDA buckets go to the daemon as device buffers, reduced in place
        # (after the work on torch's current stream); `mode` is for CPU ones.
        target = grads
    elif state.mode == "shm":
        target = state._shm_tensor(index, grads)
        target.copy_(grads.view(-1))
    else:
        target = grads
    work = state.comm.allreduce_async(target, op=state.op, name=name, priority=priority,
                                      timeout=state.timeout, compression=state.compression)
    return work.get_future()

"""ciuic as a torch.distributed backend: ``dist.init_process_group("ciuic")``.

    import torch.distributed as dist
    import ciuic.torch                       # registers the backend "ciuic"
    dist.init_process_group("ciuic")         # torchrun's or Slurm's environment
    dist.all_reduce(t)                       # through the node's ciuicd
    tp = dist.new_group([0, 1])              # a ciuic job of its own

Every process group is a ciuic job: the world group the job of
``ciuic.init()`` (job id, coordinator and node-local layout from the
launcher's environment, see ciuic.launch_env), a group of ``new_group(ranks)``
the job "<world job>.g<group id>" of its members (torch numbers groups in
creation order, the same on every rank). The daemons do the rendezvous and
the collectives; torch's store is used only to learn, at group creation,
which members share a node (each member writes "<host>|<daemon socket>"),
where the launcher's environment does not say it, and for a job id when the
environment names none.

Collectives run as unnamed ciuic operations, matched by submission order
as torch matches collectives (the same sequence on every member; a rank
calling another collective than the others gets the daemon's mismatch
error), so that small allreduces and barriers between nodes run without the
daemons' coordinator (daemon/cluster/README.md, "Direct operations"). Each
call is labelled "torch.<n>", n counting the group's calls, in the errors
its Work raises. The group's timeout, or the call's when it gives one, is
the operation's timeout. Tensors: CPU or
CUDA (the SDK's device path; not yet run on a GPU through this backend), one
per call (torch's per-device lists must have length 1).
Reductions take the ciuic dtypes (float32, float64, float16, bfloat16, int8,
uint8, int32, int64); the collectives that only move data take any dtype
(moved as bytes). See the README's table for what is refused and why.

torch 1.13 (the version on the build machines) hands a Python backend
``_DistributedBackendOptions``; torch 2.x also takes ``devices=`` at
registration and uses a ProcessGroup subclass as it is: register() passes
``devices`` where register_backend has it. torch 2.x is not installed on the
build machines, so that path is written to its documented API but untested.
"""

import collections
import datetime
import inspect
import itertools
import os
import socket as _socket
import threading
import time
import uuid
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup
from torch._C._distributed_c10d import Work as _TorchWork

import ciuic
from ciuic.errors import (CancelledError, DeadlineExceededError, InvalidArgumentError,
                          UnimplementedError)

__all__ = ["BACKEND", "register", "ProcessGroupCiuic", "CiuicWork", "communicator", "close_all"]

BACKEND = "ciuic"

# The dtypes ciuic reduces; the others are moved as bytes (data movement only).
_REDUCIBLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int32, torch.int64}

# Completed works kept referenced after completion: torch 1.13 keeps no
# reference to the Python object of a Work that a Python ProcessGroup returns
# to C++ (DDP's construction, the reducer), and once that object is gone a
# C++ wait() on it falls back to the base Work::wait, which never returns.
# C++ callers wait right after the call; these last ones stay alive for that.
_KEEP_COMPLETED = 32

_register_lock = threading.Lock()
_groups = weakref.WeakSet()


def _reduce_op(op, what):
    """ciuic's name of a torch ReduceOp; a clear refusal for the others."""
    R = dist.ReduceOp
    for torch_op, name in ((R.SUM, "sum"), (R.AVG, "avg"), (R.PRODUCT, "prod"),
                           (R.MIN, "min"), (R.MAX, "max")):
        if op == torch_op:
            return name
    if op == R.PREMUL_SUM:
        raise UnimplementedError(
            f"{what}: ReduceOp.PREMUL_SUM is not a ciuic reduction: multiply the tensor by "
            "the factor first, then reduce with SUM")
    for torch_op, name in ((R.BAND, "BAND"), (R.BOR, "BOR"), (R.BXOR, "BXOR")):
        if op == torch_op:
            raise UnimplementedError(
                f"{what}: ReduceOp.{name}: ciuic has no bitwise reductions (SUM, AVG, PRODUCT, "
                "MIN and MAX only); for 0/1 flags MAX is a logical or and MIN a logical and")
    raise InvalidArgumentError(f"{what}: unknown reduce op {op!r}")


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what}: {t.layout} tensors are not supported (dense only)")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{what}: tensor on {t.device}; ciuic takes CPU and CUDA")
    return t


def _check_reducible(t, what):
    if t.dtype not in _REDUCIBLE:
        raise InvalidArgumentError(
            f"{what}: dtype {t.dtype} cannot be reduced by ciuic (float32, float64, float16, "
            "bfloat16, int8, uint8, int32, int64); the collectives that only move data "
            "(broadcast, all_gather, all_to_all, scatter, gather) take any dtype")


def _single(tensors, what):
    """The one tensor of torch's per-device list."""
    if len(tensors) != 1:
        raise InvalidArgumentError(
            f"{what}: {len(tensors)} tensors in the list; ciuic takes one tensor per process "
            "(torch's multi-device lists must have length 1)")
    return _check_tensor(tensors[0], what)


def _same_dtype(tensors, dtype, what):
    for i, x in enumerate(tensors):
        _check_tensor(x, what)
        if x.dtype != dtype:
            raise InvalidArgumentError(f"{what}: tensor {i} is {x.dtype}, the input {dtype}")


def _flat(t):
    """A 1-D contiguous view of ``t`` if it is contiguous, else a 1-D copy."""
    return t.contiguous().view(-1)


def _movable(flat):
    """``flat`` (1-D, contiguous) as the SDK takes it: itself for a ciuic
    dtype, else its bytes (data movement only)."""
    return flat if flat.dtype in _REDUCIBLE else flat.view(torch.uint8)


def _inplace(t):
    """(a contiguous tensor holding ``t``, the copy back into ``t`` or None)."""
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, (lambda: t.copy_(c))


def _seconds(timeout):
    """Seconds of a Work.wait timeout (timedelta or number); None: no limit
    (torch's default timedelta(0) means none)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


class CiuicWork(_TorchWork):
    """A torch Work over one or more ciuic operations.

    ``wait(timeout)`` raises the operations' error (ciuic.Error subclasses:
    InvalidArgumentError for a mismatch, DeadlineExceededError for an
    operation timeout, ...) on this rank; with a timeout it raises
    DeadlineExceededError if the operations are still running when it
    passes. ``get_future()`` is completed with the output tensors, or with
    the error. ``finish`` (copies into the caller's tensors of the results
    staged in temporary ones) runs once, after every operation succeeded,
    before wait() returns or the future completes."""

    def __init__(self, what, works, outputs, finish=()):
        super().__init__()
        self._what = what
        self._works = works
        self._outputs = outputs
        self._finish = [f for f in finish if f is not None]
        self._lock = threading.Lock()
        self._finished = False
        self._future = None
        self._future_lock = threading.Lock()  # apart: a done future's then() runs at once

    def _complete(self):
        with self._lock:
            if not self._finished:
                for f in self._finish:
                    f()
                self._finish = []
                self._finished = True

    def _labelled(self, e):
        """`e` with this call's label first: the daemon names the unnamed
        operation "#N", which does not say which torch call it was."""
        return type(e)(f"{self._what}: {e.message}", code=e.code)

    def wait(self, timeout=None):
        limit = _seconds(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        for w in self._works:
            left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
            try:
                done = w.wait(left)
            except ciuic.Error as e:
                raise self._labelled(e) from e
            if not done:
                raise DeadlineExceededError(
                    f"operation '{self._what}': still running after Work.wait's timeout of "
                    f"{limit} s (the operation goes on)")
        self._complete()
        return True

    def is_completed(self):
        if not all(w.is_completed() for w in self._works):
            return False
        try:
            self.wait()
        except ciuic.Error:
            pass  # completed with an error: wait() raises it
        return True

    def is_success(self):
        if not self.is_completed():
            raise InvalidArgumentError(f"{self._what}: is_success() before completion")
        try:
            self.wait()
        except ciuic.Error:
            return False
        return True

    def exception(self):
        try:
            self.wait()
        except ciuic.Error as e:
            return e
        return None

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self):
        raise UnimplementedError(f"{self._what}: source_rank() is for recv from any source, "
                                 "which ciuic does not have")

    def synchronize(self):
        """Nothing to order on a stream: the SDK orders the daemon's device
        work after torch's current stream at submission, and wait() returns
        once that work has finished."""

    def get_future(self):
        with self._future_lock:
            if self._future is None:
                self._future = self._make_future()
            return self._future

    def _make_future(self):
        futs = [w.get_future() for w in self._works]

        def done(fut):
            try:
                values = fut.value()  # raises the error of a single operation
                for f in (values if isinstance(values, list) and len(futs) > 1 else ()):
                    f.value()  # collect_all: raises the first operation's error
            except ciuic.Error as e:
                raise self._labelled(e) from e
            self._complete()
            return self._outputs

        if not futs:
            f = torch.futures.Future()
            self._complete()
            f.set_result(self._outputs)
            return f
        head = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
        return head.then(done)

    def _done(self):
        return all(w.is_completed() for w in self._works)


class ProcessGroupCiuic(_ProcessGroup):
    """A torch process group whose collectives are ciuic operations of one
    ciuic job (``self.comm``, a ciuic.Communicator). Made by the backend's
    creator: ``dist.init_process_group("ciuic")``, ``dist.new_group(...)``."""

    def __init__(self, comm, rank, size, timeout, group_name="", socket_path=None):
        super().__init__(rank, size)
        if comm.rank != rank or comm.world_size != size:
            raise InvalidArgumentError(
                f"process group rank {rank} of {size}, but its ciuic communicator is rank "
                f"{comm.rank} of {comm.world_size}")
        self.comm = comm
        self.group_name = group_name
        self.socket_path = socket_path  # the daemon's, for the groups made under this one
        self._timeout = timeout.total_seconds() if timeout else None
        self._seq = itertools.count()
        self._live = collections.deque()
        self._live_lock = threading.Lock()
        _groups.add(self)

    def __repr__(self):
        return f"<ProcessGroupCiuic group={self.group_name!r} {self.comm!r}>"

    def getBackendName(self):
        return BACKEND

    def name(self):
        return BACKEND

    def close(self):
        """Ends this group's ciuic session now (torch 1.13's
        destroy_process_group does not tell a Python backend; without this
        the session ends when the group is collected or the process exits).
        Operations still pending fail with CancelledError."""
        self.comm.close()

    # -- plumbing
    def _op(self, collective, opts):
        """(label for errors, timeout in seconds) of the next call: taken
        first in every collective, refused or not, so that the labels count
        the group's calls alike on every rank."""
        name = f"torch.{next(self._seq)}"
        timeout = self._timeout
        t = getattr(opts, "timeout", None) if opts is not None else None
        if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
            timeout = t.total_seconds()
        if self.comm.closed:
            raise CancelledError(f"{collective}: the process group's ciuic session is closed")
        return name, timeout

    def _root(self, root, what):
        if not 0 <= int(root) < self.size():
            raise InvalidArgumentError(f"{what}: root rank {root} is not in a group of "
                                       f"{self.size()}")
        return int(root)

    def _work(self, what, works, outputs, finish=()):
        work = CiuicWork(what, works, outputs, finish)
        with self._live_lock:
            live = self._live
            while len(live) > _KEEP_COMPLETED and live[0]._done():
                live.popleft()
            live.append(work)
        return work

    def _equal_blocks(self, tensors, n, what, role):
        if len(tensors) != self.size():
            raise InvalidArgumentError(f"{what}: {len(tensors)} {role} tensors for a group of "
                                       f"{self.size()}")
        for i, x in enumerate(tensors):
            _check_tensor(x, what)
            if x.numel() != n:
                raise InvalidArgumentError(
                    f"{what}: {role} tensor {i} has {x.numel()} elements, the other side {n}")

    # -- collectives
    def allreduce(self, tensors, opts=None):
        name, timeout = self._op("allreduce", opts)
        t = _single(tensors, "allreduce")
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        _check_reducible(t, "allreduce")
        buf, back = _inplace(t)
        w = self.comm.allreduce_async(buf, op=op, name=None, timeout=timeout)
        return self._work(name, [w], [t], [back])

    def allreduce_coalesced(self, tensors, opts=None):
        base, timeout = self._op("allreduce_coalesced", opts)
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                        "allreduce_coalesced")
        works, finish = [], []
        for t in tensors:
            _check_tensor(t, "allreduce_coalesced")
            _check_reducible(t, "allreduce_coalesced")
        for i, t in enumerate(tensors):
            name = f"{base}.{i}"
            buf, back = _inplace(t)
            works.append(self.comm.allreduce_async(buf, op=op, name=None, timeout=timeout))
            finish.append(back)
        return self._work("allreduce_coalesced", works, list(tensors), finish)

    def broadcast(self, tensors, opts=None):
        name, timeout = self._op("broadcast", opts)
        t = _single(tensors, "broadcast")
        root = self._root(opts.rootRank if opts is not None else 0, "broadcast")
        if opts is not None and opts.rootTensor != 0:
            raise InvalidArgumentError(f"broadcast: root tensor {opts.rootTensor}; one tensor "
                                       "per process")
        buf, back = _inplace(t)
        w = self.comm.broadcast_async(_movable(buf.view(-1)), root=root, name=None,
                                      timeout=timeout)
        return self._work(name, [w], [t], [back])

    def _allgather_flat(self, name, timeout, inp):
        """Allgather of ``inp`` into a new flat tensor: (work, flat)."""
        flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device=inp.device)
        w = self.comm.allgather_async(_movable(flat), _movable(_flat(inp)), name=None,
                                      timeout=timeout)
        return w, flat

    def allgather(self, output_tensors, input_tensors, opts=None):
        name, timeout = self._op("allgather", opts)
        if len(output_tensors) != 1:
            raise InvalidArgumentError(
                f"allgather: {len(output_tensors)} output lists; ciuic takes one tensor per "
                "process (torch's multi-device lists must have length 1)")
        outs = output_tensors[0]
        inp = _single(input_tensors, "allgather")
        self._equal_blocks(outs, inp.numel(), "allgather", "output")
        _same_dtype(outs, inp.dtype, "allgather")
        w, flat = self._allgather_flat(name, timeout, inp)
        n = inp.numel()

        def scatter_out():
            for r, o in enumerate(outs):
                o.copy_(flat[r * n:(r + 1) * n].view(o.shape))
        return self._work(name, [w], [outs], [scatter_out])

    def _allgather_base(self, output, input, opts=None):
        name, timeout = self._op("allgather_base", opts)
        _check_tensor(output, "all_gather_into_tensor")
        _check_tensor(input, "all_gather_into_tensor")
        if output.numel() != input.numel() * self.size():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: the output must hold group size ({self.size()}) times "
                f"the input's elements; input {input.numel()}, output {output.numel()}")
        _same_dtype([output], input.dtype, "all_gather_into_tensor")
        buf, back = _inplace(output)
        w = self.comm.allgather_async(_movable(buf.view(-1)), _movable(_flat(input)),
                                      name=None, timeout=timeout)
        return self._work(name, [w], [output], [back])

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        name, timeout = self._op("reduce_scatter", opts)
        out = _single(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1:
            raise InvalidArgumentError(
                f"reduce_scatter: {len(input_tensors)} input lists; ciuic takes one tensor per "
                "process (torch's multi-device lists must have length 1)")
        ins = input_tensors[0]
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                        "reduce_scatter")
        self._equal_blocks(ins, out.numel(), "reduce_scatter", "input")
        _same_dtype(ins, out.dtype, "reduce_scatter")
        _check_reducible(out, "reduce_scatter")
        flat_in = torch.cat([x.reshape(-1) for x in ins]) if ins else out.new_empty(0)
        buf, back = _inplace(out)
        w = self.comm.reduce_scatter_async(buf.view(-1), flat_in, op=op, name=None,
                                           timeout=timeout)
        return self._work(name, [w], [out], [back])

    def _reduce_scatter_base(self, output, input, opts=None):
        name, timeout = self._op("reduce_scatter_base", opts)
        what = "reduce_scatter_tensor"
        _check_tensor(output, what)
        _check_tensor(input, what)
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
        if input.numel() != output.numel() * self.size():
            raise InvalidArgumentError(
                f"{what}: the input must hold group size ({self.size()}) times the output's "
                f"elements; input {input.numel()}, output {output.numel()}")
        _same_dtype([input], output.dtype, what)
        _check_reducible(output, what)
        buf, back = _inplace(output)
        w = self.comm.reduce_scatter_async(buf.view(-1), _flat(input), op=op, name=None,
                                           timeout=timeout)
        return self._work(name, [w], [output], [back])

    def _rows_to_units(self, t, splits, what, role):
        """Split sizes in rows of ``t`` (None: equal blocks) as counts of the
        1-D tensor the SDK gets (elements, or bytes for a moved dtype)."""
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        unit = 1 if t.dtype in _REDUCIBLE else t.element_size()
        if not splits:
            if rows % self.size():
                raise InvalidArgumentError(
                    f"{what}: the {role}'s {rows} rows do not split into {self.size()} equal "
                    f"blocks; pass {role}_split_sizes")
            return [rows // self.size() * per_row * unit] * self.size()
        sizes = [int(x) for x in splits]
        if len(sizes) != self.size() or any(x < 0 for x in sizes) or sum(sizes) != rows:
            raise InvalidArgumentError(
                f"{what}: {role}_split_sizes {sizes} must be {self.size()} non-negative row "
                f"counts adding up to the {role}'s {rows} rows")
        return [x * per_row * unit for x in sizes]

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        name, timeout = self._op("alltoall_base", opts)
        what = "all_to_all_single"
        _check_tensor(output, what)
        _check_tensor(input, what)
        _same_dtype([output], input.dtype, what)
        recv = self._rows_to_units(output, output_split_sizes, what, "output")
        send = self._rows_to_units(input, input_split_sizes, what, "input")
        buf, back = _inplace(output)
        src = _flat(input)
        if src.numel() and buf.numel() and src.data_ptr() == buf.data_ptr():
            src = src.clone()  # in place is allowed by torch; the SDK never works in place
        w = self.comm.alltoall_async(_movable(buf.view(-1)), _movable(src), recv, send,
                                     name=None, timeout=timeout)
        return self._work(name, [w], [output], [back])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        name, timeout = self._op("alltoall", opts)
        what = "all_to_all"
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise InvalidArgumentError(
                f"{what}: {len(output_tensors)} output and {len(input_tensors)} input tensors "
                f"for a group of {self.size()}")
        dtype = _check_tensor(input_tensors[0], what).dtype
        _same_dtype(input_tensors, dtype, what)
        _same_dtype(output_tensors, dtype, what)
        src = torch.cat([x.reshape(-1) for x in input_tensors])
        flat = torch.empty(sum(o.numel() for o in output_tensors), dtype=dtype,
                           device=output_tensors[0].device)
        unit = 1 if dtype in _REDUCIBLE else flat.element_size()
        send = [x.numel() * unit for x in input_tensors]
        recv = [o.numel() * unit for o in output_tensors]
        w = self.comm.alltoall_async(_movable(flat), _movable(src), recv, send, name=None,
                                     timeout=timeout)

        def scatter_out():
            at = 0
            for o in output_tensors:
                o.copy_(flat[at:at + o.numel()].view(o.shape))
                at += o.numel()
        return self._work(name, [w], list(output_tensors), [scatter_out])

    def barrier(self, opts=None):
        name, timeout = self._op("barrier", opts)
        return self._work(name, [self.comm.barrier_async(name=None, timeout=timeout)], [])

    def reduce(self, tensors, opts=None):
        """An allreduce of which non-roots discard the result (their tensor
        keeps its input): ciuic has no rooted reduce."""
        name, timeout = self._op("reduce", opts)
        t = _single(tensors, "reduce")
        root = self._root(opts.rootRank if opts is not None else 0, "reduce")
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce")
        _check_reducible(t, "reduce")
        if self.rank() == root:
            buf, back = _inplace(t)
        else:
            buf, back = t.clone(memory_format=torch.contiguous_format), None
        w = self.comm.allreduce_async(buf, op=op, name=None, timeout=timeout)
        return self._work(name, [w], [t], [back])

    def gather(self, output_tensors, input_tensors, opts=None):
        """An allgather of which non-roots discard the result."""
        what = "gather"
        name, timeout = self._op(what, opts)
        inp = _single(input_tensors, what)
        root = self._root(opts.rootRank if opts is not None else 0, what)
        if self.rank() == root:
            if len(output_tensors) != 1:
                raise InvalidArgumentError(f"{what}: the root needs one gather list, got "
                                           f"{len(output_tensors)}")
            outs = output_tensors[0]
            self._equal_blocks(outs, inp.numel(), what, "output")
            _same_dtype(outs, inp.dtype, what)
        elif output_tensors:
            raise InvalidArgumentError(f"{what}: only the root (rank {root}) takes a gather list")
        else:
            outs = []
        w, flat = self._allgather_flat(name, timeout, inp)
        n = inp.numel()

        def scatter_out():
            for r, o in enumerate(outs):
                o.copy_(flat[r * n:(r + 1) * n].view(o.shape))
        return self._work(name, [w], [outs] if outs else [], [scatter_out])

    def scatter(self, output_tensors, input_tensors, opts=None):
        """An alltoall in which only the root sends (n elements to each rank)."""
        name, timeout = self._op("scatter", opts)
        what = "scatter"
        out = _single(output_tensors, what)
        root = self._root(opts.rootRank if opts is not None else 0, what)
        n = out.numel()
        unit = 1 if out.dtype in _REDUCIBLE else out.element_size()
        if self.rank() == root:
            if len(input_tensors) != 1:
                raise InvalidArgumentError(f"{what}: the root needs one scatter list, got "
                                           f"{len(input_tensors)}")
            ins = input_tensors[0]
            self._equal_blocks(ins, n, what, "input")
            _same_dtype(ins, out.dtype, what)
            src = torch.cat([x.reshape(-1) for x in ins])
            send = [n * unit] * self.size()
        elif input_tensors:
            raise InvalidArgumentError(f"{what}: only the root (rank {root}) takes a scatter list")
        else:
            src = out.new_empty(0)
            send = [0] * self.size()
        recv = [n * unit if r == root else 0 for r in range(self.size())]
        buf, back = _inplace(out)
        w = self.comm.alltoall_async(_movable(buf.view(-1)), _movable(src), recv, send,
                                     name=None, timeout=timeout)
        return self._work(name, [w], [out], [back])

    def send(self, tensors, dst, tag=0):
        raise UnimplementedError(
            "send: ciuic has no point-to-point operations (every ciuic operation involves "
            "the whole group); use broadcast or scatter from the sender, or all_to_all_single "
            "with split sizes that are zero for the other ranks")

    def recv(self, tensors, src, tag=0):
        raise UnimplementedError(
            "recv: ciuic has no point-to-point operations (every ciuic operation involves "
            "the whole group); use broadcast or scatter from the sender, or all_to_all_single "
            "with split sizes that are zero for the other ranks")

    def recv_anysource(self, tensors, tag=0):
        raise UnimplementedError("recv from any source: ciuic has no point-to-point operations")

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        raise UnimplementedError(
            "allgather_coalesced: not in ciuic's backend; call all_gather (or "
            "all_gather_into_tensor) per tensor, async_op=True, and wait for them together")


# ------------------------------------------------------------ group creation

def _node_key(socket_path):
    """This rank's daemon: host and socket path (the same on one node)."""
    return f"{_socket.gethostname()}|{os.path.realpath(socket_path)}"


def _layout(store, rank, size, socket_path):
    """(local_rank, local_size) from every member's node key in the store."""
    key = _node_key(socket_path)
    store.set(f"ciuic.node.{rank}", key)
    keys = [store.get(f"ciuic.node.{r}").decode() for r in range(size)]
    return keys[:rank].count(key), keys.count(key)


def _store_job(store, rank):
    """A fresh job id agreed through the store (rank 0 makes it)."""
    if rank == 0:
        store.set("ciuic.job", f"torch-{uuid.uuid4().hex}")
    return store.get("ciuic.job").decode()


def _create(opts, pg_options=None):
    """The backend's creator (torch's extended API: _DistributedBackendOptions)."""
    store, rank, size = opts.store, int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout
    members = list(opts.global_ranks_in_group)
    group_id = str(opts.group_id)
    env = os.environ
    socket_path = env.get("CIUIC_SOCKET") or ciuic.default_socket_path()
    launched = ciuic.launch_env(env)
    if not members:  # the world group
        local_rank, local_size = launched["local_rank"], launched["local_size"]
        if (launched["rank"], launched["world_size"]) != (rank, size) or \
                local_rank is None or local_size is None:
            local_rank, local_size = _layout(store, rank, size, socket_path)
        job = launched["job"] or _store_job(store, rank)
        coordinator = ciuic.resolve_coordinator(None, size, local_size)
        comm = ciuic.init(rank=rank, world_size=size, local_rank=local_rank,
                          local_size=local_size, job=job, socket=socket_path,
                          coordinator=coordinator)
    else:
        default = dist.distributed_c10d._get_default_group()
        if isinstance(default, ProcessGroupCiuic):
            world = dict(job=default.comm.job_id, socket=default.socket_path,
                         coordinator=default.comm.coordinator)
        else:  # the default group is another backend's: the environment's job
            world = dict(job=launched["job"], socket=socket_path, coordinator=None)
        local_rank, local_size = _layout(store, rank, size, world["socket"])
        job = f"{world['job']}.g{group_id}" if world["job"] else _store_job(store, rank)
        coordinator = ""
        if local_size < size:
            coordinator = world["coordinator"] or ciuic.resolve_coordinator(None, size,
                                                                             local_size)
        comm = ciuic.init(rank=rank, world_size=size, local_rank=local_rank,
                          local_size=local_size, job=job, socket=world["socket"],
                          coordinator=coordinator)
    return ProcessGroupCiuic(comm, rank, size, timeout, group_name=group_id,
                             socket_path=socket_path if not members else world["socket"])


def register():
    """Registers the backend "ciuic" with torch.distributed (idempotent)."""
    with _register_lock:
        if getattr(dist.Backend, BACKEND.upper(), None) is not None:
            return
        kwargs = {"extended_api": True}
        if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
            kwargs["devices"] = ["cpu", "cuda"]  # torch 2.x
        dist.Backend.register_backend(BACKEND, _create, **kwargs)


def communicator(group=None):
    """The ciuic.Communicator of a ciuic process group (None: the default
    group), e.g. for ciuic.torch.CiuicHookState."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupCiuic):
        raise InvalidArgumentError(f"{pg!r} is not a ciuic process group")
    return pg.comm


def close_all():
    """Ends the ciuic sessions of every ciuic process group of this process
    (see ProcessGroupCiuic.close)."""
    for pg in list(_groups):
        pg.close()

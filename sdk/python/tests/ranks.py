"""What the rank processes of the test pool run (see conftest.RankPool).

Every task is ``fn(ctx, *args)``, run on every rank. Inputs are made from
(seed, rank) so that each rank can build every rank's input and compute the
expected result itself with numpy in float64/int64 (exact for the small
values used), independently of ciuic; tasks compare and raise on mismatch.
Operations carry unique names so that a failed task cannot shift the
matching of later ones.
"""

import gc
import os
import time
import traceback
import weakref

import numpy as np

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
OPS = ("sum", "avg", "min", "max", "prod")
SMALL_SIZES = (0, 1, 7, 4099)


class Ctx:
    def __init__(self, rank, world, socket, job, comm):
        self.rank, self.world, self.socket, self.job, self.comm = rank, world, socket, job, comm
        self.seq = 0

    def name(self, what):
        self.seq += 1
        return f"{what}.{self.seq}"


def worker_main(rank, world, socket, job, arena_bytes, inq, outq):
    try:
        import torch
        torch.set_num_threads(1)
        import ciuic
        comm = ciuic.init(rank=rank, world_size=world, job=job, socket=socket,
                          arena_bytes=arena_bytes)
        ctx = Ctx(rank, world, socket, job, comm)
        outq.put((rank, "ok", None))
    except BaseException:  # noqa: BLE001
        outq.put((rank, "err", traceback.format_exc()))
        return
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args = item
        try:
            outq.put((rank, "ok", globals()[fn](ctx, *args)))
        except BaseException:  # noqa: BLE001
            outq.put((rank, "err", traceback.format_exc()))
    comm.close()


# ------------------------------------------------------------------ data

def big_size(dtype):
    """Elements of a buffer just over 4 MiB (not a multiple of it)."""
    return (4 << 20) // itemsize(dtype) + 3


def itemsize(dtype):
    return {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
            "int8": 1, "uint8": 1}[dtype]


def is_float(dtype):
    return dtype.startswith("float") or dtype == "bfloat16"


def values(seed, rank, n, dtype):
    """float64/int64 values, exactly representable in `dtype`, such that sums
    and products of two stay exact in its accumulation type."""
    rng = np.random.default_rng(seed * 1009 + rank)
    if is_float(dtype):
        return rng.integers(-32, 33, n).astype(np.float64) / 4
    if dtype == "uint8":
        return rng.integers(0, 11, n).astype(np.int64)
    if dtype == "int8":
        return rng.integers(-5, 6, n).astype(np.int64)
    return rng.integers(-1000, 1001, n).astype(np.int64)


def reference(inputs, op):
    """The reduction over ranks, in float64/int64."""
    stack = np.stack(inputs)
    if op == "sum":
        return stack.sum(axis=0)
    if op == "prod":
        return stack.prod(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    s = stack.sum(axis=0)
    if stack.dtype.kind == "f":
        return s / len(inputs)
    return np.sign(s) * (np.abs(s) // len(inputs))  # truncates toward zero


def make(vals, dtype, lib):
    """An array/tensor of `dtype` from float64/int64 values."""
    if lib == "numpy":
        return np.ascontiguousarray(vals.astype(np.dtype(dtype)))
    import torch
    return torch.from_numpy(np.array(vals, copy=True)).to(getattr(torch, dtype)).contiguous()


def as_f64(x):
    """float64 numpy copy of an array/tensor (bfloat16 included)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.double().numpy().copy()


def expect_equal(got, want_vals, dtype, lib, what):
    want = as_f64(make(want_vals, dtype, lib))  # rounded as the dtype rounds
    got = as_f64(got)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got.ravel() != want.ravel())[:5] if got.shape == want.shape else []
        raise AssertionError(
            f"{what}: shape {got.shape} vs {want.shape}; first differences at {list(bad)}: "
            f"got {[got.ravel()[i] for i in bad]}, want {[want.ravel()[i] for i in bad]}")


def empty_like_lib(n, dtype, lib):
    if lib == "numpy":
        return np.zeros(n, dtype=np.dtype(dtype))
    import torch
    return torch.zeros(n, dtype=getattr(torch, dtype))


# ------------------------------------------------------------ collectives

def allreduce_all(ctx, lib, dtype, seed):
    checks = 0
    for op in OPS:
        sizes = SMALL_SIZES + ((big_size(dtype),) if op == "sum" else ())
        for n in sizes:
            inputs = [values(seed + n, r, n, dtype) for r in range(ctx.world)]
            t = make(inputs[ctx.rank], dtype, lib)
            out = ctx.comm.allreduce(t, op=op, name=ctx.name(f"ar.{lib}.{dtype}.{op}.{n}"))
            assert out is t
            expect_equal(t, reference(inputs, op), dtype, lib, f"allreduce {op} n={n}")
            checks += 1
    return checks


def reduce_scatter_all(ctx, lib, dtype, seed):
    checks = 0
    for op in OPS:
        sizes = SMALL_SIZES + ((big_size(dtype) // ctx.world,) if op == "sum" else ())
        for n in sizes:
            inputs = [values(seed + n, r, n * ctx.world, dtype) for r in range(ctx.world)]
            src = make(inputs[ctx.rank], dtype, lib)
            out = empty_like_lib(n, dtype, lib)
            ctx.comm.reduce_scatter(out, src, op=op, name=ctx.name(f"rs.{dtype}.{op}.{n}"))
            want = reference(inputs, op)[ctx.rank * n:(ctx.rank + 1) * n]
            expect_equal(out, want, dtype, lib, f"reduce_scatter {op} n={n}")
            checks += 1
    return checks


def allgather_all(ctx, lib, dtype, seed):
    checks = 0
    for n in SMALL_SIZES + (big_size(dtype) // ctx.world,):
        inputs = [values(seed + n, r, n, dtype) for r in range(ctx.world)]
        src = make(inputs[ctx.rank], dtype, lib)
        out = empty_like_lib(n * ctx.world, dtype, lib)
        ctx.comm.allgather(out, src, name=ctx.name(f"ag.{dtype}.{n}"))
        expect_equal(out, np.concatenate(inputs), dtype, lib, f"allgather n={n}")
        checks += 1
    return checks


def alltoall_reference(inputs, rank, n):
    """Block r of rank `rank`'s output: rank r's block `rank`."""
    if n == 0:
        return np.zeros(0, inputs[0].dtype)
    return np.concatenate([x[rank * n:(rank + 1) * n] for x in inputs])


def alltoall_all(ctx, lib, dtype, seed):
    checks = 0
    for n in SMALL_SIZES + (big_size(dtype) // ctx.world,):
        inputs = [values(seed + n, r, n * ctx.world, dtype) for r in range(ctx.world)]
        src = make(inputs[ctx.rank], dtype, lib)
        out = empty_like_lib(n * ctx.world, dtype, lib)
        got = ctx.comm.alltoall(out, src, name=ctx.name(f"a2a.{lib}.{dtype}.{n}"))
        assert got is out
        expect_equal(out, alltoall_reference(inputs, ctx.rank, n), dtype, lib, f"alltoall n={n}")
        expect_equal(src, inputs[ctx.rank], dtype, lib, f"alltoall n={n}: input unchanged")
        checks += 1
    return checks


def split_rows(i, j, pattern):
    """Rows rank i sends rank j in alltoallv test `pattern`: none, one,
    uneven with empty pairs, and a rank (1) that sends nothing."""
    return [0, 1, 0 if (3 * i + j) % 4 == 0 else (i + 1) * 5 + 3 * j,
            0 if i == 1 else ((i + j) % 3 + 1) * 700 + i][pattern]


def alltoallv_all(ctx, lib, dtype, seed, cols=3, device=None):
    """alltoall with input/output split sizes (rows of `cols` elements),
    against numpy: every pattern of split_rows (torch tensors on `device`,
    a CUDA device, if given)."""
    world, rank = ctx.world, ctx.rank
    checks = 0
    for pattern in range(4):
        rows = [[split_rows(i, j, pattern) for j in range(world)] for i in range(world)]
        inputs = [values(seed + pattern, r, sum(rows[r]) * cols, dtype) for r in range(world)]
        src = make(inputs[rank], dtype, lib).reshape(sum(rows[rank]), cols)
        recv_rows = [rows[i][rank] for i in range(world)]
        out = empty_like_lib(sum(recv_rows) * cols, dtype, lib).reshape(sum(recv_rows), cols)
        if device is not None:
            src, out = src.to(device, non_blocking=True), out.to(device)
        got = ctx.comm.alltoall(out, src, output_split_sizes=recv_rows,
                                input_split_sizes=rows[rank],
                                name=ctx.name(f"a2av.{lib}.{dtype}.{pattern}.{device}"))
        assert got is out
        want = []
        for i in range(world):
            at = sum(rows[i][:rank]) * cols
            want.append(inputs[i][at:at + rows[i][rank] * cols])
        expect_equal((out.cpu() if device is not None else out).reshape(-1),
                     np.concatenate(want), dtype, lib, f"alltoallv pattern {pattern}")
        checks += 1
    return checks


def alltoallv_mismatch(ctx):
    """Rank world-1 expects one row more from rank 0 than rank 0 sends:
    InvalidArgumentError on every rank, and the next operation works."""
    import ciuic
    world, rank = ctx.world, ctx.rank
    send = [1] * world
    recv = [1] * world
    if rank == world - 1:
        recv[0] = 2
    src = np.full(sum(send), rank, np.int32)
    out = np.zeros(sum(recv), np.int32)
    try:
        ctx.comm.alltoall(out, src, output_split_sizes=recv, input_split_sizes=send,
                          name=ctx.name("a2av.mismatch"), timeout=20)
    except ciuic.InvalidArgumentError as e:
        message = e.message
    else:
        raise AssertionError("no error for mismatched alltoallv counts")
    out = np.zeros(world, np.int32)
    ctx.comm.alltoall(out, np.full(world, rank, np.int32), name=ctx.name("a2av.after"))
    assert out.tolist() == list(range(world)), out
    return message


def broadcast_all(ctx, lib, dtype, seed):
    checks = 0
    for root in range(ctx.world):
        for n in SMALL_SIZES + (big_size(dtype),):
            inputs = [values(seed + n + root, r, n, dtype) for r in range(ctx.world)]
            t = make(inputs[ctx.rank], dtype, lib)
            ctx.comm.broadcast(t, root=root, name=ctx.name(f"bc.{dtype}.{root}.{n}"))
            expect_equal(t, inputs[root], dtype, lib, f"broadcast root={root} n={n}")
            checks += 1
    return checks


def barriers(ctx):
    for i in range(5):
        ctx.comm.barrier(name=ctx.name("barrier"))
    t0 = time.monotonic()
    if ctx.rank == 1:
        time.sleep(0.3)
    ctx.comm.barrier(name=ctx.name("barrier.late"))
    return time.monotonic() - t0  # rank 0 must have waited for rank 1


def large_allreduce(ctx, shared):
    """16M float32 elements (64 MiB), through staging or in shared memory."""
    n = 16 << 20
    if shared:
        a = ctx.comm.empty((n,), np.float32)
        assert ctx.comm.is_shared(a)
    else:
        a = np.empty(n, np.float32)
        assert not ctx.comm.is_shared(a)
    # rank r holds (i % 1024) * (r + 1): the sum is (i % 1024) * 3 for 2 ranks.
    base = (np.arange(n, dtype=np.int64) % 1024).astype(np.float32)
    np.multiply(base, ctx.rank + 1, out=a)
    t0 = time.perf_counter()
    ctx.comm.allreduce(a, name=ctx.name(f"large.{shared}"))
    dt = time.perf_counter() - t0
    want = base * sum(r + 1 for r in range(ctx.world))
    assert np.array_equal(a, want), "large allreduce differs"
    return dt


# ------------------------------------------------------------------ async

def async_ops(ctx):
    import torch
    comm = ctx.comm
    tag = ctx.name("async")
    # Named operations submitted in opposite orders on the two ranks.
    names = [f"{tag}.{k}" for k in range(4)]
    tensors = {nm: torch.full((1000 + k,), float(ctx.rank + 1 + k)) for k, nm in enumerate(names)}
    order = names if ctx.rank == 0 else names[::-1]
    works = {nm: comm.allreduce_async(tensors[nm], name=nm) for nm in order}
    for k, nm in enumerate(names):
        assert works[nm].wait() is True
        assert works[nm].is_completed()
        want = sum(float(r + 1 + k) for r in range(ctx.world))
        assert torch.all(tensors[nm] == want), nm

    # A handle waits for the slower rank: not complete, wait(timeout) -> False.
    late = np.full(10, ctx.rank + 1.0, np.float32)
    if ctx.rank == 1:
        time.sleep(0.5)
    w = comm.allreduce_async(late, name=f"{tag}.late")
    if ctx.rank == 0:
        assert not w.is_completed()
        t0 = time.monotonic()
        assert w.wait(timeout=0.1) is False
        assert 0.08 <= time.monotonic() - t0 < 0.4
    assert w.wait() is True
    assert w.result() is late and np.all(late == 3.0)

    # Torch futures, completed by the waiter thread without any wait() here.
    ts = [torch.full((257,), float(ctx.rank + i)) for i in range(6)]
    futs = [comm.allreduce_async(t, op="max", name=f"{tag}.fut.{i}").get_future()
            for i, t in enumerate(ts)]
    chained = futs[0].then(lambda f: f.value() * 2)
    for i, f in enumerate(futs):
        v = f.wait()
        assert v is ts[i] and torch.all(v == float(ctx.world - 1 + i))
    assert torch.all(chained.wait() == 2.0 * (ctx.world - 1))
    all_done = torch.futures.collect_all(
        [comm.allreduce_async(torch.ones(3), name=f"{tag}.all.{i}").get_future()
         for i in range(3)])
    assert all(torch.all(f.value() == ctx.world) for f in all_done.wait())

    # Other collectives, async, and the barrier.
    out = torch.zeros(4 * ctx.world, dtype=torch.int64)
    wa = comm.allgather_async(out, torch.arange(4) + 10 * ctx.rank, name=f"{tag}.ag")
    b = torch.zeros(5, dtype=torch.float16) + ctx.rank
    wb = comm.broadcast_async(b, root=1, name=f"{tag}.bc")
    wbar = comm.barrier_async(name=f"{tag}.bar")
    assert wbar.wait() and wa.get_future().wait() is out and wb.wait()
    assert out.tolist() == [i + 10 * r for r in range(ctx.world) for i in range(4)]
    assert torch.all(b == 1)

    # Dropping a Work before completion must not free the memory in use: the
    # communicator holds the array until the operation has completed.
    tmp = np.full(1 << 16, ctx.rank + 1.0, np.float32)
    ref = weakref.ref(tmp)
    comm.allreduce_async(tmp, name=f"{tag}.dropped")
    del tmp
    gc.collect()
    assert ref() is not None, "array of an operation in flight was released"
    for i in range(5):  # completed operations are released at later submissions
        comm.barrier(name=f"{tag}.dropped.bar{i}")
        time.sleep(0.02)
    gc.collect()
    assert ref() is None, "array of a completed operation still held"
    return True


# -------------------------------------------------------------- zero copy

def empty_buffers(ctx, lib, dtype, seed):
    import torch
    comm = ctx.comm
    shape = (3, 129)
    if lib == "numpy":
        a = comm.empty(shape, np.dtype(dtype))
        assert isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype)
    else:
        a = comm.empty(shape, getattr(torch, dtype))
        assert isinstance(a, torch.Tensor) and a.dtype == getattr(torch, dtype)
    assert tuple(a.shape) == shape
    assert comm.is_shared(a) and comm.is_shared(a[1])
    inputs = [values(seed, r, 3 * 129, dtype).reshape(shape) for r in range(ctx.world)]
    a[...] = make(inputs[ctx.rank], dtype, lib)
    row = a[2]  # a view: sees the result written in place
    comm.allreduce(a, name=ctx.name(f"empty.{lib}.{dtype}"))
    expect_equal(a, reference(inputs, "sum"), dtype, lib, "allreduce on empty()")
    expect_equal(row, reference(inputs, "sum")[2], dtype, lib, "view of empty()")
    # Views keep the shared memory alive after the array itself is gone.
    del a
    gc.collect()
    other = comm.empty(shape, getattr(torch, dtype) if lib == "torch" else np.dtype(dtype))
    other[...] = make(np.zeros(shape), dtype, lib)
    expect_equal(row, reference(inputs, "sum")[2], dtype, lib, "view after del")
    return True


def zero_copy_proof(ctx):
    """A shared array needs no staging: with the arena nearly full, an
    allreduce of a shared 128 MiB array works while a private 64 MiB one
    cannot be staged."""
    import ciuic
    comm = ctx.comm
    n = (128 << 20) // 4
    a = comm.empty((n,), np.float32)
    a[:] = ctx.rank + 1
    comm.allreduce(a, name=ctx.name("zc.shared"))
    assert a[0] == 3 and a[-1] == 3
    private = np.ones((64 << 20) // 4, np.float32)
    try:
        comm.allreduce(private, name=ctx.name("zc.private"))
    except ciuic.ResourceExhaustedError as e:
        return str(e)
    raise AssertionError("a private 64 MiB array was staged in a nearly full arena")


# ----------------------------------------------------------------- errors

def mismatch(ctx, which):
    """Mismatched counts on a fresh job: InvalidArgumentError on every rank."""
    import ciuic
    import torch
    job = f"{ctx.job}-mismatch-{which}"
    with ciuic.init(rank=ctx.rank, world_size=ctx.world, job=job, socket=ctx.socket,
                    arena_bytes=16 << 20) as comm:
        t = torch.ones(3 + ctx.rank)
        name = f"grads.mismatch.{which}"
        try:
            if which == "sync":
                comm.allreduce(t, name=name, timeout=20)
            else:
                comm.allreduce_async(t, name=name, timeout=20).get_future().wait()
        except ciuic.InvalidArgumentError as e:
            return (type(e).__name__, int(e.code), e.code.name, e.message)
    raise AssertionError("no error for mismatched counts")


# -------------------------------------------------------------------- DDP

def ddp_losses(ctx, port, steps, modes):
    """Trains a tiny MLP with DDP over gloo, then with the ciuic hook in each
    of `modes`, from the same seed; returns {mode: [loss per step]}."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuic.torch as ct

    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world)

    def train(mode):
        torch.manual_seed(1234)
        net = torch.nn.Sequential(
            torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96), torch.nn.ReLU(),
            torch.nn.Linear(96, 4))
        if ctx.rank == 1:  # DDP must broadcast rank 0's parameters
            for p in net.parameters():
                p.data.add_(1.0)
        dist._DEFAULT_FIRST_BUCKET_BYTES = 8192  # several buckets (DDP documents this knob)
        model = DDP(net, bucket_cap_mb=0.02)
        state = None
        if mode != "gloo":
            state = ct.CiuicHookState(ctx.comm, mode=mode, prefix=ctx.name(f"ddp.{mode}"))
            model.register_comm_hook(state, ct.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(99 + ctx.rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 4, generator=g)
        losses = []
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        buckets = sorted(state.calls) if state else []
        checksum = float(sum(p.double().sum() for p in model.parameters()))
        return losses, buckets, checksum

    return {mode: train(mode) for mode in ("gloo",) + tuple(modes)}


# ------------------------------------------------------------- multi-node
#
# Processes of conftest.MultiNodePool: one per (node, local rank), holding a
# communicator per job shape (nodes, ranks per node). The 2 x 1 job finds its
# coordinator through $MASTER_ADDR and $CIUIC_PEER_PORT, the 2 x 2 job gets
# it as the explicit coordinator= argument.

MN_SMALL_SIZES = (0, 1, 1001)
MN_BIG = (1 << 20) + 1  # about 1M elements, odd


class _Env:
    """Sets (value) or removes (None) environment variables for a while."""

    def __init__(self, **changes):
        self.changes, self.saved = changes, {}

    def __enter__(self):
        for k, v in self.changes.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _mn_ctx(spec, shape, node, local):
    import ciuic
    nodes, per_node = shape
    rank, world = node * per_node + local, nodes * per_node
    job = f"{spec['job']}-{nodes}x{per_node}"
    socket = spec["sockets"][node]
    kw = dict(rank=rank, world_size=world, local_rank=local, local_size=per_node, job=job,
              socket=socket, arena_bytes=spec["arena_bytes"])
    if per_node == 1:
        host, port = spec["coordinator"].rsplit(":", 1)
        with _Env(CIUIC_COORDINATOR=None, MASTER_ADDR=host, CIUIC_PEER_PORT=port):
            comm = ciuic.init(**kw)
    else:
        comm = ciuic.init(coordinator=spec["coordinator"], **kw)
    ctx = Ctx(rank, world, socket, job, comm)
    ctx.node, ctx.local, ctx.local_size = node, local, per_node
    ctx.coordinator = spec["coordinator"]
    return ctx


def mn_worker_main(proc, node, local, spec, inq, outq):
    try:
        import torch
        torch.set_num_threads(1)
        import ciuic  # noqa: F401
        outq.put((proc, "ok", None))
    except BaseException:  # noqa: BLE001
        outq.put((proc, "err", traceback.format_exc()))
        return
    ctxs = {}
    while True:
        item = inq.get()
        if item is None:
            break
        shape, fn, args = item
        try:
            if shape not in ctxs:
                ctxs[shape] = _mn_ctx(spec, shape, node, local)
            outq.put((proc, "ok", globals()[fn](ctxs[shape], *args)))
        except BaseException:  # noqa: BLE001
            outq.put((proc, "err", traceback.format_exc()))
    for ctx in ctxs.values():
        ctx.comm.close()


def mn_identity(ctx):
    c = ctx.comm
    return (c.rank, c.world_size, c.local_rank, c.local_size, c.node_name, c.coordinator)


def mn_values(seed, rank, n, dtype, op):
    """values(), except for prod: +-1 and +-2 (exact in every dtype and
    order for 4 ranks; wrap-around of the integer types aside)."""
    if op != "prod":
        return values(seed, rank, n, dtype)
    rng = np.random.default_rng(seed * 1013 + rank)
    choices = [1, 2] if dtype == "uint8" else [-2, -1, 1, 2]
    v = rng.choice(np.array(choices), n)
    return v.astype(np.float64) if is_float(dtype) else v.astype(np.int64)


def mn_collectives(ctx, lib, dtype, seed, big):
    """allreduce (every op), reduce_scatter (every op), allgather, alltoall and
    broadcast (a root on each node) of sizes 0, 1, odd and, with `big`, about
    1M elements (sum only for the reductions), against numpy references."""
    world, rank = ctx.world, ctx.rank
    checks = 0

    def big_or_none(n):
        return (n,) if big else ()

    for op in OPS:
        for n in MN_SMALL_SIZES + (big_or_none(MN_BIG) if op == "sum" else ()):
            inputs = [mn_values(seed + n, r, n, dtype, op) for r in range(world)]
            t = make(inputs[rank], dtype, lib)
            ctx.comm.allreduce(t, op=op, name=ctx.name(f"mn.ar.{lib}.{dtype}.{op}.{n}"))
            expect_equal(t, reference(inputs, op), dtype, lib, f"allreduce {op} n={n}")
            checks += 1
    for op in OPS:
        for n in MN_SMALL_SIZES + (big_or_none(MN_BIG // world) if op == "sum" else ()):
            inputs = [mn_values(seed + n, r, n * world, dtype, op) for r in range(world)]
            src = make(inputs[rank], dtype, lib)
            out = empty_like_lib(n, dtype, lib)
            ctx.comm.reduce_scatter(out, src, op=op, name=ctx.name(f"mn.rs.{lib}.{dtype}.{op}.{n}"))
            want = reference(inputs, op)[rank * n:(rank + 1) * n]
            expect_equal(out, want, dtype, lib, f"reduce_scatter {op} n={n}")
            checks += 1
    for n in MN_SMALL_SIZES + big_or_none(MN_BIG // world):
        inputs = [values(seed + n, r, n, dtype) for r in range(world)]
        src = make(inputs[rank], dtype, lib)
        out = empty_like_lib(n * world, dtype, lib)
        ctx.comm.allgather(out, src, name=ctx.name(f"mn.ag.{lib}.{dtype}.{n}"))
        expect_equal(out, np.concatenate(inputs), dtype, lib, f"allgather n={n}")
        checks += 1
    for n in MN_SMALL_SIZES + big_or_none(MN_BIG // world):
        inputs = [values(seed + n, r, n * world, dtype) for r in range(world)]
        src = make(inputs[rank], dtype, lib)
        out = empty_like_lib(n * world, dtype, lib)
        ctx.comm.alltoall(out, src, name=ctx.name(f"mn.a2a.{lib}.{dtype}.{n}"))
        expect_equal(out, alltoall_reference(inputs, rank, n), dtype, lib, f"alltoall n={n}")
        checks += 1
    checks += alltoallv_all(ctx, lib, dtype, seed)
    for root in sorted({0, world - 1}):  # node 0 and the last node
        for n in MN_SMALL_SIZES + big_or_none(MN_BIG):
            inputs = [values(seed + n + root, r, n, dtype) for r in range(world)]
            t = make(inputs[rank], dtype, lib)
            ctx.comm.broadcast(t, root=root, name=ctx.name(f"mn.bc.{lib}.{dtype}.{root}.{n}"))
            expect_equal(t, inputs[root], dtype, lib, f"broadcast root={root} n={n}")
            checks += 1
    return checks


def mn_mismatch(ctx):
    """A fresh job of the same shape, its coordinator from $CIUIC_COORDINATOR;
    the ranks of node k submit count 3 + k: the nodes disagree (the ranks of
    one node agree), and every rank must get InvalidArgumentError."""
    import ciuic
    import torch
    job = ctx.job + "-" + ctx.name("mismatch")
    with _Env(CIUIC_COORDINATOR=ctx.coordinator, MASTER_ADDR=None, CIUIC_PEER_PORT=None):
        comm = ciuic.init(rank=ctx.rank, world_size=ctx.world, local_rank=ctx.local,
                          local_size=ctx.local_size, job=job, socket=ctx.socket,
                          arena_bytes=16 << 20)
    with comm:
        assert comm.coordinator == ctx.coordinator, comm.coordinator
        t = torch.ones(3 + ctx.node)
        try:
            comm.allreduce(t, name="grads.mismatch.nodes", timeout=20)
        except ciuic.InvalidArgumentError as e:
            return (type(e).__name__, int(e.code), e.message)
    raise AssertionError("no error for counts mismatched across nodes")


# ------------------------------------------------------------ CUDA tensors

def _cuda_device(ctx):
    import torch
    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def cuda_collectives(ctx, dtype, seed):
    """Every collective on CUDA tensors (device buffers through the daemon,
    alltoall and alltoallv included),
    every op for the reductions, sizes 0, 1, odd and just over 4 MiB; the
    inputs are written on the current stream right before each call (the
    daemon must wait for that work)."""
    import torch
    dev = _cuda_device(ctx)
    w, r = ctx.world, ctx.rank
    checks = 0
    for n in SMALL_SIZES + (big_size(dtype),):
        for op in OPS:
            inputs = [values(seed + n, q, n, dtype) for q in range(w)]
            t = make(inputs[r], dtype, "torch").to(dev, non_blocking=True)
            ctx.comm.allreduce(t, op=op, name=ctx.name(f"cuda.ar.{dtype}.{op}.{n}"))
            expect_equal(t.cpu(), reference(inputs, op), dtype, "torch", f"allreduce {op} {n}")
            blocks = [values(seed + n + 1, q, n * w, dtype) for q in range(w)]
            inp = make(blocks[r], dtype, "torch").to(dev)
            out = torch.zeros(n, dtype=getattr(torch, dtype), device=dev)
            ctx.comm.reduce_scatter(out, inp, op=op, name=ctx.name(f"cuda.rs.{dtype}.{op}.{n}"))
            want = reference([b[r * n:(r + 1) * n] for b in blocks], op)
            expect_equal(out.cpu(), want, dtype, "torch", f"reduce_scatter {op} {n}")
            checks += 2
        inputs = [values(seed + n + 2, q, n, dtype) for q in range(w)]
        inp = make(inputs[r], dtype, "torch").to(dev)
        out = torch.zeros(n * w, dtype=getattr(torch, dtype), device=dev)
        ctx.comm.allgather(out, inp, name=ctx.name(f"cuda.ag.{dtype}.{n}"))
        expect_equal(out.cpu(), np.concatenate(inputs), dtype, "torch", f"allgather {n}")
        t = make(inputs[r], dtype, "torch").to(dev)
        ctx.comm.broadcast(t, root=w - 1, name=ctx.name(f"cuda.bc.{dtype}.{n}"))
        expect_equal(t.cpu(), inputs[w - 1], dtype, "torch", f"broadcast {n}")
        blocks = [values(seed + n + 3, q, n * w, dtype) for q in range(w)]
        inp = make(blocks[r], dtype, "torch").to(dev, non_blocking=True)
        out = torch.zeros(n * w, dtype=getattr(torch, dtype), device=dev)
        ctx.comm.alltoall(out, inp, name=ctx.name(f"cuda.a2a.{dtype}.{n}"))
        expect_equal(out.cpu(), alltoall_reference(blocks, r, n), dtype, "torch", f"alltoall {n}")
        checks += 3
    return checks + alltoallv_all(ctx, "torch", dtype, seed, device=dev)


class _FakeBucket:
    """What ciuic.torch.allreduce_hook uses of a DDP GradBucket."""

    def __init__(self, index, buffer):
        self._index, self._buffer = index, buffer

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer


def cuda_dropped_tensors_live_on(ctx):
    """A CUDA tensor whose Work and tensor the caller drops stays alive until
    its operation completes (the daemon works on it on its own streams), and
    is let go once it has; the result is right."""
    import gc
    import weakref
    import torch
    dev = _cuda_device(ctx)
    n = 1 << 20
    t = torch.full((n,), float(ctx.rank + 1), dtype=torch.float32, device=dev)
    alive = weakref.ref(t)
    ctx.comm.allreduce_async(t, name=ctx.name("cuda.dropped"))  # Work dropped at once
    del t
    gc.collect()
    assert alive() is not None, "dropped while its operation may still run"
    u = torch.zeros(n, dtype=torch.float32, device=dev)
    ctx.comm.allreduce(u, name=ctx.name("cuda.after"))  # on the daemon's stream after it
    deadline = time.monotonic() + 10
    while alive() is not None and time.monotonic() < deadline:
        ctx.comm._device_holds.prune()
        gc.collect()
        time.sleep(0.01)
    assert alive() is None, "still held after its operation completed"
    v = torch.ones(3, dtype=torch.float32, device=dev)
    ctx.comm.allreduce(v, name=ctx.name("cuda.check"))
    expect_equal(v.cpu(), np.full(3, float(ctx.world), np.float32), "float32", "torch",
                 "after a dropped operation")
    return True


def cuda_busy_stream_times_out(ctx):
    """Rank 1's stream is busy (torch.cuda._sleep, about 1.5 s on an H200)
    past the operation's timeout of 0.5 s: every rank gets
    DeadlineExceededError naming rank 1's stream, the tensors keep their
    values (nothing of the operation ran, also once the stream is free), and
    the next operation works."""
    import ciuic
    import torch
    dev = _cuda_device(ctx)
    t = torch.full((1000,), float(ctx.rank + 1), dtype=torch.float32, device=dev)
    torch.cuda.synchronize(dev)
    ctx.comm.barrier(name=ctx.name("cuda.busy_barrier"))  # the deadline is the first submission's
    if ctx.rank == 1:
        torch.cuda._sleep(3_000_000_000)  # cycles, on the current stream
    start = time.monotonic()
    try:
        ctx.comm.allreduce(t, name=ctx.name("cuda.busy"), timeout=0.5)
        raise AssertionError("no timeout")
    except ciuic.DeadlineExceededError as e:
        took = time.monotonic() - start
        assert "rank 1's stream" in str(e) and "nothing of the operation ran" in str(e), str(e)
        assert 0.4 <= took < 20, took
    torch.cuda.synchronize(dev)
    time.sleep(0.1)
    expect_equal(t.cpu(), np.full(1000, float(ctx.rank + 1), np.float32), "float32", "torch",
                 "after the timed-out operation")
    ctx.comm.allreduce(t, name=ctx.name("cuda.after_busy"))
    expect_equal(t.cpu(), np.full(1000, float(sum(range(1, ctx.world + 1))), np.float32),
                 "float32", "torch", "the next operation")
    return True


def cuda_ddp_hook(ctx, steps):
    """ciuic.torch.allreduce_hook on CUDA buckets: the future's value is the
    average over the ranks, on the same device."""
    import torch
    import ciuic.torch as ct
    dev = _cuda_device(ctx)
    state = ct.CiuicHookState(ctx.comm, prefix="cudaddp")
    for step in range(steps):
        for index, n in enumerate((1000, 257, 3)):
            inputs = [values(step * 10 + index, q, n, "float32") for q in range(ctx.world)]
            grads = make(inputs[ctx.rank], "float32", "torch").to(dev)
            out = ct.allreduce_hook(state, _FakeBucket(index, grads)).wait()
            assert out.is_cuda and out.device == dev, out.device
            expect_equal(out.cpu(), reference(inputs, "avg"), "float32", "torch",
                         f"hook step {step} bucket {index}")
    return steps


# -- device arrays through __cuda_array_interface__ (test_cuda_array_interface.py)

class CudaRuntime:
    """The CUDA runtime of this process through ctypes: the CUDA emulation's
    where libciuic was built against it (tests/cuda_emulation: the library
    is already loaded then), else a libcudart on the library path. None
    without either or without a device."""

    _NAMES = ("libciuic_cuda_emulation.so", "libcudart.so", "libcudart.so.13",
              "libcudart.so.12")

    @classmethod
    def load(cls):
        import ctypes
        for name in cls._NAMES:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            n = ctypes.c_int(0)
            if lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0:
                return cls(lib, name, n.value)
        return None

    def __init__(self, lib, name, devices):
        import ctypes
        self.lib, self.name, self.devices = lib, name, devices
        self.ctypes = ctypes
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                      ctypes.c_uint]
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc} ({self.name})")


class DeviceArray:
    """A C-contiguous device array of `dtype` with __cuda_array_interface__
    version 3, as CuPy and Numba arrays have: device memory of the current
    device, the data produced on `stream` (0: none given)."""

    H2D, D2H = 1, 2

    def __init__(self, rt, n, dtype, stream=0):
        self.rt, self.n, self.dtype, self.stream = rt, n, np.dtype(dtype), stream
        self.nbytes = n * self.dtype.itemsize
        p = rt.ctypes.c_void_p()
        rt.check(rt.lib.cudaMalloc(rt.ctypes.byref(p), max(self.nbytes, 1)), "cudaMalloc")
        self.ptr = p.value or 0

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.n,), "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": self.stream or None}

    def upload(self, host):
        host = np.ascontiguousarray(host, dtype=self.dtype)
        if self.stream and self.nbytes:
            # Written on the stream, then handed over: the daemon must wait
            # for it. From pinned memory, so that the copy is asynchronous
            # (one from pageable memory returns only once done); the
            # emulation's jitter (CMakeLists.txt) makes it late.
            ct, lib = self.rt.ctypes, self.rt.lib
            pinned = ct.c_void_p()
            self.rt.check(lib.cudaHostAlloc(ct.byref(pinned), self.nbytes, 0), "cudaHostAlloc")
            self._pinned = pinned.value
            ct.memmove(self._pinned, host.ctypes.data, self.nbytes)
            self.rt.check(lib.cudaMemcpyAsync(self.ptr, self._pinned, self.nbytes, self.H2D,
                                              self.stream), "cudaMemcpyAsync")
        else:
            self.rt.check(self.rt.lib.cudaMemcpy(self.ptr, host.ctypes.data, self.nbytes,
                                                 self.H2D), "cudaMemcpy")
        return self

    def download(self):
        out = np.empty(self.n, dtype=self.dtype)
        self.rt.check(self.rt.lib.cudaMemcpy(out.ctypes.data, self.ptr, self.nbytes, self.D2H),
                      "cudaMemcpy")
        return out

    def free(self):
        self.rt.check(self.rt.lib.cudaFree(self.ptr), "cudaFree")
        if getattr(self, "_pinned", None):
            self.rt.check(self.rt.lib.cudaFreeHost(self._pinned), "cudaFreeHost")
            self._pinned = None


def cai_collectives(ctx, dtype, seed):
    """Every collective on __cuda_array_interface__ device arrays (the
    daemon's device path), every op for the reductions, sizes 0, 1, odd and
    just over 4 MiB, against numpy; half of the inputs written on a stream
    the arrays name (the daemon must wait for it)."""
    rt = CudaRuntime.load()
    rt.check(rt.lib.cudaSetDevice(ctx.rank % rt.devices), "cudaSetDevice")
    s = rt.ctypes.c_void_p()
    rt.check(rt.lib.cudaStreamCreateWithFlags(rt.ctypes.byref(s), 1), "cudaStreamCreate")
    stream = s.value
    w, r = ctx.world, ctx.rank
    checks = 0
    arrays = []

    def dev(vals, n, on_stream=False):
        a = DeviceArray(rt, n, dtype, stream if on_stream else 0)
        arrays.append(a)
        return a.upload(make(vals, dtype, "numpy")) if vals is not None else a

    for n in SMALL_SIZES + (big_size(dtype),):
        for k, op in enumerate(OPS):
            inputs = [values(seed + n, q, n, dtype) for q in range(w)]
            t = dev(inputs[r], n, on_stream=k % 2 == 0)
            got = ctx.comm.allreduce(t, op=op, name=ctx.name(f"cai.ar.{dtype}.{op}.{n}"))
            assert got is t
            expect_equal(t.download(), reference(inputs, op), dtype, "numpy", f"allreduce {op} {n}")
            blocks = [values(seed + n + 1, q, n * w, dtype) for q in range(w)]
            inp, out = dev(blocks[r], n * w, on_stream=k % 2 == 1), dev(None, n)
            ctx.comm.reduce_scatter(out, inp, op=op, name=ctx.name(f"cai.rs.{dtype}.{op}.{n}"))
            want = reference([b[r * n:(r + 1) * n] for b in blocks], op)
            expect_equal(out.download(), want, dtype, "numpy", f"reduce_scatter {op} {n}")
            checks += 2
        inputs = [values(seed + n + 2, q, n, dtype) for q in range(w)]
        inp, out = dev(inputs[r], n), dev(None, n * w)
        ctx.comm.allgather(out, inp, name=ctx.name(f"cai.ag.{dtype}.{n}"))
        expect_equal(out.download(), np.concatenate(inputs), dtype, "numpy", f"allgather {n}")
        t = dev(inputs[r], n, on_stream=True)
        ctx.comm.broadcast(t, root=w - 1, name=ctx.name(f"cai.bc.{dtype}.{n}"))
        expect_equal(t.download(), inputs[w - 1], dtype, "numpy", f"broadcast {n}")
        blocks = [values(seed + n + 3, q, n * w, dtype) for q in range(w)]
        inp, out = dev(blocks[r], n * w), dev(None, n * w)
        ctx.comm.alltoall(out, inp, name=ctx.name(f"cai.a2a.{dtype}.{n}"))
        expect_equal(out.download(), alltoall_reference(blocks, r, n), dtype, "numpy",
                     f"alltoall {n}")
        checks += 3
        # alltoallv: rank i sends rank j 1 + (j - i) mod w elements.
        sizes = [[1 + (j - i) % w for j in range(w)] for i in range(w)]
        rows = [values(seed + n + 4, q, sum(sizes[q]), dtype) for q in range(w)]
        inp = dev(rows[r], sum(sizes[r]))
        out = dev(None, sum(sizes[i][r] for i in range(w)))
        ctx.comm.alltoall(out, inp, output_split_sizes=[sizes[i][r] for i in range(w)],
                          input_split_sizes=sizes[r], name=ctx.name(f"cai.a2av.{dtype}.{n}"))
        want = np.concatenate([rows[i][sum(sizes[i][:r]):sum(sizes[i][:r + 1])]
                               for i in range(w)])
        expect_equal(out.download(), want, dtype, "numpy", f"alltoallv {n}")
        checks += 1
        for a in arrays:
            a.free()
        arrays.clear()
    # alltoallv where the last rank sends nothing: its input is an empty
    # array as CuPy and Numba make them (data pointer 0, so no device of
    # its own, and a stream that is not the output's), its output is on its
    # device.
    sizes = [[0 if i == w - 1 else 2 + j for j in range(w)] for i in range(w)]
    rows = [values(seed + 5, q, sum(sizes[q]), dtype) for q in range(w)]

    class Empty:
        __cuda_array_interface__ = {"shape": (0,), "typestr": np.dtype(dtype).str,
                                    "data": (0, False), "version": 3, "strides": None,
                                    "stream": stream}

    inp = Empty() if r == w - 1 else dev(rows[r], sum(sizes[r]))
    out = DeviceArray(rt, sum(sizes[i][r] for i in range(w)), dtype, 1)  # on the legacy stream
    arrays.append(out)
    ctx.comm.alltoall(out, inp, output_split_sizes=[sizes[i][r] for i in range(w)],
                      input_split_sizes=sizes[r], name=ctx.name(f"cai.a2av0.{dtype}"))
    want = np.concatenate([rows[i][sum(sizes[i][:r]):sum(sizes[i][:r + 1])] for i in range(w)])
    expect_equal(out.download(), want, dtype, "numpy", "alltoallv, the last rank sending nothing")
    for a in arrays:
        a.free()
    return checks + 1


def gpu_memory_line(socket, want, seconds=10):
    """The "gpu memory" line of `ciuicctl status` for the daemon at `socket`
    (the ciuicctl built beside $CIUICD), polled until it starts with `want`."""
    import subprocess
    daemon = os.environ.get("CIUICD") or os.path.join(
        os.path.dirname(__file__), "..", "..", "..", "build", "daemon", "ciuicd")
    ctl = os.path.join(os.path.dirname(daemon), "..", "tools", "ctl", "ciuicctl")
    line = ""
    deadline = time.monotonic() + seconds
    while not line.startswith(want) and time.monotonic() < deadline:
        out = subprocess.run([ctl, "--socket", socket, "status"], capture_output=True,
                             text=True, timeout=30).stdout
        line = next((x.strip() for x in out.splitlines() if "gpu memory" in x), "")
        if not line.startswith(want):
            time.sleep(0.1)
    return line


def cai_two_communicators(ctx):
    """Two communicators of one process (two jobs, as a data-parallel and a
    tensor-parallel group) with arrays in one allocation, as PyTorch's
    allocator carves tensors from one segment. First the second one's
    allreduce runs while the first one's is held for rank 1's stream (a
    host function on it waits) with the allocation mapped: ciuicd maps it
    once for the process; before, the second open failed. Then one of each
    in flight at once, and the first goes on once the second has closed.
    Every result against numpy."""
    import threading
    import ciuic
    rt = CudaRuntime.load()
    ct = rt.ctypes
    rt.check(rt.lib.cudaSetDevice(ctx.rank % rt.devices), "cudaSetDevice")
    w, r, n = ctx.world, ctx.rank, 100003
    other = ciuic.init(rank=r, world_size=w, job=f"{ctx.job}.{ctx.name('second')}",
                       socket=ctx.socket, arena_bytes=1 << 20)
    whole = DeviceArray(rt, 2 * n, "float32")

    class View:
        def __init__(self, first, stream=None):
            self.__cuda_array_interface__ = dict(
                whole.__cuda_array_interface__, shape=(n,), stream=stream,
                data=(whole.ptr + first * whole.dtype.itemsize, False))

    views = (View(0), View(n))
    s = ct.c_void_p()
    rt.check(rt.lib.cudaStreamCreateWithFlags(ct.byref(s), 1), "cudaStreamCreate")
    release = threading.Event()
    host_fn = ct.CFUNCTYPE(None, ct.c_void_p)(lambda _: release.wait(30))
    rt.lib.cudaLaunchHostFunc.argtypes = [ct.c_void_p, ct.CFUNCTYPE(None, ct.c_void_p),
                                          ct.c_void_p]
    rt.lib.cudaStreamSynchronize.argtypes = [ct.c_void_p]
    rt.lib.cudaStreamDestroy.argtypes = [ct.c_void_p]
    inputs = [[values(7 + j, q, n, "float32") for q in range(w)] for j in (0, 1)]
    whole.upload(make(np.concatenate([inputs[0][r], inputs[1][r]]), "float32", "numpy"))
    if r == 1:
        rt.check(rt.lib.cudaLaunchHostFunc(s.value, host_fn, None), "cudaLaunchHostFunc")
    held = ctx.comm.allreduce_async(View(0, s.value), name=ctx.name("cai.two.held"))
    if r == 0:  # until ciuicd has mapped both ranks' allocations for it
        want = "gpu memory      2 trainer allocations mapped"
        line = gpu_memory_line(ctx.socket, want)
        assert line.startswith(want), line
    try:
        other.allreduce(views[1], name=ctx.name("cai.two.while-held"))
    finally:
        release.set()
    held.wait()
    got = whole.download()
    for j in (0, 1):
        expect_equal(got[j * n:(j + 1) * n], reference(inputs[j], "sum"), "float32", "numpy",
                     f"communicator {j}, the first one's operation held")
    checks = 2
    for step in range(3):
        inputs = [[values(10 * step + j, q, n, "float32") for q in range(w)] for j in (0, 1)]
        whole.upload(make(np.concatenate([inputs[0][r], inputs[1][r]]), "float32", "numpy"))
        works = [comm.allreduce_async(views[j], name=ctx.name(f"cai.two.{j}"))
                 for j, comm in enumerate((ctx.comm, other))]
        for work in works:
            work.wait()
        got = whole.download()
        for j in (0, 1):
            expect_equal(got[j * n:(j + 1) * n], reference(inputs[j], "sum"), "float32", "numpy",
                         f"step {step}, communicator {j}")
            checks += 1
    other.close()
    inputs = [values(99, q, n, "float32") for q in range(w)]
    whole.upload(make(np.concatenate([inputs[r], inputs[r]]), "float32", "numpy"))
    ctx.comm.allreduce(views[0], op="max", name=ctx.name("cai.two.after"))
    expect_equal(whole.download()[:n], reference(inputs, "max"), "float32", "numpy",
                 "after the second communicator closed")
    whole.free()
    rt.check(rt.lib.cudaStreamSynchronize(s.value), "cudaStreamSynchronize")
    rt.check(rt.lib.cudaStreamDestroy(s.value), "cudaStreamDestroy")
    return checks + 1


def cai_refusals(ctx):
    """What the device-array path refuses, each with a message naming it."""
    import ciuic
    rt = CudaRuntime.load()
    rt.check(rt.lib.cudaSetDevice(0), "cudaSetDevice")
    a = DeviceArray(rt, 8, "float32").upload(np.arange(8, dtype=np.float32))
    said = []

    class Like:
        def __init__(self, **changes):
            self.__cuda_array_interface__ = dict(a.__cuda_array_interface__, **changes)

    for arr, words in [
            (Like(typestr="<c8"), "typestr '<c8' is not a ciuic dtype"),
            (Like(shape=(4, 2), strides=(4, 16)), "not C-contiguous"),
            (Like(shape=(4, 2), strides=(8,)), "do not match shape"),
            (Like(mask=object()), "masked"),
            (Like(stream=0), "stream 0 is ambiguous"),
            (Like(data=(a.ptr, True)), "read-only"),
            (Like(data=(ctx.comm.empty((8,), np.float32).ctypes.data, False)),
             "not CUDA device memory")]:
        try:
            ctx.comm.allreduce(arr, name=ctx.name("cai.refused"))
        except ciuic.InvalidArgumentError as e:
            assert words in str(e), (words, str(e))
            said.append(words)
    # Mixed with a host array: refused as a mismatch of kinds.
    try:
        ctx.comm.allgather(np.zeros(8 * ctx.world, np.float32), a, name=ctx.name("cai.mixed"))
    except ciuic.InvalidArgumentError as e:
        assert "both CUDA tensors (or device arrays) or neither" in str(e), str(e)
        said.append("mixed")
    a.free()
    return len(said)


# ------------------------------------------------------------ load balance

def balance_skew(ctx, slow_rank, delay_s, steps, per_step, n):
    """`steps` steps of `per_step` asynchronous allreduces of n float32 each,
    waited at the end of the step, as DDP's buckets are: before each
    submission rank `slow_rank` works (sleeps) `delay_s`, the others
    delay_s / 2. The last balance() measures the window; its result, the
    split of 1000 samples, and the reductions' check."""
    comm = ctx.comm
    comm.balance()  # the window starts here
    x = np.full(n, float(ctx.rank + 1), dtype=np.float32)
    want = float(sum(range(1, ctx.world + 1)))
    for _ in range(steps):
        works = []
        bufs = []
        for _ in range(per_step):
            time.sleep(delay_s if ctx.rank == slow_rank else delay_s / 2)
            b = x.copy()
            bufs.append(b)
            works.append(comm.allreduce_async(b))
        for w in works:
            w.wait()
        for b in bufs:
            if not np.all(b == want):
                raise AssertionError(f"allreduce gave {b[:4]}, want {want}")
    b = comm.balance(samples=steps * (8 if ctx.rank == slow_rank else 16))
    return b.as_dict(), b.split(1000)


def balance_bad_samples(ctx):
    import ciuic
    try:
        ctx.comm.balance(samples=-3)
    except ciuic.InvalidArgumentError as e:
        return str(e)
    raise AssertionError("balance(samples=-3) was taken")


def balance_many_ops(ctx, n):
    """n tiny allreduces in one window: balance() measures the newest 1024."""
    comm = ctx.comm
    comm.balance()
    x = np.zeros(1, dtype=np.float32)
    for _ in range(n):
        comm.allreduce(x)
    b = comm.balance()
    return b.ops, b.dropped

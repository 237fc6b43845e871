"""What the processes of conftest.TorchPool run: torch.distributed with the
"ciuic" backend (ciuic/torch_backend.py).

Each task runs with torchrun's environment for its shape (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a fresh port, hence
a fresh ciuic job, per task; CIUIC_SOCKET of the rank's "node"), calls
dist.init_process_group itself, and the worker destroys the process group
and closes its ciuic sessions afterwards. Expected values come from
tests/ranks.py's numpy references (exact for the values used).
"""

import datetime
import gc
import os
import pathlib
import sys
import time
import traceback

import numpy as np

import ranks
from ranks import expect_equal, make, mn_values, reference, values

OPS = ("sum", "avg", "prod", "min", "max")
SIZES = (0, 1, 7)
BIG = (1 << 19) + 1  # elements: odd, 0.5 to 4 MiB by dtype (several chunks between nodes)


def worker_main(proc, inq, outq):
    try:
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist
        import ciuic.torch
        outq.put((proc, "ok", None))
    except BaseException:  # noqa: BLE001
        outq.put((proc, "err", traceback.format_exc()))
        return
    while True:
        item = inq.get()
        if item is None:
            break
        env, fn, args = item
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            outq.put((proc, "ok", globals()[fn](*args)))
        except BaseException:  # noqa: BLE001
            outq.put((proc, "err", traceback.format_exc()))
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (the next task starts afresh anyway)
                pass
            ciuic.torch.close_all()
            gc.collect()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _init(**kw):
    import torch.distributed as dist
    import ciuic.torch  # noqa: F401
    dist.init_process_group("ciuic", **kw)
    return dist.get_rank(), dist.get_world_size()


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def _t(vals, dtype):
    return make(vals, dtype, "torch")


def _check(got, want_vals, dtype, what):
    expect_equal(got.reshape(-1), np.asarray(want_vals).reshape(-1), dtype, "torch", what)


# ------------------------------------------------------------ collectives

def collectives(dtypes, seed, big):
    """Every collective torch calls on a process group, for `dtypes`, sizes
    0, 1, 7 and (with `big`) BIG, against numpy; returns the checks made."""
    import torch
    import torch.distributed as dist
    rank, world = _init()
    R = dist.ReduceOp
    torch_ops = {"sum": R.SUM, "avg": R.AVG, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}
    checks = 0
    last = world - 1
    for dtype in dtypes:
        sizes = SIZES + ((BIG,) if big else ())
        for op in OPS:
            for n in sizes if op == "sum" else SIZES:
                inputs = [mn_values(seed + n, r, n, dtype, op) for r in range(world)]
                t = _t(inputs[rank], dtype)
                dist.all_reduce(t, op=torch_ops[op])
                _check(t, reference(inputs, op), dtype, f"all_reduce {dtype} {op} n={n}")
                checks += 1
        # In place on a non-contiguous tensor (staged and copied back).
        inputs = [values(seed, r, 12, dtype) for r in range(world)]
        t = _t(inputs[rank], dtype).reshape(3, 4).t()
        dist.all_reduce(t)
        _check(t.t(), reference(inputs, "sum"), dtype, f"all_reduce {dtype} non-contiguous")
        for n in sizes:
            inputs = [values(seed + 1 + n, r, n, dtype) for r in range(world)]
            for root in sorted({0, last}):
                t = _t(inputs[rank], dtype)
                dist.broadcast(t, src=root)
                _check(t, inputs[root], dtype, f"broadcast {dtype} root={root} n={n}")
            outs = [torch.full((n,), 7, dtype=_torch_dtype(dtype)) for _ in range(world)]
            dist.all_gather(outs, _t(inputs[rank], dtype))
            _check(torch.cat(outs), np.concatenate(inputs), dtype, f"all_gather {dtype} n={n}")
            out = torch.empty(n * world, dtype=_torch_dtype(dtype))
            dist.all_gather_into_tensor(out, _t(inputs[rank], dtype))
            _check(out, np.concatenate(inputs), dtype, f"all_gather_into_tensor {dtype} n={n}")
            checks += 4
        for op in ("sum", "max", "avg"):
            for n in sizes if op == "sum" else SIZES:
                inputs = [values(seed + 2 + n, r, n * world, dtype) for r in range(world)]
                want = reference(inputs, op)[rank * n:(rank + 1) * n]
                out = torch.zeros(n, dtype=_torch_dtype(dtype))
                dist.reduce_scatter(out, list(_t(inputs[rank], dtype).chunk(world)) if n else
                                    [torch.zeros(0, dtype=out.dtype)] * world,
                                    op=torch_ops[op])
                _check(out, want, dtype, f"reduce_scatter {dtype} {op} n={n}")
                out = torch.zeros(n, dtype=_torch_dtype(dtype))
                dist.reduce_scatter_tensor(out, _t(inputs[rank], dtype), op=torch_ops[op])
                _check(out, want, dtype, f"reduce_scatter_tensor {dtype} {op} n={n}")
                checks += 2
        for n in sizes:
            n = n if n < BIG else BIG // world
            inputs = [values(seed + 3 + n, r, n * world, dtype) for r in range(world)]
            out = torch.empty(n * world, dtype=_torch_dtype(dtype))
            dist.all_to_all_single(out, _t(inputs[rank], dtype))
            _check(out, ranks.alltoall_reference(inputs, rank, n), dtype,
                   f"all_to_all_single {dtype} n={n}")
            checks += 1
        checks += _alltoall_splits(dtype, seed, rank, world)
        for n in sizes:
            # reduce: the root gets the reduction, the others keep their input.
            inputs = [values(seed + 4 + n, r, n, dtype) for r in range(world)]
            t = _t(inputs[rank], dtype)
            dist.reduce(t, dst=last, op=R.SUM)
            _check(t, reference(inputs, "sum") if rank == last else inputs[rank], dtype,
                   f"reduce {dtype} n={n}")
            # gather to rank 0, scatter from the last rank.
            gl = [torch.zeros(n, dtype=_torch_dtype(dtype)) for _ in range(world)] \
                if rank == 0 else None
            dist.gather(_t(inputs[rank], dtype), gather_list=gl, dst=0)
            if rank == 0:
                _check(torch.cat(gl), np.concatenate(inputs), dtype, f"gather {dtype} n={n}")
            out = torch.zeros(n, dtype=_torch_dtype(dtype))
            pieces = [_t(x, dtype) for x in inputs]
            dist.scatter(out, scatter_list=pieces if rank == last else None, src=last)
            _check(out, inputs[rank], dtype, f"scatter {dtype} n={n}")
            checks += 3
    return checks


def _alltoall_splits(dtype, seed, rank, world, cols=3):
    """all_to_all_single with split sizes (uneven, with empty pairs) and
    all_to_all on lists of per-pair sizes."""
    import torch
    import torch.distributed as dist
    checks = 0
    for pattern in (1, 2, 3):
        rows = [[ranks.split_rows(i, j, pattern) % 50 for j in range(world)]
                for i in range(world)]
        inputs = [values(seed + pattern, r, sum(rows[r]) * cols, dtype) for r in range(world)]
        src = _t(inputs[rank], dtype).reshape(sum(rows[rank]), cols)
        recv_rows = [rows[i][rank] for i in range(world)]
        out = torch.zeros(sum(recv_rows), cols, dtype=_torch_dtype(dtype))
        dist.all_to_all_single(out, src, output_split_sizes=recv_rows,
                               input_split_sizes=rows[rank])
        want = []
        for i in range(world):
            at = sum(rows[i][:rank]) * cols
            want.append(inputs[i][at:at + rows[i][rank] * cols])
        _check(out, np.concatenate(want), dtype, f"all_to_all_single splits {pattern}")
        # The same exchange as lists of tensors.
        ins = list(torch.split(src, rows[rank]))
        outs = [torch.zeros(r, cols, dtype=_torch_dtype(dtype)) for r in recv_rows]
        dist.all_to_all(outs, ins)
        _check(torch.cat(outs), np.concatenate(want), dtype, f"all_to_all lists {pattern}")
        checks += 2
    return checks


def movable_dtypes(seed):
    """Dtypes ciuic does not reduce (bool, int16, complex64) go through the
    collectives that only move data, as bytes; reductions refuse them,
    except complex SUM, which torch itself turns into a float one."""
    import torch
    import torch.distributed as dist
    import ciuic
    rank, world = _init()
    checks = 0
    rng = np.random.default_rng(seed + rank)
    mine = {
        "bool": torch.from_numpy(rng.integers(0, 2, 9).astype(bool)),
        "int16": torch.from_numpy(rng.integers(-999, 999, 9).astype(np.int16)),
        "complex64": torch.from_numpy((rng.standard_normal(9) + 1j * rng.standard_normal(9))
                                      .astype(np.complex64)),
    }
    for name, x in mine.items():
        everyone = [torch.zeros_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        assert bool(everyone[rank].eq(x).all()), name
        t = x.clone()
        dist.broadcast(t, src=world - 1)
        assert bool(t.eq(everyone[world - 1]).all()), name
        out = torch.zeros(world * 9, dtype=x.dtype)
        dist.all_gather_into_tensor(out, x)
        assert bool(out.eq(torch.cat(everyone)).all()), name
        src = torch.cat([x] * world)
        out = torch.zeros_like(src)
        dist.all_to_all_single(out, src)
        assert bool(out.eq(torch.cat(everyone)).all()), name
        if x.is_complex():
            t = x.clone()
            dist.all_reduce(t)
            assert torch.allclose(t, sum(everyone), rtol=1e-6), (t, sum(everyone))
            checks += 5
            continue
        try:
            dist.all_reduce(x.clone())
        except ciuic.InvalidArgumentError as e:
            assert "cannot be reduced" in str(e) and str(x.dtype) in str(e), e
        else:
            raise AssertionError(f"all_reduce of {name} was not refused")
        checks += 5
    return checks


def object_collectives_and_barrier():
    """all_gather_object, broadcast_object_list, gather_object,
    scatter_object_list (torch builds them on allgather/broadcast/gather/
    scatter of byte tensors) and barrier."""
    import torch.distributed as dist
    rank, world = _init()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * (rank * 37)})
    assert objs == [{"rank": r, "pad": "x" * (r * 37)} for r in range(world)], objs
    lst = [("hello", 3.5, [1, 2]), None] if rank == world - 1 else [None, None]
    dist.broadcast_object_list(lst, src=world - 1)
    assert lst == [("hello", 3.5, [1, 2]), None], lst
    got = [None] * world if rank == 0 else None
    dist.gather_object(f"r{rank}", got, dst=0)
    if rank == 0:
        assert got == [f"r{r}" for r in range(world)], got
    out = [None]
    dist.scatter_object_list(out, [f"to{r}" for r in range(world)] if rank == 0 else None,
                             src=0)
    assert out == [f"to{rank}"], out
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(0.5)
    dist.barrier()
    waited = time.monotonic() - t0
    assert waited >= 0.45, f"rank {rank} left the barrier after {waited:.3f} s"
    return 5


def async_and_refusals():
    """Async work objects (wait, is_completed, get_future, result) and the
    clear refusals: PREMUL_SUM, bitwise ops, multi-tensor lists, bad split
    sizes, wrong list lengths, point-to-point."""
    import torch
    import torch.distributed as dist
    import ciuic
    import ciuic.torch as ct
    ct.register()  # again: idempotent (torch asserts on a second registration)
    ct.register()
    rank, world = _init()
    t = torch.full((1000,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success()
    assert fut.wait()[0] is t and float(t[0]) == world * (world + 1) / 2
    assert work.result()[0] is t
    # A future chained before completion, completed by ciuic's waiter thread.
    outs = [torch.zeros(4) for _ in range(world)]
    fut = dist.all_gather(outs, torch.full((4,), float(rank)), async_op=True).get_future()
    got = fut.then(lambda f: [float(o[0]) for o in f.value()[0]]).wait()
    assert got == [float(r) for r in range(world)], got
    R = dist.ReduceOp
    refusals = [
        (lambda: dist.all_reduce(torch.ones(2), op=R.BAND), ciuic.UnimplementedError, "bitwise"),
        (lambda: dist.all_reduce(torch.ones(2), op=R.BXOR), ciuic.UnimplementedError, "BXOR"),
        (lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
         ciuic.UnimplementedError, "PREMUL_SUM"),
        (lambda: dist.all_to_all_single(torch.zeros(5), torch.zeros(5)),
         ciuic.InvalidArgumentError, "equal"),
        (lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4),
                                        input_split_sizes=[1] * (world + 1)),
         ciuic.InvalidArgumentError, "input_split_sizes"),
        (lambda: dist.all_gather([torch.zeros(2)] * (world + 1), torch.zeros(2)),
         ciuic.InvalidArgumentError, "output tensors"),
        (lambda: dist.all_gather([torch.zeros(3)] * world, torch.zeros(2)),
         ciuic.InvalidArgumentError, "elements"),
        (lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(2)),
         ciuic.InvalidArgumentError, "times"),
        (lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(3)),
         ciuic.InvalidArgumentError, "times"),
        (lambda: dist.all_reduce_multigpu([torch.ones(2), torch.ones(2)]),
         ciuic.InvalidArgumentError, "length 1"),
        (lambda: dist.send(torch.ones(1), (rank + 1) % world), ciuic.UnimplementedError,
         "point-to-point"),
        (lambda: dist.recv(torch.ones(1), (rank + 1) % world), ciuic.UnimplementedError,
         "point-to-point"),
    ]
    for call, cls, match in refusals:
        try:
            call()
        except cls as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"not refused: {match}")
    # The group still works after the refusals (names stayed aligned).
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [world] * 3
    return len(refusals)


# ------------------------------------------------------------ errors

def mismatch_everywhere():
    """Rank 0's node submits 3 elements, the others 4 (one node: rank 0
    submits 3): every rank's wait() raises InvalidArgumentError naming the
    operation; sync, async and through the future. The group goes on
    working afterwards."""
    import torch
    import torch.distributed as dist
    import ciuic
    rank, world = _init()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    odd = rank == 0 if per_node == world else rank < per_node
    results = []
    for how in ("sync", "wait", "future"):
        t = torch.ones(3 if odd else 4)
        try:
            if how == "sync":
                dist.all_reduce(t)
            elif how == "wait":
                dist.all_reduce(t, async_op=True).wait()
            else:
                dist.all_reduce(t, async_op=True).get_future().wait()
        except ciuic.InvalidArgumentError as e:
            results.append((how, type(e).__name__, str(e)))
        except RuntimeError as e:  # a future's error arrives wrapped by torch
            assert "mismatched" in str(e), e
            results.append((how, "RuntimeError", str(e)))
        else:
            raise AssertionError(f"{how}: no error for mismatched sizes")
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [world, world]
    return results


def timeout_raised(timeout_s):
    """A group with a short timeout: rank 0's all_reduce, which no other rank
    joins, raises DeadlineExceededError from wait() after about the
    timeout; Work.wait(timeout) raises while the operation goes on, and the
    operation then completes when the others join."""
    import torch
    import torch.distributed as dist
    import ciuic
    rank, world = _init()
    short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
    took = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2), group=short)
        except ciuic.DeadlineExceededError as e:
            took = time.monotonic() - t0
            assert "torch.0" in str(e), e
        else:
            raise AssertionError("no timeout")
    dist.barrier()
    # Work.wait(timeout): the last rank joins 1.5 s late.
    t = torch.ones(2)
    if rank == world - 1:
        time.sleep(1.5)
    work = dist.all_reduce(t, async_op=True)
    wait_raised = False
    if rank != world - 1:
        try:
            work.wait(datetime.timedelta(milliseconds=200))
        except ciuic.DeadlineExceededError:
            wait_raised = True
    work.wait()
    assert t.tolist() == [world, world]
    return took, wait_raised


# ------------------------------------------------------------ training

def _net(torch, seed, shift):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96), torch.nn.ReLU(),
        torch.nn.Linear(96, 4))
    if shift:  # DDP must broadcast rank 0's parameters
        for p in net.parameters():
            p.data.add_(1.0)
    return net


def ddp_variants(steps):
    """The same model and data trained with DDP over a gloo group and, on the
    ciuic default group, DDP alone, DDP + ciuic.torch.allreduce_hook, DDP +
    ZeroRedundancyOptimizer and DDP over gloo + ZeroRedundancyOptimizer
    over gloo; returns the parameters of each (flat float64 lists)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ciuic.torch as ct
    rank, world = _init()
    gloo = dist.new_group(backend="gloo")
    dist._DEFAULT_FIRST_BUCKET_BYTES = 8192  # several buckets

    def train(group, hook=False, zero=False):
        net = _net(torch, 1234, shift=rank == 1)
        model = DDP(net, bucket_cap_mb=0.02, process_group=group)
        if hook:
            state = ct.CiuicHookState(ct.communicator(group), prefix="hook")
            model.register_comm_hook(state, ct.allreduce_hook)
        if zero:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                          process_group=group, lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(99 + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 4, generator=g)
        losses = []
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
        return flat.tolist(), losses

    default = dist.distributed_c10d._get_default_group()
    return {"gloo": train(gloo), "ciuic": train(default), "hook": train(default, hook=True),
            "zero": train(default, zero=True), "gloo_zero": train(gloo, zero=True)}


def zero2_example(steps, seed):
    """examples/train_zero2.py on this group; rank 0 also trains the same
    model in one process on the concatenated batches. Returns on rank 0
    (largest relative difference of a parameter tensor, parameter tensors
    compared, losses, the one-process losses)."""
    examples = pathlib.Path(__file__).resolve().parents[3] / "examples"
    sys.path.insert(0, str(examples))
    try:
        import train_zero2
    finally:
        sys.path.remove(str(examples))
    rank, world = _init()
    result = train_zero2.train(steps=steps, seed=seed)
    if rank != 0:
        return None
    ref = train_zero2.train_single(world=world, steps=steps, seed=seed)
    worst = 0.0
    for name, p in result["params"].items():
        q = ref["params"][name]
        worst = max(worst, float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)))
    return worst, len(result["params"]), result["losses"], ref["losses"]


def two_groups(steps):
    """Data- and model-parallel groups on 2 nodes x 2 ranks: dp = the same
    local rank on both nodes (across nodes), mp = the ranks of one node. In
    each step an mp all_reduce runs async beside the DDP step over dp.
    Returns (dp parameters checksum, mp results)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ciuic.torch as ct
    rank, world = _init()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // per_node
    dp_groups = [dist.new_group([n * per_node + l for n in range(nodes)])
                 for l in range(per_node)]
    mp_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
                 for n in range(nodes)]
    dp = dp_groups[rank % per_node]
    mp = mp_groups[rank // per_node]
    dp_comm, mp_comm = ct.communicator(dp), ct.communicator(mp)
    layout = [(dp_comm.world_size, dp_comm.local_size, bool(dp_comm.coordinator)),
              (mp_comm.world_size, mp_comm.local_size, bool(mp_comm.coordinator))]
    model = DDP(_net(torch, 7, shift=False), process_group=dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    mp_sums = []
    for step in range(steps):
        act = torch.full((5,), float(rank + step))
        work = dist.all_reduce(act, group=mp, async_op=True)
        loss = model(torch.randn(8, 32, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        work.wait()
        mp_sums.append(float(act[0]))
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    return checksum, mp_sums, layout, dp_comm.job_id, mp_comm.job_id


# ------------------------------------------------------------ launchers

def slurm_layout():
    """init_process_group("ciuic") from Slurm's environment (no torchrun
    variables: rank and world size passed, as an srun script does)."""
    import torch
    import torch.distributed as dist
    import ciuic.torch as ct
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    _init(init_method=f"tcp://127.0.0.1:{os.environ['TEST_STORE_PORT']}", rank=rank,
          world_size=world)
    c = ct.communicator()
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [world] * 3
    return c.rank, c.world_size, c.local_rank, c.local_size, c.job_id


def store_layout():
    """No launcher variables at all (as under mp.spawn): the node-local
    layout comes from the store, the job id from the store too."""
    import torch
    import torch.distributed as dist
    import ciuic.torch as ct
    rank, world = int(os.environ["TEST_RANK"]), int(os.environ["TEST_WORLD"])
    _init(init_method=f"tcp://127.0.0.1:{os.environ['TEST_STORE_PORT']}", rank=rank,
          world_size=world)
    c = ct.communicator()
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [sum(range(world))] * 2
    return c.rank, c.world_size, c.local_rank, c.local_size, c.job_id



def ciuic_group_under_gloo():
    """The default group on gloo, a new_group(backend="ciuic") beside it:
    its job id from the environment, its coordinator (several nodes) from
    MASTER_ADDR and CIUIC_PEER_PORT, its layout from the store."""
    import torch
    import torch.distributed as dist
    import ciuic.torch as ct
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.new_group(backend="ciuic")
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=g)
    assert t.tolist() == [float(sum(range(world)))] * 3, t
    c = ct.communicator(g)
    return c.job_id, c.local_rank, c.local_size, dist.get_backend(g)

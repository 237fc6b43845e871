"""ciuic: collectives through the node's ciuicd, for numpy and torch (CPU).

    import ciuic
    comm = ciuic.init()                      # torchrun's environment
    comm.allreduce(tensor)                   # in place, sum
    work = comm.allreduce_async(tensor, op="avg", name="grads.0")
    ...                                      # compute meanwhile
    work.wait()
    x = comm.empty((1024, 1024), torch.float32)   # lives in shared memory: zero copy

Operations are matched across ranks by ``name``; unnamed ones by their order
of submission on the communicator (names starting with '#' are reserved).
Arrays and tensors must be C-contiguous and on the CPU, or torch CUDA
tensors, or device arrays with ``__cuda_array_interface__`` (CuPy, Numba);
every SDK dtype is supported: float32, float64, float16, bfloat16 (torch
only: numpy and the interface have none), int8, uint8, int32, int64. Errors raise :class:`ciuic.Error` subclasses
(``InvalidArgumentError``, ``UnavailableError``, ...), see ciuic.errors.

Waits release the GIL and are interruptible by Ctrl-C (KeyboardInterrupt);
the daemon frees a session when its process exits, whatever the way.
"""

import atexit
import collections
import os
import re
import threading
import time
import weakref

import numpy as np

from . import _ciuic
from . import balance as _balance
from .balance import Balance
from .errors import *  # noqa: F401,F403  (Error, InvalidArgumentError, ...)
from .errors import Error, InvalidArgumentError, StatusCode, _make_error, error_class

_ciuic._set_error_factory(_make_error)

__all__ = ["init", "Communicator", "Work", "Balance", "Error", "StatusCode", "error_class",
           "default_socket_path", "resolve_coordinator", "launch_env", "DEFAULT_PEER_PORT",
           "DTYPES", "REDUCE_OPS"]

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
REDUCE_OPS = ("sum", "avg", "min", "max", "prod")

# The names of Communicator.balance()'s own operations start with it.
_BALANCE_PREFIX = "ciuic.balance."
# At most this many of a rank's operations measured per balance() call.
_BALANCE_MAX_OPS = 1024

_NUMPY_DTYPES = {
    np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
    np.dtype(np.float16): "float16", np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8",
    np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
}


def default_socket_path():
    """$CIUIC_SOCKET, else /run/ciuic/ciuicd.sock."""
    return _ciuic.default_socket_path()


def _torch():
    """torch, if it is already imported (ciuic does not import it itself)."""
    import sys
    return sys.modules.get("torch")


def _is_tensor(obj):
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _as_buffer(obj, what):
    """(object with the buffer protocol, dtype override or None) for an array/tensor."""
    if isinstance(obj, np.ndarray):
        if obj.dtype not in _NUMPY_DTYPES:
            raise InvalidArgumentError(
                f"{what}: numpy dtype {obj.dtype} is not a ciuic dtype ({', '.join(DTYPES)})")
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError(
                f"{what}: the array is not C-contiguous (use numpy.ascontiguousarray)")
        return obj, None
    if _is_tensor(obj):
        torch = _torch()
        if obj.device.type != "cpu":
            raise InvalidArgumentError(
                f"{what}: tensor on {obj.device}; ciuic takes CPU and CUDA tensors")
        if obj.layout != torch.strided:
            raise InvalidArgumentError(f"{what}: {obj.layout} tensors are not supported")
        if not obj.is_contiguous():
            raise InvalidArgumentError(
                f"{what}: the tensor is not contiguous (use tensor.contiguous())")
        t = obj.detach()
        if t.dtype == torch.bfloat16:
            # numpy has no bfloat16: hand over the same bytes as int16.
            return t.view(torch.int16).numpy(), "bfloat16"
        if t.dtype not in _TORCH_DTYPES():
            raise InvalidArgumentError(
                f"{what}: torch dtype {t.dtype} is not a ciuic dtype ({', '.join(DTYPES)})")
        return t.numpy(), None
    return obj, None  # anything else with the buffer protocol (checked by _ciuic)


class _CudaArray:
    """A device array of another library (CuPy, Numba, JAX, ...), taken
    through its ``__cuda_array_interface__`` (versions 2 and 3): C-contiguous,
    of a ciuic dtype (no bfloat16: the interface has no typestr for it), not
    masked. Its device is the memory's own (cudaPointerGetAttributes); the
    daemon's work is ordered after its ``stream`` (version 3). Absent or
    None (the data is ready), the work is ordered after the legacy default
    stream, the SDK's default: correct, though that also waits for work
    queued on other blocking streams of the device."""

    _TYPESTRS = {"<f4": "float32", "<f8": "float64", "<f2": "float16", "|i1": "int8",
                 "<i1": "int8", "|u1": "uint8", "<u1": "uint8", "<i4": "int32", "<i8": "int64"}

    def __init__(self, obj, what):
        try:
            cai = obj.__cuda_array_interface__
            shape = tuple(int(d) for d in cai["shape"])
            typestr = cai["typestr"]
            ptr, readonly = cai["data"]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"{what}: a malformed __cuda_array_interface__ ({e!r})")
        dtype = self._TYPESTRS.get(typestr)
        if dtype is None:
            raise InvalidArgumentError(
                f"{what}: __cuda_array_interface__ typestr {typestr!r} is not a ciuic dtype "
                f"({', '.join(d for d in DTYPES if d != 'bfloat16')}; bfloat16 has no typestr)")
        if cai.get("mask") is not None:
            raise InvalidArgumentError(f"{what}: masked device arrays are not supported")
        itemsize = int(typestr[2:])
        strides = cai.get("strides")
        n = 1
        for d in shape:
            n *= d
        if strides is not None and len(tuple(strides)) != len(shape):
            raise InvalidArgumentError(
                f"{what}: __cuda_array_interface__ strides {tuple(strides)} do not match "
                f"shape {shape}")
        if strides is not None and n:  # an empty array moves nothing: any strides do
            want = itemsize
            for d, st in zip(reversed(shape), reversed(tuple(strides))):
                if d > 1 and st != want:
                    raise InvalidArgumentError(
                        f"{what}: the device array is not C-contiguous (strides {tuple(strides)})")
                want *= d
        stream = cai.get("stream") if int(cai.get("version", 0)) >= 3 else None
        if stream == 0:
            raise InvalidArgumentError(
                f"{what}: __cuda_array_interface__ stream 0 is ambiguous (the interface "
                "disallows it: 1 is the legacy default stream, 2 the per-thread one)")
        self.original = obj
        self.shape = shape
        self.dtype = dtype
        self.ptr = int(ptr or 0)
        self.readonly = bool(readonly)
        self.stream = int(stream or 0)  # 0: none given
        self._numel = n
        # An empty array moves nothing: its pointer (often 0) is not looked
        # at, and its device (None) is the other argument's.
        self.index = _ciuic.device_of(self.ptr) if n else None
        self.device = f"cuda:{self.index}" if n else "cuda (empty)"

    def numel(self):
        return self._numel


def _cuda_array(obj, what):
    """`obj`, or a _CudaArray for a device array that is not a torch tensor."""
    if obj is None or _is_tensor(obj) or isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return _CudaArray(obj, what)
    return obj


def _original(obj):
    return obj.original if isinstance(obj, _CudaArray) else obj


def _where(obj):
    if isinstance(obj, _CudaArray) or _is_tensor(obj):
        return str(obj.device)
    return "the host"


def _is_cuda(obj):
    """True for a torch tensor on a CUDA device or another library's device
    array (_CudaArray)."""
    return isinstance(obj, _CudaArray) or (_is_tensor(obj) and obj.device.type == "cuda")


def _device_args(obj, what):
    """(data_ptr, device index, ciuic dtype name, numel) of a CUDA tensor or
    device array."""
    if isinstance(obj, _CudaArray):
        return obj.ptr, obj.index, obj.dtype, obj.numel()
    torch = _torch()
    if obj.layout != torch.strided:
        raise InvalidArgumentError(f"{what}: {obj.layout} tensors are not supported")
    if not obj.is_contiguous():
        raise InvalidArgumentError(f"{what}: the tensor is not contiguous (use tensor.contiguous())")
    dtype = _TORCH_DTYPES().get(obj.dtype)
    if dtype is None:
        raise InvalidArgumentError(
            f"{what}: torch dtype {obj.dtype} is not a ciuic dtype ({', '.join(DTYPES)})")
    return obj.data_ptr(), obj.device.index, dtype, obj.numel()


def _check_same_kind(what, a, b):
    """Both CUDA tensors (or device arrays), or neither."""
    if _is_cuda(a) != _is_cuda(b):
        raise InvalidArgumentError(
            f"{what}: input on {_where(a)}, output on {_where(b)}: both CUDA tensors (or "
            "device arrays) or neither")


_torch_dtypes_cache = None


def _TORCH_DTYPES():
    global _torch_dtypes_cache
    if _torch_dtypes_cache is None:
        torch = _torch()
        _torch_dtypes_cache = {
            torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
            torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "uint8",
            torch.int32: "int32", torch.int64: "int64",
        }
    return _torch_dtypes_cache


def _split_counts(t, split_sizes, world_size, what):
    """Elements per block of ``t`` cut along its first dimension into
    ``split_sizes`` rows each (None: world_size equal blocks)."""
    shape = tuple(t.shape)
    rows = shape[0] if shape else 1
    numel = int(np.prod(shape)) if shape else 1
    per_row = numel // rows if rows else 0
    if split_sizes is None:
        if rows % world_size:
            raise InvalidArgumentError(
                f"alltoall: the {what}'s {rows} rows do not split into {world_size} equal blocks")
        return [rows // world_size * per_row] * world_size
    sizes = [int(x) for x in split_sizes]
    if len(sizes) != world_size or any(x < 0 for x in sizes) or sum(sizes) != rows:
        raise InvalidArgumentError(
            f"alltoall: {what}_split_sizes {sizes} must be {world_size} non-negative row "
            f"counts adding up to the {what}'s {rows} rows")
    return [x * per_row for x in sizes]


def _timeout_ms(timeout):
    if timeout is None:
        return 0
    ms = int(round(float(timeout) * 1000))
    if ms <= 0:
        raise InvalidArgumentError(f"timeout must be positive seconds, got {timeout}")
    return min(ms, 2**32 - 1)


class Work:
    """An operation in flight (from the ``*_async`` calls).

    ``wait(timeout=None)`` blocks (GIL released) until it completes and returns
    True, raising its error if it failed; with a timeout in seconds it returns
    False if that passes first (the operation goes on). ``is_completed()``
    never blocks. ``result()`` waits and returns the output array/tensor.

    ``get_future()`` (torch only) returns a ``torch.futures.Future`` completed
    with the output tensor, or with the error. It is completed by the
    communicator's waiter thread (one per communicator, started on the first
    get_future(), sleeping in the SDK's futex wait while it waits: no
    spinning), independently of wait(), so code that only waits on the future
    never deadlocks.
    """

    __slots__ = ("_handle", "_output", "_comm", "_future", "_keep", "__weakref__")

    def __init__(self, handle, output, comm, keep=None):
        self._handle = handle
        self._output = output
        self._comm = comm
        self._future = None
        self._keep = keep  # device tensors the operation uses: alive until it completes

    @property
    def name(self):
        return self._handle.name

    def wait(self, timeout=None):
        done = self._handle.wait(timeout)
        if done and self._keep is not None:
            self._comm._device_holds.prune()
        return done

    def is_completed(self):
        return self._handle.is_completed()

    def result(self, timeout=None):
        if not self._handle.wait(timeout):
            raise error_class(StatusCode.DEADLINE_EXCEEDED)(
                f"operation still in progress after {timeout} s")
        return self._output

    def get_future(self):
        if self._future is None:
            torch = _torch()
            if torch is None:
                import torch  # noqa: F811
            self._future = torch.futures.Future()
            # The waiter holds what the operation uses (_keep) until it
            # completes: the caller may drop this Work and its inputs.
            self._comm._waiter().add(self._handle, self._future, self._output, self._keep)
        return self._future


class _Waiter:
    """Completes torch futures: one daemon thread per communicator.

    Waits on the oldest pending handle (blocking in the SDK, GIL released),
    then completes every handle already done, in any order. Sleeps on a
    condition variable while nothing is pending.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ciuic-waiter", daemon=True)
        self._thread.start()

    def add(self, handle, future, value, keep=None):
        with self._cv:
            if self._stopped:
                raise error_class(StatusCode.FAILED_PRECONDITION)("the communicator is closed")
            self._queue.append((handle, future, value, keep))
            self._cv.notify()

    def stop(self):
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @staticmethod
    def _complete(handle, future, value, keep):
        del keep  # held in the queue item until here
        try:
            handle.wait()
        except BaseException as e:  # noqa: BLE001 (handed to the future's waiter)
            future.set_exception(e)
        else:
            future.set_result(value)

    def _run(self):
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if not self._queue:
                    return  # stopped and drained
                head = self._queue[0]
            self._complete(*head)  # blocks outside the lock
            with self._cv:
                self._queue.popleft()
                rest = list(self._queue)
            done = set()
            for i, item in enumerate(rest):
                if item[0].is_completed():
                    self._complete(*item)
                    done.add(i)
            if done:
                with self._cv:
                    # Items are only appended meanwhile: indices still hold.
                    self._queue = collections.deque(
                        it for i, it in enumerate(self._queue) if i not in done)


# The tensors of device operations still in flight when their communicator
# closed (_DeviceHolds.close_with).
_orphaned_device_tensors = []


class _DeviceHolds:
    """The torch tensors of a communicator's device operations in flight,
    kept alive until each operation completes, whether or not the caller
    keeps its Work or the tensors: ciuicd works on them on streams of its
    own, so torch's caching allocator, which only orders reuse after the
    tensor's own stream, would otherwise hand the memory of a dropped
    tensor to new work while the daemon still reads or writes it. Pruned
    (completed operations let go) at each device submission and each
    completed wait; at close, see close_with()."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items = []  # (handle, tensors)

    # Past this many held, a submission looks at every one, not only at the
    # oldest (each look at a handle takes the GIL again).
    _FULL_PRUNE = 64

    def add(self, handle, keep):
        with self._lock:
            # Operations mostly complete in order: the oldest first.
            done = 0
            while done < len(self._items) and self._items[done][0].is_completed():
                done += 1
            del self._items[:done]
            if len(self._items) >= self._FULL_PRUNE:
                self._items = [it for it in self._items if not it[0].is_completed()]
            self._items.append((handle, keep))

    def prune(self):
        with self._lock:
            self._items = [it for it in self._items if not it[0].is_completed()]

    def close_with(self, close):
        """Calls ``close`` (which ends the session: every handle completes,
        cancelled). The tensors of operations not completed before it stay
        referenced for the life of the process: the daemon may still be
        working on them (a session's end does not wait for its device
        work); the rest go."""
        with self._lock:
            unfinished = [keep for handle, keep in self._items if not handle.is_completed()]
            self._items = []
        try:
            close()
        finally:
            _orphaned_device_tensors.extend(unfinished)

    def __len__(self):
        with self._lock:
            return len(self._items)


_live_comms = weakref.WeakSet()


@atexit.register
def _close_all():
    for comm in list(_live_comms):
        try:
            comm.close()
        except Exception:  # noqa: BLE001 (exiting anyway)
            pass


class Communicator:
    """A rank's session with ciuicd for one job. Made by :func:`init`.

    Collectives work in place on numpy arrays and torch CPU tensors (C-contiguous)
    of any SDK dtype, and on torch CUDA tensors (device buffers, ordered after
    the work on the current stream); they accept ``name`` (matches the operation across ranks),
    ``priority`` (higher first among ready operations) and ``timeout``
    (seconds; default: the daemon's op timeout). The plain call waits; the
    ``*_async`` call returns a :class:`Work` at once. The arrays of an
    operation in flight must not be changed until it has completed.
    """

    def __init__(self, impl):
        self._impl = impl
        self._waiter_obj = None
        self._lock = threading.Lock()
        self._device_holds = _DeviceHolds()
        self._balance_since = time.monotonic_ns()
        self._balance_calls = 0
        _live_comms.add(self)

    # -- identity
    rank = property(lambda self: self._impl.rank)
    world_size = property(lambda self: self._impl.world_size)
    local_rank = property(lambda self: self._impl.local_rank)
    local_size = property(lambda self: self._impl.local_size)
    job_id = property(lambda self: self._impl.job_id)
    node_name = property(lambda self: self._impl.node_name)
    #: peer address ("host:port") of the coordinator daemon; "" for a one-node job
    coordinator = property(lambda self: self._impl.coordinator)
    closed = property(lambda self: self._impl.closed)

    def __repr__(self):
        return (f"<ciuic.Communicator job={self.job_id!r} rank={self.rank}/{self.world_size} "
                f"local={self.local_rank}/{self.local_size} node={self.node_name!r}"
                f"{' coordinator=' + self.coordinator if self.coordinator else ''}"
                f"{' closed' if self.closed else ''}>")

    # -- memory
    def empty(self, shape, dtype):
        """An uninitialised array in the daemon's shared memory (zero copy).

        ``dtype`` a numpy dtype (gives a numpy array) or a torch dtype (gives a
        torch tensor). The memory stays valid while the array (or any view)
        lives, even after close().
        """
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            if s < 0:
                raise InvalidArgumentError(f"negative dimension in shape {shape}")
            n *= s
        torch = _torch()
        if torch is not None and isinstance(dtype, torch.dtype):
            if dtype not in _TORCH_DTYPES():
                raise InvalidArgumentError(f"torch dtype {dtype} is not a ciuic dtype")
            itemsize = torch.empty((), dtype=dtype).element_size()
            buf = self._impl.allocate(n * itemsize)
            if n == 0:
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive
            return raw.view(dtype).view(shape)
        dt = np.dtype(dtype)
        if dt not in _NUMPY_DTYPES:
            raise InvalidArgumentError(f"numpy dtype {dt} is not a ciuic dtype")
        buf = self._impl.allocate(n * dt.itemsize)
        if n == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(buf, dtype=dt, count=n).reshape(shape)  # keeps `buf` alive

    def zeros(self, shape, dtype):
        """Like empty(), filled with zeros."""
        a = self.empty(shape, dtype)
        a[...] = 0
        return a

    def is_shared(self, t):
        """True if the array/tensor lies in this communicator's shared memory."""
        buf, _ = _as_buffer(t, "is_shared")
        return self._impl.is_shared(buf)

    # -- collectives
    def _stage_apart(self, ibuf, obuf):
        """The input, copied into shared memory when input and output are two
        separate private arrays.

        Works around the C++ SDK (sdk/src/client.cc, Submit): for a private
        send and a private recv it stages one region spanning both, i.e. as
        large as the distance between the two arrays in the address space,
        which can exceed the arena (RESOURCE_EXHAUSTED for a few MiB of data).
        With the input shared, only the output is staged. Same copies as
        before: this copy replaces the SDK's copy-in.
        """
        if not (isinstance(ibuf, np.ndarray) and isinstance(obuf, np.ndarray)):
            return ibuf
        if ibuf.nbytes == 0 or obuf.nbytes == 0 or np.may_share_memory(ibuf, obuf):
            return ibuf
        if self._impl.is_shared(ibuf) or self._impl.is_shared(obuf):
            return ibuf
        staged = np.frombuffer(self._impl.allocate(ibuf.nbytes), dtype=ibuf.dtype,
                               count=ibuf.size).reshape(ibuf.shape)
        np.copyto(staged, ibuf)
        return staged

    def _device_async(self, collective, send, recv, count, output, op="sum", root=0,
                      name=None, priority=0, timeout=None, compression=None, counts=((), ())):
        """A collective on CUDA tensors: the SDK's device path, ordered after
        the work enqueued so far on torch's current stream of their device."""
        sp, sdev, sdtype, sn = _device_args(send, f"{collective} input")
        rp, rdev, rdtype, rn = _device_args(recv, f"{collective} output")
        # An empty side moves nothing: the device is the other side's.
        if sn and rn and sdev != rdev:
            raise InvalidArgumentError(
                f"{collective}: input on cuda:{sdev}, output on cuda:{rdev}: one device")
        device = rdev if rn and rdev is not None else sdev
        if device is None:  # two empty device arrays
            device = rdev if rdev is not None else 0
        if sdtype != rdtype:
            raise InvalidArgumentError(f"{collective}: input and output dtypes differ")
        if isinstance(recv, _CudaArray) and recv.readonly:
            raise InvalidArgumentError(f"{collective}: the output device array is read-only")
        # The streams the arguments are produced on: a device array's own
        # (none given: no constraint), torch's current one for a tensor; an
        # empty side moves nothing and constrains nothing.
        streams = set()
        for x, n in ((send, sn), (recv, rn)):
            if not n:
                continue
            if isinstance(x, _CudaArray):
                if x.stream:
                    streams.add(0 if x.stream == 1 else x.stream)  # 1: legacy default
            else:
                streams.add(_torch().cuda.current_stream(device).cuda_stream)
        if len(streams) > 1:
            raise InvalidArgumentError(
                f"{collective}: input and output are produced on different streams; "
                "synchronise one with the other first")
        stream = streams.pop() if streams else 0
        h = self._impl.device_op(collective, sp, rp, device=device, count=count, dtype=rdtype,
                                 op=op, root=root, stream=stream, name=name or "",
                                 priority=priority, timeout_ms=_timeout_ms(timeout),
                                 compression=compression or "", send_counts=list(counts[0]),
                                 recv_counts=list(counts[1]))
        self._device_holds.add(h, (send, recv))
        return Work(h, _original(output), self, keep=(send, recv))

    def allreduce_async(self, t, op="sum", name=None, priority=0, timeout=None,
                        compression=None):
        t = _cuda_array(t, "allreduce")
        if _is_cuda(t):
            return self._device_async("allreduce", t, t, t.numel(), t, op=op, name=name,
                                      priority=priority, timeout=timeout,
                                      compression=compression)
        buf, dtype = _as_buffer(t, "allreduce")
        h = self._impl.allreduce(buf, op=op, dtype=dtype, name=name or "",
                                 priority=priority, timeout_ms=_timeout_ms(timeout),
                                 compression=compression or "")
        return Work(h, t, self)

    def allreduce(self, t, op="sum", name=None, priority=0, timeout=None, compression=None):
        """In place: every rank's ``t`` becomes the reduction (op) of all ranks'.

        ``compression`` ("none", "fp16", "bf16", "int8", "topk:RATIO"; None:
        the daemon's setting) applies to what crosses the network between
        nodes, for float sum/avg; every rank must pass the same."""
        self.allreduce_async(t, op, name, priority, timeout, compression).wait()
        return t

    def reduce_scatter_async(self, output, input, op="sum", name=None, priority=0,
                             timeout=None, compression=None):
        output = _cuda_array(output, "reduce_scatter output")
        input = _cuda_array(input, "reduce_scatter input")
        _check_same_kind("reduce_scatter", input, output)
        if _is_cuda(output):
            if input.numel() != output.numel() * self.world_size:
                raise InvalidArgumentError(
                    f"reduce_scatter: the input must hold world_size ({self.world_size}) times "
                    f"the output's elements; input {input.numel()}, output {output.numel()}")
            return self._device_async("reduce_scatter", input, output, output.numel(), output,
                                      op=op, name=name, priority=priority, timeout=timeout,
                                      compression=compression)
        ibuf, dtype = _as_buffer(input, "reduce_scatter input")
        obuf, odtype = _as_buffer(output, "reduce_scatter output")
        if dtype != odtype:
            raise InvalidArgumentError("reduce_scatter: input and output dtypes differ")
        ibuf = self._stage_apart(ibuf, obuf)
        h = self._impl.reduce_scatter(ibuf, obuf, op=op, dtype=dtype, name=name or "",
                                      priority=priority, timeout_ms=_timeout_ms(timeout),
                                      compression=compression or "")
        return Work(h, output, self)

    def reduce_scatter(self, output, input, op="sum", name=None, priority=0, timeout=None):
        """``input`` holds world_size blocks of output's size; rank r's ``output``
        becomes the reduction of block r over all ranks."""
        self.reduce_scatter_async(output, input, op, name, priority, timeout).wait()
        return output

    def allgather_async(self, output, input, name=None, priority=0, timeout=None):
        output = _cuda_array(output, "allgather output")
        input = _cuda_array(input, "allgather input")
        _check_same_kind("allgather", input, output)
        if _is_cuda(output):
            if output.numel() != input.numel() * self.world_size:
                raise InvalidArgumentError(
                    f"allgather: the output must hold world_size ({self.world_size}) times "
                    f"the input's elements; input {input.numel()}, output {output.numel()}")
            return self._device_async("allgather", input, output, input.numel(), output,
                                      name=name, priority=priority, timeout=timeout)
        ibuf, dtype = _as_buffer(input, "allgather input")
        obuf, odtype = _as_buffer(output, "allgather output")
        if dtype != odtype:
            raise InvalidArgumentError("allgather: input and output dtypes differ")
        ibuf = self._stage_apart(ibuf, obuf)
        h = self._impl.allgather(ibuf, obuf, dtype=dtype, name=name or "", priority=priority,
                                 timeout_ms=_timeout_ms(timeout))
        return Work(h, output, self)

    def allgather(self, output, input, name=None, priority=0, timeout=None):
        """``output`` (world_size times input's size) gets rank r's input as block r."""
        self.allgather_async(output, input, name, priority, timeout).wait()
        return output

    def alltoall_async(self, output, input, output_split_sizes=None, input_split_sizes=None,
                       name=None, priority=0, timeout=None):
        output = _cuda_array(output, "alltoall output")
        input = _cuda_array(input, "alltoall input")
        _check_same_kind("alltoall", input, output)
        if _is_cuda(output):
            if output_split_sizes is not None or input_split_sizes is not None:
                counts = (_split_counts(input, input_split_sizes, self.world_size, "input"),
                          _split_counts(output, output_split_sizes, self.world_size, "output"))
                return self._device_async("alltoallv", input, output, 0, output, name=name,
                                          priority=priority, timeout=timeout, counts=counts)
            if input.numel() != output.numel() or input.numel() % self.world_size:
                raise InvalidArgumentError(
                    f"alltoall: input and output must hold the same number of elements, a "
                    f"multiple of world_size ({self.world_size}); input {input.numel()}, "
                    f"output {output.numel()}")
            return self._device_async("alltoall", input, output,
                                      input.numel() // self.world_size, output, name=name,
                                      priority=priority, timeout=timeout)
        ibuf, dtype = _as_buffer(input, "alltoall input")
        obuf, odtype = _as_buffer(output, "alltoall output")
        if dtype != odtype:
            raise InvalidArgumentError("alltoall: input and output dtypes differ")
        if isinstance(ibuf, np.ndarray) and isinstance(obuf, np.ndarray) and \
                ibuf.nbytes > 0 and np.may_share_memory(ibuf, obuf):
            raise InvalidArgumentError("alltoall: input and output overlap (never in place)")
        ibuf = self._stage_apart(ibuf, obuf)
        if output_split_sizes is None and input_split_sizes is None:
            h = self._impl.alltoall(ibuf, obuf, dtype=dtype, name=name or "",
                                    priority=priority, timeout_ms=_timeout_ms(timeout))
        else:
            send_counts = _split_counts(input, input_split_sizes, self.world_size, "input")
            recv_counts = _split_counts(output, output_split_sizes, self.world_size, "output")
            h = self._impl.alltoallv(ibuf, obuf, send_counts, recv_counts, dtype=dtype,
                                     name=name or "", priority=priority,
                                     timeout_ms=_timeout_ms(timeout))
        return Work(h, output, self)

    def alltoall(self, output, input, output_split_sizes=None, input_split_sizes=None,
                 name=None, priority=0, timeout=None):
        """As torch.distributed.all_to_all_single: ``input``'s rows (its first
        dimension) are cut into world_size blocks, block j going to rank j;
        ``output``'s block i comes from rank i. Without split sizes the
        blocks are equal; with them (a list of world_size row counts, for
        either side; the other side's default is equal blocks) they may
        differ (alltoallv): rank i's input_split_sizes[j] must equal rank j's
        output_split_sizes[i]. Never in place. CUDA tensors too (across
        nodes staged through pinned host memory)."""
        self.alltoall_async(output, input, output_split_sizes, input_split_sizes, name,
                            priority, timeout).wait()
        return output

    def broadcast_async(self, t, root=0, name=None, priority=0, timeout=None):
        t = _cuda_array(t, "broadcast")
        if _is_cuda(t):
            return self._device_async("broadcast", t, t, t.numel(), t, root=root, name=name,
                                      priority=priority, timeout=timeout)
        buf, dtype = _as_buffer(t, "broadcast")
        h = self._impl.broadcast(buf, root=root, dtype=dtype, name=name or "",
                                 priority=priority, timeout_ms=_timeout_ms(timeout))
        return Work(h, t, self)

    def broadcast(self, t, root=0, name=None, priority=0, timeout=None):
        """In place: every rank's ``t`` becomes root's."""
        self.broadcast_async(t, root, name, priority, timeout).wait()
        return t

    def barrier_async(self, name=None, priority=0, timeout=None):
        h = self._impl.barrier(name=name or "", priority=priority,
                               timeout_ms=_timeout_ms(timeout))
        return Work(h, None, self)

    def barrier(self, name=None, priority=0, timeout=None):
        self.barrier_async(name, priority, timeout).wait()

    # -- load balance
    def balance(self, samples=None, timeout=None):
        """Collective (every rank calls it, like a barrier): how busy each
        rank was since the previous call (or since ``init``), and how fast.

        Measured from this communicator's own operations: how much longer a
        rank waited for an operation than the rank that submitted it last is
        time it spent waiting for slower ranks (ciuic.balance explains the
        measure; no clock shared between hosts is needed). ``samples``: what
        this rank processed in the window, given on every rank or on none
        (then speed is per unit of work, 1 each). Returns a :class:`Balance`,
        the same on every rank: ``share`` (each rank's busy share of the
        step time), ``speed``, ``slowest``, and ``split(global_batch)``, a
        division of a global batch in proportion to the ranks' speed.

        Call it between steps (e.g. each epoch) with no operation in flight.
        It measures the window's newest 1024 operations (``dropped`` counts
        the rest) and gathers 24 bytes per operation and rank on every rank.
        """
        if samples is not None and (int(samples) != samples or samples < 0):
            raise InvalidArgumentError(f"balance(): samples must be a count >= 0, got {samples}")
        now = time.monotonic_ns()
        timings, dropped = self._impl.take_op_timings()
        # balance()'s own operations (named below) are not part of the measure.
        timings = [t for t in timings if not t[0].startswith(_BALANCE_PREFIX)]
        # The exchange carries 24 bytes per operation per rank, gathered on
        # every rank: the window's newest operations only.
        if len(timings) > _BALANCE_MAX_OPS:
            dropped += len(timings) - _BALANCE_MAX_OPS
            timings = sorted(timings, key=lambda t: t[2])[-_BALANCE_MAX_OPS:]
        self._balance_calls += 1
        name = f"{_BALANCE_PREFIX}{self._balance_calls}"
        row = _balance.row_of(timings, self._balance_since, now - self._balance_since,
                              None if samples is None else int(samples), dropped)
        count = np.array([row[0]], dtype=np.int64)
        self.allreduce(count, op="max", name=name + ".count", timeout=timeout)
        n = int(count[0])
        mine = _balance.padded(row, n)
        rows = np.zeros(mine.size * self.world_size, dtype=np.int64)
        self.allgather(rows, mine, name=name + ".rows", timeout=timeout)
        self._balance_since = time.monotonic_ns()
        try:
            return _balance.compute(rows.reshape(self.world_size, mine.size), n)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None

    # -- lifetime
    def _waiter(self):
        with self._lock:
            if self._waiter_obj is None:
                if self._impl.closed:
                    raise error_class(StatusCode.FAILED_PRECONDITION)(
                        "the communicator is closed")
                self._waiter_obj = _Waiter()
            return self._waiter_obj

    def close(self):
        """Ends the session; operations still pending fail with CancelledError."""
        self._device_holds.close_with(self._impl.close)
        with self._lock:
            waiter, self._waiter_obj = self._waiter_obj, None
        if waiter is not None:
            waiter.stop()
        _live_comms.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _env_int(name, environ=None):
    env = os.environ if environ is None else environ
    v = env.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise InvalidArgumentError(f"${name} is {v!r}, not an integer") from None


DEFAULT_PEER_PORT = 7361


def _slurm_tasks_on_node(spec, node_id):
    """Tasks on node ``node_id`` from Slurm's SLURM_TASKS_PER_NODE syntax:
    comma-separated counts, each optionally repeated, "2(x3),1" meaning
    nodes 0-2 run 2 tasks and node 3 runs 1."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise InvalidArgumentError(
                f"$SLURM_TASKS_PER_NODE {spec!r} is not Slurm's syntax (e.g. \"2(x3),1\")")
        counts += [int(m[1])] * int(m[2] or 1)
    if not 0 <= node_id < len(counts):
        raise InvalidArgumentError(
            f"$SLURM_NODEID {node_id} is not one of the {len(counts)} nodes of "
            f"$SLURM_TASKS_PER_NODE {spec!r}")
    return counts[node_id]


def _slurm_first_host(nodelist):
    """The first host of a Slurm host list ("gpu[07-09,12],cpu1" -> "gpu07"):
    rank 0's node under Slurm's default (block) distribution."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry: up to a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    if not first or first.count("[") != first.count("]"):
        raise InvalidArgumentError(f"Slurm host list {nodelist!r} is malformed")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m[1])[0], first)


def launch_env(environ=None):
    """The job layout a launcher put in the environment, as a dict with
    rank, world_size, local_rank, local_size (each None where not given),
    job (None where not given) and launcher ("torchrun", "slurm" or None).

    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
    win where present. Otherwise Slurm's (a task started by srun):
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the tasks of this node
    from SLURM_TASKS_PER_NODE at SLURM_NODEID (e.g. "2(x3),1"), else the
    uniform SLURM_NTASKS_PER_NODE. The job id is $CIUIC_JOB, else
    $TORCHELASTIC_RUN_ID, else under Slurm "slurm-$SLURM_JOB_ID.$SLURM_STEP_ID"
    (each srun step its own job), else "$MASTER_ADDR:$MASTER_PORT".
    """
    env = os.environ if environ is None else environ
    out = dict(rank=None, world_size=None, local_rank=None, local_size=None, job=None,
               launcher=None)
    if any(env.get(k) not in (None, "") for k in ("RANK", "WORLD_SIZE")):
        out.update(launcher="torchrun", rank=_env_int("RANK", env),
                   world_size=_env_int("WORLD_SIZE", env),
                   local_rank=_env_int("LOCAL_RANK", env),
                   local_size=_env_int("LOCAL_WORLD_SIZE", env))
    elif env.get("SLURM_PROCID") not in (None, ""):
        out.update(launcher="slurm", rank=_env_int("SLURM_PROCID", env),
                   world_size=_env_int("SLURM_NTASKS", env),
                   local_rank=_env_int("SLURM_LOCALID", env))
        per_node, node_id = env.get("SLURM_TASKS_PER_NODE"), _env_int("SLURM_NODEID", env)
        if per_node and node_id is not None:
            out["local_size"] = _slurm_tasks_on_node(per_node, node_id)
        else:
            out["local_size"] = _env_int("SLURM_NTASKS_PER_NODE", env)
        if out["world_size"] is None:
            raise InvalidArgumentError("$SLURM_PROCID is set but $SLURM_NTASKS is not")
    else:
        out.update(local_rank=_env_int("LOCAL_RANK", env),
                   local_size=_env_int("LOCAL_WORLD_SIZE", env))
    job = env.get("CIUIC_JOB") or env.get("TORCHELASTIC_RUN_ID")
    if not job and out["launcher"] == "slurm" and env.get("SLURM_JOB_ID"):
        job = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID') or '0'}"
    if not job and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        job = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    out["job"] = job
    return out


def resolve_coordinator(coordinator=None, world_size=1, local_size=None, environ=None):
    """The coordinator ``init()`` hands to the daemon: "host:port" or "".

    ``coordinator`` if given (any job); otherwise, only for a job spanning
    several nodes (``local_size < world_size``): $CIUIC_COORDINATOR, else
    $MASTER_ADDR + ":" + ($CIUIC_PEER_PORT or 7361), else under Slurm the
    first host of $SLURM_STEP_NODELIST (or $SLURM_JOB_NODELIST), which runs
    rank 0 under Slurm's default block distribution, with the same port.
    "" for a one-node job, which needs none. A multi-node job with none of
    these raises InvalidArgumentError.
    """
    if coordinator:
        return str(coordinator)
    env = os.environ if environ is None else environ
    if local_size is None or int(local_size) >= int(world_size):
        return ""
    c = env.get("CIUIC_COORDINATOR")
    if c:
        return c
    port = env.get("CIUIC_PEER_PORT") or DEFAULT_PEER_PORT
    addr = env.get("MASTER_ADDR")
    if addr:
        return f"{addr}:{port}"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        return f"{_slurm_first_host(nodelist)}:{port}"
    raise InvalidArgumentError(
        f"the job spans several nodes (world size {world_size}, local size {local_size}) but "
        f"names no coordinator: pass coordinator='host:port', or set CIUIC_COORDINATOR=host:port, "
        f"or MASTER_ADDR (and CIUIC_PEER_PORT, default {DEFAULT_PEER_PORT})")


def init(rank=None, world_size=None, local_rank=None, local_size=None, job=None, socket=None,
         arena_bytes=None, coordinator=None):
    """Joins a job through the node's ciuicd; returns a :class:`Communicator`.

    Defaults come from torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, else from Slurm's (srun: SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, SLURM_TASKS_PER_NODE), else rank 0 of 1, local = global;
    see :func:`launch_env`. The job id is ``job``, else $CIUIC_JOB, else
    $TORCHELASTIC_RUN_ID, else under Slurm "slurm-$SLURM_JOB_ID.$SLURM_STEP_ID",
    else "$MASTER_ADDR:$MASTER_PORT". The socket is ``socket``, else
    $CIUIC_SOCKET, else /run/ciuic/ciuicd.sock. ``arena_bytes``: shared memory
    of this communicator (else $CIUIC_ARENA_BYTES, else 512 MiB), mapped and
    populated at once.

    A job spans several nodes when ``local_size < world_size``; it then needs
    the coordinator, the peer service ("host:port") of the daemon that hosts
    rank 0: ``coordinator``, else $CIUIC_COORDINATOR, else
    "$MASTER_ADDR:$CIUIC_PEER_PORT" (port default 7361); see
    :func:`resolve_coordinator`. Every rank of a job must name the same one.
    """
    env = os.environ
    launched = launch_env(env)
    rank = launched["rank"] if rank is None else rank
    world_size = launched["world_size"] if world_size is None else world_size
    rank = 0 if rank is None else int(rank)
    world_size = 1 if world_size is None else int(world_size)
    if local_rank is None:
        local_rank = launched["local_rank"]
    if local_size is None:
        local_size = launched["local_size"]
    if job is None:
        job = launched["job"]
        if not job:
            if world_size == 1:
                job = f"local-{os.getpid()}"
            else:
                raise InvalidArgumentError(
                    "no job id: pass job=, or set CIUIC_JOB, TORCHELASTIC_RUN_ID, "
                    "SLURM_JOB_ID (under srun) or MASTER_ADDR and MASTER_PORT")
    if socket is None:
        socket = env.get("CIUIC_SOCKET") or ""
    coordinator = resolve_coordinator(coordinator, world_size, local_size)
    impl = _ciuic.Communicator(
        socket=str(socket), job=str(job), rank=rank, world_size=world_size,
        local_rank=-1 if local_rank is None else int(local_rank),
        local_size=-1 if local_size is None else int(local_size),
        arena_bytes=int(arena_bytes or 0), coordinator=coordinator)
    return Communicator(impl)

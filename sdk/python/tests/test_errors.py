"""Error mapping, local argument checks, close(), Ctrl-C."""

import os
import pickle
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

import ciuic
import ranks


def job():
    return f"errors-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def solo(daemon):
    """A one-rank communicator (operations complete on their own)."""
    with ciuic.init(rank=0, world_size=1, job=job(), socket=daemon.socket,
                    arena_bytes=16 << 20) as comm:
        yield comm


def test_hierarchy():
    assert issubclass(ciuic.InvalidArgumentError, ciuic.Error)
    for code in ciuic.StatusCode:
        if code == ciuic.StatusCode.OK:
            continue
        cls = ciuic.error_class(code)
        assert issubclass(cls, ciuic.Error) and cls is not ciuic.Error
        assert getattr(ciuic, cls.__name__) is cls
        assert cls.code == code
    e = ciuic.AbortedError("job aborted")
    assert e.code == ciuic.StatusCode.ABORTED and e.code.name == "ABORTED" and int(e.code) == 10
    assert str(e) == "ABORTED: job aborted" and e.message == "job aborted"
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is ciuic.AbortedError and e2.message == "job aborted"


@pytest.mark.parametrize("which", ["sync", "future"])
def test_mismatched_counts_fail_on_every_rank(pool, which):
    results = pool.run(ranks.mismatch, which)
    for name, code, code_name, message in results:
        assert (name, code, code_name) == ("InvalidArgumentError", 3, "INVALID_ARGUMENT")
        assert f"grads.mismatch.{which}" in message, message


def test_unreachable_socket(tmp_path):
    with pytest.raises(ciuic.UnavailableError) as info:
        ciuic.init(rank=0, world_size=1, job="x", socket=str(tmp_path / "none.sock"))
    assert info.value.code == ciuic.StatusCode.UNAVAILABLE
    assert "none.sock" in info.value.message


def test_local_argument_errors(solo):
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ciuic.InvalidArgumentError, match="contiguous"):
        solo.allreduce(a[:, 1])
    with pytest.raises(ciuic.InvalidArgumentError, match="contiguous"):
        solo.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(ciuic.InvalidArgumentError, match="not a ciuic dtype"):
        solo.allreduce(np.zeros(3, np.complex64))
    with pytest.raises(ciuic.InvalidArgumentError, match="not a ciuic dtype"):
        solo.allreduce(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ciuic.InvalidArgumentError, match="reduce op"):
        solo.allreduce(a, op="median")
    with pytest.raises(ciuic.InvalidArgumentError, match="reserved"):
        solo.allreduce(a, name="#1")
    with pytest.raises(ciuic.InvalidArgumentError, match="world_size"):
        solo.allgather(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ciuic.InvalidArgumentError, match="world_size"):
        solo.reduce_scatter(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ciuic.InvalidArgumentError, match="same dtype"):
        solo.allgather(np.zeros(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(ciuic.InvalidArgumentError, match="same number of elements"):
        solo.alltoall(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ciuic.InvalidArgumentError, match="same dtype"):
        solo.alltoall(np.zeros(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(ciuic.InvalidArgumentError, match="never in place"):
        solo.alltoall(a, a)
    with pytest.raises(ciuic.InvalidArgumentError, match="never in place"):
        t = torch.zeros(8)
        solo.alltoall(t[2:6], t[:4])
    with pytest.raises(ciuic.InvalidArgumentError, match="input_split_sizes"):
        solo.alltoall(np.zeros(4, np.float32), np.zeros(4, np.float32), input_split_sizes=[3])
    with pytest.raises(ciuic.InvalidArgumentError, match="output_split_sizes"):
        solo.alltoall(np.zeros(4, np.float32), np.zeros(4, np.float32), output_split_sizes=[4, 0])
    with pytest.raises(ciuic.InvalidArgumentError, match="input_split_sizes"):
        solo.alltoall(np.zeros(4, np.float32), np.zeros(4, np.float32), input_split_sizes=[-1])
    with pytest.raises(ciuic.InvalidArgumentError, match="root"):
        solo.broadcast(a, root=1)
    with pytest.raises(ciuic.InvalidArgumentError, match="buffer protocol"):
        solo._impl.allreduce([1.0, 2.0])
    # A tensor on neither the CPU nor a CUDA device: a clear error, nothing sent.
    off_cpu = torch.zeros(3, device="meta")
    with pytest.raises(ciuic.InvalidArgumentError,
                       match="tensor on meta; ciuic takes CPU and CUDA tensors"):
        solo.allreduce(off_cpu)
    with pytest.raises(ciuic.InvalidArgumentError, match="CPU and CUDA tensors"):
        solo.broadcast(off_cpu, root=0)
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ciuic.InvalidArgumentError, match="read-only"):
        solo.allreduce(ro)
    # The communicator still works.
    b = np.arange(5, dtype=np.int32)
    solo.allreduce(b, op="max")
    assert b.tolist() == [0, 1, 2, 3, 4]


def test_close(daemon):
    comm = ciuic.init(rank=0, world_size=2, job=job(), socket=daemon.socket,
                      arena_bytes=16 << 20)
    a = torch.ones(8)
    pending = comm.allreduce_async(a, name="never.completed")  # rank 1 never comes
    fut = pending.get_future()
    assert not pending.is_completed()
    comm.close()
    with pytest.raises(ciuic.CancelledError):
        pending.wait()
    with pytest.raises(ciuic.CancelledError):
        fut.wait()
    with pytest.raises(ciuic.FailedPreconditionError):
        comm.allreduce(a)
    with pytest.raises(ciuic.FailedPreconditionError):
        comm.empty(4, np.float32)
    comm.close()  # idempotent
    assert comm.closed


def test_memory_outlives_close(daemon):
    comm = ciuic.init(rank=0, world_size=1, job=job(), socket=daemon.socket,
                      arena_bytes=16 << 20)
    a = comm.empty((1000,), np.float64)
    t = comm.empty((10,), torch.bfloat16)
    a[:] = 7
    t.fill_(2)
    comm.close()
    assert a.sum() == 7000 and float(t.sum()) == 20


def _ctl_status(daemon):
    ctl = os.path.join(os.path.dirname(daemon.proc.args[0]), "..", "tools", "ctl", "ciuicctl")
    if not os.access(ctl, os.X_OK):
        return None
    import json
    out = subprocess.run([ctl, "--socket", daemon.socket, "--json", "status"],
                         capture_output=True, text=True, timeout=10)
    return json.loads(out.stdout)


INTERRUPTED = """
import sys, numpy as np, ciuic
comm = ciuic.init(rank=0, world_size=2, job=sys.argv[2], socket=sys.argv[1], arena_bytes=16 << 20)
print("ready", flush=True)
comm.allreduce(np.ones(4, np.float32), name="never")
"""


def test_ctrl_c_exits_cleanly_and_frees_the_session(daemon):
    jid = job()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED, daemon.socket, jid],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        status = _ctl_status(daemon)
        if status is not None:
            assert any(s.get("jobId") == jid for s in status.get("sessions", []))
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert time.monotonic() - t0 < 3
    assert p.returncode != 0 and "KeyboardInterrupt" in err, err
    assert "Segmentation" not in err and "terminate called" not in err, err
    # The daemon has freed the session: rank 0 of the job can join again.
    deadline = time.monotonic() + 5
    while True:
        status = _ctl_status(daemon)
        if status is None or not any(s.get("jobId") == jid for s in status.get("sessions", [])):
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    with ciuic.init(rank=0, world_size=2, job=jid, socket=daemon.socket, arena_bytes=16 << 20):
        pass


REJOINS = """
import sys, numpy as np, ciuic
socket, jid = sys.argv[1], sys.argv[2]
comm = ciuic.init(rank=0, world_size=1, job=jid, socket=socket, arena_bytes=16 << 20)
x = np.arange(8, dtype=np.float32)
comm.allreduce(x)
print("ready", flush=True)
sys.stdin.readline()  # the daemon has been restarted meanwhile
try:
    comm.allreduce(x)
    print("old communicator still worked")
    sys.exit(1)
except ciuic.UnavailableError as e:
    print("old:", e, flush=True)
comm.close()
comm = ciuic.init(rank=0, world_size=1, job=jid, socket=socket, arena_bytes=16 << 20)
y = np.arange(8, dtype=np.float32)
comm.allreduce(y)
assert np.array_equal(y, np.arange(8, dtype=np.float32)), y
print("rejoined", flush=True)
"""


def test_a_trainer_rejoins_a_restarted_daemon():
    # A daemon of its own: the session-wide one must not be restarted.
    from conftest import Daemon, ciuicd_binary
    # No TCP port: the session-wide daemon holds the default one.
    d = Daemon(ciuicd_binary(), node_name="restart", listen="off")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", REJOINS, d.socket, job()], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert d.restart() == 0, d.log()
        out, err = p.communicate(input="go\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        d.stop()
    assert p.returncode == 0, (out, err)
    assert "rejoined" in out, (out, err)
    assert "old:" in out, out


def test_operation_timeout_raises_deadline_exceeded(daemon):
    with ciuic.init(rank=0, world_size=2, job=job(), socket=daemon.socket,
                    arena_bytes=16 << 20) as comm:
        t0 = time.monotonic()
        with pytest.raises(ciuic.DeadlineExceededError, match="late") as info:
            comm.allreduce(np.ones(3, np.float32), name="late", timeout=0.3)  # rank 1 never comes
        assert info.value.code == ciuic.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5


def test_device_buffers_without_cuda(solo):
    """The device path from Python (what a torch CUDA tensor takes) on a
    machine or build without CUDA: FAILED_PRECONDITION saying which, and the
    communicator goes on."""
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here: tests/test_cuda.py covers the device path")
    sdk_cuda, why = ciuic._ciuic.sdk_supports_device_buffers()
    h = solo._impl.device_op("allreduce", 0x10000, 0x10000, device=0, count=4, dtype="float32",
                             name="dev")
    words = "no CUDA device" if sdk_cuda else "built without CUDA"
    with pytest.raises(ciuic.FailedPreconditionError, match=f"operation 'dev': .*{words}"):
        h.wait()
    assert sdk_cuda or "built without CUDA" in why
    b = np.arange(5, dtype=np.int32)
    solo.allreduce(b)
    np.testing.assert_array_equal(b, np.arange(5, dtype=np.int32))
    # A device array of another library (__cuda_array_interface__): its
    # device cannot be found without CUDA, and the error says why.

    class DeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x10000, False),
                                    "version": 3, "strides": None, "stream": None}

    with pytest.raises(ciuic.FailedPreconditionError, match=words):
        solo.allreduce(DeviceArray(), name="dev2")
    solo.allreduce(b)

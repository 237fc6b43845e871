"""Fixtures: a private ciuicd and a pool of rank processes.

- ``daemon``: a ciuicd of our own (binary from $CIUICD, else
  build/daemon/ciuicd of this checkout) on a socket in a temp dir; stopped
  with SIGTERM at the end of the session.
- ``pool``: ``world`` rank processes (multiprocessing, spawn context), each
  with a communicator of one job, kept for the whole session so that the
  interpreter and torch start-up is paid once. ``pool.run(fn, *args)`` runs
  the module-level function ``fn(ctx, *args)`` of tests/ranks.py on every
  rank and returns the per-rank results; an exception on any rank fails the
  test with that rank's traceback, and the pool is rebuilt (new job) for the
  next test so that one failure cannot desynchronise the following ones.
"""

import multiprocessing as mp
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]

# `import ciuic` from the build tree when PYTHONPATH does not say otherwise
# (the spawned ranks inherit sys.path).
try:
    import ciuic  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO / "build" / "python"))
    import ciuic  # noqa: F401

import ranks  # noqa: E402

POOL_ARENA_BYTES = 192 << 20
TASK_TIMEOUT_S = 90


def ciuicd_binary():
    path = os.environ.get("CIUICD") or str(REPO / "build" / "daemon" / "ciuicd")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no ciuicd binary at {path} (build it, or set CIUICD)")
    return path


class Daemon:
    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="ciuic-pytest-")
        self.socket = os.path.join(self.dir, "ciuicd.sock")
        self.log_path = os.path.join(self.dir, "ciuicd.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--socket", self.socket, "--node-name", "pytest", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not (os.path.exists(self.socket) and os.path.exists(self.socket + ".session")):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ciuicd exited ({self.proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ciuicd did not create its sockets: {self.log()}")
            time.sleep(0.02)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        for name in ("ciuicd.sock", "ciuicd.sock.session", "ciuicd.log"):
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


@pytest.fixture(scope="session")
def daemon():
    d = Daemon(ciuicd_binary())
    yield d
    alive = d.proc.poll() is None
    d.stop()
    assert alive, "ciuicd died during the tests"


class RankError(AssertionError):
    pass


class RankPool:
    def __init__(self, socket, world=2, arena_bytes=POOL_ARENA_BYTES):
        self.socket = socket
        self.world = world
        self.job = f"pytest-{uuid.uuid4().hex[:8]}"
        self.broken = False
        ctx = mp.get_context("spawn")
        self.inq = [ctx.Queue() for _ in range(world)]
        self.outq = ctx.Queue()
        self.procs = [
            ctx.Process(target=ranks.worker_main,
                        args=(r, world, socket, self.job, arena_bytes, self.inq[r], self.outq),
                        daemon=True, name=f"rank{r}")
            for r in range(world)]
        for p in self.procs:
            p.start()
        self._collect("start", TASK_TIMEOUT_S)

    def _collect(self, what, timeout):
        results = [None] * self.world
        errors = []
        got = 0
        deadline = time.monotonic() + timeout
        while got < self.world:
            try:
                rank, status, payload = self.outq.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() >= deadline:
                    self.broken = True
                    raise RankError(f"{what}: no answer from every rank within {timeout} s "
                                    f"(dead: {dead})")
                continue
            got += 1
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
        if errors:
            self.broken = True
            raise RankError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout=TASK_TIMEOUT_S):
        """fn(ctx, *args) on every rank; returns the list of results by rank."""
        for q in self.inq:
            q.put((fn.__name__, args))
        return self._collect(fn.__name__, timeout)

    def close(self):
        if self.broken:  # a rank may be stuck in a wait: no goodbye
            for p in self.procs:
                p.terminate()
        for q in self.inq:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()


@pytest.fixture(scope="session")
def _pool_holder(daemon):
    holder = {}
    yield holder
    if holder.get("pool"):
        holder["pool"].close()


@pytest.fixture
def pool(daemon, _pool_holder):
    p = _pool_holder.get("pool")
    if p is None or p.broken:
        if p is not None:
            p.close()
        p = RankPool(daemon.socket)
        _pool_holder["pool"] = p
    return p


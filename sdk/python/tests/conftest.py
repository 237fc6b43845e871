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
import random
import signal
import socket
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


_given_ports = set()


def free_port():
    """A TCP port free now for a listener that binds it a little later.

    Not a port the kernel hands out itself (bind to 0, or the local end of
    an outgoing connection): between this call and the listener's bind,
    another test's connection could take such a port (torch's TCPStore
    then fails to bind with "Address already in use" and its other ranks
    wait 90 s). So from below the ephemeral range, each port once per
    session.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")


class Daemon:
    """A ciuicd on a socket in a temp dir. ``listen``: "host:port" of its peer
    service (multi-node jobs), else "off": no TCP port, so that any number of
    these daemons (and other test processes) run side by side; the daemon's
    own default, 127.0.0.1:7361, would allow one at a time."""

    def __init__(self, binary, node_name="pytest", listen="off", env=None):
        self.dir = tempfile.mkdtemp(prefix="ciuic-pytest-")
        self.socket = os.path.join(self.dir, "ciuicd.sock")
        self.log_path = os.path.join(self.dir, "ciuicd.log")
        self.node_name = node_name
        self.listen = listen
        self._log = open(self.log_path, "wb")
        cmd = [binary, "--socket", self.socket, "--node-name", node_name, "--log-level", "warn"]
        cmd += ["--listen", listen]
        self._cmd = cmd
        self._env = dict(os.environ, **(env or {}))
        self._launch()

    def restart(self):
        """SIGTERM, then the same daemon again on the same sockets (as
        `systemctl restart` does). Returns the old daemon's exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=20)
        self._launch()
        return code

    def _launch(self):
        self.proc = subprocess.Popen(self._cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self._env)
        deadline = time.monotonic() + 20
        while not (os.path.exists(self.socket) and os.path.exists(self.socket + ".session")
                   and self._listening()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ciuicd exited ({self.proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ciuicd did not create its sockets: {self.log()}")
            time.sleep(0.02)

    def _listening(self):
        if not self.listen or self.listen == "off":
            return True
        host, port = self.listen.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return True
        except OSError:
            return False

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



# ------------------------------------------------------------- multi-node
#
# ``cluster``: two ciuicd ("nodes" node0, node1) on this host, each with its
# own socket and peer service (--listen 127.0.0.1:<free port>), UCX forced
# onto TCP so that the inter-node path is the network path; stopped with
# SIGTERM at the end of the session.
# ``mn_pool``: 4 rank processes, process p on node p // 2 as local rank
# p % 2, kept for the session. ``mn_pool.run((nodes, ranks_per_node), fn,
# *args)`` runs fn(ctx, *args) on the processes of that shape (2 x 1: local
# rank 0 of each node; 2 x 2: all four), with the communicator of that
# shape's job (made on first use), and returns the results by rank.

MN_NODES = 2
MN_MAX_RANKS_PER_NODE = 2
MN_ARENA_BYTES = 64 << 20
MN_DAEMON_ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}


class Cluster:
    def __init__(self, binary, nodes=MN_NODES):
        self.nodes = []
        try:
            for k in range(nodes):
                self.nodes.append(Daemon(binary, node_name=f"node{k}",
                                         listen=f"127.0.0.1:{free_port()}", env=MN_DAEMON_ENV))
        except BaseException:
            self.stop()
            raise
        self.sockets = [d.socket for d in self.nodes]
        self.coordinator = self.nodes[0].listen

    def dead(self):
        return [d.node_name for d in self.nodes if d.proc.poll() is not None]

    def stop(self):
        for d in self.nodes:
            d.stop()


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(ciuicd_binary())
    yield c
    dead = c.dead()
    logs = {d.node_name: d.log() for d in c.nodes}
    c.stop()
    assert not dead, f"ciuicd died during the tests: {dead}: {logs}"


class MultiNodePool:
    def __init__(self, cluster, arena_bytes=MN_ARENA_BYTES):
        self.job = f"pytest-mn-{uuid.uuid4().hex[:8]}"
        self.broken = False
        spec = {"sockets": cluster.sockets, "coordinator": cluster.coordinator,
                "job": self.job, "arena_bytes": arena_bytes}
        ctx = mp.get_context("spawn")
        n = MN_NODES * MN_MAX_RANKS_PER_NODE
        self.where = [(p // MN_MAX_RANKS_PER_NODE, p % MN_MAX_RANKS_PER_NODE) for p in range(n)]
        self.inq = [ctx.Queue() for _ in range(n)]
        self.outq = ctx.Queue()
        self.procs = [
            ctx.Process(target=ranks.mn_worker_main,
                        args=(p, node, local, spec, self.inq[p], self.outq),
                        daemon=True, name=f"node{node}.local{local}")
            for p, (node, local) in enumerate(self.where)]
        for p in self.procs:
            p.start()
        self._collect("start", {p: p for p in range(n)}, TASK_TIMEOUT_S)

    def _collect(self, what, rank_of, timeout):
        """Answers of the processes in rank_of (process -> rank), by rank."""
        results = [None] * len(rank_of)
        errors = []
        pending = set(rank_of)
        deadline = time.monotonic() + timeout
        while pending:
            try:
                proc, status, payload = self.outq.get(
                    timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [self.procs[p].name for p in pending if not self.procs[p].is_alive()]
                if dead or time.monotonic() >= deadline:
                    self.broken = True
                    raise RankError(f"{what}: no answer from {sorted(pending)} within "
                                    f"{timeout} s (dead: {dead})")
                continue
            pending.discard(proc)
            if status == "ok":
                results[rank_of[proc]] = payload
            else:
                errors.append(f"--- {self.procs[proc].name} ---\n{payload}")
        if errors:
            self.broken = True
            raise RankError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, shape, fn, *args, timeout=TASK_TIMEOUT_S):
        nodes, per_node = shape
        assert nodes <= MN_NODES and per_node <= MN_MAX_RANKS_PER_NODE
        rank_of = {p: node * per_node + local for p, (node, local) in enumerate(self.where)
                   if node < nodes and local < per_node}
        for p in rank_of:
            self.inq[p].put((tuple(shape), fn.__name__, args))
        return self._collect(f"{fn.__name__} on {nodes}x{per_node}", rank_of, timeout)

    def close(self):
        RankPool.close(self)


@pytest.fixture(scope="session")
def _mn_pool_holder(cluster):
    holder = {}
    yield holder
    if holder.get("pool"):
        holder["pool"].close()


@pytest.fixture
def mn_pool(cluster, _mn_pool_holder):
    p = _mn_pool_holder.get("pool")
    if p is None or p.broken:
        if p is not None:
            p.close()
        p = MultiNodePool(cluster)
        _mn_pool_holder["pool"] = p
    return p


# ------------------------------------------------------- torch backend
#
# ``torch_pool``: 4 processes (tests/backend_ranks.py) that run tasks under
# torch.distributed with the "ciuic" backend. ``torch_pool.run(shape, fn,
# *args)`` gives the processes of that shape torchrun's environment (a fresh
# MASTER_PORT, hence a fresh job, per task), each with the socket of its node:
# (1, 2): processes 0 and 1 on the session daemon; (2, 2): all four on the
# cluster's two daemons, the coordinator found through MASTER_ADDR and
# CIUIC_PEER_PORT. ``env(rank, node, local)`` returns variables to add (a
# value of None removes one).

TORCH_ARENA_BYTES = 64 << 20
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "CIUIC_JOB", "CIUIC_COORDINATOR", "CIUIC_PEER_PORT",
                "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                "SLURM_NODEID", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")


class TorchPool(MultiNodePool):
    def __init__(self, daemon, cluster):
        import backend_ranks
        self.daemon, self.cluster = daemon, cluster
        self.broken = False
        ctx = mp.get_context("spawn")
        n = MN_NODES * MN_MAX_RANKS_PER_NODE
        self.where = [(p // MN_MAX_RANKS_PER_NODE, p % MN_MAX_RANKS_PER_NODE) for p in range(n)]
        self.inq = [ctx.Queue() for _ in range(n)]
        self.outq = ctx.Queue()
        self.procs = [ctx.Process(target=backend_ranks.worker_main,
                                  args=(p, self.inq[p], self.outq), daemon=True,
                                  name=f"torch.node{node}.local{local}")
                      for p, (node, local) in enumerate(self.where)]
        for p in self.procs:
            p.start()
        self._collect("start", {p: p for p in range(n)}, TASK_TIMEOUT_S)

    def run(self, shape, fn, *args, env=None, timeout=TASK_TIMEOUT_S):
        nodes, per_node = shape
        assert nodes <= MN_NODES and per_node <= MN_MAX_RANKS_PER_NODE
        port = free_port()
        coord_port = self.cluster.coordinator.rsplit(":", 1)[1]
        rank_of = {}
        for p, (node, local) in enumerate(self.where):
            if node >= nodes or local >= per_node:
                continue
            rank = node * per_node + local
            rank_of[p] = rank
            e = {k: None for k in _LAUNCH_VARS}
            e.update(RANK=str(rank), WORLD_SIZE=str(nodes * per_node), LOCAL_RANK=str(local),
                     LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), CIUIC_ARENA_BYTES=str(TORCH_ARENA_BYTES),
                     CIUIC_SOCKET=self.daemon.socket if nodes == 1 else
                     self.cluster.sockets[node])
            if nodes > 1:
                e["CIUIC_PEER_PORT"] = coord_port
            if env is not None:
                e.update(env(rank, node, local))
            self.inq[p].put((e, fn.__name__, args))
        return self._collect(f"{fn.__name__} on {nodes}x{per_node}", rank_of, timeout)


@pytest.fixture(scope="session")
def _torch_pool_holder(daemon, cluster):
    holder = {}
    yield holder
    if holder.get("pool"):
        holder["pool"].close()


@pytest.fixture
def torch_pool(daemon, cluster, _torch_pool_holder):
    p = _torch_pool_holder.get("pool")
    if p is None or p.broken:
        if p is not None:
            p.close()
        p = TorchPool(daemon, cluster)
        _torch_pool_holder["pool"] = p
    return p

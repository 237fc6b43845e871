#!/usr/bin/python3
"""compare.py: one command that benchmarks a collective on ciuic, OpenMPI and gloo.

It runs ciuic-bench, ciuic-mpi-bench (under mpirun) and gloo_bench.py with the
same --op/--sizes/--dtype/--iters/--warmup, interleaved per repetition
(rep 1: ciuic, mpi, gloo; rep 2: ciuic, mpi, gloo; ...) so that drift of the
machine (other jobs, thermal, page cache) hits all systems alike. It reports,
per size and system, the median and the spread (min..max over reps) of
time_us and busbw_gbps, and the busbw ratios ciuic/OpenMPI and ciuic/gloo.

Each benchmark already reports the median over --iters of the max over ranks;
the reps here measure how stable that median is across process launches.

Scenarios (how ranks are placed and which transport the baselines use):
  local     one node, --ranks R processes. OpenMPI keeps its defaults
            (ob1 + vader shared memory); gloo uses TCP on loopback (it has
            no shared-memory transport); ciuic-bench gets --nodes 1.
  loopback  --nodes N x --ranks-per-node R processes on this machine acting as
            N nodes. OpenMPI is forced onto TCP over lo (--mca pml ob1
            --mca btl tcp,self); gloo is the same as local; ciuic-bench gets
            --nodes N --ranks-per-node R and arranges its daemons itself.
  netns     --nodes N x --ranks-per-node R with N network namespaces as hosts,
            joined by veths shaped with tbf to --link-rate (root only; see
            netns.py). ciuic: one ciuicd per namespace started here (UCX over
            TCP on the veth), ranks through ciuic_py_bench.py; OpenMPI: mpirun
            in node 0's namespace reaching the others through netns_rsh.sh,
            TCP on the veths; gloo: ranks inside the namespaces. The veths'
            tx byte counters are printed per run.
  train     2 namespaces x 1 rank as netns; DDP training (examples/train_ddp.py)
            instead of a collective; see train_compare.py.
  balance   --nodes N (default 2) x --ranks-per-node R (default 1) loopback
            nodes, one rank slower per sample: DDP with equal batches against
            DDP whose per-rank batches follow Communicator.balance()
            (examples/train_balanced.py --compare, --reps runs of each,
            interleaved); throughput medians and their ratio.
  channels  2 namespaces joined by two links shaped to 800 and 200 Mbit/s,
            one channel each (root): equal shares, then shares weighted by
            the measured rates, then the rates swapped mid-run; 64 MiB
            allreduces, the share of the links' summed rate reached
            (tests/netns/channel_weights_test.py, --reps runs).
  racks     4 namespaces in 2 racks joined by one link shaped to 200 Mbit/s
            (root): the flat ring against the rack-hierarchical allreduce
            and auto, 16 MiB float32, --reps interleaved pairs; the
            measured speedup beside the cost model's prediction
            (tests/netns/racks_test.py, which checks every result).
--codecs none,fp16,int8,topk:0.01 runs the ciuic system once per codec
(rows ciuic, ciuic+fp16, ...; lossy rows report max_rel_error) and adds a
table of each codec's busbw against ciuic uncompressed from the same run.
A new scenario is one more Scenario subclass (see below).
"""

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402  (beside this file)

SYSTEMS = ("ciuic", "mpi", "mpi_tuned", "gloo")
LABEL = {"ciuic": "ciuic", "mpi": "OpenMPI", "mpi_tuned": "OpenMPI+malloc", "gloo": "gloo"}
# --codecs turns the ciuic system into one row per codec: "ciuic" (codec none)
# and "ciuic+CODEC"; CODEC_OF maps each such row to the --compression it runs.
CODEC_OF = {}


def base_system(system):
    """'ciuic+int8' -> 'ciuic'; other names unchanged."""
    return system.split("+", 1)[0]


MPI_TUNED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                 "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def log(msg):
    print("[compare] " + msg, file=sys.stderr, flush=True)


def human_bytes(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


# ----------------------------------------------------------------- machine

def machine_info(memcpy_mib=256, memcpy_reps=5):
    """Cores, memory, CPU model and a memcpy bandwidth measured now."""
    info = {
        "host": platform.node(),
        "kernel": platform.release(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": "?",
        "mem_total_gib": None,
        "loadavg": os.getloadavg(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        import numpy as np
        n = memcpy_mib << 20
        src = np.ones(n, dtype=np.uint8)        # written: pages faulted in
        dst = np.empty(n, dtype=np.uint8)
        dst.fill(0)                             # pre-fault the destination too
        times = []
        for _ in range(memcpy_reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        info["memcpy_bytes"] = n
        info["memcpy_gbps"] = round(n / statistics.median(times) / 1e9, 2)
        del src, dst
    except ImportError:
        info["memcpy_gbps"] = None
    return info


def cpu_stall_us():
    """PSI "some" total for the CPU: µs in which some runnable task waited, or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.split("total=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def wait_until_quiet(max_wait_s, threshold_pct=5.0, window_s=1.0, windows=2):
    """Waits (at most max_wait_s) for `windows` consecutive windows of low CPU
    pressure, so that a run does not start in the middle of someone's build.
    Returns the seconds waited."""
    if max_wait_s <= 0 or cpu_stall_us() is None:
        return 0.0
    t0 = time.monotonic()
    quiet = 0
    announced = False
    while time.monotonic() - t0 < max_wait_s:
        a = cpu_stall_us()
        time.sleep(window_s)
        pct = 100.0 * (cpu_stall_us() - a) / (window_s * 1e6)
        quiet = quiet + 1 if pct < threshold_pct else 0
        if quiet >= windows:
            break
        if not announced and quiet == 0:
            log("waiting for the CPUs to be quiet (pressure %.0f%%, up to %d s)"
                % (pct, max_wait_s))
            announced = True
    else:
        log("still busy after %d s; running anyway" % max_wait_s)
    return time.monotonic() - t0


def cpu_pressure():
    """Share of the last 10 s in which some runnable task waited for a CPU (PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def busy_note(when, warn):
    """A line on how busy the machine is: other jobs on few cores skew results.

    At the end the pressure includes our own ranks, so only `warn` at start.
    """
    load = os.getloadavg()[0]
    psi = cpu_pressure()
    line = "load average %.2f, cpu pressure (some, avg10) %s %s" % (
        load, "?" if psi is None else "%.0f%%" % psi, when)
    busy = psi > 20 if psi is not None else load > os.cpu_count() / 2
    if warn and busy:
        line += "\nWARNING: the machine is busy before we start; expect slow, noisy numbers"
    return line


def print_machine(info, versions):
    print("machine: %s, %d cores (nproc), %s GiB memory, CPU %s, kernel %s"
          % (info["host"], info["nproc"], info["mem_total_gib"], info["cpu_model"],
             info["kernel"]))
    print("memcpy %s (numpy copy into a preallocated array, median of 5): %s GB/s"
          % (human_bytes(info.get("memcpy_bytes", 0)), info["memcpy_gbps"]))
    print(busy_note("at start", warn=True))
    for k, v in versions.items():
        print("%s: %s" % (k, v))


# ---------------------------------------------------------------- scenarios

class Scenario:
    """Where the ranks run and how each system is told so.

    nodes x ranks_per_node ranks in all. Subclasses choose the extra mpirun
    flags; the benchmark flags are common to every system.
    """
    name = "?"

    def __init__(self, nodes, ranks_per_node):
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node

    @property
    def world(self):
        return self.nodes * self.ranks_per_node

    def placement_flags(self):
        return ["--nodes", str(self.nodes), "--ranks-per-node", str(self.ranks_per_node)]

    def mpirun_transport_flags(self):
        raise NotImplementedError

    def describe(self):
        raise NotImplementedError

    # Hooks for scenarios that build something (netns): set up before the
    # commands are made, torn down at the end whatever happens.
    def setup(self, args):
        pass

    def teardown(self):
        pass

    def command(self, system, args, common):
        """argv of `system` when the scenario places the ranks itself, else None."""
        return None

    def extra_env(self, system):
        return {}

    def counters(self):
        """Per-node traffic counters (netns: veth tx bytes), or None."""
        return None


class LocalScenario(Scenario):
    name = "local"

    def mpirun_transport_flags(self):
        return []  # OpenMPI's defaults: ob1 + vader shared memory

    def describe(self):
        return ("local: 1 node, %d ranks; OpenMPI default transports (vader shared "
                "memory), gloo TCP over lo" % self.world)


class LoopbackScenario(Scenario):
    name = "loopback"

    def mpirun_transport_flags(self):
        return ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]

    def describe(self):
        return ("loopback: %d nodes x %d ranks on this machine; OpenMPI forced onto "
                "TCP over lo (ob1, btl tcp,self), gloo TCP over lo"
                % (self.nodes, self.ranks_per_node))


class NetnsScenario(Scenario):
    """N namespaces joined by shaped veths (netns.py); every system's ranks
    run so that their traffic crosses the veths."""
    name = "netns"
    PEER_PORT = 7361

    def __init__(self, nodes, ranks_per_node, rate):
        super().__init__(nodes, ranks_per_node)
        self.rate = rate
        self.topo = None
        self.daemons = []
        self.sockets = []
        self.tmp = None
        self.ciuic_error = None

    def describe(self):
        what = ("netns: %d nodes x %d ranks, each node a network namespace, links shaped "
                "to %s; ciuic UCX tcp, OpenMPI ob1 btl tcp, gloo TCP, all on the veths"
                % (self.nodes, self.ranks_per_node, self.rate))
        if self.topo is not None:
            what += "\n  " + self.topo.describe()
        return what

    def mpirun_transport_flags(self):
        from netns import IFNAME
        return ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", IFNAME, "--mca", "oob_tcp_if_include", IFNAME]

    def setup(self, args):
        import netns
        self.topo = netns.Topology(self.nodes, rate=self.rate)
        self.topo.up()
        for line in self.topo.qdiscs():
            log("  " + line)
        self.tmp = tempfile.mkdtemp(prefix="ciuic-netns-")
        if any(base_system(s) == "ciuic" for s in args.system_list):
            try:
                self.start_daemons(args)
            except RuntimeError as e:
                self.ciuic_error = str(e)

    def daemon_config_with_token(self, daemon_config):
        """The daemons listen on the veth addresses, which ciuicd allows only
        with a cluster token: the given config (if any) plus a fresh token
        file shared by the run's daemons, unless that config names one."""
        text = ""
        if daemon_config:
            with open(daemon_config) as f:
                text = f.read()
            if re.search(r"^cluster_token_file\s*:", text, re.M):
                return daemon_config
        token = os.path.join(self.tmp, "cluster-token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        path = os.path.join(self.tmp, "ciuicd.yaml")
        with open(path, "w") as f:
            f.write(text + ("" if text.endswith("\n") or not text else "\n"))
            f.write("cluster_token_file: %s\n" % token)
        return path

    def start_daemons(self, args):
        import netns
        binary = args.ciuicd
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise RuntimeError("ciuicd not found at %s (build it, or pass --ciuicd)" % binary)
        env = dict(os.environ)
        env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": netns.IFNAME,
                    "UCX_WARN_UNUSED_ENV_VARS": "n"})
        config = self.daemon_config_with_token(args.daemon_config)
        for i in range(self.nodes):
            sock = os.path.join(self.tmp, "n%d.sock" % i)
            cmd = self.topo.prefix(i) + [
                binary, "--socket", sock, "--listen",
                "%s:%d" % (self.topo.addr(i), self.PEER_PORT), "--node-name", "host%d" % i,
                "--log-level", "warn"]
            cmd += ["--config", config]
            logf = open(os.path.join(self.tmp, "n%d.log" % i), "w")
            proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.daemons.append(proc)
            self.sockets.append(sock)
            deadline = time.monotonic() + 20
            while not (os.path.exists(sock) and os.path.exists(sock + ".session")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(self.tmp, "n%d.log" % i)) as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError("ciuicd of node %d did not start: %s" % (i, tail))
                time.sleep(0.05)
        log("started %d ciuicd, one per namespace (UCX_TLS=tcp UCX_NET_DEVICES=%s)"
            % (self.nodes, netns.IFNAME))

    def teardown(self):
        for proc in self.daemons:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except OSError:
                    pass
        for proc in self.daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.daemons = []
        if self.topo is not None:
            self.topo.down()
            log("removed the namespaces %s" % ", ".join(
                self.topo.ns + ([self.topo.bridge_ns] if self.topo.bridge_ns else [])))
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def command(self, system, args, common):
        world, rpn = self.world, self.ranks_per_node
        addr0 = self.topo.addr(0)
        if system == "ciuic":
            if self.ciuic_error:
                return None, self.ciuic_error
            script = os.path.join(HERE, "ciuic_py_bench.py")
            return ([args.python, script] + common +
                    ["--sockets", ",".join(self.sockets),
                     "--coordinator", "%s:%d" % (addr0, self.PEER_PORT),
                     "--timeout", str(args.timeout)]), None
        if system in ("mpi", "mpi_tuned"):
            path = os.path.abspath(args.mpi_bench)
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                return None, "ciuic-mpi-bench not found at %s" % path
            mpirun = shutil.which(args.mpirun)
            if mpirun is None:
                return None, "mpirun not found (%s)" % args.mpirun
            # mpirun in node 0's namespace; orted on the others through
            # netns_rsh.sh (see there why 'ip netns exec' per rank fails).
            cmd = self.topo.prefix(0) + [mpirun, "--allow-run-as-root", "--oversubscribe",
                                         "--bind-to", "none", "-np", str(world),
                                         "--host", ",".join("%s:%d" % (self.topo.addr(i), rpn)
                                                            for i in range(self.nodes)),
                                         "--mca", "plm_rsh_agent",
                                         os.path.join(HERE, "netns_rsh.sh"),
                                         "--mca", "plm_rsh_no_tree_spawn", "1"]
            cmd += self.mpirun_transport_flags()
            for key, value in env_for(args, system).items():
                cmd += ["-x", "%s=%s" % (key, value)]
            return cmd + [path] + common, None
        if system == "gloo":
            import netns
            script = os.path.join(HERE, "gloo_bench.py")
            return ([args.python, script] + common +
                    ["--netns", ",".join(self.topo.ns), "--master-addr", addr0,
                     "--ifname", netns.IFNAME, "--timeout", str(args.timeout)]), None
        return None

    def extra_env(self, system):
        env = {}
        if base_system(system) == "ciuic":
            pp = os.path.abspath(os.path.join("build", "python"))
            env["PYTHONPATH"] = pp + (":" + os.environ["PYTHONPATH"]
                                      if os.environ.get("PYTHONPATH") else "")
        if system in ("mpi", "mpi_tuned"):
            env["CIUIC_NETNS_MAP"] = ",".join("%s=%s" % (self.topo.addr(i), self.topo.ns[i])
                                              for i in range(self.nodes))
        return env

    def counters(self):
        return self.topo.tx_bytes() if self.topo is not None else None


def make_scenario(args):
    if args.scenario == "local":
        if args.nodes not in (None, 1):
            sys.exit("compare.py: --scenario local is one node; use --scenario loopback "
                     "for --nodes %d" % args.nodes)
        return LocalScenario(1, args.ranks or args.ranks_per_node or 2)
    if args.scenario == "loopback":
        return LoopbackScenario(args.nodes or 2, args.ranks_per_node or args.ranks or 1)
    if args.scenario == "netns":
        return NetnsScenario(args.nodes or 2, args.ranks_per_node or args.ranks or 1,
                             args.link_rate)
    sys.exit("compare.py: unknown scenario %s" % args.scenario)


# ------------------------------------------------------------------ systems

def bench_flags(args):
    flags = ["--op", args.op, "--sizes", args.sizes, "--dtype", args.dtype,
             "--iters", str(args.iters), "--warmup", str(args.warmup), "--json"]
    if not args.no_check:
        flags.append("--check")
    return flags


def env_for(args, system):
    """Extra environment of `system` from --env [SYSTEM:]KEY=VALUE.

    "mpi:" applies to mpi_tuned as well; mpi_tuned starts from MPI_TUNED_ENV.
    """
    extra = dict(MPI_TUNED_ENV) if system == "mpi_tuned" else {}
    for item in args.env:
        target, sep, kv = item.partition(":")
        if not sep or "=" in target:
            target, kv = None, item
        if target is not None and target not in SYSTEMS:
            sys.exit("compare.py: --env %s: unknown system %s" % (item, target))
        if (target in (None, system, base_system(system)) or
                (target == "mpi" and system == "mpi_tuned")):
            key, _, value = kv.partition("=")
            extra[key] = value
    return extra


def command_for(system, args, scenario):
    """The argv for one run of `system`, or (None, reason) if it cannot run."""
    common = bench_flags(args) + scenario.placement_flags()
    if system in CODEC_OF:  # a ciuic row of --codecs
        common += ["--compression", CODEC_OF[system]]
        system = base_system(system)
    placed = scenario.command(system, args, common)
    if placed is not None:
        return placed
    if system == "ciuic":
        path = args.ciuic_bench
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return None, "ciuic-bench not found at %s (build it, or pass --ciuic-bench)" % path
        cmd = [path] + common
        if args.socket:
            cmd += ["--socket", args.socket]
        elif args.bind_daemons != "none":
            cmd += ["--bind-daemons", args.bind_daemons]
        return cmd, None
    if system in ("mpi", "mpi_tuned"):
        path = args.mpi_bench
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return None, ("ciuic-mpi-bench not found at %s (cmake --build build --target "
                          "ciuic-mpi-bench, or pass --mpi-bench)" % path)
        mpirun = shutil.which(args.mpirun)
        if mpirun is None:
            return None, "mpirun not found (%s)" % args.mpirun
        cmd = [mpirun]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        # Few cores here: allow more ranks than cores, and do not pin ranks.
        cmd += ["--oversubscribe", "--bind-to", "none", "-np", str(scenario.world)]
        cmd += scenario.mpirun_transport_flags()
        for key, value in env_for(args, system).items():
            cmd += ["-x", "%s=%s" % (key, value)]
        return cmd + [path] + common, None
    if system == "gloo":
        script = os.path.join(HERE, "gloo_bench.py")
        return [args.python, script] + common + ["--timeout", str(args.timeout)], None
    raise ValueError(system)


def run_one(system, cmd, args, rep, scenario=None):
    """Runs one benchmark; returns (rows, failure or None)."""
    env = dict(os.environ)
    env.update(env_for(args, system))
    if scenario is not None:
        env.update(scenario.extra_env(system))
    tx0 = scenario.counters() if scenario is not None else None
    t0 = time.monotonic()
    stall0 = cpu_stall_us()
    # Own process group, so that a timeout also ends the ranks mpirun or
    # gloo_bench.py started, not only the launcher.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        log("rep %d/%d %-5s TIMED OUT after %d s" % (rep, args.reps, system,
                                                      args.timeout + 30))
        return [], {"system": system, "rep": rep, "returncode": None,
                    "reason": "timed out after %d s" % (args.timeout + 30)}
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    elapsed = time.monotonic() - t0
    stall1 = cpu_stall_us()
    tx = None
    if tx0 is not None:
        tx1 = scenario.counters()
        tx = [None if a is None or b is None else b - a for a, b in zip(tx0, tx1)]
    # Share of the run in which some task waited for a CPU. Our own ranks
    # add a little; well above that, another job competed with the run.
    pressure = (None if stall0 is None or stall1 is None
                else round(100.0 * (stall1 - stall0) / (elapsed * 1e6), 1))
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        row.update({"system": system, "rep": rep, "cpu_pressure_pct": pressure})
        if tx is not None:
            row["link_tx_bytes_run"] = tx  # whole run (all sizes), per node's veth
        rows.append(row)
    failure = None
    if proc.returncode != 0 or not rows:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        failure = {"system": system, "rep": rep, "returncode": proc.returncode,
                   "reason": "exit code %d, %d rows" % (proc.returncode, len(rows)),
                   "stderr_tail": tail}
    log("rep %d/%d %-5s done in %5.1f s (cpu pressure %s%%): %d rows%s%s" % (
        rep, args.reps, system, elapsed, pressure, len(rows),
        "" if tx is None else ", veth tx bytes per node " + " ".join(
            "%.1fMB" % (b / 1e6) if b is not None else "?" for b in tx),
        "" if failure is None else "  FAILED (" + failure["reason"] + ")"))
    if tx is not None:
        TRAFFIC.append({"system": system, "rep": rep, "tx_bytes": tx})
    if failure is not None and failure.get("stderr_tail"):
        for line in failure["stderr_tail"].splitlines():
            log("  %s| %s" % (system, line))
    return rows, failure


# ----------------------------------------------------------------- summary

TRAFFIC = []  # netns: veth tx bytes per run


def expected_link_bytes(args, scenario):
    """What one run must at least send over each node's link, all sizes:
    ops per size (cold + warmup + iters + check) x the bytes a rank of a
    ring/pairwise algorithm sends to other nodes (allreduce 2(N-1)/N x
    bytes, others (N-1)/N), N = nodes (intra-node traffic does not cross)."""
    if args.op == "barrier":
        return 0
    n = scenario.nodes
    ops = 1 + args.warmup + args.iters + (0 if args.no_check else 1)
    factor = 2.0 * (n - 1) / n if args.op == "allreduce" else (n - 1) / n
    if args.op == "broadcast":
        factor = 1.0 / n  # root's node sends the buffer once per other node, spread
    total = sum(parse_size(x) for x in args.sizes.split(",") if x)
    return int(total * factor * ops * scenario.ranks_per_node)


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult != 1 else text) * mult


def print_traffic(args, scenario):
    if not TRAFFIC:
        return
    print()
    print("traffic over the shaped links (tx bytes of each node's veth, whole run: "
          "all sizes, cold+warmup+iters+check ops; a rank sends about %.0f MB per node "
          "for the algorithm-independent minimum)" % (expected_link_bytes(args, scenario) / 1e6))
    for t in TRAFFIC:
        print("  rep %d %-14s %s" % (t["rep"], LABEL[t["system"]], "  ".join(
            "node%d %8.1f MB" % (i, b / 1e6) if b is not None else "node%d ?" % i
            for i, b in enumerate(t["tx_bytes"]))))

def summarize(rows, systems):
    """{(system, bytes): stats} over reps."""
    groups = {}
    for r in rows:
        groups.setdefault((r["system"], r["bytes"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        t = [r["time_us"] for r in rs]
        p99 = [r["p99_us"] for r in rs if r.get("p99_us") is not None]
        b = [r["busbw_gbps"] for r in rs]
        errs = [r["errors"] for r in rs if r.get("errors") is not None]
        rel = [r["max_rel_error"] for r in rs if r.get("max_rel_error") is not None]
        out[key] = {
            "system": key[0], "bytes": key[1], "reps": len(rs),
            "time_us": statistics.median(t), "time_us_min": min(t), "time_us_max": max(t),
            # the median over repetitions of each one's 99th percentile
            "p99_us": statistics.median(p99) if p99 else None,
            "busbw_gbps": statistics.median(b), "busbw_gbps_min": min(b),
            "busbw_gbps_max": max(b),
            "errors": sum(errs) if errs else None,
            "max_rel_error": max(rel) if rel else None,
            "impl": rs[0].get("impl"),
        }
    return out


def ratio(stats, a, b, nbytes):
    """busbw of a / busbw of b (> 1: a is faster); time ratio for 0-byte ops."""
    sa, sb = stats.get((a, nbytes)), stats.get((b, nbytes))
    if not sa or not sb:
        return None
    if sa["busbw_gbps"] > 0 and sb["busbw_gbps"] > 0:
        return sa["busbw_gbps"] / sb["busbw_gbps"]
    if sa["time_us"] > 0:
        return sb["time_us"] / sa["time_us"]
    return None


def print_table(stats, systems):
    sizes = sorted({k[1] for k in stats})
    print()
    if "mpi_tuned" in systems:
        print("OpenMPI+malloc: OpenMPI with " +
              " ".join("%s=%s" % kv for kv in MPI_TUNED_ENV.items()))
    print("%10s  %-14s %10s   %-19s %9s %9s   %-17s %6s" % (
        "bytes", "system", "time_us", "(min..max)", "p99_us", "busbw", "(min..max)", "errors"))
    print("%10s  %-14s %10s   %-19s %9s %9s   %-17s %6s" % ("", "", "median", "", "", "GB/s",
                                                               "", ""))
    notes = set()
    for n in sizes:
        for s in systems:
            st = stats.get((s, n))
            if st is None:
                continue
            mark = ""
            if st["impl"]:
                mark = " *"
                notes.add("* %s: %s (emulated)" % (LABEL[s], st["impl"]))
            check = "-" if st["errors"] is None else st["errors"]
            if st.get("max_rel_error") is not None:
                check = "rel %.1e" % st["max_rel_error"]  # lossy codec: max |err| / max |exact|
            p99 = "-" if st.get("p99_us") is None else "%.2f" % st["p99_us"]
            print("%10s  %-14s %10.2f  (%8.2f..%8.2f) %9s %9.3f  (%7.3f..%7.3f) %6s%s" % (
                human_bytes(n), LABEL[s], st["time_us"], st["time_us_min"],
                st["time_us_max"], p99, st["busbw_gbps"], st["busbw_gbps_min"],
                st["busbw_gbps_max"], check, mark))
    codec_rows = [s for s in systems if s in CODEC_OF and s != "ciuic"]
    if codec_rows and "ciuic" in systems:
        print()
        print("codecs: busbw ratio against ciuic uncompressed, same run (median; > 1: faster)")
        heads = [LABEL[c] + "/ciuic" for c in codec_rows]
        print("%10s  " % "bytes" + "  ".join("%16s" % h for h in heads))
        for n in sizes:
            cells = []
            for c, h in zip(codec_rows, heads):
                r = ratio(stats, c, "ciuic", n)
                cells.append("%*s" % (max(16, len(h)), "-" if r is None else "%.2fx" % r))
            print("%10s  " % human_bytes(n) + "  ".join(cells))
    if "ciuic" in systems and len(systems) > 1 and any(k[0] == "ciuic" for k in stats):
        others = [s for s in systems if base_system(s) != "ciuic"]
        print()
        print("busbw ratio (median; > 1 means ciuic is faster)")
        heads = ["ciuic/" + LABEL[o] for o in others]
        print("%10s  " % "bytes" + "  ".join("%13s" % h for h in heads))
        for n in sizes:
            cells = []
            for o, h in zip(others, heads):
                r = ratio(stats, "ciuic", o, n)
                cells.append("%*s" % (max(13, len(h)), "-" if r is None else "%.2fx" % r))
            print("%10s  " % human_bytes(n) + "  ".join(cells))
    for note in sorted(notes):
        print(note)


def rate_gbps(rate):
    """tc rate ("1gbit", "100mbit", "500kbit", "1e9bit") in GB/s, or None."""
    m = re.fullmatch(r"([0-9.e+]+)\s*([kmgt]?)bit", rate.strip().lower())
    if not m:
        return None
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * mult / 8 / 1e9


def plot(stats, systems, path, title, memcpy_gbps, link_gbps=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for s in systems:
        pts = sorted((k[1], v) for k, v in stats.items() if k[0] == s and k[1] > 0)
        if not pts:
            continue
        x = [p[0] for p in pts]
        for ax, key in ((ax_bw, "busbw_gbps"), (ax_t, "time_us")):
            y = [p[1][key] for p in pts]
            lo = [p[1][key] - p[1][key + "_min"] for p in pts]
            hi = [p[1][key + "_max"] - p[1][key] for p in pts]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=LABEL[s])
    if link_gbps:  # shaped links: the link, not memory, is the bound
        ax_bw.axhline(link_gbps, color="grey", linestyle=":",
                      label="link rate (%.3g GB/s)" % link_gbps)
        ax_bw.set_ylim(0, link_gbps * 1.15)
    elif memcpy_gbps:
        ax_bw.axhline(memcpy_gbps, color="grey", linestyle=":",
                      label="memcpy 256 MiB (%.1f GB/s)" % memcpy_gbps)
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_bw.set_ylabel("busbw (GB/s, median over reps; bars: min..max)")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per op (us)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Benchmark one collective on ciuic, OpenMPI and gloo, interleaved.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--op", default="allreduce",
                   choices=("allreduce", "reduce_scatter", "allgather", "alltoall", "alltoallv",
                            "broadcast", "barrier"))
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,64M,256M",
                   help="bytes per rank, K/M/G = powers of 1024 (nccl-tests definition)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "int32"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--systems", default="ciuic,mpi,gloo")
    p.add_argument("--codecs", default="",
                   help="run the ciuic system once per codec, interleaved, e.g. "
                        "none,fp16,int8,topk:0.01: rows ciuic (none), ciuic+fp16, ... "
                        "(passed as --compression; lossy rows report max_rel_error)")
    p.add_argument("--scenario", default="local",
                   choices=("local", "loopback", "netns", "train", "balance", "racks",
                            "channels"))
    p.add_argument("--link-rate", default="1gbit",
                   help="netns/train: tbf rate of every veth end (tc syntax, default 1gbit)")
    p.add_argument("--ranks", type=int, help="ranks of the local scenario (default 2)")
    p.add_argument("--nodes", type=int, help="nodes of the loopback scenario (default 2)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (default 1)")
    p.add_argument("--no-check", action="store_true",
                   help="do not verify results (--check is on by default; it runs "
                        "outside the timing)")
    build = os.path.join(os.getcwd(), "build", "tools", "bench")
    p.add_argument("--ciuic-bench", default=os.path.join(build, "ciuic-bench"))
    p.add_argument("--socket", help="passed to ciuic-bench as --socket")
    p.add_argument("--bind-daemons", choices=["none", "core"], default="none",
                   help="local/loopback: passed to ciuic-bench, which then pins the daemon of "
                        "node n to the n-th CPU (each simulated node's daemon on a core of its "
                        "own, as on separate hosts; trainers and MPI ranks float)")
    p.add_argument("--mpi-bench", default=os.path.join(build, "ciuic-mpi-bench"))
    p.add_argument("--ciuicd", default=os.path.join(os.getcwd(), "build", "daemon", "ciuicd"),
                   help="netns/train: the daemon started in each namespace")
    p.add_argument("--daemon-config", help="netns/train: passed to each ciuicd as --config")
    t = p.add_argument_group("--scenario train (see train_compare.py)")
    t.add_argument("--train-script", default=os.path.join(os.getcwd(), "examples", "train_ddp.py"))
    t.add_argument("--train-rows", default=None,
                   help="subset of compute,gloo,gloo+fp16,gloo+powerSGD,ciuic (default all)")
    t.add_argument("--steps", type=int, default=12, help="training steps per run")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--hidden", type=int, default=None, help="train_ddp.py --hidden")
    t.add_argument("--layers", type=int, default=None, help="train_ddp.py --layers")
    t.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="train_ddp.py --bucket-cap-mb (DDP's gradient bucket size; default 25)")
    t.add_argument("--train-threads", type=int, default=1,
                   help="torch threads per rank (default 1: 2 ranks on 2 cores)")
    t.add_argument("--train-timeout", type=int, default=300,
                   help="seconds per training run before it counts as hung")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--python", default="/usr/bin/python3",
                   help="interpreter with torch for gloo_bench.py")
    p.add_argument("--env", action="append", default=[], metavar="[SYSTEM:]KEY=VALUE",
                   help="environment for every system, or one (e.g. "
                        "mpi:MALLOC_MMAP_THRESHOLD_=1073741824); repeatable")
    p.add_argument("--timeout", type=int, default=900, help="seconds per benchmark run")
    p.add_argument("--wait-quiet", type=int, default=0, metavar="SECONDS",
                   help="before each run, wait up to SECONDS for 2 s of CPU pressure "
                        "under 5%% (others' jobs on a shared machine); default off")
    p.add_argument("--noisy-pressure", type=float, default=25.0,
                   help="flag runs with more CPU pressure (PSI some, %%) than this")
    p.add_argument("--json-out", help="write machine, config, raw rows and summary here")
    p.add_argument("--plot", help="write a PNG of busbw and time against size here")
    args = p.parse_args(argv)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in args.system_list:
        if s not in SYSTEMS:
            p.error("unknown system %s (choose from %s)" % (s, ",".join(SYSTEMS)))
    if args.codecs:
        codecs = [c.strip().lower() for c in args.codecs.split(",") if c.strip()]
        for c in codecs:
            if not benchlib.valid_codec(c):
                p.error("unknown codec %s in --codecs (none, fp16, bf16, int8, topk:RATIO "
                        "with 0 < RATIO <= 1)" % c)
        if "ciuic" not in args.system_list:
            p.error("--codecs needs the ciuic system in --systems")
        if args.op not in ("allreduce", "reduce_scatter"):
            p.error("--codecs applies to allreduce and reduce_scatter, not %s" % args.op)
        rows = []
        for c in codecs:
            row = "ciuic" if c == "none" else "ciuic+" + c
            if row not in rows:
                rows.append(row)
                CODEC_OF[row] = c
                LABEL[row] = row
        i = args.system_list.index("ciuic")
        args.system_list[i:i + 1] = rows
    if args.reps < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--reps and --iters must be >= 1, --warmup >= 0")
    return args


def versions():
    out = {}
    try:
        v = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                           timeout=20).stdout.splitlines()
        out["OpenMPI"] = v[0] if v else "?"
    except (OSError, subprocess.TimeoutExpired):
        out["OpenMPI"] = "not found"
    try:
        from importlib.metadata import version
        out["torch"] = version("torch")
    except Exception:  # Debian may ship torch without dist-info
        out["torch"] = "?"
    return out


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)


def main(argv):
    args = parse_args(argv)
    if args.scenario in ("netns", "train", "racks", "channels") and os.geteuid() != 0:
        print("compare.py: --scenario %s builds network namespaces (ip netns add, veth, tc) "
              "and needs root; run it as root, or use --scenario loopback" % args.scenario,
              file=sys.stderr)
        return 2
    # SIGINT (also where a background job inherited it ignored), SIGTERM and
    # SIGHUP end the run like Ctrl-C, so that the finally clauses below
    # remove the namespaces and stop the daemons.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    if args.scenario == "train":
        import train_compare
        return train_compare.main(args)
    if args.scenario == "balance":
        return run_balance(args)
    if args.scenario == "racks":
        return run_netns_test(args, "racks_test.py", ["--pairs", str(args.reps)], 1)
    if args.scenario == "channels":
        return run_netns_test(args, "channel_weights_test.py", [], args.reps)
    scenario = make_scenario(args)
    try:
        return run(args, scenario)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return 130
    finally:
        scenario.teardown()


def run_balance(args):
    """--scenario balance: examples/train_balanced.py --compare does the runs."""
    script = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples",
                          "train_balanced.py")
    cmd = [args.python, script, "--compare", "--reps", str(args.reps),
           "--nodes", str(args.nodes or 2), "--nprocs", str(args.ranks_per_node or 1),
           "--ciuicd", args.ciuicd]
    log("running " + " ".join(cmd))
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                             timeout=args.timeout * 2 * args.reps)
    except subprocess.TimeoutExpired:
        print("compare.py: the balance runs took longer than %d s" % (args.timeout * 2 * args.reps))
        return 1
    lines = out.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    if out.returncode != 0 or not lines:
        return out.returncode or 1
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(lines[-1] + "\n")
    return 0


def run_netns_test(args, script, flags, runs):
    """--scenario racks / channels: a tests/netns script does the runs and
    the checks (`runs` times); its table lines are printed, its last JSON
    line per run goes to --json-out (one line per run)."""
    root = os.path.dirname(os.path.dirname(HERE))
    build = os.path.dirname(os.path.dirname(os.path.abspath(args.ciuicd)))
    cmd = [args.python, os.path.join(root, "tests", "netns", script), build] + flags
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    results, code = [], 0
    for run in range(runs):
        log("run %d/%d: %s" % (run + 1, runs, " ".join(cmd)))
        try:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                 timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print("compare.py: %s took longer than %d s" % (script, args.timeout))
            return 1
        lines = out.stdout.strip().splitlines()
        for line in lines:
            if not line.startswith("{"):
                print(line)
        results += [line for line in reversed(lines) if line.startswith("{")][:1]
        code = code or out.returncode
    if args.json_out and results:
        with open(args.json_out, "w") as f:
            f.write("\n".join(results) + "\n")
    return code


def run(args, scenario):
    log("measuring the machine (memcpy of 256 MiB)")
    info = machine_info()
    info["cpu_pressure_start"] = cpu_pressure()
    vers = versions()
    print_machine(info, vers)
    try:
        scenario.setup(args)
    except Exception as e:  # netns.NetnsError, OSError
        print("compare.py: could not set up scenario %s: %s" % (scenario.name, e))
        return 2
    print("scenario %s" % scenario.describe())
    print("op %s, dtype %s, sizes %s, iters %d, warmup %d, reps %d (interleaved)%s"
          % (args.op, args.dtype, args.sizes, args.iters, args.warmup, args.reps,
             "" if not args.env else ", env " + " ".join(args.env)))
    sys.stdout.flush()

    commands = {}
    skipped = {}
    for s in args.system_list:
        cmd, why = command_for(s, args, scenario)
        if cmd is None:
            skipped[s] = why
            print("NOTE: skipping %s: %s" % (LABEL[s], why))
            log("skipping %s: %s" % (s, why))
        else:
            commands[s] = cmd
    if not commands:
        print("nothing to run", file=sys.stderr)
        return 2

    rows, failures = [], []
    t_start = time.monotonic()
    for rep in range(1, args.reps + 1):
        for s in args.system_list:
            if s not in commands:
                continue
            wait_until_quiet(args.wait_quiet)
            log("rep %d/%d %-5s: %s" % (rep, args.reps, s, " ".join(commands[s])))
            r, f = run_one(s, commands[s], args, rep, scenario)
            rows.extend(r)
            if f:
                failures.append(f)
        log("rep %d/%d finished, %.0f s elapsed" % (rep, args.reps,
                                                    time.monotonic() - t_start))

    info["cpu_pressure_end"] = cpu_pressure()
    info["loadavg_end"] = os.getloadavg()
    print(busy_note("at end", warn=False))
    ran = [s for s in args.system_list if s in commands]
    stats = summarize(rows, ran)
    print_table(stats, ran)
    print_traffic(args, scenario)
    noisy = sorted({(r["rep"], r["system"], r["cpu_pressure_pct"]) for r in rows
                    if (r.get("cpu_pressure_pct") or 0) > args.noisy_pressure})
    if noisy:
        print("NOTE: runs during which other tasks waited for a CPU more than %g%% of "
              "the time (noisy; see min..max): %s" % (
                  args.noisy_pressure,
                  ", ".join("rep %d %s %.0f%%" % (rep, LABEL[s], p) for rep, s, p in noisy)))
    bad = [r for r in rows if r.get("errors")]
    for s, why in skipped.items():
        print("NOTE: %s was not run: %s" % (LABEL[s], why))
    for f in failures:
        print("FAILED: %s rep %d: %s" % (LABEL[f["system"]], f["rep"], f["reason"]))
    if bad:
        print("ERRORS: %d rows with mismatching elements" % len(bad))

    if args.json_out:
        doc = {
            "machine": info, "versions": vers,
            "config": {k: v for k, v in vars(args).items() if k != "system_list"},
            "link_traffic": TRAFFIC,
            "scenario": {"name": scenario.name, "nodes": scenario.nodes,
                         "link_rate": getattr(scenario, "rate", None),
                         "ranks_per_node": scenario.ranks_per_node,
                         "description": scenario.describe()},
            "commands": {s: c for s, c in commands.items()},
            "skipped": skipped,
            "failures": failures,
            "rows": rows,
            "summary": sorted(stats.values(), key=lambda x: (x["bytes"], x["system"])),
        }
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        log("wrote %s" % args.json_out)
    if args.plot:
        where = scenario.name
        if scenario.name != "local":
            where += " %dx%d" % (scenario.nodes, scenario.ranks_per_node)
        if scenario.name == "netns":
            where += " at %s" % scenario.rate
        title = "%s %s, %s, %d ranks (%s)" % (args.op, args.dtype, where,
                                              scenario.world, info["cpu_model"])
        plot(stats, ran, args.plot, title, info.get("memcpy_gbps"),
             rate_gbps(scenario.rate) if scenario.name == "netns" else None)
        log("wrote %s" % args.plot)
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

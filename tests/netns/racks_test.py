#!/usr/bin/python3
"""Rack-hierarchical allreduce chosen by the cost model, across network
namespaces (issue 33, item 2).

Four namespaces ("nodes") n0..n3 in two racks. Each rack is a namespace
holding a Linux bridge (its switch): n0 and n1 hang off rack a's, n2 and n3
off rack b's, each by an unshaped veth (eth0 in the node). The two switches
are joined by one veth, shaped with tbf on both ends to --inter (200 Mbit/s):
the slow inter-rack link. One ciuicd per node (UCX over TCP, config `rack: a`
or `rack: b`; nodes 2 and 3 get theirs from CIUIC_RACK, which overrides the
file's), one rank per node, float32 allreduces of --mib MiB. Before
each phase the coordinator's daemon (node0) is tuned with `ciuicctl tune set
algorithm=...`; each phase runs --ops allreduces:

  ring, rack, ring, rack   the flat ring and the rack-hierarchical allreduce
                           (--pairs of each, default 2), interleaved so that the machine's noise falls on
                           both alike. The ring crosses the inter-rack link
                           with 2(N-1)/N of the buffer each way, the rack
                           algorithm with the buffer once (its leaders'
                           exchange), the rest on the fast links.
  auto                     the coordinator picks by its cost model of the
                           per-peer link rates measured in the ring phases.

A phase's time per operation is the slowest rank's; its median leaves out
the phase's first operation (warm-up). Pass criteria:

  1. every element of every result is the exact sum (the data's float32 sums
     are exact), and each phase's last result is bit-identical on all ranks
     and in all phases;
  2. `ciuicctl trace` on node0 records algorithm "ring" for the ring phases'
     operations and "rack" for the rack phases';
  3. measured speedup = ring median / rack median >= --min-speedup;
  4. in the auto phase the trace records "rack", and the model's predicted
     speedup (modelFlatUs / modelRackUs, median over the phase's operations
     after the first) is within --tolerance of the measured one;
  5. the auto phase's median is within --auto-slack of the rack phases'.

--topology-only builds the namespaces, checks n0 reaches n3, and with
--check-rate measures a TCP stream through the inter-rack link (n0 -> n2,
about --inter) and inside a rack (n0 -> n1, much faster); no daemon runs.
Root only (ip netns, tc); exits 77 (skipped) otherwise. Everything it makes
is deleted at the end, also on failure.

    sudo PYTHONPATH=build/python /usr/bin/python3 tests/netns/racks_test.py build
"""

import argparse
import hashlib
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 7361
RATE_PORT = 7399
NODES = 4
RACK_OF = ["a", "a", "b", "b"]
def phases(pairs):
    """--pairs interleaved ring and rack phases, then auto."""
    return ["ring", "rack"] * pairs + ["auto"]


def sh(cmd, check=True, timeout=60):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def rate_bytes(rate):
    """tc rate ("200mbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f / 8
    raise ValueError(rate)


class Racks:
    """Nodes n0..n3 on two bridges (rack switches) joined by one shaped veth.

    Veths are made in the root namespace under names unique to this run (at
    most 15 characters), then moved and renamed: eth0 in a node; n<k> (the
    port to node k) and inter (the inter-rack link) in a switch."""

    def __init__(self, tag, inter, latency):
        self.tag = tag
        self.nodes = [f"cir{tag}n{k}" for k in range(NODES)]
        self.switches = {r: f"cir{tag}sw{r.upper()}" for r in ("a", "b")}
        self.inter = inter
        self.latency = latency

    @staticmethod
    def addr(node):
        return f"10.78.0.{node + 1}"

    def root_devs(self):
        """The root-namespace names of the veths' first ends."""
        return [f"cr{self.tag}n{k}" for k in range(NODES)] + [f"cr{self.tag}xa"]

    def up(self):
        self.down()
        for n in self.nodes + list(self.switches.values()):
            sh(["ip", "netns", "add", n])
            sh(["ip", "-n", n, "link", "set", "lo", "up"])
        for sw in self.switches.values():
            sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for k in range(NODES):
            node, port = f"cr{self.tag}n{k}", f"cr{self.tag}p{k}"
            sw = self.switches[RACK_OF[k]]
            sh(["ip", "link", "add", node, "type", "veth", "peer", "name", port])
            sh(["ip", "link", "set", node, "netns", self.nodes[k]])
            sh(["ip", "-n", self.nodes[k], "link", "set", node, "name", "eth0"])
            sh(["ip", "-n", self.nodes[k], "addr", "add", self.addr(k) + "/24", "dev", "eth0"])
            sh(["ip", "-n", self.nodes[k], "link", "set", "eth0", "up"])
            sh(["ip", "link", "set", port, "netns", sw])
            sh(["ip", "-n", sw, "link", "set", port, "name", f"n{k}"])
            sh(["ip", "-n", sw, "link", "set", f"n{k}", "master", "br0"])
            sh(["ip", "-n", sw, "link", "set", f"n{k}", "up"])
        ends = {"a": f"cr{self.tag}xa", "b": f"cr{self.tag}xb"}
        sh(["ip", "link", "add", ends["a"], "type", "veth", "peer", "name", ends["b"]])
        for r, sw in self.switches.items():
            sh(["ip", "link", "set", ends[r], "netns", sw])
            sh(["ip", "-n", sw, "link", "set", ends[r], "name", "inter"])
            sh(["ip", "-n", sw, "link", "set", "inter", "master", "br0"])
            sh(["ip", "-n", sw, "link", "set", "inter", "up"])
            # Each end shapes its egress: both directions are slow.
            sh(["tc", "-n", sw, "qdisc", "add", "dev", "inter", "root", "tbf", "rate", self.inter,
                "burst", "256kb", "latency", self.latency])
        return self

    def ping(self, src, dst):
        """Checks src reaches dst: ping, else (no ping installed) a TCP probe."""
        probe = (["ping", "-c1", "-W2"] if shutil.which("ping") else
                 [sys.executable, os.path.abspath(__file__), "--probe"])
        r = subprocess.run(["ip", "netns", "exec", self.nodes[src]] + probe + [self.addr(dst)],
                           capture_output=True, text=True, timeout=15)
        if r.returncode != 0:
            raise RuntimeError(f"n{src} cannot reach n{dst} ({self.addr(dst)}): "
                               f"{(r.stdout + r.stderr).strip()}")

    def down(self):
        for n in self.nodes + list(self.switches.values()):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
        for dev in self.root_devs():
            if os.path.exists("/sys/class/net/" + dev):
                subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30)


# ------------------------------------------------------------------ TCP rate

def probe_main(args):
    """Exits 0 when the host answers a TCP connection to RATE_PORT (refused
    counts: the reply crossed the network), else 1."""
    try:
        socket.create_connection((args.probe, RATE_PORT), timeout=2).close()
    except ConnectionRefusedError:
        pass
    except OSError as e:
        print(f"{args.probe}: {e}")
        return 1
    return 0


def rate_recv_main(args):
    """Receiver (inside a namespace): accepts one stream, prints
    {"bytes", "seconds"} from its first byte to its end."""
    host, port = args.rate_recv.rsplit(":", 1)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, int(port)))
    srv.listen(1)
    srv.settimeout(30)
    print("listening", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(30)
    got, t0 = 0, None
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.perf_counter()
        got += len(b)
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    conn.close()
    print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)


def rate_send_main(args):
    """Sender (inside a namespace): --rate-mib MiB to the receiver."""
    host, port = args.rate_send.rsplit(":", 1)
    c = socket.create_connection((host, int(port)), timeout=30)
    block = b"\x5a" * (1 << 20)
    for _ in range(args.rate_mib):
        c.sendall(block)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)  # the receiver's close
    c.close()


def measure_rate(racks, src, dst, mib):
    """Bytes per second of one TCP stream from node src to node dst."""
    me = [sys.executable, os.path.abspath(__file__)]
    target = f"{racks.addr(dst)}:{RATE_PORT}"
    recv = subprocess.Popen(["ip", "netns", "exec", racks.nodes[dst]] + me +
                            ["--rate-recv", target], stdout=subprocess.PIPE, text=True)
    try:
        lines = queue.Queue()

        def pump():
            for line in recv.stdout:
                lines.put(line)
        threading.Thread(target=pump, daemon=True).start()
        if lines.get(timeout=15).strip() != "listening":
            raise RuntimeError("the rate receiver did not start")
        sh(["ip", "netns", "exec", racks.nodes[src]] + me +
           ["--rate-send", target, "--rate-mib", str(mib)], timeout=60)
        result = json.loads(lines.get(timeout=30))
        recv.wait(timeout=15)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    if result["bytes"] != mib << 20 or result["seconds"] <= 0:
        raise RuntimeError(f"rate n{src} -> n{dst}: got {result}")
    return result["bytes"] / result["seconds"]


# ------------------------------------------------------------------ a rank

def others(comm, rank, m=1 << 18):
    """The other collectives that go rack by rack, each checked against
    numpy: reduce_scatter and allgather of m float32 per rank, broadcast of
    4m from ranks 1 and 2; one JSON line with the times."""
    import numpy as np
    ranks_sum = sum(r + 1 for r in range(NODES))
    times = []

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)

    def check(what, got, want):
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise SystemExit(f"rank {rank} {what}: element {bad} is {got[bad]}, want {want[bad]}")

    inp = comm.empty((NODES * m,), "float32")
    out = comm.empty((m,), "float32")
    inp[:] = ((rank + 1) * (np.arange(NODES * m) % 5)).astype(np.float32)
    timed(lambda: comm.reduce_scatter(out, inp, timeout=120))
    check("reduce_scatter", out,
          (ranks_sum * (np.arange(rank * m, (rank + 1) * m) % 5)).astype(np.float32))
    mine = comm.empty((m,), "float32")
    gathered = comm.empty((NODES * m,), "float32")
    mine[:] = (rank + 1 + np.arange(m) % 3).astype(np.float32)
    timed(lambda: comm.allgather(gathered, mine, timeout=120))
    check("allgather", gathered,
          np.concatenate([q + 1 + np.arange(m) % 3 for q in range(NODES)]).astype(np.float32))
    y = comm.empty((4 * m,), "float32")
    for root in (1, 2):
        y[:] = (np.arange(4 * m) % 11 + root).astype(np.float32) if rank == root else -1
        timed(lambda: comm.broadcast(y, root=root, timeout=120))
        check(f"broadcast from {root}", y, (np.arange(4 * m) % 11 + root).astype(np.float32))
    print(json.dumps({"phase": "others", "times": times, "hash": ""}), flush=True)


def rank_main(args):
    """One rank (inside its namespace): for each 'go PHASE' line on stdin,
    --ops allreduces and one JSON line on stdout; 'done' ends it."""
    import numpy as np

    import ciuic
    n = args.mib << 18  # float32 elements
    comm = ciuic.init(rank=args.rank, world_size=NODES, local_rank=0, local_size=1, job="racks",
                      socket=args.socket, coordinator=args.coordinator,
                      arena_bytes=(args.mib << 20) + (64 << 20))
    x = comm.empty((n,), "float32")
    ranks_sum = sum(r + 1 for r in range(NODES))
    while True:
        line = sys.stdin.readline().split()
        if not line or line[0] == "done":
            break
        if line[0] != "go" or len(line) != 2:
            raise SystemExit(f"rank {args.rank}: unexpected {line}")
        if line[1] == "others":
            others(comm, args.rank)
            continue
        times = []
        for op in range(args.ops):
            # Halves and small integers: every order of float32 additions
            # gives the exact sum, so every algorithm must give these bits.
            steps = (np.arange(n, dtype=np.int64) + op) % 7
            x[:] = (args.rank + 1 + steps * 0.5).astype(np.float32)
            want = (ranks_sum + steps * (0.5 * NODES)).astype(np.float32)
            t0 = time.perf_counter()
            comm.allreduce(x, timeout=120)
            times.append(time.perf_counter() - t0)
            if not np.array_equal(x, want):
                bad = int(np.flatnonzero(x != want)[0])
                raise SystemExit(f"rank {args.rank} phase {line[1]} op {op}: element {bad} is "
                                 f"{x[bad]}, want {want[bad]}")
        print(json.dumps({"phase": line[1], "times": times,
                          "hash": hashlib.sha256(x.tobytes()).hexdigest()}), flush=True)
    comm.close()


# ------------------------------------------------------------------ driver

def ctl(build, racks, sock, *cmd):
    return sh(["ip", "netns", "exec", racks.nodes[0],
               os.path.join(build, "tools", "ctl", "ciuicctl"), "--socket", sock] + list(cmd))


def trace_ops(build, racks, sock, bytes_):
    """node0's recorded allreduces of bytes_ bytes, in submission order."""
    ops = json.loads(ctl(build, racks, sock, "--json", "trace", "--last", "0")).get("ops", [])
    ops = [o for o in ops
           if o.get("collective") == "allreduce" and int(o.get("bytes", "0")) == bytes_]
    return sorted(ops, key=lambda o: int(o.get("jobSeq", "0")))


def us(op, field):
    """A trace op's uint64 field (a JSON string; absent: 0)."""
    return float(op.get(field, 0) or 0)


def median(v):
    return statistics.median(v) if v else float("nan")


def check_rates(racks, args, failures):
    inter = measure_rate(racks, 0, 2, args.rate_mib)
    intra = measure_rate(racks, 0, 1, args.rate_mib)
    shaped = rate_bytes(args.inter)
    print(f"TCP n0 -> n2 (inter-rack): {inter / 1e6:.1f} MB/s (tbf {args.inter} = "
          f"{shaped / 1e6:.1f} MB/s); n0 -> n1 (same rack): {intra / 1e6:.1f} MB/s", flush=True)
    # The tbf bucket (256 kB) lets the stream's start through at once: a few
    # percent above the rate on --rate-mib MiB.
    if not 0.5 * shaped <= inter <= 1.25 * shaped:
        failures.append(f"inter-rack TCP rate {inter / 1e6:.1f} MB/s, not about "
                        f"{shaped / 1e6:.1f} MB/s")
    if intra < 3 * inter:
        failures.append(f"same-rack TCP rate {intra / 1e6:.1f} MB/s is not well above the "
                        f"inter-rack {inter / 1e6:.1f} MB/s")
    return {"inter_rack_mbs": inter / 1e6, "same_rack_mbs": intra / 1e6,
            "tbf_mbs": shaped / 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("build", nargs="?", default=os.path.join(HERE, "..", "..", "build"))
    p.add_argument("--inter", default="200mbit", help="the inter-rack link's rate (tc)")
    p.add_argument("--tbf-latency", default="200ms",
                   help="tbf's queue (as time at the link's rate): a queue too short for TCP's "
                        "window drops packets, and TCP's backoff, not ciuic, sets the pace")
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--pairs", type=int, default=2,
                   help="interleaved ring and rack phases before the auto phase")
    p.add_argument("--ops", type=int, default=5, help="allreduces per phase (the first is "
                   "left out of the phase's median)")
    p.add_argument("--min-speedup", type=float, default=1.15,
                   help="the ring phases' median over the rack phases' must reach this")
    p.add_argument("--tolerance", type=float, default=0.20,
                   help="how far the model's predicted speedup may be from the measured one "
                        "(|measured / predicted - 1|)")
    p.add_argument("--auto-slack", type=float, default=1.25,
                   help="the auto phase's median may be this many times the rack phases'")
    p.add_argument("--phase-timeout", type=float, default=150,
                   help="seconds to wait for every rank's result of one phase")
    p.add_argument("--tuning", default="", help="extra tuning lines for every daemon, e.g. "
                   "'chunks_in_flight: 16'")
    p.add_argument("--topology-only", action="store_true",
                   help="build the namespaces, check n0 reaches n3, tear down; no daemon")
    p.add_argument("--check-rate", action="store_true",
                   help="measure TCP through the inter-rack link and inside a rack")
    p.add_argument("--rate-mib", type=int, default=8, help="MiB per --check-rate stream")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--rate-recv", help=argparse.SUPPRESS)
    p.add_argument("--rate-send", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank >= 0:
        return rank_main(args)
    if args.probe:
        return probe_main(args)
    if args.rate_recv:
        return rate_recv_main(args)
    if args.rate_send:
        return rate_send_main(args)
    if os.geteuid() != 0:
        print("skipped: network namespaces need root")
        return 77
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.ops < 2:
        p.error("--ops must be at least 2 (the first of each phase is warm-up)")
    build = os.path.abspath(args.build)
    ciuicd = os.path.join(build, "daemon", "ciuicd")
    racks = Racks(os.getpid() % 100000, args.inter, args.tbf_latency)
    tmp = tempfile.mkdtemp(prefix="ciuic-racks-")
    os.chmod(tmp, 0o700)
    daemons, ranks = [], []
    failures = []
    try:
        racks.up()
        racks.ping(0, 3)
        print(f"topology: {' '.join(racks.nodes)}; rack a {racks.switches['a']} (n0, n1), "
              f"rack b {racks.switches['b']} (n2, n3); inter-rack {args.inter}", flush=True)
        rates = check_rates(racks, args, failures) if args.check_rate else None
        if args.topology_only:
            print(json.dumps({"topology_only": True, "rates": rates}))
            if failures:
                print("FAILED:\n  " + "\n  ".join(failures))
                return 1
            print("ok")
            return 0

        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write("racks-test-token-0123456789abcdef0123456789\n")
        os.chmod(token, 0o600)
        socks = []
        for node in range(NODES):
            d = os.path.join(tmp, f"n{node}")
            os.mkdir(d, 0o700)
            sock = os.path.join(d, "ciuicd.sock")
            cfg = os.path.join(d, "ciuicd.yaml")
            with open(cfg, "w") as f:
                f.write(f"socket: {sock}\nnode_name: node{node}\nlog_level: info\n"
                        f"listen: {racks.addr(node)}:{PORT}\ncluster_token_file: {token}\n"
                        # Rack b comes from CIUIC_RACK, which overrides the file.
                        f"rack: {RACK_OF[node] if node < 2 else 'overridden'}\n")
                if args.tuning:
                    f.write("tuning:\n" + "".join(f"  {t.strip()}\n"
                                                  for t in args.tuning.split(";")))
            log = open(os.path.join(d, "log"), "w")
            env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
            if node >= 2:
                env["CIUIC_RACK"] = RACK_OF[node]
            daemons.append((subprocess.Popen(
                ["ip", "netns", "exec", racks.nodes[node], ciuicd, "--config", cfg],
                stdout=log, stderr=subprocess.STDOUT, env=env), d))
            socks.append(sock)
        deadline = time.monotonic() + 20
        while not all(os.path.exists(s + ".session") for s in socks):
            if time.monotonic() > deadline or any(p.poll() is not None for p, _ in daemons):
                raise RuntimeError("a ciuicd did not start")
            time.sleep(0.05)
        coordinator = f"{racks.addr(0)}:{PORT}"
        env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
        lines = []  # per rank: its stdout's lines, read by a thread, so every wait is bounded
        for node in range(NODES):
            r = subprocess.Popen(
                ["ip", "netns", "exec", racks.nodes[node], sys.executable,
                 os.path.abspath(__file__), "--rank", str(node), "--socket", socks[node],
                 "--coordinator", coordinator, "--mib", str(args.mib), "--ops", str(args.ops)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            q = queue.Queue()

            def pump(out=r.stdout, q=q):
                for line in out:
                    q.put(line)
                q.put(None)
            threading.Thread(target=pump, daemon=True).start()
            ranks.append(r)
            lines.append(q)

        def tell(text):
            for r in ranks:
                r.stdin.write(text + "\n")
                r.stdin.flush()

        def read_phase(name):
            deadline = time.monotonic() + args.phase_timeout
            out = []
            for k, q in enumerate(lines):
                while True:
                    try:
                        line = q.get(timeout=max(0.1, deadline - time.monotonic()))
                    except queue.Empty:
                        raise RuntimeError(f"rank {k}: no result of phase {name} in "
                                           f"{args.phase_timeout:.0f} s") from None
                    if line is None:
                        code = ranks[k].wait(timeout=30)
                        raise RuntimeError(f"rank {k} ended in phase {name} (exit {code})")
                    if line.startswith("{"):
                        break
                    print(f"rank {k}: {line.rstrip()}", flush=True)
                got = json.loads(line)
                if got.get("phase") != name:
                    raise RuntimeError(f"rank {k}: result of phase {got.get('phase')}, "
                                       f"want {name}")
                out.append(got)
            return [max(ts) for ts in zip(*(o["times"] for o in out))], [o["hash"] for o in out]

        bytes_ = args.mib << 20
        results = []  # per phase: name, times (slowest rank), hashes, trace ops
        seen = 0
        for name in phases(args.pairs):
            ctl(build, racks, socks[0], "tune", "set", f"algorithm={name}")
            tell(f"go {name}")
            times, hashes = read_phase(name)
            ops = trace_ops(build, racks, socks[0], bytes_)
            results.append({"phase": name, "times": times, "hashes": hashes,
                            "ops": ops[seen:]})
            seen = len(ops)
            algs = [o.get("algorithm", "") for o in results[-1]["ops"]]
            print(f"phase {name:5s}: " + " ".join(f"{t * 1e3:.0f}" for t in times) +
                  f" ms; median after the first {median(times[1:]) * 1e3:.0f} ms; "
                  f"trace algorithm {algs}", flush=True)
        # Reduce-scatter, allgather and broadcast rack by rack, checked by
        # the ranks; node0's trace must say "rack" for each.
        ctl(build, racks, socks[0], "tune", "set", "algorithm=rack")
        tell("go others")
        other_times, _ = read_phase("others")
        traced = json.loads(ctl(build, racks, socks[0], "--json", "trace", "--last", "0"))
        other_algs = {(o.get("collective"), o.get("algorithm", ""))
                      for o in traced.get("ops", [])
                      if o.get("collective") in ("reduce_scatter", "allgather", "broadcast")}
        print("reduce_scatter, allgather, broadcast x2 rack by rack: " +
              " ".join(f"{t * 1e3:.0f}" for t in other_times) + f" ms; trace {sorted(other_algs)}",
              flush=True)
        if other_algs != {("reduce_scatter", "rack"), ("allgather", "rack"),
                          ("broadcast", "rack")}:
            failures.append(f"the other collectives' trace algorithms: {sorted(other_algs)}")
        print(ctl(build, racks, socks[0], "peers"), flush=True)
        jobs = json.loads(ctl(build, racks, socks[0], "--json", "peers")).get("jobs", [])
        registered = [p.get("rack", "") for p in (jobs[0].get("peers", []) if jobs else [])]
        if registered != [RACK_OF[n] for n in range(NODES)]:
            failures.append(f"racks as registered: {registered}, want "
                            f"{[RACK_OF[n] for n in range(NODES)]} (nodes 2 and 3 by CIUIC_RACK)")
        tell("done")
        for r in ranks:
            if r.wait(timeout=60) != 0:
                raise RuntimeError("a rank failed")

        # 1. bit-identical on every rank and in every phase (each rank
        #    checked every element against the exact sum).
        all_hashes = {h for res in results for h in res["hashes"]}
        if len(all_hashes) != 1:
            failures.append("results differ: " + "; ".join(
                f"{res['phase']}: {[h[:12] for h in res['hashes']]}" for res in results))

        # 2. the trace records the algorithm each phase asked for.
        for i, res in enumerate(results):
            algs = [o.get("algorithm", "") for o in res["ops"]]
            if len(algs) != args.ops:
                failures.append(f"phase {i} ({res['phase']}): the trace holds {len(algs)} "
                                f"operations, want {args.ops}")
            if res["phase"] != "auto" and any(a != res["phase"] for a in algs):
                failures.append(f"phase {i} ({res['phase']}): trace algorithm {algs}")

        # 3. rack beats ring.
        ring = median([t for res in results if res["phase"] == "ring" for t in res["times"][1:]])
        rack = median([t for res in results if res["phase"] == "rack" for t in res["times"][1:]])
        auto_res = results[-1]
        auto = median(auto_res["times"][1:])
        measured = ring / rack
        if measured < args.min_speedup:
            failures.append(f"measured speedup ring/rack {measured:.2f} < {args.min_speedup}")

        # 4. auto picks rack, and the model predicted the speedup.
        auto_ops = auto_res["ops"][1:]
        auto_algs = [o.get("algorithm", "") for o in auto_res["ops"]]
        if not auto_ops or any(o.get("algorithm", "") != "rack" for o in auto_ops):
            failures.append(f"auto phase: trace algorithm {auto_algs}, want rack after the first")
        model = [(us(o, "modelFlatUs"), us(o, "modelRackUs")) for o in auto_res["ops"]]
        ratios = [flat / rack_us for flat, rack_us in model[1:] if flat > 0 and rack_us > 0]
        predicted = median(ratios)
        if not ratios:
            failures.append("auto phase: the trace holds no modelFlatUs / modelRackUs")
        elif abs(measured / predicted - 1) > args.tolerance:
            failures.append(f"predicted speedup {predicted:.2f} (model) vs measured "
                            f"{measured:.2f}: off by {abs(measured / predicted - 1) * 100:.0f}% "
                            f"> {args.tolerance * 100:.0f}%")

        # 5. auto runs as fast as rack.
        if auto > args.auto_slack * rack:
            failures.append(f"auto median {auto * 1e3:.0f} ms > {args.auto_slack} x rack median "
                            f"{rack * 1e3:.0f} ms")

        link_s = bytes_ / rate_bytes(args.inter)
        print(f"\n{'phase':6s} {'median ms':>10s} {'ops ms (slowest rank)':s}")
        for res in results:
            print(f"{res['phase']:6s} {median(res['times'][1:]) * 1e3:10.0f}  " +
                  " ".join(f"{t * 1e3:.0f}" for t in res["times"]))
        print(f"ring {ring * 1e3:.0f} ms, rack {rack * 1e3:.0f} ms, auto {auto * 1e3:.0f} ms; "
              f"measured speedup {measured:.2f}, predicted {predicted:.2f}; "
              f"auto model (flat us, rack us): {model}; "
              f"the buffer once over the inter-rack link: {link_s * 1e3:.0f} ms", flush=True)
        print(json.dumps({
            "phases": [{"phase": res["phase"], "ms": [t * 1e3 for t in res["times"]],
                        "algorithms": [o.get("algorithm", "") for o in res["ops"]]}
                       for res in results],
            "ring_ms": ring * 1e3, "rack_ms": rack * 1e3, "auto_ms": auto * 1e3,
            "measured_speedup": measured, "predicted_speedup": predicted,
            "auto_model_us": model, "rates": rates}))
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures))
            return 1
        print("ok")
        return 0
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait(timeout=30)
        for proc, d in daemons:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        for proc, d in daemons:
            if proc.returncode not in (0, None):
                with open(os.path.join(d, "log")) as f:
                    print(f"--- ciuicd log {d}:\n{f.read()[-3000:]}")
        racks.down()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

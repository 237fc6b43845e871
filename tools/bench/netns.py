"""netns.py: N network namespaces acting as N hosts, joined by shaped veths.

Used by compare.py (--scenario netns and train). Root only.

Layout (tag = a per-process number, so that concurrent runs do not collide):
  2 nodes   cib<tag>n0 <-- veth --> cib<tag>n1
  N > 2     cib<tag>n<i> <-- veth --> bridge br0 in its own namespace cib<tag>br
Inside every node namespace the veth is renamed to IFNAME ("cib0"), so that
every system can be told one interface name (GLOO_SOCKET_IFNAME,
btl_tcp_if_include, UCX_NET_DEVICES); node i has the address 10.88.0.<i+1>/24.
Every veth end (both ends of each pair) gets `tc qdisc ... tbf rate RATE`:
tbf shapes egress only, so shaping both ends limits both directions.
The pairs are created in the root namespace and then moved: a pair created
straight into two namespaces comes up without carrier on this kernel.
Deleting a namespace deletes the veth ends in it; down() deletes them all.
"""

import json
import os
import subprocess

IFNAME = "cib0"
SUBNET = "10.88.0"


class NetnsError(RuntimeError):
    pass


def _sh(cmd, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetnsError("%s: %s" % (" ".join(cmd), (r.stderr or r.stdout).strip()))
    return r.stdout


class Topology:
    def __init__(self, nodes, rate="1gbit", burst="256kb", latency="50ms", tag=None):
        if nodes < 2:
            raise ValueError("a namespace topology needs at least 2 nodes")
        self.nodes = nodes
        self.rate, self.burst, self.latency = rate, burst, latency
        self.tag = tag if tag is not None else os.getpid() % 100000
        self.ns = ["cib%dn%d" % (self.tag, i) for i in range(nodes)]
        self.bridge_ns = "cib%dbr" % self.tag if nodes > 2 else None
        self.created = []
        self.log = []

    # ------------------------------------------------------------ queries
    def addr(self, i):
        return "%s.%d" % (SUBNET, i + 1)

    def prefix(self, i):
        return ["ip", "netns", "exec", self.ns[i]]

    def describe(self):
        shape = "tbf rate %s burst %s latency %s on every veth end" % (
            self.rate, self.burst, self.latency)
        if self.nodes == 2:
            return "2 namespaces %s joined by one veth pair (%s), %s" % (
                ", ".join("%s=%s" % (n, self.addr(i)) for i, n in enumerate(self.ns)),
                IFNAME, shape)
        return "%d namespaces %s, each one veth to bridge br0 in namespace %s, %s" % (
            self.nodes, ", ".join("%s=%s" % (n, self.addr(i)) for i, n in enumerate(self.ns)),
            self.bridge_ns, shape)

    def tx_bytes(self):
        """tx byte counter of each node's veth (list, one per node)."""
        out = []
        for n in self.ns:
            try:
                text = _sh(["ip", "-n", n, "-j", "-s", "link", "show", IFNAME])
                out.append(int(json.loads(text)[0]["stats64"]["tx"]["bytes"]))
            except (NetnsError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired):
                out.append(None)
        return out

    def qdiscs(self):
        lines = []
        for n in self.ns + ([self.bridge_ns] if self.bridge_ns else []):
            for line in _sh(["tc", "-n", n, "qdisc", "show"], check=False).splitlines():
                if "tbf" in line:
                    lines.append("%s: %s" % (n, line.strip()))
        return lines

    # ------------------------------------------------------------ setup
    def _run(self, cmd):
        self.log.append(" ".join(cmd))
        _sh(cmd)

    def _add_ns(self, name):
        self._run(["ip", "netns", "add", name])
        self.created.append(name)
        self._run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns, dev):
        self._run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                   "burst", self.burst, "latency", self.latency])

    def _node_end(self, i, dev):
        """Moves `dev` (in the root namespace) into node i as IFNAME, addressed and up."""
        n = self.ns[i]
        self._run(["ip", "link", "set", dev, "netns", n])
        self._run(["ip", "-n", n, "link", "set", dev, "name", IFNAME])
        self._run(["ip", "-n", n, "addr", "add", self.addr(i) + "/24", "dev", IFNAME])
        self._run(["ip", "-n", n, "link", "set", IFNAME, "up"])
        self._shape(n, IFNAME)

    def up(self):
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root (ip netns add); run compare.py "
                             "as root, or use --scenario loopback")
        self.down()  # leftovers of an earlier run with the same tag
        try:
            for n in self.ns:
                self._add_ns(n)
            t = self.tag
            if self.nodes == 2:
                a, b = "cib%dva" % t, "cib%dvb" % t
                self._run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
                self._node_end(0, a)
                self._node_end(1, b)
            else:
                br = self.bridge_ns
                self._add_ns(br)
                self._run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
                self._run(["ip", "-n", br, "link", "set", "br0", "up"])
                for i in range(self.nodes):
                    a, b = "cib%de%d" % (t, i), "cib%db%d" % (t, i)
                    self._run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
                    self._run(["ip", "link", "set", b, "netns", br])
                    self._run(["ip", "-n", br, "link", "set", b, "master", "br0"])
                    self._run(["ip", "-n", br, "link", "set", b, "up"])
                    self._shape(br, b)
                    self._node_end(i, a)
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        """Deletes every namespace (and so every veth) of this topology. Idempotent."""
        for n in self.ns + ([self.bridge_ns] if self.bridge_ns else []):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
        # A veth that was created but not moved yet lives in the root namespace.
        t = self.tag
        for dev in ["cib%dva" % t] + ["cib%de%d" % (t, i) for i in range(self.nodes)]:
            if os.path.exists("/sys/class/net/" + dev):
                subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30)
        self.created = []

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False

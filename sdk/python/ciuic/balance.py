"""How busy each rank is, from the timings of its own operations, and a split
of a global batch that would even the ranks out (``Communicator.balance()``).

The measure needs no clock shared between hosts. Every rank of an operation
sees it complete at nearly the same moment (the last message of the
exchange), and none can complete before the last rank submits it. So for one
operation, how much longer rank i waited than the rank that waited least,
``lag_i = (completed_i - submitted_i) - min_j (completed_j - submitted_j)``,
is how far ahead of the last submitter rank i was: time it spent waiting for
others. Each rank measures its durations on its own clock.

Operations that overlap on a rank (asynchronous ones, such as DDP's gradient
buckets submitted during the backward pass) end in one wait: while the first
of them is in flight the rank still computes the next. So a rank's idle time
is, for each group of its operations whose [submitted, completed] intervals
overlap, the largest lag in the group, summed over the groups. A rank's busy
time is the window's wall time less its idle time, and its speed is the
samples it processed in the window per busy second.

Everything here is plain arithmetic on numbers every rank has after the
exchange, so every rank computes the same result.
"""

import collections
import hashlib

import numpy as np

# The fields before the per-operation columns of a rank's row.
_HEADER = 4  # count, wall_ns, samples (-1: not given), dropped


def op_key(name, occurrence):
    """A 63-bit key for the occurrence-th operation named `name` in a window,
    the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{name}\0{occurrence}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_of(timings, window_start_ns, wall_ns, samples, dropped):
    """The int64 row a rank contributes: its header, then the keys, the
    submission times and the completion times of its operations (relative
    to the window's start on its own clock)."""
    ordered = sorted(timings, key=lambda t: t[1])  # by submission
    seen = collections.Counter()
    keys, subs, comps = [], [], []
    for name, submitted, completed in ordered:
        keys.append(op_key(name, seen[name]))
        seen[name] += 1
        subs.append(submitted - window_start_ns)
        comps.append(completed - window_start_ns)
    head = [len(keys), wall_ns, -1 if samples is None else samples, dropped]
    return np.array(head + keys + subs + comps, dtype=np.int64)


def padded(row, n):
    """`row` with its three columns padded to n operations each."""
    count = int(row[0])
    out = np.zeros(_HEADER + 3 * n, dtype=np.int64)
    out[:_HEADER] = row[:_HEADER]
    for c in range(3):
        out[_HEADER + c * n:_HEADER + c * n + count] = \
            row[_HEADER + c * count:_HEADER + (c + 1) * count]
    return out


def idle_ns(intervals):
    """Idle time from (submitted, completed, lag) of one rank's operations:
    the largest lag of each group of overlapping intervals, summed."""
    total = 0
    end = None
    group_max = 0
    for sub, comp, lag in sorted(intervals):
        if end is None or sub > end:
            total += group_max
            group_max = lag
            end = comp
        else:
            end = max(end, comp)
            group_max = max(group_max, lag)
    return total + group_max


class Balance:
    """What ``Communicator.balance()`` measured over its window (since the
    previous call, or since the communicator was made), the same on every
    rank. Lists are indexed by rank; times are seconds.

    - ``wall``: the window's length on each rank;
    - ``idle``: time each rank waited for slower ranks;
    - ``busy``: ``wall - idle``, the time it worked;
    - ``share``: ``busy / wall``, its share of the step time;
    - ``samples``: what each rank said it processed (1 each if not given);
    - ``speed``: samples per busy second;
    - ``slowest``: the rank with the lowest speed;
    - ``ops``: operations every rank completed in the window (the measure);
    - ``dropped``: operations that fell out of a rank's history of 4096.

    ``split(global_batch)`` divides a global batch among the ranks in
    proportion to their speed.
    """

    def __init__(self, wall, idle, samples, ops, dropped):
        self.wall = [w / 1e9 for w in wall]
        self.idle = [i / 1e9 for i in idle]
        self.busy = [max(w - i, 1e-9) for w, i in zip(self.wall, self.idle)]
        self.share = [b / w if w > 0 else 1.0 for b, w in zip(self.busy, self.wall)]
        self.samples = list(samples)
        self.speed = [s / b for s, b in zip(self.samples, self.busy)]
        self.slowest = min(range(len(self.speed)), key=lambda r: (self.speed[r], r))
        self.ops = ops
        self.dropped = dropped

    def split(self, global_batch, minimum=1):
        """`global_batch` samples divided among the ranks in proportion to
        their measured speed, each getting at least `minimum` (largest
        remainder; ties to the lower rank). Sums to `global_batch`."""
        world = len(self.speed)
        global_batch = int(global_batch)
        minimum = int(minimum)
        if minimum < 0 or global_batch < minimum * world:
            raise ValueError(f"cannot split {global_batch} samples among {world} ranks with at "
                             f"least {minimum} each")
        speeds = [max(s, 0.0) for s in self.speed]
        if sum(speeds) <= 0:
            speeds = [1.0] * world
        # Exact shares in proportion to speed; a rank under the minimum gets
        # the minimum and the others share what is left, until none is under.
        floored = set()
        while True:
            free = global_batch - minimum * len(floored)
            total = sum(speeds[r] for r in range(world) if r not in floored)
            exact = [float(minimum) if r in floored else
                     (free * speeds[r] / total if total > 0 else 0.0) for r in range(world)]
            under = {r for r in range(world) if r not in floored and exact[r] < minimum}
            if not under:
                break
            floored |= under
        out = [int(e) for e in exact]
        left = global_batch - sum(out)
        order = sorted(range(world), key=lambda r: (-(exact[r] - int(exact[r])), r))
        for r in order[:left]:
            out[r] += 1
        return out

    def __repr__(self):
        return (f"<ciuic.Balance ops={self.ops} slowest={self.slowest} "
                f"share={[round(s, 3) for s in self.share]} "
                f"speed={[round(s, 3) for s in self.speed]}>")

    def table(self):
        """A readable table, one line per rank."""
        lines = [f"{'rank':>4} {'wall s':>9} {'busy s':>9} {'idle s':>9} {'share':>6} "
                 f"{'samples':>8} {'speed/s':>9}"]
        for r in range(len(self.wall)):
            mark = "  <- slowest" if r == self.slowest else ""
            lines.append(f"{r:>4} {self.wall[r]:>9.3f} {self.busy[r]:>9.3f} "
                         f"{self.idle[r]:>9.3f} {self.share[r]:>6.2f} {self.samples[r]:>8} "
                         f"{self.speed[r]:>9.1f}{mark}")
        return "\n".join(lines)

    def as_dict(self):
        return {"wall": self.wall, "busy": self.busy, "idle": self.idle, "share": self.share,
                "samples": self.samples, "speed": self.speed, "slowest": self.slowest,
                "ops": self.ops, "dropped": self.dropped}


def compute(rows, n):
    """The Balance from every rank's padded row (`n` operations each)."""
    world = len(rows)
    counts = [int(r[0]) for r in rows]
    given = [int(r[2]) for r in rows]
    if any(g < 0 for g in given) and any(g >= 0 for g in given):
        missing = [i for i, g in enumerate(given) if g < 0]
        raise ValueError(f"balance(): ranks {missing} gave no samples while others did: give "
                         f"them on every rank or on none")
    samples = [1] * world if given[0] < 0 else given

    def column(r, c):
        return rows[r][_HEADER + c * n:_HEADER + c * n + counts[r]]

    per_rank = []
    for r in range(world):
        keys, subs, comps = column(r, 0), column(r, 1), column(r, 2)
        per_rank.append({int(k): (int(s), int(c)) for k, s, c in zip(keys, subs, comps)})
    common = set(per_rank[0])
    for ops in per_rank[1:]:
        common &= set(ops)
    shortest = {k: min(ops[k][1] - ops[k][0] for ops in per_rank) for k in common}
    idle = []
    for r in range(world):
        wall = int(rows[r][1])
        ops = per_rank[r]
        intervals = [(ops[k][0], ops[k][1], ops[k][1] - ops[k][0] - shortest[k])
                     for k in common]
        idle.append(min(idle_ns(intervals), wall))
    return Balance([int(r[1]) for r in rows], idle, samples, len(common),
                   max(int(r[3]) for r in rows))

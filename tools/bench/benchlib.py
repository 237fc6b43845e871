"""What the Python benchmarks share: size parsing, nccl-tests shapes and
bus-bandwidth factors, and supervising rank processes."""

import sys
import time

ELEMENT_SIZE = {"float32": 4, "float64": 8, "int32": 4}

BUS_FACTOR = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "alltoallv": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def parse_size(text):
    """'64K' -> 65536; suffixes K, M, G are powers of 1024, a trailing B is allowed."""
    text = text.strip().upper()
    if len(text) > 1 and text.endswith("B"):
        text = text[:-1]
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    if mult != 1:
        text = text[:-1]
    return int(text) * mult


def shape_for(op, dtype, nbytes, n):
    """(send elements, recv elements, bytes reported), nccl-tests style."""
    es = ELEMENT_SIZE[dtype]
    if op in ("allreduce", "broadcast"):
        count = max(1, nbytes // es)
        return count, count, count * es
    if op == "reduce_scatter":
        count = max(1, nbytes // es // n)
        return count * n, count, count * n * es
    if op == "allgather":
        count = max(1, nbytes // es // n)
        return count, count * n, count * n * es
    if op == "alltoall":  # count elements per rank pair
        count = max(1, nbytes // es // n)
        return count * n, count * n, count * n * es
    if op == "alltoallv":  # what each rank sends (and receives) in all
        count = max(1, nbytes // es)
        return count, count, count * es
    return 0, 0, 0


def uneven_count(n, total, i, j):
    """alltoallv: elements rank i sends rank j out of `total` each rank sends
    (ciuic-bench's UnevenCount): shares 1 + ((j - i) mod n) of n(n+1)/2,
    rounded down, the remainder to the largest share."""
    d = (j - i) % n
    shares = n * (n + 1) // 2

    def piece(w):
        return total // shares * w + total % shares * w // shares
    given = sum(piece(w) for w in range(1, n + 1))
    return piece(d + 1) + (total - given if d == n - 1 else 0)


def alltoallv_pieces(n, total, rank):
    """What `rank` receives from that alltoallv, in order: (sender, where the
    piece starts in the sender's input, elements) per sender."""
    return [(src, sum(uneven_count(n, total, src, j) for j in range(rank)),
             uneven_count(n, total, src, rank)) for src in range(n)]


def supervise(procs, timeout, name):
    """Waits for rank processes; if one fails the others are stopped, and all
    are killed after `timeout` seconds. Returns the first failure's code
    (124 on timeout), else 0."""
    deadline = time.monotonic() + timeout
    rc = 0
    try:
        pending = list(procs)
        while pending:
            for p in list(pending):
                code = p.poll()
                if code is None:
                    continue
                pending.remove(p)
                if code != 0 and rc == 0:
                    rc = code if code > 0 else 1
                    print("%s: a rank exited with %d; stopping the others" % (name, code),
                          file=sys.stderr)
                    for q in pending:
                        q.terminate()
            if pending and time.monotonic() > deadline:
                print("%s: timed out after %.0f s" % (name, timeout), file=sys.stderr)
                for q in pending:
                    q.kill()
                rc = 124
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return rc


def fill_value(xp, rank, start, count):
    """FillValue(rank, i) of ciuic-mpi-bench for i in [start, start+count):
    small integers, exact in every dtype, as an int64 array of `xp` (numpy or
    torch: both have arange and int64)."""
    idx = xp.arange(start, start + count, dtype=xp.int64)
    return (idx * 3 + rank * 5) % 17 - 8


def alltoall_expected(xp, rank, per, start, count):
    """Elements [start, start+count) of what `rank` receives from an alltoall
    of `per` elements per rank pair when every rank r sends
    fill_value(r, 0, ...): element i is element rank * per + i % per of rank
    i // per's input."""
    idx = xp.arange(start, start + count, dtype=xp.int64)
    return ((rank * per + idx % per) * 3 + (idx // per) * 5) % 17 - 8


def valid_codec(text):
    """Whether `text` names a codec ciuic takes: none, fp16, bf16, int8 or
    topk:RATIO with 0 < RATIO <= 1 (the daemon gives the full error)."""
    text = text.strip().lower()
    if text in ("none", "fp16", "bf16", "int8"):
        return True
    if text.startswith("topk:"):
        try:
            return 0 < float(text[5:]) <= 1
        except ValueError:
            return False
    return False

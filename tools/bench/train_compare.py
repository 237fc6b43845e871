"""train_compare.py: compare.py --scenario train.

DDP training (examples/train_ddp.py) of 2 ranks, one per network namespace,
the namespaces joined by one veth pair shaped to --link-rate (netns.py).
Rows, each run --reps times (interleaved), every one with a time limit:

  compute       one process, no DDP (train_hooks.py --mode compute): compute alone
  gloo          plain DDP over gloo
  gloo+fp16     DDP + torch's fp16_compress_hook (gloo)
  ciuic+CODEC   the ciuic hook with that codec (fp16, int8, topk:0.01) and error feedback
  gloo+powerSGD DDP + torch's powerSGD_hook (gloo); it may hang or crash over
                gloo (MACHINE-NOTES), reported as "hung" / "crashed"
  ciuic         DDP + ciuic.torch.allreduce_hook through one ciuicd per namespace
  ciuic-pg      DDP over the torch.distributed backend "ciuic" (no hook, no gloo)
  ciuic-zero2   examples/train_zero2.py (reduce_scatter + all_gather per step)
                on the backend "ciuic", its hidden layers --hidden wide
  gloo-zero2    the same on gloo: torch 1.13's gloo has no reduce_scatter, so
                it is expected to fail ("crashed", its error in the tail)

What is expected of examples/train_ddp.py (checked with --help; a flag it
lacks is left out and named in a NOTE):
  --backend gloo|ciuic --steps K --seed S [--hidden H --layers L]
  [--threads T] [--socket PATH] --json
and, with --json, a final line holding a JSON object (optionally prefixed by
"JSON ") with median_step_s or median_step_ms, and final_loss. Ranks take
their identity from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which train_ddp.py supports.
Every rank runs inside its namespace ('ip netns exec'), MASTER_ADDR is node
0's veth address and GLOO_SOCKET_IFNAME the veth, so gloo's bytes cross the
shaped link; the ciuic ranks reach their node's daemon through its unix socket
and the daemons talk UCX/TCP over the veth (CIUIC_COORDINATOR = node 0's
daemon). The veth tx counters are printed per run.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import compare
import netns

HERE = os.path.dirname(os.path.abspath(__file__))
# "ciuic": DDP over gloo with the ciuic hook for its gradients; "ciuic-pg":
# DDP over the torch.distributed backend "ciuic" (no hook, no gloo).
ROWS = ("compute", "gloo", "gloo+fp16", "gloo+powerSGD", "ciuic", "ciuic+fp16", "ciuic+int8",
        "ciuic+topk:0.01", "ciuic-pg", "ciuic-zero2", "gloo-zero2")
ZERO2 = ("ciuic-zero2", "gloo-zero2")
ZERO2_SCRIPT = os.path.join(HERE, "..", "..", "examples", "train_zero2.py")
MODE = {"compute": "compute", "gloo": "plain", "gloo+fp16": "fp16",
        "gloo+powerSGD": "powersgd", "ciuic": "plain", "ciuic+fp16": "plain",
        "ciuic+int8": "plain", "ciuic+topk:0.01": "plain", "ciuic-pg": "plain",
        "ciuic-zero2": None, "gloo-zero2": None}


def log(msg):
    compare.log(msg)


def script_flags(python, script):
    try:
        out = subprocess.run([python, script, "--help"], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def parse_result(text):
    """The last JSON object line of rank 0's stdout, normalized, or None."""
    found = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("JSON "):
            line = line[5:]
        if not line.startswith("{"):
            continue
        try:
            found = json.loads(line)
        except ValueError:
            continue
    if found is None:
        return None
    if "median_step_s" not in found and "median_step_ms" in found:
        found["median_step_s"] = found["median_step_ms"] / 1e3
    if "first_step_s" not in found and "first_step_ms" in found:
        found["first_step_s"] = found["first_step_ms"] / 1e3
    return found


def run_row(row, args, topo, sockets, flags, port, rep, timeout):
    world = 1 if row == "compute" else 2
    base = [args.python, os.path.join(HERE, "train_hooks.py"), "--mode", MODE[row],
            "--script", args.train_script, "--"]
    backend = "ciuic-pg" if row == "ciuic-pg" else "ciuic" if row.startswith("ciuic") else "gloo"
    targs = ["--backend", backend, "--steps", str(args.steps),
             "--seed", str(args.seed)]
    if row in ZERO2:
        # Its own script, which always ends with its JSON line and reads
        # the socket from CIUIC_SOCKET.
        base = [args.python, os.path.abspath(ZERO2_SCRIPT)]
        if args.hidden is not None:
            targs += ["--hidden", str(args.hidden)]
        flags = set()
    for flag, value in (("--hidden", args.hidden), ("--layers", args.layers),
                        ("--threads", args.train_threads), ("--bucket-cap-mb", args.bucket_cap_mb)):
        if value is not None and flag in flags:
            targs += [flag, str(value)]
    if "--json" in flags:
        targs.append("--json")
    procs, outs = [], []
    tx0 = topo.tx_bytes()
    t0 = time.monotonic()
    try:
        for rank in range(world):
            env = dict(os.environ)
            env.update({
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": topo.addr(0), "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": netns.IFNAME, "OMP_NUM_THREADS": str(args.train_threads),
            })
            a = list(targs)
            if row.startswith("ciuic+") and "--compression" in flags:
                a += ["--compression", row.split("+", 1)[1]]  # the hook's codec
            if row.startswith("ciuic"):
                env["CIUIC_JOB"] = "train-%d-%d" % (os.getpid(), port)
                env["CIUIC_COORDINATOR"] = "%s:%d" % (topo.addr(0),
                                                      compare.NetnsScenario.PEER_PORT)
                pp = os.path.abspath(os.path.join("build", "python"))
                env["PYTHONPATH"] = pp + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                          else "")
                if "--socket" in flags:
                    a += ["--socket", sockets[rank]]
                else:
                    env["CIUIC_SOCKET"] = sockets[rank]
            out = tempfile.TemporaryFile(mode="w+")
            outs.append(out)
            procs.append(subprocess.Popen(topo.prefix(rank) + base + a, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        status = "ok"
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                status = "hung"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                # one rank failed: give the others a moment, then stop them
                time.sleep(3)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            p.wait()
    elapsed = time.monotonic() - t0
    tx1 = topo.tx_bytes()
    texts = []
    for out in outs:
        out.seek(0)
        texts.append(out.read())
        out.close()
    codes = [p.returncode for p in procs]
    res = parse_result(texts[0])
    if status == "ok" and (any(c != 0 for c in codes) or res is None):
        status = "crashed" if any(c != 0 for c in codes) else "no result"
    result = {"row": row, "rep": rep, "status": status, "exit_codes": codes,
              "wall_s": round(elapsed, 1),
              "link_tx_bytes": [None if a is None or b is None else b - a
                                for a, b in zip(tx0, tx1)]}
    if res is not None:
        result.update({k: res.get(k) for k in ("median_step_s", "first_step_s", "final_loss",
                                               "params", "steps")})
    if status != "ok":
        tail = []
        for r, t in enumerate(texts):
            lines = [l for l in t.splitlines() if l.strip()][-8:]
            tail += ["rank %d| %s" % (r, l) for l in lines]
        result["output_tail"] = tail
    log("rep %d %-14s %-8s %5.1f s  median step %s  veth tx %s" % (
        rep, row, status, elapsed,
        "%.3f s" % result["median_step_s"] if result.get("median_step_s") else "-",
        " ".join("%.1fMB" % (b / 1e6) if b is not None else "?"
                 for b in result["link_tx_bytes"])))
    for line in result.get("output_tail", []):
        log("  " + line)
    return result


def main(args):
    rows = [r.strip() for r in (args.train_rows or ",".join(ROWS)).split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            print("compare.py: unknown train row %s (choose from %s)" % (r, ",".join(ROWS)),
                  file=sys.stderr)
            return 2
    if not os.path.isfile(args.train_script):
        print("compare.py: %s not found (pass --train-script)" % args.train_script,
              file=sys.stderr)
        return 2
    info = compare.machine_info()
    vers = compare.versions()
    compare.print_machine(info, vers)
    flags = script_flags(args.python, args.train_script)
    notes = []
    # examples/train_ddp.py always ends with its JSON line; older versions
    # needed --json for it.
    for f in ("--steps", "--seed", "--hidden", "--layers", "--threads", "--compression"):
        if f not in flags:
            notes.append("%s has no %s flag: left out" % (args.train_script, f))
    for n in notes:
        print("NOTE: " + n)

    # daemons only when needed
    args.system_list = ["ciuic"] if any(r.startswith("ciuic") for r in rows) else []
    scen = compare.NetnsScenario(2, 1, args.link_rate)
    results = []
    try:
        scen.setup(args)  # namespaces; ciuicd per namespace when "ciuic" is in system_list
        print("scenario train: 2 nodes x 1 rank, DDP training, links %s\n  %s" % (
            args.link_rate, scen.topo.describe()))
        print("examples: %s --steps %d --seed %d%s%s%s, %d torch thread(s) per rank" % (
            args.train_script, args.steps, args.seed,
            " --hidden %d" % args.hidden if args.hidden else "",
            " --layers %d" % args.layers if args.layers else "",
            " --bucket-cap-mb %g" % args.bucket_cap_mb if args.bucket_cap_mb else "",
            args.train_threads))
        sys.stdout.flush()
        if scen.ciuic_error and args.system_list:
            print("NOTE: ciuic rows not run: %s" % scen.ciuic_error)
            rows = [r for r in rows if not r.startswith("ciuic")]
        port = 29400 + os.getpid() % 500
        for rep in range(1, args.reps + 1):
            for row in rows:
                port += 1
                results.append(run_row(row, args, scen.topo, scen.sockets, flags, port, rep,
                                       args.train_timeout))
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return 130
    finally:
        scen.teardown()

    print()
    print("%-14s %8s %16s %10s %12s %-8s %s" % (
        "row", "step s", "(min..max)", "first s", "final loss", "status", "veth tx MB/run "
        "(node0 node1, median)"))
    compute = None
    table = []
    for row in rows:
        rs = [r for r in results if r["row"] == row]
        ok = [r for r in rs if r["status"] == "ok" and r.get("median_step_s")]
        status = "ok" if len(ok) == len(rs) else "/".join(sorted({r["status"] for r in rs}))
        med = statistics.median([r["median_step_s"] for r in ok]) if ok else None
        if row == "compute":
            compute = med
        txs = [r["link_tx_bytes"] for r in rs if None not in r["link_tx_bytes"]]
        tx = ([statistics.median([t[i] for t in txs]) / 1e6 for i in range(2)]
              if txs else None)
        table.append({"row": row, "median_step_s": med, "status": status, "reps": len(rs)})
        print("%-14s %8s %16s %10s %12s %-8s %s" % (
            row, "%.3f" % med if med else "-",
            "(%.3f..%.3f)" % (min(r["median_step_s"] for r in ok),
                              max(r["median_step_s"] for r in ok)) if ok else "",
            "%.3f" % statistics.median([r["first_step_s"] for r in ok])
            if ok and all(r.get("first_step_s") for r in ok) else "-",
            "%.6f" % ok[-1]["final_loss"] if ok and ok[-1].get("final_loss") is not None
            else "-",
            status, "" if tx is None else "%.1f %.1f" % tuple(tx)))
    if compute:
        print()
        print("communication overhead per step over compute alone:")
        for t in table:
            if t["row"] != "compute" and t["median_step_s"]:
                print("  %-14s +%.3f s (%.2fx compute)" % (
                    t["row"], t["median_step_s"] - compute, t["median_step_s"] / compute))
    failures = [r for r in results if r["status"] != "ok"]
    for r in failures:
        why = next((l.split("| ", 1)[-1].strip() for l in r.get("output_tail", [])
                    if "what():" in l or "Error" in l), "")
        print("NOTE: rep %d %s: %s (exit codes %s)%s" % (r["rep"], r["row"], r["status"],
                                                       r["exit_codes"],
                                                       ": " + why if why else ""))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": info, "versions": vers, "scenario": "train",
                       "link_rate": args.link_rate, "notes": notes,
                       "config": {k: v for k, v in vars(args).items() if k != "system_list"},
                       "results": results, "summary": table}, f, indent=1)
        log("wrote %s" % args.json_out)
    # powerSGD failing over gloo is an expected outcome, not a failure of the run.
    bad = [r for r in failures if r["row"] != "gloo+powerSGD"]
    return 1 if bad else 0

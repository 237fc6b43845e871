#!/usr/bin/python3
"""md_table.py: a Markdown table of one compare.py --json-out file.

    /usr/bin/python3 tools/bench/md_table.py /tmp/local.json [...]

Per size: for each system the median time (µs) and busbw (GB/s) over reps,
then ciuic's busbw ratio to each other system (> 1: ciuic faster). For
--scenario train files: one row per training row.
"""

import json
import sys

LABEL = {"ciuic": "ciuic", "mpi": "OpenMPI", "mpi_tuned": "OpenMPI+malloc", "gloo": "gloo"}


def human(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def Label(system):
    return LABEL.get(system, system)


def fmt_t(us):
    return "%.0f" % us if us >= 100 else "%.1f" % us


def collective(doc):
    summ = doc["summary"]
    # ciuic's codec rows (compare.py --codecs: "ciuic+fp16", ...) right after ciuic.
    codecs = sorted({r["system"] for r in summ if r["system"].startswith("ciuic+")})
    systems = [s for s in ["ciuic"] + codecs + ["mpi", "mpi_tuned", "gloo"]
               if any(r["system"] == s for r in summ)]
    by = {(r["system"], r["bytes"]): r for r in summ}
    sizes = sorted({r["bytes"] for r in summ})
    sc = doc["scenario"]
    head = "%s, %d×%d ranks" % (sc["name"], sc["nodes"], sc["ranks_per_node"])
    if sc.get("link_rate") and sc["name"] == "netns":
        head += ", links %s" % sc["link_rate"]
    print("%s; %s %s, iters %d, reps %d; memcpy %s GB/s; CPU pressure at start %s%%"
          % (head, doc["config"]["op"], doc["config"]["dtype"], doc["config"]["iters"],
             doc["config"]["reps"], doc["machine"].get("memcpy_gbps"),
             doc["machine"].get("cpu_pressure_start")))
    print()
    cols = ["bytes"]
    for s in systems:
        cols += ["%s µs" % Label(s), "%s GB/s" % Label(s)]
    others = [s for s in systems if not s.startswith("ciuic")] if "ciuic" in systems else []
    cols += ["ciuic/%s" % Label(o) for o in others]
    codecs = [s for s in codecs if s in systems] if "ciuic" in systems else []
    cols += ["%s/ciuic" % c for c in codecs]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---:" for _ in cols) + "|")
    for n in sizes:
        cells = [human(n)]
        for s in systems:
            r = by.get((s, n))
            cells += ["-", "-"] if r is None else [fmt_t(r["time_us"]),
                                                  "%.3f" % r["busbw_gbps"]]
        for o in others:
            a, b = by.get(("ciuic", n)), by.get((o, n))
            if a and b and a["busbw_gbps"] > 0 and b["busbw_gbps"] > 0:
                cells.append("%.2f×" % (a["busbw_gbps"] / b["busbw_gbps"]))
            elif a and b and a["time_us"] > 0:
                cells.append("%.2f×" % (b["time_us"] / a["time_us"]))
            else:
                cells.append("-")
        for c in codecs:  # the codec's speed-up over ciuic uncompressed
            a, b = by.get(("ciuic", n)), by.get((c, n))
            cells.append("%.2f×" % (a["time_us"] / b["time_us"]) if a and b and b["time_us"] > 0
                         else "-")
        print("| " + " | ".join(cells) + " |")
    traffic = doc.get("link_traffic")
    if traffic:
        print()
        print("veth tx per run (MB, node 0 / node 1 ...): " + "; ".join(
            "%s rep %d %s" % (Label(t["system"]), t["rep"],
                              "/".join("%.0f" % (b / 1e6) for b in t["tx_bytes"] if b is not None))
            for t in traffic))


def train(doc):
    print("train, 2 namespaces × 1 rank, links %s; %s" % (doc["link_rate"], " ".join(
        "%s=%s" % (k, doc["config"][k]) for k in ("steps", "reps", "hidden", "layers",
                                                  "train_threads"))))
    print()
    print("| row | median step s | final loss | status | veth tx MB (node0/node1) |")
    print("|---|---:|---:|---|---:|")
    for row in doc["summary"]:
        rs = [r for r in doc["results"] if r["row"] == row["row"]]
        loss = next((r.get("final_loss") for r in reversed(rs)
                     if r.get("final_loss") is not None), None)
        tx = rs[-1]["link_tx_bytes"] if rs else []
        print("| %s | %s | %s | %s | %s |" % (
            row["row"], "%.3f" % row["median_step_s"] if row["median_step_s"] else "-",
            "%.6f" % loss if loss is not None else "-", row["status"],
            "/".join("%.0f" % (b / 1e6) for b in tx if b is not None)))


def main(paths):
    if not paths or any(p in ("-h", "--help") for p in paths):
        print(__doc__.strip())
        return 0 if paths else 64
    for i, p in enumerate(paths):
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print("md_table.py: cannot read %s: %s" % (p, e), file=sys.stderr)
            return 1
        if not isinstance(doc, dict) or not (
                "rows" in doc or (doc.get("scenario") == "train" and "results" in doc)):
            print("md_table.py: %s is not a compare.py --json-out file" % p, file=sys.stderr)
            return 1
        if i:
            print()
        if doc.get("scenario") == "train":
            train(doc)
        else:
            collective(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""What each kernel adds to a replayed decode graph, from DEEPSERVE_KERNEL_TRACE's table.

Input: the tab-separated table a run writes with DEEPSERVE_KERNEL_TRACE=path (CUPTI's start
and end of every kernel, src/backend/cuda/kernel_trace.h). Each launch of the chosen graph is a
step: a launch runs every node once, so a node seen again starts the next (without node ids,
the kernels of one launch share its correlation id). Within a step, in start order,
a kernel *adds* the time from the latest end of the kernels before it to its own end (0 when it
ends before them); the additions of a step sum to its span, first start to last end. A kernel's
*lead* is its start minus that latest end: negative when dependent launch started it while the
kernel ahead still ran. Nsight Compute's times (tools/ncu_step_table.py) are each kernel alone;
these are what it costs in the graph.

Every complete step's kernels are grouped by (kernel, grid); the table gives launches per step
and the medians of us added per launch, us added per step, us from start to end per launch and
the lead, largest first; then the median span and the median gap between steps. The gap is
not the launch's cost: in traced runs it has grown ~1 us a kernel, where an untraced graph
launch costs a waiting step ~5-7 us whatever its size (tests/gpu/test_cuda_graphs.cu's
GraphBench; docs/PERFORMANCE.md, thirty-sixth section). Use the engine's host_gap_mean instead.
--timeline A:B prints launches A..B-1 of the median step in order, with start and end from the
step's start: one layer's chain.

  DEEPSERVE_KERNEL_TRACE=/tmp/w3.tsv deepserve bench --config bench/w3.yaml
  tools/kernel_trace_table.py /tmp/w3.tsv [--graph ID] [--timeline 0:40] [--json]
"""
import argparse
import csv
import json
import os
import statistics
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_step_table import short  # noqa: E402  (one shortening of kernel names for both tables)


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or "start_ns" not in rows[0]:
        sys.exit(f"{path}: not a kernel trace (no start_ns column)")
    out = []
    for r in rows:
        grid = "(" + ", ".join(r["grid"].split(",")) + ")"
        out.append({"start": int(r["start_ns"]), "end": int(r["end_ns"]),
                    "corr": int(r["correlation"]), "graph": int(r["graph_id"]),
                    "node": int(r["graph_node"]),
                    "name": short(r["name"]), "grid": grid})
    return out


def steps_of(kernels, graph):
    """The chosen graph's launches (steps), each its kernels in start order, steps in time order.

    A launch runs each node of the graph once, so in time order a node seen again starts the
    next launch. Where CUPTI gave no node ids, the kernels of one launch share the graph
    launch's correlation id instead."""
    ks = sorted((k for k in kernels if k["graph"] == graph), key=lambda k: (k["start"], k["end"]))
    if ks and all(k["node"] != 0 for k in ks):
        steps, seen = [], set()
        for k in ks:
            if not steps or k["node"] in seen:
                steps.append([])
                seen = set()
            steps[-1].append(k)
            seen.add(k["node"])
        return steps
    launches = defaultdict(list)
    for k in ks:
        launches[k["corr"]].append(k)
    return sorted(launches.values(), key=lambda s: s[0]["start"])


def additions(step):
    """(kernel, us added, us lead) for each kernel of a step, in start order."""
    out = []
    latest = step[0]["start"]
    for k in step:
        out.append((k, max(0, k["end"] - latest) / 1e3, (k["start"] - latest) / 1e3))
        latest = max(latest, k["end"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tsv")
    ap.add_argument("--graph", type=int, help="graph id (default: the one launched most)")
    ap.add_argument("--timeline", help="A:B, launches A..B-1 of the median step in order")
    ap.add_argument("--json", action="store_true", help="the table as JSON")
    a = ap.parse_args()
    kernels = load(a.tsv)
    per_graph = Counter(k["graph"] for k in kernels if k["graph"] != 0)
    if not per_graph:
        sys.exit(f"{a.tsv}: no kernel ran inside a graph")
    # The graph that ran the most kernels (the steady decode size).
    graph = a.graph if a.graph is not None else per_graph.most_common(1)[0][0]
    steps = steps_of(kernels, graph)
    # A step whose kernels were cut by the trace's window has fewer: keep the usual count.
    size = Counter(len(s) for s in steps).most_common(1)[0][0]
    steps = [s for s in steps if len(s) == size]
    if not steps:
        sys.exit(f"{a.tsv}: graph {graph} has no complete launch")
    spans = [max(k["end"] for k in s) - s[0]["start"] for s in steps]
    gaps = [steps[i + 1][0]["start"] - max(k["end"] for k in steps[i])
            for i in range(len(steps) - 1)]
    per_key = defaultdict(lambda: {"count": [], "added": [], "each": [], "dur": [], "lead": []})
    for s in steps:
        here = defaultdict(list)
        for k, added, lead in additions(s):
            key = (k["name"], k["grid"])
            here[key].append(added)
            per_key[key]["each"].append(added)
            per_key[key]["dur"].append((k["end"] - k["start"]) / 1e3)
            per_key[key]["lead"].append(lead)
        for key, v in here.items():
            per_key[key]["count"].append(len(v))
            per_key[key]["added"].append(sum(v))
    med = statistics.median
    rows = sorted(((med(v["added"]), name, grid, med(v["count"]), med(v["each"]), med(v["dur"]),
                    med(v["lead"])) for (name, grid), v in per_key.items()), reverse=True)
    span = med(spans) / 1e3
    gap = med(gaps) / 1e3 if gaps else 0.0
    if a.json:
        print(json.dumps({"graph": graph, "steps": len(steps), "kernels_per_step": size,
                          "span_us": span, "host_gap_us": gap,
                          "kernels": [{"kernel": n, "grid": g, "per_step": c, "us_added_each": e,
                                       "us_added_per_step": t, "us_each": d, "us_lead": l}
                                      for t, n, g, c, e, d, l in rows]}))
        return
    print(f"graph {graph}: {len(steps)} complete launch(es) of {size} kernels; median span "
          f"{span:.1f} us, median gap between launches {gap:.1f} us")
    print(f"{'kernel':56} {'grid':>14} {'/step':>6} {'added':>7} {'us/step':>8} {'us each':>8} "
          f"{'lead':>7}")
    for tot, name, grid, count, each, dur, lead in rows:
        print(f"{name[:56]:56} {grid:>14} {count:6.0f} {each:7.2f} {tot:8.1f} {dur:8.2f} "
              f"{lead:7.2f}")
    if a.timeline:
        lo, hi = (int(x) for x in a.timeline.split(":"))
        mid = sorted(range(len(steps)), key=lambda i: spans[i])[len(steps) // 2]
        s = steps[mid]
        t0 = s[0]["start"]
        print(f"\nthe median step (launch {mid}), launches {lo}..{hi - 1}: us from its start")
        print(f"{'#':>4} {'kernel':56} {'grid':>14} {'start':>8} {'end':>8} {'added':>7}")
        for i, (k, added, _) in enumerate(additions(s)[lo:hi], start=lo):
            print(f"{i:4d} {k['name'][:56]:56} {k['grid']:>14} {(k['start'] - t0) / 1e3:8.2f} "
                  f"{(k['end'] - t0) / 1e3:8.2f} {added:7.2f}")


if __name__ == "__main__":
    main()

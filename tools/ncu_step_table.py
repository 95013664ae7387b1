#!/usr/bin/env python3
"""A decode step kernel by kernel, from Nsight Compute's CSV (`gpu_run.sh ncustep`).

Input: `ncu --csv --metrics gpu__time_duration.sum ...` over a stretch of a bench run (the
bench's own output lines before ncu's table are skipped). Each kernel ran alone under ncu, so
the durations are what a kernel costs by itself, not what it adds to a step in the graph (where
dependent launch overlaps starts): their sum overstates the step.

A step starts at each launch of --step-kernel (the embedding lookup). For every complete step
the launches are grouped by (kernel, grid); the table gives launches per step, the median
microseconds per launch and the median microseconds per step, largest first, then the median
step sum.

  tools/ncu_step_table.py bench/results/2026-12-04-h200-82120a6-ncu-w3-kernels.csv
"""
import argparse
import csv
import json
import re
import statistics
import sys
from collections import defaultdict


def short(name: str) -> str:
    # Anonymous namespaces: "<unnamed>::" from ncu (or cut to "unnamed>::" at the start),
    # "(anonymous namespace)::" from the C++ demangler (kernel_trace_table.py); before the
    # parameter list goes, which would take the latter's parenthesis for its start.
    s = re.sub(r"(<|\b)unnamed>::|\(anonymous namespace\)::", "", name)
    s = re.sub(r"\(.*$", "", s)  # the parameter list
    s = re.sub(r"^void ", "", s)
    return re.sub(r"\bds::cuda::", "", s)


def load(path):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if head is None:
        sys.exit(f"{path}: no ncu CSV table (a line starting with \"ID\")")
    launches = []
    for r in csv.DictReader(lines[head:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        us = {"nsecond": v / 1e3, "ns": v / 1e3, "usecond": v, "us": v, "msecond": v * 1e3,
              "ms": v * 1e3}.get(unit)
        if us is None:
            sys.exit(f"{path}: unknown time unit {unit!r}")
        launches.append((short(r["Kernel Name"]), r.get("Grid Size", ""), us))
    return launches


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--step-kernel", default="embed_kernel")
    ap.add_argument("--json", action="store_true", help="the table as JSON")
    a = ap.parse_args()
    launches = load(a.csv)
    starts = [i for i, l in enumerate(launches) if a.step_kernel in l[0]]
    if len(starts) < 2:
        sys.exit(f"{a.csv}: fewer than two launches of {a.step_kernel}: no complete step")
    steps = [launches[s:e] for s, e in zip(starts, starts[1:])]
    per_step = defaultdict(list)  # (kernel, grid) -> [(count, us) per step]
    sums = []
    for st in steps:
        groups = defaultdict(list)
        for name, grid, us in st:
            groups[(name, grid)].append(us)
        for key in set(per_step) | set(groups):
            us = groups.get(key, [])
            per_step[key].append((len(us), sum(us), us))
        sums.append(sum(us for _, _, us in st))
    rows = []
    for (name, grid), v in per_step.items():
        each = [u for _, _, us in v for u in us]
        rows.append((statistics.median(t for _, t, _ in v), name, grid,
                     statistics.median(c for c, _, _ in v), statistics.median(each) if each else 0))
    rows.sort(reverse=True)
    if a.json:
        print(json.dumps({"steps": len(steps), "launches": len(launches),
                          "step_sum_us": statistics.median(sums),
                          "kernels": [{"kernel": n, "grid": g, "per_step": c, "us_each": e,
                                       "us_per_step": t} for t, n, g, c, e in rows]}))
        return
    print(f"{len(steps)} complete step(s), {len(launches)} launches; median step sum "
          f"{statistics.median(sums):.1f} us (each kernel alone)")
    print(f"{'kernel':60} {'grid':>14} {'/step':>6} {'us each':>8} {'us/step':>8}")
    for tot, name, grid, count, each in rows:
        print(f"{name[:60]:60} {grid:>14} {count:6.0f} {each:8.2f} {tot:8.1f}")


if __name__ == "__main__":
    main()

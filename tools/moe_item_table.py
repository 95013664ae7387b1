#!/usr/bin/env python3
"""How a one-launch decode MoE's time splits (DEEPSERVE_MOE_ITEMS's table).

Each row of the table is one item of ffn_fused_kernel (moe_wq.cu): its CTA, SM, item number,
the launch's gate/up and total item counts, the global timer at its start and end (ns) and its
SM's clock at start, after a down item's wait for its tile's h, and at end. Items are grouped
into launches (items whose spans overlap). Per launch this takes:
  span     first item's start to last item's end;
  busy     the items' summed time over CTAs x span (1.0: no CTA ever idle inside the span);
  spread   how late the last CTA took its first item;
  drain    the span's end minus the end of the CTA that ran out of items first;
  idle end the mean over CTAs of the span's end minus the CTA's last item's end;
and prints their medians over the launches kept, with the items' lengths by kind (clock cycles
turned into time by the ns per cycle of all items together).

  python3 tools/moe_item_table.py items.tsv [--skip-launches N]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_phase_table import cli, launches, pct  # noqa: E402


def summary(rows, skip_launches=0):
    groups = launches(rows)[skip_launches:]
    items = [r for g in groups for r in g["ctas"]]
    if not items:
        return "no records\n"
    cyc = sum(r["c_end"] - r["c_start"] for r in items)
    ns = sum(r["end_ns"] - r["start_ns"] for r in items)
    us_per_cycle = ns / cyc / 1e3 if cyc > 0 else 0.0
    per = {"span": [], "busy": [], "spread": [], "drain": [], "idle_end": [], "ctas": [],
           "items": [], "wait_share": []}
    for g in groups:
        rs = g["ctas"]
        start = min(r["start_ns"] for r in rs)
        end = g["end"]
        span = end - start
        if span <= 0:
            continue
        by_cta = {}
        for r in rs:
            by_cta.setdefault(r["cta"], []).append(r)
        work = sum((r["c_end"] - r["c_start"]) * us_per_cycle for r in rs)
        wait = sum((r["c_wait"] - r["c_start"]) * us_per_cycle for r in rs)
        last_end = [max(r["end_ns"] for r in v) for v in by_cta.values()]
        first_start = [min(r["start_ns"] for r in v) for v in by_cta.values()]
        per["span"].append(span / 1e3)
        per["busy"].append(work / (len(by_cta) * span / 1e3))
        per["spread"].append((max(first_start) - start) / 1e3)
        per["drain"].append((end - min(last_end)) / 1e3)
        per["idle_end"].append(statistics.mean(end - t for t in last_end) / 1e3)
        per["ctas"].append(len(by_cta))
        per["items"].append(len(rs))
        per["wait_share"].append(wait / work if work > 0 else 0.0)
    lines = [f"{len(items)} items in {len(groups)} launches; {us_per_cycle * 1e3:.3f} ns a cycle"]
    lines.append(f"  {'per launch':<12}{'median':>10}{'p90':>10}")
    for key, unit in [("items", ""), ("ctas", ""), ("span", " us"), ("busy", ""),
                      ("spread", " us"), ("drain", " us"), ("idle_end", " us"),
                      ("wait_share", "")]:
        v = per[key]
        lines.append(f"  {key:<12}{statistics.median(v):>10.3f}{pct(v, 0.9):>10.3f}{unit}")
    lines.append(f"\n  {'item kind':<10}{'count':>8}{'median us':>11}{'p90 us':>9}"
                 f"{'wait med':>10}{'wait p90':>10}")
    for kind, pick in [("gate/up", lambda r: r["item"] < r["gate_up_items"]),
                       ("down", lambda r: r["item"] >= r["gate_up_items"])]:
        rs = [r for r in items if pick(r)]
        if not rs:
            continue
        t = [(r["c_end"] - r["c_start"]) * us_per_cycle for r in rs]
        w = [(r["c_wait"] - r["c_start"]) * us_per_cycle for r in rs]
        lines.append(f"  {kind:<10}{len(rs):>8}{statistics.median(t):>11.2f}{pct(t, 0.9):>9.2f}"
                     f"{statistics.median(w):>10.2f}{pct(w, 0.9):>10.2f}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    cli(summary, __doc__, argv)


if __name__ == "__main__":
    main()

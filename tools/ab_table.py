#!/usr/bin/env python3
"""Summarise interleaved A/B bench runs (scripts/gpu_run.sh abenv with AB_ROUNDS=N).

Reads the JSON that `deepserve bench --output` wrote, groups the files by setting (the file
name without its `-r<k>` round suffix) and prints, per setting and scenario, the median and
range over rounds of TPOT p50 and output tok/s, and the change of the medians against the
`default` setting of the same workload (--baseline names another: `base` for gpu_run.sh abtree's
bench-{this,base}-<w>-r<k>.json). Medians of interleaved rounds, not one pair of runs, decide a
default: one pair can differ by as much as the change being measured.

  python3 tools/ab_table.py OUT_DIR            # every bench-*.json in it
  python3 tools/ab_table.py a.json b.json ...  # or the files named
  --json                                       # the table as JSON
  --baseline base                              # changes against setting `base` (abtree)
"""
import argparse
import json
import pathlib
import re
import statistics
import sys

ROUND = re.compile(r"-r(\d+)$")


def setting_of(path):
    """(setting, round) of a bench file: bench-<tag>-<workload>[-r<k>].json -> (<tag>-<workload>, k)."""
    stem = path.stem
    if stem.startswith("bench-"):
        stem = stem[len("bench-"):]
    m = ROUND.search(stem)
    return (stem[:m.start()], int(m.group(1))) if m else (stem, 1)


def load(paths):
    """{(setting, workload, scenario): [(round, tpot_p50_ms, output_tok_s)]}"""
    runs = {}
    for p in paths:
        d = json.loads(p.read_text())
        if "scenarios" not in d:
            raise ValueError(f"{p}: not a deepserve bench result (no 'scenarios')")
        setting, rnd = setting_of(p)
        workload = d.get("name", "?")
        if setting.endswith("-" + workload):
            setting = setting[: -len(workload) - 1]
        if setting == workload:
            setting = "default"
        for s in d["scenarios"]:
            tpot = (s.get("tpot_ms") or {}).get("p50")
            runs.setdefault((setting, workload, s["name"]), []).append(
                (rnd, tpot, s.get("output_tokens_per_s")))
    return runs


def summarise(runs, baseline="default"):
    rows = []
    for (setting, workload, scenario), vals in sorted(runs.items()):
        vals.sort()
        tpots = [v[1] for v in vals if v[1] is not None]
        toks = [v[2] for v in vals if v[2] is not None]
        rows.append({
            "setting": setting, "workload": workload, "scenario": scenario, "rounds": len(vals),
            "tpot_p50_ms": tpots, "output_tok_s": toks,
            "tpot_median": statistics.median(tpots) if tpots else None,
            "tok_s_median": statistics.median(toks) if toks else None,
        })
    base = {(r["workload"], r["scenario"]): r for r in rows if r["setting"] == baseline}
    for r in rows:
        b = base.get((r["workload"], r["scenario"]))
        r["tpot_vs_default"] = (r["tpot_median"] / b["tpot_median"] - 1
                                if b and r["tpot_median"] and b["tpot_median"] else None)
        r["tok_s_vs_default"] = (r["tok_s_median"] / b["tok_s_median"] - 1
                                 if b and r["tok_s_median"] and b["tok_s_median"] else None)
    return rows


def fmt_range(xs, digits):
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def fmt_pct(x):
    return "" if x is None else f"{100 * x:+.1f}%"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=pathlib.Path)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--baseline", default="default",
                    help="the setting the changes are against (default: default)")
    a = ap.parse_args(argv)
    files = []
    for p in a.paths:
        files += sorted(p.glob("bench-*.json")) if p.is_dir() else [p]
    if not files:
        ap.error("no bench JSON files")
    rows = summarise(load(files), a.baseline)
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    vs = f"vs {a.baseline}"
    print(f"| setting | workload | scenario | rounds | TPOT p50 ms, median (range) | {vs} "
          f"| output tok/s, median (range) | {vs} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['workload']} | {r['scenario']} | {r['rounds']} "
              f"| {fmt_range(r['tpot_p50_ms'], 2)} | {fmt_pct(r['tpot_vs_default'])} "
              f"| {fmt_range(r['output_tok_s'], 1)} | {fmt_pct(r['tok_s_vs_default'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
